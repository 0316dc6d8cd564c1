"""Demo adapters for the tiny model, written directly in PEFT's on-disk format.

Each adapter differs in rank and target modules, so one batch can mix them the way the issue asks:

| name              | r  | alpha | targets                         | notes                                  |
| ----------------- | -- | ----- | ------------------------------- | -------------------------------------- |
| demo-r8-qv        | 8  | 16    | q_proj v_proj                   |                                        |
| demo-r16-attn     | 16 | 32    | q_proj k_proj v_proj o_proj     |                                        |
| demo-r32-mlp      | 32 | 32    | all seven, MLP included         | use_rslora: scale alpha / sqrt(r)      |
| demo-r4-pattern   | 4  | 8     | q_proj o_proj down_proj         | rank_pattern down_proj=12, alpha_pattern o_proj=16 |

The weights are random (from fixed seeds, drawn with :func:`portable_randn`, the same bits on every
CPU) and B is not zero, so each adapter visibly changes the model's output; they are scaled so that
activations stay finite. ``target_modules`` is a regex limited to the language model, so that PEFT
does not also wrap the CLIP tower's q_proj/k_proj/v_proj. Key names are those PEFT writes for
LlavaForConditionalGeneration under transformers 5.
PEFT itself is not needed to write or read them.

Beside them, the demo adapters with vision task heads (``demo-count-circles``, ``demo-shapes``) ship as
data: trained once by :mod:`vlora.fusion.demo` and committed in ``demo_adapters/`` with a stamp naming
the model they were trained on (:func:`model_fingerprint`). They are copied, never trained, here, so
serving imports no training code; for another model they are left out with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vlora.lora.adapter import ATTN_MODULES, CONFIG_FILE, WEIGHTS_FILE, decoder_module_dims

log = logging.getLogger(__name__)

DEMO_VERSION = 2  # 2: values from portable_randn (bit-identical on every CPU), not torch.randn
STAMP_FILE = "vlora_demo.json"
COMMITTED_DIR = Path(__file__).parent / "demo_adapters"  # the trained demo adapters (package data)
TARGET_DELTA = 0.2  # typical size of one LoRA delta entry for a unit-RMS input (base projections give ~0.2)


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    r: int
    alpha: float
    modules: tuple[str, ...]
    seed: int
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank(self, module: str) -> int:
        return self.rank_pattern.get(module, self.r)

    def scale(self, module: str) -> float:
        r, alpha = self.rank(module), self.alpha_pattern.get(module, self.alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


DEMO_ADAPTERS = (
    DemoAdapter("demo-r8-qv", r=8, alpha=16, modules=("q_proj", "v_proj"), seed=101),
    DemoAdapter("demo-r16-attn", r=16, alpha=32, modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=102),
    DemoAdapter("demo-r32-mlp", r=32, alpha=32, seed=103, use_rslora=True,
                modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    DemoAdapter("demo-r4-pattern", r=4, alpha=8, modules=("q_proj", "o_proj", "down_proj"), seed=104,
                rank_pattern={"down_proj": 12}, alpha_pattern={"o_proj": 16}),
)
DEMO_ADAPTER_NAMES = tuple(a.name for a in DEMO_ADAPTERS)


# Irwin-Hall N(0, 1): the sum of 12 uniforms on [0, 1) has mean 6 and variance 12 * 1/12 = 1.
_IRWIN_HALL_TERMS = 12
_UNIFORM_BITS = 24


def portable_randn(shape, generator: torch.Generator, *, std: float = 1.0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N(0, std^2)-like values from ``generator`` that are bit-identical on every CPU, ISA and thread count.

    ``torch.randn`` is not: its Box-Muller transform takes log/cos from Sleef on the AVX2/AVX-512 path
    and from libm on the scalar one (what ``ATEN_CPU_CAPABILITY=default``, old x86 and ARM get), and the
    two differ in the last bit. Here only integers are drawn and every step after is exact:

    - ``torch.randint(0, 2**24)`` takes the low 24 bits of each 32-bit Mersenne Twister output, in a
      serial integer kernel: the same integers on every platform;
    - each value is the Irwin-Hall sum of 12 uniforms ``(k_i + 1/2) / 2^24`` minus 6, i.e.
      ``(sum k_i + 6 - 6 * 2^24) / 2^24``: the numerator is an integer below 2^29, summed in int64 and
      converted to float64 exactly, and the division by 2^24 is exact;
    - the one rounding step is IEEE: ``z * std`` in float64, then the cast to ``dtype`` (both correctly
      rounded, no transcendental function, no fused multiply-add to contract).

    The distribution: mean exactly 0, variance 1 - 2^-48, bounded to [-6, 6) (a normal passes 6 sigma
    once in 5e8 draws; weights' tails are a little lighter than a normal's). Values take 12 draws each, in
    row-major order: a tensor's values depend on every draw made from ``generator`` before it, so the
    model and adapter generators give each tensor a generator of its own (:func:`seeded_randn`) or draw
    in a fixed order.
    """
    shape = tuple(int(n) for n in shape)
    numel = math.prod(shape)
    ints = torch.randint(0, 1 << _UNIFORM_BITS, (numel, _IRWIN_HALL_TERMS), generator=generator, dtype=torch.int64)
    numerator = ints.sum(dim=1) + (_IRWIN_HALL_TERMS // 2 - (_IRWIN_HALL_TERMS // 2 << _UNIFORM_BITS))
    z = numerator.to(torch.float64) / float(1 << _UNIFORM_BITS)
    if std != 1.0:
        z = z * float(std)
    return z.to(dtype).reshape(shape)


def seeded_randn(key: str, shape, std: float = 1.0) -> torch.Tensor:
    """:func:`portable_randn` from a generator seeded by ``key`` (float32): the same key and shape, the same
    bits on every machine. Draws for different keys are independent of each other and of the order they
    are made in."""
    digest = hashlib.sha256(key.encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return portable_randn(shape, gen, std=std)


def ensure_demo_adapters(model_dir: Path, out_root: Path, *, trained: bool = True) -> Path:
    """Write the demo adapters for the model in ``model_dir`` under ``out_root``; return ``out_root``.

    Idempotent: an adapter folder whose stamp matches (same demo spec, same model dimensions) is kept
    as it is. Otherwise it is built in a temporary folder and renamed into place, so a reader never
    sees a half-written adapter, and concurrent callers do not clash.

    With ``trained``, the committed adapters with vision task heads are added too (see
    :func:`install_committed_demos`).
    """
    model_dir, out_root = Path(model_dir), Path(out_root)
    text_config = _text_config(model_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    for spec in DEMO_ADAPTERS:
        _ensure_one(spec, model_dir, text_config, out_root)
    if trained:
        install_committed_demos(model_dir, out_root)
    return out_root


def model_fingerprint(model_dir: Path) -> str:
    """What the trained demo weights depend on: the model's config and weights files. The config is hashed
    without its "transformers_version" (save_pretrained writes the installed version there): a newer
    transformers that generates the same tiny model bit for bit must not make the committed demos stale."""
    h = hashlib.sha256()
    for name in sorted(p.name for p in Path(model_dir).iterdir() if p.name == "config.json" or p.suffix == ".safetensors"):
        if name == "config.json":
            config = json.loads((Path(model_dir) / name).read_text(encoding="utf-8"))
            config.pop("transformers_version", None)
            h.update(json.dumps(config, sort_keys=True).encode())
            continue
        with open(Path(model_dir) / name, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def install_committed_demos(model_dir: Path, out_root: Path) -> list[str]:
    """Copy the committed trained demo adapters that were trained on ``model_dir`` into ``out_root``; return
    the names now there. One already there with the committed stamp is kept; one trained on another model
    is left out with a warning (``python -m vlora.fusion.demo --write-committed`` retrains them)."""
    model_dir, out_root = Path(model_dir), Path(out_root)
    fingerprint = model_fingerprint(model_dir)
    present = []
    for committed in sorted(p for p in COMMITTED_DIR.iterdir() if p.is_dir()):
        stamp = read_stamp(committed)
        if not isinstance(stamp, dict) or stamp.get("model") != fingerprint:
            log.warning("demo adapter %s was trained on another model than %s; left out (retrain the committed "
                        "copies with `python -m vlora.fusion.demo --write-committed`)", committed.name, model_dir)
            continue
        final = out_root / committed.name
        if read_stamp(final) != stamp:
            install(final, lambda tmp, c=committed: shutil.copytree(c, tmp, dirs_exist_ok=True))
        present.append(committed.name)
    return present


def _text_config(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    needed = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
    missing = [k for k in needed if k not in text]
    if missing:
        raise ValueError(f"{model_dir}/config.json: text_config lacks {missing}")
    return text


def _stamp(spec: DemoAdapter, text_config: dict[str, Any]) -> dict[str, Any]:
    dims = decoder_module_dims(text_config)
    blob = json.dumps({"version": DEMO_VERSION, "spec": repr(spec), "dims": dims,
                       "layers": text_config["num_hidden_layers"]}, sort_keys=True)
    return {"demo_version": DEMO_VERSION, "spec_sha256": hashlib.sha256(blob.encode()).hexdigest()}


def read_stamp(d: Path) -> Any:
    """The stamp of the adapter folder ``d`` (what it was built from), or None."""
    try:
        return json.loads((d / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def install(final: Path, build: Callable[[Path], None]) -> None:
    """Build an adapter folder with ``build(tmp)`` in a temporary folder beside ``final``, then rename it
    into place, so a reader never sees a half-written adapter and concurrent callers do not clash. ``build``
    writes the stamp too: losing the rename to another writer of the same stamp is fine."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    old = None
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        if final.exists() or final.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            try:
                os.rename(final, old / "adapter")
            except FileNotFoundError:
                pass  # another process moved it first
        try:
            os.rename(tmp, final)
        except OSError:
            if read_stamp(final) != read_stamp(tmp):  # lost a race against a writer of the same build: fine
                raise
    finally:
        for d in (tmp, old):
            if d is not None and d.exists():
                shutil.rmtree(d, ignore_errors=True)


def _ensure_one(spec: DemoAdapter, model_dir: Path, text_config: dict[str, Any], out_root: Path) -> None:
    final = out_root / spec.name
    stamp = _stamp(spec, text_config)
    if read_stamp(final) == stamp:
        return

    def build(tmp: Path) -> None:
        write_adapter(spec, model_dir, text_config, tmp)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")

    install(final, build)


def write_adapter(spec: DemoAdapter, model_dir: Path, text_config: dict[str, Any], out: Path) -> None:
    """Write ``spec`` as a PEFT adapter folder ``out`` (random weights) for a decoder with ``text_config``.

    The values come from one generator seeded by ``spec.seed`` (:func:`portable_randn`), drawn layer by
    layer in the spec's module order: the same bits on every machine."""
    from safetensors.torch import save_file

    dims = decoder_module_dims(text_config)
    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(text_config["num_hidden_layers"])):
        for module in spec.modules:  # fixed order: the generator's draws depend on it
            d_in, d_out = dims[module]
            r = spec.rank(module)
            block = "self_attn" if module in ATTN_MODULES else "mlp"
            prefix = f"base_model.model.model.language_model.layers.{layer}.{block}.{module}"
            a = portable_randn((r, d_in), gen, std=1 / math.sqrt(d_in))
            b = portable_randn((d_out, r), gen, std=TARGET_DELTA / (spec.scale(module) * math.sqrt(r)))
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": str(model_dir),
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": r".*language_model.*\.(" + "|".join(spec.modules) + ")",
        "bias": "none",
        "use_rslora": spec.use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "rank_pattern": dict(spec.rank_pattern),
        "alpha_pattern": dict(spec.alpha_pattern),
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(
        f"# {spec.name}\n\nA demo LoRA adapter generated by vlora (`vlora.lora.demo`) for the tiny random model: "
        f"random weights from seed {spec.seed}, not trained. Rank {spec.r}, targets {', '.join(spec.modules)}.\n")
