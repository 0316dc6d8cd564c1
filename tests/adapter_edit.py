"""Test helpers: copy an adapter folder under the adapter root, editing its config or tensors; an adapter
root that mixes a language-only adapter with vision-side ones."""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def clone_adapter(root: Path, src: str, dst: str, edit_config=None, edit_tensors=None) -> str:
    """Copy ``root/src`` to ``root/dst``; ``edit_config(dict)`` and ``edit_tensors(dict)`` change it in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(root / src, root / dst)
    if edit_config:
        cfg = json.loads((root / dst / "adapter_config.json").read_text())
        edit_config(cfg)
        (root / dst / "adapter_config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(str(root / dst / "adapter_model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(root / dst / "adapter_model.safetensors"))
    return dst


def mixed_vision_root(root: Path, model_dir: Path, demo_root: Path, language_only: str) -> Path:
    """``root`` with the demo adapter ``language_only`` copied from ``demo_root`` and the tiny LLaVA's
    vision-side adapters (:data:`vlora.models.tiny.VISION_ADAPTER_NAMES`, written by PEFT for the model
    in ``model_dir``); returns ``root``. Each caller's root is its own, free to edit."""
    from vlora.models.tiny import ensure_tiny_vision_adapters

    shutil.copytree(demo_root / language_only, root / language_only)
    return ensure_tiny_vision_adapters(model_dir, root)
