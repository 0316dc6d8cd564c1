"""Random LoRA adapters for adapter-count sweeps (1 to 1,000), written in PEFT's format with ``write_adapter``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from vlora.lora.demo import DemoAdapter, write_adapter

LOAD_ADAPTER_PREFIX = "load"


def load_adapter_names(n: int, rank: int) -> list[str]:
    return [f"{LOAD_ADAPTER_PREFIX}-r{rank}-{i:04d}" for i in range(n)]


def ensure_load_adapters(model_dir: Path, root: Path, n: int, rank: int = 8,
                         modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"), seed: int = 0) -> list[str]:
    """``n`` adapters ``load-r<rank>-0000`` ... under ``root`` for the model in ``model_dir``; existing ones are kept."""
    model_dir, root = Path(model_dir), Path(root)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text_config = config.get("text_config", config)
    root.mkdir(parents=True, exist_ok=True)
    names = load_adapter_names(n, rank)
    for i, name in enumerate(names):
        folder = root / name
        if (folder / "adapter_config.json").is_file():
            continue
        tmp = root / f".{name}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        spec = DemoAdapter(name, r=rank, alpha=2 * rank, modules=tuple(modules), seed=seed * 100_003 + i)
        write_adapter(spec, model_dir, text_config, tmp)
        tmp.rename(folder)
    return names
