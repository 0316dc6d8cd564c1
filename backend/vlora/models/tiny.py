"""The embedded default model: a tiny, randomly initialised LLaVA-architecture model.

Nothing can be downloaded, so the default model is generated locally on first use, from a fixed seed,
into ``<cache_dir>/tiny-llava-<spec hash>/``. The folder is laid out like a llava-hf checkpoint
(``config.json``, ``model.safetensors``, tokenizer files, ``preprocessor_config.json``), so it goes
through the same loader as a real checkpoint.

Determinism: the weights do not come from transformers' initialisers (which may change between
versions) but from one ``torch.Generator`` per tensor, seeded from the tensor's name, through
:func:`vlora.lora.demo.portable_randn` (integer draws and exact arithmetic, not ``torch.randn``, whose
vectorized and scalar paths differ in the last bit); the tokenizer is a byte-level BPE trained on the
corpus below. The same spec gives bit-identical files on every CPU (x86-64 of any ISA level, ARM).

The model is not trained. It exercises every code path (CLIP vision tower, projector, a LLaMA decoder
with grouped-query attention) in a few MB and a few seconds, and its answers are meaningless text.

LoRA adapters made with PEFT itself (:func:`write_peft_adapter`, :func:`ensure_peft_adapters`; the tiny
Qwen models' too, :mod:`vlora.models.tiny_qwen`): :func:`ensure_tiny_vision_adapters` writes
:data:`VISION_ADAPTERS`, which target the CLIP tower and the projector (one of them the decoder as well).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from vlora.config import default_cache_dir
from vlora.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from vlora.lora.demo import STAMP_FILE, DemoAdapter, install, read_stamp, seeded_randn  # noqa: F401 (re-exported)
from vlora.models.loader import LLAVA_15_CHAT_TEMPLATE

# Bump when anything below changes what is generated; it is part of the folder's hash.
# 2: values from vlora.lora.demo.portable_randn (bit-identical on every CPU) instead of torch.randn.
GENERATOR_VERSION = 2
SEED = 20240917

VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=64,
    patch_size=8,  # (64 / 8)^2 = 64 image tokens per image
    projection_dim=64,
)
TEXT = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention, as in larger LLaMA models
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
BPE_VOCAB_SIZE = 1024  # trained tokens; <image> and <pad> are added after them, as in llava-hf
BPE_MIN_FREQUENCY = 1  # the corpus is small; every pair it has may merge
INIT_STD = 0.02
LM_HEAD_STD = 0.08  # a little larger than INIT_STD so the next-token distribution is not flat
SINGLE_BYTE_LOGIT_SCALE = 0.3  # see _shape_output_distribution

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# The pixel rescaling and CLIP normalization every tiny model's image (and video) processor config carries.
CLIP_PIXEL_SETTINGS = {
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "do_convert_rgb": True,
}

# LLaVA-1.5's conversation format, shared with the loader's fallback.
CHAT_TEMPLATE = LLAVA_15_CHAT_TEMPLATE

CORPUS = """\
A picture shows a small red house next to a tall green tree. The sky above the house is blue and
there are a few white clouds. A dog is sleeping on the grass in front of the door. The door is open
and a woman is standing in the doorway. She is holding a cup of tea and looking at the garden.
The image contains two cats sitting on a wooden table. One cat is black and the other cat is orange.
Behind them there is a window, and through the window you can see a street with cars and people.
What is in the image? The image shows a bowl of fruit: apples, bananas, oranges and grapes. The bowl
is white and stands on a kitchen counter. Next to the bowl there is a knife and a cutting board.
Describe the scene. A group of children is playing football in a park. The ball is in the air and
a boy is running to kick it. Some parents are sitting on a bench and watching the game. It is a sunny
afternoon in summer, and the trees cast long shadows on the field.
How many people are in the photo? There are three people in the photo. Two of them are smiling and
one is looking at a phone. They are standing on a bridge over a river, and a boat is passing under
the bridge. The water is calm and reflects the buildings on the other side.
The chart shows the number of visitors per month. The number grows from January to July and then
falls until December. The highest value is in July and the lowest value is in February.
A man is riding a bicycle along a road in the mountains. He wears a yellow jacket and a black helmet.
The road is wet after the rain, and the mountains in the distance are covered with snow.
Is there a traffic light in the picture? Yes, there is a traffic light at the corner of the street.
The light is red, and several cars are waiting. A bus is coming from the left side of the image.
The photo was taken at night. The city lights are bright, and the moon is visible above the towers.
There is a sign with the words open late on the front of a small shop. A cat sits under the sign.
Read the text in the image. The text says welcome to the museum of science and art. Below the text
there is an arrow that points to the entrance. The entrance has glass doors and a red carpet.
The table has four plates, four glasses, a bottle of water and a basket of bread. The chairs are
made of metal and the floor is made of stone. A lamp hangs from the ceiling above the table.
The video frames show a ball rolling down a hill. In the first frame the ball is at the top; in the
last frame it has reached the bottom and stopped next to a fence. The grass is green and short.
Answer the question with one word. What color is the car? Blue. What animal is on the sofa? Dog.
Where is the book? On the shelf. How many birds are on the wire? Five. Is it raining? No.
The scientist looks at a sample through a microscope. On the screen there are small round cells,
some of them dividing. The laboratory is clean and bright, with bottles and boxes on every shelf.
A plane is flying over the sea. The sea is dark blue, and there are small islands with white beaches.
One island has a lighthouse, and a ship is sailing toward the harbor near the lighthouse.
The kitchen is full of people preparing dinner. Someone is cutting vegetables, someone is stirring a
pot of soup, and a child is setting the table with forks, spoons and napkins of many colors.
Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 12 20 25 50 100 2024 3.5 % + - = ( ) : ; , . ! ? " '
"""

README = """\
# tiny-llava (generated by vlora)

This folder was generated locally by `vlora.models.tiny.ensure_tiny_model()` from a fixed seed.

**It is a tiny random model, not a trained one. Its answers are meaningless text.**

It has the LLaVA-1.5 architecture (`LlavaForConditionalGeneration`: a CLIP vision tower, a two-layer
projector and a LLaMA decoder with grouped-query attention) at a very small size, so that the whole
serving stack (image encoding, packed prefill and decode, multi-LoRA) can run and be tested on a CPU
in seconds. The tokenizer is a byte-level BPE trained on a few KB of embedded English text.

- vision: CLIP, image {image_size}x{image_size}, patch {patch_size}, hidden {v_hidden}, {v_layers} layers -> {num_image_tokens} image tokens per image
- text: LLaMA, hidden {hidden}, {layers} layers, {heads} heads, {kv_heads} KV heads, intermediate {inter}, vocab {vocab}, context {ctx}
- seed {seed}, generator version {version}, spec hash {spec_hash}

Real checkpoints in the llava-hf layout (for example llava-hf/llava-1.5-7b-hf) load through the same
code path: pass their local folder with `vlora serve --model DIR`.
"""


def tiny_model_spec() -> dict[str, Any]:
    """Everything that determines the generated folder; its hash names the folder."""
    return {
        "generator_version": GENERATOR_VERSION,
        "seed": SEED,
        "vision": VISION,
        "text": TEXT,
        "bpe_vocab_size": BPE_VOCAB_SIZE,
        "bpe_min_frequency": BPE_MIN_FREQUENCY,
        "init_std": INIT_STD,
        "lm_head_std": LM_HEAD_STD,
        "single_byte_logit_scale": SINGLE_BYTE_LOGIT_SCALE,
        "chat_template": CHAT_TEMPLATE,
        "corpus_sha256": hashlib.sha256(CORPUS.encode()).hexdigest(),
    }


def tiny_model_dirname() -> str:
    blob = json.dumps(tiny_model_spec(), sort_keys=True).encode()
    return f"tiny-llava-{hashlib.sha256(blob).hexdigest()[:12]}"


def ensure_tiny_model(cache_dir: Optional[Path] = None) -> Path:
    """Return the tiny model's folder, generating it first if it is not there yet.

    Safe when several processes race: each builds in its own temporary folder next to the target and
    renames it into place; the loser of the rename discards its copy. A folder at the final path is
    therefore always complete.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_atomically(root / tiny_model_dirname(), _generate)


def build_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build`` into a temporary sibling folder and rename it to ``final`` (returned at once if it is
    there). Each racing process builds its own copy; the loser of the rename discards it, so a folder at
    ``final`` is always complete."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared by the user's processes
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _generate(out: Path) -> None:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = build_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    num_image_tokens = (VISION["image_size"] // VISION["patch_size"]) ** 2
    text_config = LlamaConfig(
        **TEXT,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=text_config,
        image_token_index=image_token_id,
        image_seq_length=num_image_tokens,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):  # construction draws from the global RNG; leave it as it was
        model = LlavaForConditionalGeneration(config)
    _seeded_init(model)
    _shape_output_distribution(model, tokenizer)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor",
        "image_token": "<image>",
        "patch_size": VISION["patch_size"],
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,  # CLIP's class token, dropped by the "default" strategy
    }, indent=2) + "\n")
    spec = tiny_model_spec()
    (out / "vlora_tiny_spec.json").write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(README.format(
        image_size=VISION["image_size"], patch_size=VISION["patch_size"], v_hidden=VISION["hidden_size"],
        v_layers=VISION["num_hidden_layers"], num_image_tokens=num_image_tokens, hidden=TEXT["hidden_size"],
        layers=TEXT["num_hidden_layers"], heads=TEXT["num_attention_heads"], kv_heads=TEXT["num_key_value_heads"],
        inter=TEXT["intermediate_size"], vocab=len(tokenizer), ctx=TEXT["max_position_embeddings"],
        seed=SEED, version=GENERATOR_VERSION, spec_hash=tiny_model_dirname().rsplit("-", 1)[1],
    ))


def norm_parameter_names(model: torch.nn.Module) -> set[str]:
    """The full names of every LayerNorm's and RMSNorm's own parameters (weights and biases)."""
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.LayerNorm) or type(mod).__name__.endswith("RMSNorm"):
            names.update(f"{mod_name}.{p}" for p, _ in mod.named_parameters(recurse=False))
    return names


def _seeded_init(model: torch.nn.Module) -> None:
    """Overwrite every parameter from a generator seeded by (SEED, parameter name).

    Norm weights are 1 and biases 0; every other tensor is N(0, INIT_STD^2) (the lm_head LM_HEAD_STD).
    Independent of module construction order and of transformers' own initialisers.
    """
    norm_params = norm_parameter_names(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in norm_params:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = LM_HEAD_STD if name.endswith("lm_head.weight") else INIT_STD
                param.copy_(seeded_randn(f"{SEED}:{name}", param.shape, std=std).to(param.dtype))


def _shape_output_distribution(model, tokenizer) -> None:
    """Make the random model's text a little more readable, and keep it off tokens it must not emit.

    Rows of the lm_head for single-byte tokens are scaled down (else greedy output is mostly raw bytes
    that do not decode to UTF-8); rows for ``<unk>``, ``<pad>`` and ``<image>`` are zeroed, so their logit
    is always 0, far below the top logits (greedy never picks them; sampling at high temperature
    rarely could, as with any real checkpoint).
    """
    weight = model.get_output_embeddings().weight
    vocab = tokenizer.get_vocab()
    single = [i for tok, i in vocab.items() if len(tok) == 1]
    never = [tokenizer.convert_tokens_to_ids(t) for t in ("<unk>", "<pad>", "<image>")]
    with torch.no_grad():
        weight[single] *= SINGLE_BYTE_LOGIT_SCALE
        weight[never] = 0.0


def build_tokenizer():
    """A byte-level BPE trained on CORPUS, wrapped as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=BPE_MIN_FREQUENCY,
        special_tokens=["<unk>", "<s>", "</s>"],  # ids 0, 1, 2 as in LLaMA
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False),
                            AddedToken("<pad>", special=True, normalized=False)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=TEXT["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def preprocessor_config() -> dict[str, Any]:
    size = VISION["image_size"]
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": size},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": size, "width": size},
        **CLIP_PIXEL_SETTINGS,
    }


# ---------------------------------------------------------------------------------------------------
# LoRA adapters, made with PEFT

VISION_ADAPTER_VERSION = 2  # 2: portable_randn
VISION_ADAPTER_DELTA = 0.2  # typical size of one LoRA delta entry for a unit-RMS input (base projections: ~0.2)
# ``modules`` are the served target names (what the adapter reader and ``list`` call them): decoder
# projections as they are, vision-side ones as ``vision.<path in a block>`` and ``projector.<path>``.
VISION_ADAPTERS = (
    DemoAdapter("llava-vision-r8", r=8, alpha=16, seed=301,
                modules=("vision.self_attn.q_proj", "vision.self_attn.k_proj", "vision.self_attn.v_proj",
                         "vision.self_attn.out_proj", "projector.linear_1", "projector.linear_2", "q_proj", "v_proj")),
    DemoAdapter("llava-vision-r16-mlp", r=16, alpha=16, seed=302, use_rslora=True,
                modules=("vision.mlp.fc1", "vision.mlp.fc2", "projector.linear_2")),
)
VISION_ADAPTER_NAMES = tuple(a.name for a in VISION_ADAPTERS)


def peft_target_regex(modules: Sequence[str], tower: str, projector: str) -> str:
    """PEFT ``target_modules`` (a regex that PEFT full-matches against module names) for served target names:
    decoder projections (``q_proj``), the vision tower's (``vision.<path in a block>``, found under the
    regex ``tower`` + ``.<block index>.``) and the projector's (``projector.<path>``, under ``projector``)."""
    decoder = [m for m in modules if "." not in m]
    blocks = [re.escape(m.split(".", 1)[1]) for m in modules if m.startswith("vision.")]
    proj = [re.escape(m.split(".", 1)[1]) for m in modules if m.startswith("projector.")]
    if len(decoder) + len(blocks) + len(proj) != len(modules):
        raise ValueError(f"target names {list(modules)}: use decoder projections, vision.* or projector.*")
    parts = []
    if decoder:
        parts.append(r".*language_model\.layers\.\d+\.(self_attn|mlp)\.(" + "|".join(decoder) + ")")
    if blocks:
        parts.append(tower + r"\.\d+\.(" + "|".join(blocks) + ")")
    if proj:
        parts.append(projector + r"\.(" + "|".join(proj) + ")")
    return "|".join(parts)


def llava_target_regex(modules: Sequence[str]) -> str:
    """:func:`peft_target_regex` for LlavaForConditionalGeneration under transformers 5."""
    return peft_target_regex(modules, r".*vision_tower\.encoder\.layers", r".*multi_modal_projector")


def write_peft_adapter(spec: DemoAdapter, model: torch.nn.Module, target_regex: Callable[[Sequence[str]], str],
                       delta: float, out: Path, what: str) -> None:
    """Write ``spec`` into ``out`` as PEFT itself makes it: ``get_peft_model`` on ``model`` with a
    ``LoraConfig`` whose ``target_modules`` is ``target_regex(spec.modules)``, then every ``lora_A`` /
    ``lora_B`` overwritten from a generator seeded by (spec seed, parameter name), B not zero, scaled so
    that each module's delta entry is about ``delta`` for a unit-RMS input, and ``save_pretrained``
    (``adapter_config.json`` + ``adapter_model.safetensors``). Raises when PEFT wraps a module that no
    target of ``spec`` names, or none for one of them."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    lora_config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=target_regex(spec.modules),
        lora_dropout=0.0,
        bias="none",
        use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern),
        alpha_pattern=dict(spec.alpha_pattern),
    )
    with torch.random.fork_rng(devices=[]):  # PEFT's own init of lora_A draws from the global RNG
        model = get_peft_model(model, lora_config)
    wrapped = [name for name, mod in model.named_modules() if isinstance(mod, LoraLayer)]
    per_target = {m: [n for n in wrapped if re.fullmatch(target_regex([m]), n)] for m in spec.modules}
    if not all(per_target.values()) or sum(map(len, per_target.values())) != len(wrapped):
        raise RuntimeError(f"adapter {spec.name}: PEFT wrapped {wrapped} for the targets {list(spec.modules)}")
    with torch.no_grad():
        for name in wrapped:
            layer = model.get_submodule(name)
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            r, d_in = a.shape
            scale = layer.scaling["default"]
            a.copy_(seeded_randn(f"{spec.seed}:{name}.lora_A", a.shape, std=1 / math.sqrt(d_in)))
            b.copy_(seeded_randn(f"{spec.seed}:{name}.lora_B", b.shape, std=delta / (scale * math.sqrt(r))))
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").write_text(
        f"# {spec.name}\n\nA LoRA adapter made with PEFT by vlora for {what}: random weights from seed "
        f"{spec.seed}, not trained. Rank {spec.r}, alpha {spec.alpha}{', rsLoRA' if spec.use_rslora else ''}, "
        f"targets {', '.join(spec.modules)}.\n")
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if not (out / required).is_file():
            raise RuntimeError(f"adapter {spec.name}: PEFT did not write {required}")


def ensure_peft_adapters(specs: Sequence[DemoAdapter], model_dir: Path, out_root: Path, *,
                         load: Callable[[], torch.nn.Module], target_regex: Callable[[Sequence[str]], str],
                         delta: float, what: str, version: int) -> Path:
    """Write each of ``specs`` under ``out_root`` with :func:`write_peft_adapter`, on a copy of the model
    that ``load()`` returns (called once, and only when some adapter must be written).

    Idempotent: a folder whose stamp matches (the spec, ``delta``, ``version`` and the model's config.json)
    is kept; a stale one is replaced. Atomic per adapter (:func:`vlora.lora.demo.install`). Returns ``out_root``.
    """
    import copy

    model_dir, out_root = Path(model_dir), Path(out_root)
    model_sha = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    out_root.mkdir(parents=True, exist_ok=True)
    base: list[torch.nn.Module] = []
    for spec in specs:
        blob = json.dumps({"version": version, "delta": delta, "spec": repr(spec), "model_config_sha256": model_sha},
                          sort_keys=True)
        stamp = {"peft_adapter": spec.name, "spec_sha256": hashlib.sha256(blob.encode()).hexdigest()}
        final = out_root / spec.name
        if read_stamp(final) == stamp:
            continue

        def build(tmp: Path, spec=spec, stamp=stamp) -> None:
            if not base:
                base.append(load())
            write_peft_adapter(spec, copy.deepcopy(base[0]), target_regex, delta, tmp, what)
            (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")

        install(final, build)
    return out_root


def ensure_tiny_vision_adapters(model_dir: Path, out_root: Path) -> Path:
    """Write :data:`VISION_ADAPTERS` for the tiny LLaVA model in ``model_dir`` under ``out_root`` (made by
    PEFT, see :func:`write_peft_adapter`; keys ``base_model.model.model.vision_tower.encoder.layers.N...``,
    ``...model.multi_modal_projector.linear_K...``). Idempotent and atomic per adapter. Returns ``out_root``."""
    from transformers import LlavaForConditionalGeneration

    def load() -> torch.nn.Module:
        return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()

    return ensure_peft_adapters(VISION_ADAPTERS, model_dir, out_root, load=load, target_regex=llava_target_regex,
                                delta=VISION_ADAPTER_DELTA, what="the tiny random LLaVA model",
                                version=VISION_ADAPTER_VERSION)
