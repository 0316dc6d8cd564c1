"""Test helper: copy an adapter folder under the adapter root, editing its config or tensors."""
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
