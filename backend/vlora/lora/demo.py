"""Demo adapters for the tiny model, written directly in PEFT's on-disk format.

Each adapter differs in rank and target modules, so one batch can mix them the way the issue asks:

| name              | r  | alpha | targets                         | notes                                  |
| ----------------- | -- | ----- | ------------------------------- | -------------------------------------- |
| demo-r8-qv        | 8  | 16    | q_proj v_proj                   |                                        |
| demo-r16-attn     | 16 | 32    | q_proj k_proj v_proj o_proj     |                                        |
| demo-r32-mlp      | 32 | 32    | all seven, MLP included         | use_rslora: scale alpha / sqrt(r)      |
| demo-r4-pattern   | 4  | 8     | q_proj o_proj down_proj         | rank_pattern down_proj=12, alpha_pattern o_proj=16 |

The weights are random (from fixed seeds) and B is not zero, so each adapter visibly changes the
model's output; they are scaled so that activations stay finite. ``target_modules`` is a regex limited
to the language model, so that PEFT does not also wrap the CLIP tower's q_proj/k_proj/v_proj. Key
names are those PEFT writes for LlavaForConditionalGeneration under transformers 5.
PEFT itself is not needed to write or read them.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlora.lora.adapter import ATTN_MODULES, CONFIG_FILE, WEIGHTS_FILE, decoder_module_dims

DEMO_VERSION = 1
STAMP_FILE = "vlora_demo.json"
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


def ensure_demo_adapters(model_dir: Path, out_root: Path, *, trained: bool = True) -> Path:
    """Write the demo adapters for the model in ``model_dir`` under ``out_root``; return ``out_root``.

    Idempotent: an adapter folder whose stamp matches (same demo spec, same model dimensions) is kept
    as it is. Otherwise it is built in a temporary folder and renamed into place, so a reader never
    sees a half-written adapter, and concurrent callers do not clash.

    With ``trained``, the adapters with vision task heads of :mod:`vlora.fusion.demo` are added too
    (copied from the committed ones when they were trained on this model, else trained here).
    """
    model_dir, out_root = Path(model_dir), Path(out_root)
    text_config = _text_config(model_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    for spec in DEMO_ADAPTERS:
        _ensure_one(spec, model_dir, text_config, out_root)
    if trained:
        from vlora.fusion.demo import ensure_trained_demo_adapters

        ensure_trained_demo_adapters(model_dir, out_root)
    return out_root


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


def _read_stamp(d: Path) -> Any:
    try:
        return json.loads((d / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _ensure_one(spec: DemoAdapter, model_dir: Path, text_config: dict[str, Any], out_root: Path) -> None:
    final = out_root / spec.name
    stamp = _stamp(spec, text_config)
    if _read_stamp(final) == stamp:
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=out_root))
    old = None
    try:
        write_adapter(spec, model_dir, text_config, tmp)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        if final.exists() or final.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{spec.name}.old.", dir=out_root))
            try:
                os.rename(final, old / "adapter")
            except FileNotFoundError:
                pass  # another process moved it first
        try:
            os.rename(tmp, final)
        except OSError:
            if _read_stamp(final) != stamp:  # lost a race against a writer of the same spec: fine
                raise
    finally:
        for d in (tmp, old):
            if d is not None and d.exists():
                shutil.rmtree(d, ignore_errors=True)


def write_adapter(spec: DemoAdapter, model_dir: Path, text_config: dict[str, Any], out: Path) -> None:
    """Write ``spec`` as a PEFT adapter folder ``out`` (random weights) for a decoder with ``text_config``."""
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
            a = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
            b = torch.randn(d_out, r, generator=gen) * (TARGET_DELTA / (spec.scale(module) * math.sqrt(r)))
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
