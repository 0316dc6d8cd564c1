"""Random LoRA adapters for adapter-count sweeps (1 to 1,000), and adapters with random task heads (soak runs at any
model's dimensions), written in PEFT's format with ``write_adapter``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

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


def ensure_head_adapters(model_dir: Path, root: Path, heads: Mapping[str, Mapping[str, tuple[str, Sequence[str], str]]],
                         seed: int = 900) -> list[str]:
    """Rank-8 q/v adapters with random task heads under ``root``, one per name of ``heads`` (adapter -> head task ->
    (task type, labels, prompt)) at the dimensions of the model in ``model_dir``; a random head still answers one
    of its labels. Folders that have their heads and adapter already are kept. Returns the names."""
    import torch

    from vlora.heads import TaskHead, has_heads, save_heads

    model_dir, root = Path(model_dir), Path(root)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    for i, (name, tasks) in enumerate(sorted(heads.items())):
        folder = root / name
        if has_heads(folder) and (folder / "adapter_config.json").is_file():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        write_adapter(DemoAdapter(name, r=8, alpha=16, modules=("q_proj", "v_proj"), seed=seed + i), model_dir, text, folder)
        g = torch.Generator().manual_seed(seed + i)
        save_heads(folder, {task: TaskHead(task, task_type, tuple(labels),
                                           torch.randn(len(labels), int(text["hidden_size"]), generator=g) * 0.02,
                                           torch.zeros(len(labels)), prompt)
                            for task, (task_type, labels, prompt) in tasks.items()})
    return sorted(heads)
