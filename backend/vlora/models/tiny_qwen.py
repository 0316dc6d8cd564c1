"""Tiny, randomly initialised Qwen2-VL and Qwen2.5-VL models, and PEFT adapters for them.

Nothing can be downloaded, so the CPU tests of the Qwen2-VL family run on models generated here from
a fixed seed, into ``<cache_dir>/tiny-qwen2-vl-<spec hash>/`` or ``tiny-qwen2-5-vl-<spec hash>/``.
Each folder is laid out like the Hub checkpoints (Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct):

- ``config.json``: the Hub's flat layout (text settings at the top level, ``rope_scaling``
  ``{"type": "mrope", "mrope_section": [...]}``, a nested ``vision_config``), which transformers 5
  reads into its nested config;
- ``generation_config.json``, ``model.safetensors`` (float32);
- ``tokenizer.json`` + ``tokenizer_config.json`` (``Qwen2Tokenizer``: a byte-level BPE with Qwen's
  pre-tokenizer regex, trained on :data:`vlora.models.tiny.CORPUS`, Qwen's special tokens after it,
  no BOS) and ``chat_template.jinja`` (Qwen's template, default system prompt included);
- ``preprocessor_config.json`` (``Qwen2VLImageProcessor``) and ``video_preprocessor_config.json``
  (``Qwen2VLVideoProcessor``) with small pixel bounds, so small images give few visual tokens and
  images of different sizes give different counts (28 px per token side: 64x64 -> 4 tokens,
  112x56 -> 8 tokens).

The generation is deterministic, as in :mod:`vlora.models.tiny`: every tensor comes from its own
``torch.Generator`` seeded by (SEED, tensor name), not from transformers' initialisers, through
:func:`vlora.lora.demo.portable_randn`: the same bits on every CPU. Unlike the
LLaVA one, biases are random too, so Qwen2's q/k/v biases (and the vision tower's) are non-zero and an
engine that drops them is caught.

The embedding and lm_head have more rows than the tokenizer (rounded up to ``VOCAB_MULTIPLE``), as in
the real checkpoints (151,665 tokens, 152,064 rows); the extra lm_head rows are zero, so greedy
decoding never emits them.

:func:`ensure_tiny_qwen_adapters` makes three LoRA adapters with PEFT itself (``get_peft_model``,
then ``save_pretrained``), limited to the language model's decoder projections;
:func:`ensure_tiny_qwen_vision_adapters` two more that target the vision blocks and the patch merger.

Processor: ``AutoProcessor.from_pretrained(folder)`` works where torchvision is installed (transformers
5's ``Qwen2VLVideoProcessor`` needs it, and AutoProcessor fails without it even for images).
:func:`load_qwen_processor` returns the same ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` either
way: without torchvision it is composed from the folder's files, with transformers' PIL image
processor and :class:`QwenVideoProcessorPil` (the video processor's resize rule and patch layout).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from vlora.config import default_cache_dir
from vlora.lora.adapter import ATTN_MODULES
from vlora.lora.demo import DemoAdapter
from vlora.models.qwen_processing import QwenVideoProcessorPil, load_qwen_processor  # noqa: F401 (re-exported)
from vlora.models.tiny import (
    CLIP_PIXEL_SETTINGS,
    CORPUS,
    build_atomically,
    ensure_peft_adapters,
    norm_parameter_names,
    peft_target_regex,
    seeded_randn,
)

# Bump when anything below changes what is generated; it is part of the folder's hash.
# 2: values from vlora.lora.demo.portable_randn (bit-identical on every CPU) instead of torch.randn.
# 3: the video processor's cap_pixels_per_frame False (transformers' per-frame resize, as a Hub folder without
#    a video config gets; True turned the fast preprocessing off on a machine with torchvision).
GENERATOR_VERSION = 3
SEED = 20250128

TEXT = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention, head_dim 32
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    use_sliding_window=False,
)
# M-RoPE splits head_dim / 2 = 16 rotary frequencies over (temporal, height, width), as Qwen's 16:24:24.
MROPE_SECTION = [4, 6, 6]
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# The patching both vision towers share.
VISION_PATCHING = dict(
    in_channels=3,
    patch_size=PATCH_SIZE,
    spatial_merge_size=MERGE_SIZE,
    temporal_patch_size=TEMPORAL_PATCH_SIZE,
)
VISION_QWEN2_VL = dict(
    depth=2,
    embed_dim=32,
    num_heads=2,  # vision head_dim 16
    mlp_ratio=2,
    hidden_act="quick_gelu",
    **VISION_PATCHING,
)
VISION_QWEN2_5_VL = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    hidden_act="silu",
    **VISION_PATCHING,
    window_size=56,  # 2x2 merged tokens per window: a 112x56 image has 2 windows
    fullatt_block_indexes=[1],  # block 0 windowed, block 1 full
    tokens_per_second=2,
)
# Pixel bounds (smart_resize rounds each side to 28 px, then scales into [MIN_PIXELS, MAX_PIXELS]).
MIN_PIXELS = 56 * 56  # 4 visual tokens
MAX_PIXELS = 28 * 28 * 64  # 64 visual tokens, e.g. 224x224
VIDEO_MIN_PIXELS = 56 * 56
VIDEO_MAX_PIXELS = 28 * 28 * 16  # per frame
BPE_VOCAB_SIZE = 1024
BPE_MIN_FREQUENCY = 1
VOCAB_MULTIPLE = 64
# See _seeded_init.
WEIGHT_GAIN = 1.5
EMBED_STD = 1.0
BIAS_STD = 0.1
LM_HEAD_STD = 0.15
SINGLE_BYTE_LOGIT_SCALE = 0.3

# Qwen2's added tokens, in the Hub tokenizer's order (151643 ... 151656 there; after the BPE here).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Tokens a chat model emits only by its template, never as generated text: their lm_head rows are zero.
NEVER_GENERATED = tuple(t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN))
# Qwen's pre-tokenizer (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

# The chat template of Qwen2-VL-Instruct and Qwen2.5-VL-Instruct.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class QwenVariant:
    """One member of the family: its transformers classes and its vision tower's settings."""

    name: str
    model_type: str
    architecture: str  # the model class in transformers
    processor_class: str
    vision: dict[str, Any]
    vision_out_key: str  # the vision config field that must equal the text hidden size

    @property
    def dir_prefix(self) -> str:
        return "tiny-" + self.name.replace("_", "-")

    def model_class(self):
        import transformers

        return getattr(transformers, self.architecture)


VARIANTS: dict[str, QwenVariant] = {
    v.name: v for v in (
        QwenVariant("qwen2_vl", "qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor",
                    VISION_QWEN2_VL, vision_out_key="hidden_size"),
        QwenVariant("qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor",
                    VISION_QWEN2_5_VL, vision_out_key="out_hidden_size"),
    )
}

README = """\
# {dirname} (generated by vlora)

This folder was generated locally by `vlora.models.tiny_qwen.ensure_tiny_qwen(variant={variant!r})` from a
fixed seed. **It is a tiny random model, not a trained one. Its answers are meaningless text.**

`{architecture}` at a very small size, laid out like the Hub checkpoint, for CPU tests of the whole
stack (dynamic-resolution images, video, M-RoPE, multi-LoRA).

- vision: patch {patch}, temporal patch {temporal}, merge {merge} ({px} px per visual token side), {vision}
- text: Qwen2, hidden {hidden}, {layers} layers, {heads} heads, {kv_heads} KV heads, intermediate {inter},
  M-RoPE sections {mrope}, {tokens} tokenizer tokens ({vocab} embedding rows)
- image pixels in [{min_px}, {max_px}]; video frame pixels in [{vmin_px}, {vmax_px}]
- seed {seed}, generator version {version}, spec hash {spec_hash}
"""


def tiny_qwen_spec(variant: str = "qwen2_vl") -> dict[str, Any]:
    """Everything that determines the generated folder; its hash names the folder."""
    v = _variant(variant)
    return {
        "generator_version": GENERATOR_VERSION,
        "seed": SEED,
        "variant": v.name,
        "text": TEXT,
        "mrope_section": MROPE_SECTION,
        "vision": v.vision,
        "pixels": [MIN_PIXELS, MAX_PIXELS, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS],
        "bpe_vocab_size": BPE_VOCAB_SIZE,
        "bpe_min_frequency": BPE_MIN_FREQUENCY,
        "special_tokens": SPECIAL_TOKENS,
        "vocab_multiple": VOCAB_MULTIPLE,
        "weight_gain": WEIGHT_GAIN,
        "embed_std": EMBED_STD,
        "bias_std": BIAS_STD,
        "lm_head_std": LM_HEAD_STD,
        "single_byte_logit_scale": SINGLE_BYTE_LOGIT_SCALE,
        "chat_template": CHAT_TEMPLATE,
        "corpus_sha256": hashlib.sha256(CORPUS.encode()).hexdigest(),
    }


def tiny_qwen_dirname(variant: str = "qwen2_vl") -> str:
    blob = json.dumps(tiny_qwen_spec(variant), sort_keys=True).encode()
    return f"{_variant(variant).dir_prefix}-{hashlib.sha256(blob).hexdigest()[:12]}"


def ensure_tiny_qwen(cache_dir: Optional[Path] = None, variant: str = "qwen2_vl") -> Path:
    """Return the tiny Qwen2-VL (``variant="qwen2_vl"``) or Qwen2.5-VL (``"qwen2_5_vl"``) folder,
    generating it first if it is not there yet. Atomic, as :func:`vlora.models.tiny.ensure_tiny_model`."""
    v = _variant(variant)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_atomically(root / tiny_qwen_dirname(v.name), lambda out: _generate(v, out))


def _variant(name: str) -> QwenVariant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown tiny Qwen variant {name!r}; supported: {', '.join(VARIANTS)}") from None


def hub_config(variant: QwenVariant, tokenizer) -> dict[str, Any]:
    """config.json as the Hub checkpoints have it: flat text settings, rope_scaling, nested vision_config."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vision = dict(variant.vision, **{variant.vision_out_key: TEXT["hidden_size"]})
    vision["initializer_range"] = 0.02
    return {
        "architectures": [variant.architecture],
        "model_type": variant.model_type,
        **TEXT,
        "vocab_size": padded_vocab_size(len(tokenizer)),
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "sliding_window": TEXT["max_position_embeddings"],
        "max_window_layers": TEXT["num_hidden_layers"],
        "rope_scaling": {"type": "mrope", "mrope_section": list(MROPE_SECTION)},
        "bos_token_id": ids[PAD_TOKEN],  # as the Hub config: <|endoftext|>; the tokenizer adds no BOS
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "torch_dtype": "float32",
        "use_cache": True,
        "vision_config": vision,
    }


def padded_vocab_size(num_tokens: int) -> int:
    return -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _generate(variant: QwenVariant, out: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    tokenizer = build_tokenizer()
    config_dict = hub_config(variant, tokenizer)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    with torch.random.fork_rng(devices=[]):  # construction draws from the global RNG; leave it as it was
        model = variant.model_class()(config)
    _seeded_init(model)
    _shape_output_distribution(model, tokenizer)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config_dict["bos_token_id"],
        eos_token_id=[config_dict["eos_token_id"], config_dict["pad_token_id"]],
        pad_token_id=config_dict["pad_token_id"],
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json in transformers' nested layout; keep the Hub's flat one
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor_config(variant), indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(
        json.dumps(video_processor_config(variant), indent=2) + "\n")
    spec = tiny_qwen_spec(variant.name)
    (out / "vlora_tiny_spec.json").write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    dirname = tiny_qwen_dirname(variant.name)
    vision_desc = ", ".join(f"{k} {v}" for k, v in variant.vision.items()
                            if k not in ("patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels"))
    (out / "README.md").write_text(README.format(
        dirname=dirname, variant=variant.name, architecture=variant.architecture, patch=PATCH_SIZE,
        temporal=TEMPORAL_PATCH_SIZE, merge=MERGE_SIZE, px=PATCH_SIZE * MERGE_SIZE, vision=vision_desc,
        hidden=TEXT["hidden_size"], layers=TEXT["num_hidden_layers"], heads=TEXT["num_attention_heads"],
        kv_heads=TEXT["num_key_value_heads"], inter=TEXT["intermediate_size"], mrope=MROPE_SECTION,
        tokens=len(tokenizer), vocab=config_dict["vocab_size"], min_px=MIN_PIXELS, max_px=MAX_PIXELS,
        vmin_px=VIDEO_MIN_PIXELS, vmax_px=VIDEO_MAX_PIXELS, seed=SEED, version=GENERATOR_VERSION,
        spec_hash=dirname.rsplit("-", 1)[1],
    ))


def _seeded_init(model: torch.nn.Module) -> None:
    """Overwrite every parameter from a generator seeded by (SEED, parameter name).

    Norm weights are 1 and norm biases 0. Every other matrix is N(0, (WEIGHT_GAIN / sqrt(fan_in))^2),
    so each projection keeps its input's scale: attention is far from uniform, the decoder layers and
    the image features move the residual stream as much as the token embedding (N(0, EMBED_STD^2)) does,
    and the next token depends on the whole context (with transformers' 0.02 everywhere, the random
    model repeats one token whatever the prompt). Biases, Qwen2's q/k/v ones included, are
    N(0, BIAS_STD^2); the lm_head is N(0, LM_HEAD_STD^2).
    """
    norm_params = norm_parameter_names(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in norm_params:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            if name.endswith("lm_head.weight"):
                std = LM_HEAD_STD
            elif name.endswith("embed_tokens.weight"):
                std = EMBED_STD
            elif param.dim() == 1:
                std = BIAS_STD
            else:
                std = WEIGHT_GAIN / math.sqrt(param[0].numel())
            param.copy_(seeded_randn(f"{SEED}:{name}", param.shape, std=std).to(param.dtype))


def _shape_output_distribution(model, tokenizer) -> None:
    """As :func:`vlora.models.tiny._shape_output_distribution`: single-byte tokens are damped, and the
    template-only special tokens and the padding rows past the tokenizer get a constant 0 logit."""
    weight = model.get_output_embeddings().weight
    vocab = tokenizer.get_vocab()
    single = [i for tok, i in vocab.items() if len(tok) == 1]
    never = [tokenizer.convert_tokens_to_ids(t) for t in NEVER_GENERATED]
    with torch.no_grad():
        weight[single] *= SINGLE_BYTE_LOGIT_SCALE
        weight[never] = 0.0
        weight[len(tokenizer):] = 0.0


def build_tokenizer():
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer, trained on CORPUS, as ``Qwen2Tokenizer``.

    The BPE's tokens come first and Qwen's added tokens after them, in the Hub's order. No BOS is
    added (Qwen2's tokenizer has none); EOS is ``<|im_end|>`` and padding ``<|endoftext|>``, as in the
    Instruct checkpoints.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=BPE_MIN_FREQUENCY,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    fast = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=PAD_TOKEN,  # so that <|endoftext|> is added first; EOS is set to <|im_end|> below
        pad_token=PAD_TOKEN,
        model_max_length=TEXT["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        errors="replace",
    )
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t != PAD_TOKEN]})
    fast.eos_token = EOS_TOKEN
    ids = fast.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise RuntimeError(f"tiny Qwen tokenizer: special tokens are not in Qwen's order: {ids}")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _processor_config(kind: str, variant: QwenVariant, min_pixels: int, max_pixels: int) -> dict[str, Any]:
    """What Qwen2-VL's image and video processors share: ``kind`` names the processor type's key."""
    return {
        f"{kind}_processor_type": f"Qwen2VL{kind.capitalize()}Processor",
        "processor_class": variant.processor_class,
        "do_resize": True,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "resample": 3,
        **CLIP_PIXEL_SETTINGS,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }


def image_processor_config(variant: QwenVariant) -> dict[str, Any]:
    return _processor_config("image", variant, MIN_PIXELS, MAX_PIXELS)


def video_processor_config(variant: QwenVariant) -> dict[str, Any]:
    return {**_processor_config("video", variant, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS),
            "min_frames": 2, "max_frames": 64, "do_sample_frames": False, "cap_pixels_per_frame": False}


# ---------------------------------------------------------------------------------------------------
# LoRA adapters, made with PEFT

ADAPTER_VERSION = 2  # 2: portable_randn
ADAPTER_DELTA = 0.3  # typical size of one LoRA delta entry for a unit-RMS input (base projections: ~1.5)
QWEN_ADAPTERS = (
    DemoAdapter("qwen-r8-qv", r=8, alpha=16, modules=("q_proj", "v_proj"), seed=201),
    DemoAdapter("qwen-r16-attn", r=16, alpha=32, modules=ATTN_MODULES, seed=202),
    DemoAdapter("qwen-r32-mlp", r=32, alpha=32, modules=("q_proj", "gate_proj", "up_proj", "down_proj"), seed=203,
                use_rslora=True),
)
QWEN_ADAPTER_NAMES = tuple(a.name for a in QWEN_ADAPTERS)
QWEN_VISION_ADAPTER_NAMES = ("qwen-vision-r8", "qwen-vision-r16-mlp")


def qwen_vision_adapters(model_type: str) -> tuple[DemoAdapter, ...]:
    """Adapters on the vision side (served target names, see :data:`vlora.models.tiny.VISION_ADAPTERS`): the
    blocks' attention, the merger and two decoder projections; the blocks' MLP (Qwen2-VL's fc1/fc2,
    Qwen2.5-VL's gate/up/down) and the merger's last layer only."""
    mlp = (("vision.mlp.fc1", "vision.mlp.fc2") if model_type == "qwen2_vl"
           else ("vision.mlp.gate_proj", "vision.mlp.up_proj", "vision.mlp.down_proj"))
    attn = DemoAdapter(QWEN_VISION_ADAPTER_NAMES[0], r=8, alpha=16, seed=211,
                       modules=("vision.attn.qkv", "vision.attn.proj", "projector.mlp.0", "projector.mlp.2", "q_proj", "v_proj"))
    return attn, DemoAdapter(QWEN_VISION_ADAPTER_NAMES[1], r=16, alpha=16, seed=212, use_rslora=True,
                             modules=mlp + ("projector.mlp.2",))


def adapter_target_regex(modules) -> str:
    """PEFT ``target_modules`` for served target names (:func:`vlora.models.tiny.peft_target_regex`): the
    decoder's ``model.language_model.layers.N.{self_attn,mlp}.X``, the vision blocks' ``model.visual.
    blocks.N.{attn,mlp}.X`` (whose MLP has the decoder's names in Qwen2.5-VL: the prefix tells them apart)
    and the merger's ``model.visual.merger.mlp.{0,2}``."""
    return peft_target_regex(modules, r".*visual\.blocks", r".*visual\.merger")


def ensure_tiny_qwen_adapters(model_dir: Path, out_root: Path) -> Path:
    """Write :data:`QWEN_ADAPTERS` for the Qwen2-VL / Qwen2.5-VL model in ``model_dir`` under ``out_root``.

    Each adapter is made by PEFT itself (:func:`vlora.models.tiny.write_peft_adapter`): ``get_peft_model``
    with a ``LoraConfig`` on the loaded model, seeded random ``lora_A`` / ``lora_B`` (B not zero), and
    ``save_pretrained`` writes ``<out_root>/<name>/adapter_config.json`` and ``adapter_model.safetensors``,
    keys ``base_model.model.model.language_model.layers.N.<block>.<proj>.lora_{A,B}.weight``. Idempotent
    and atomic per adapter. Returns ``out_root``.
    """
    return _ensure_adapters(QWEN_ADAPTERS, model_dir, out_root)


def ensure_tiny_qwen_vision_adapters(model_dir: Path, out_root: Path) -> Path:
    """Write :func:`qwen_vision_adapters` for the model in ``model_dir`` under ``out_root``, as
    :func:`ensure_tiny_qwen_adapters` does (keys ``base_model.model.model.visual.blocks.N...`` and
    ``...model.visual.merger.mlp.K...`` besides the decoder's). Returns ``out_root``."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))["model_type"]
    return _ensure_adapters(qwen_vision_adapters(model_type), model_dir, out_root)


def _ensure_adapters(specs, model_dir: Path, out_root: Path) -> Path:
    return ensure_peft_adapters(specs, model_dir, out_root, load=lambda: load_tiny_qwen(model_dir),
                                target_regex=adapter_target_regex, delta=ADAPTER_DELTA, version=ADAPTER_VERSION,
                                what="the tiny random Qwen2-VL family model (vlora.models.tiny_qwen)")


def load_tiny_qwen(model_dir: Path, dtype: torch.dtype = torch.float32):
    """The model class named by the folder's config.json, loaded offline, in eval mode."""
    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    (architecture,) = config["architectures"]
    if architecture not in {v.architecture for v in VARIANTS.values()}:
        raise ValueError(f"{model_dir}: {architecture} is not a Qwen2-VL family model")
    model_class = getattr(transformers, architecture)
    return model_class.from_pretrained(model_dir, dtype=dtype, local_files_only=True).eval()

