"""The one place that decides whether a load-test request is answered by a task head or by generation.

A video-analytics request (detection, action) sends ``task`` in ``sampling_parameters`` only when its
adapter declares a head for it; otherwise it generates a short label with ``max_tokens``. Heads live
beside ``adapter_config.json`` in ``vlora_heads.json`` (``vlora.heads``). A workload task matches a head
with the same task name, else a head of a matching task type (``WORKLOAD_TASK_TYPES``). When the
adapter folders are not visible to the load generator (a remote server given with ``--url`` and no
``--adapters``), no adapter has heads and every request generates.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

log = logging.getLogger(__name__)

# Workload task -> head task types that answer it (vlora.heads.TASK_TYPES).
WORKLOAD_TASK_TYPES = {"action": ("action",), "detection": ("counting", "presence")}


@dataclass(frozen=True)
class HeadPolicy:
    """adapter name -> {workload task: the head's task name}."""

    heads: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @classmethod
    def none(cls) -> "HeadPolicy":
        return cls({})

    @classmethod
    def from_adapter_root(cls, adapter_root: Optional[str | Path], names: tuple[str, ...]) -> "HeadPolicy":
        if adapter_root is None:
            return cls.none()
        root = Path(adapter_root)
        found = {}
        for name in names:
            declared = declared_heads(root / name)
            mapping = {task: head for task in WORKLOAD_TASK_TYPES if (head := match_head(task, declared))}
            if mapping:
                found[name] = mapping
        return cls(found)

    def head_task(self, adapter: Optional[str], task: str) -> Optional[str]:
        """The ``task`` value to send, or None to generate the answer instead."""
        if adapter is None:
            return None
        return self.heads.get(adapter, {}).get(task)

    def to_dict(self) -> dict[str, dict[str, str]]:
        return {a: dict(m) for a, m in self.heads.items()}

    def describe(self) -> str:
        if not self.heads:
            return "no adapter declares task heads: video tasks generate short labels"
        return "task heads: " + "; ".join(
            f"{a}: " + ", ".join(f"{t}->{h}" for t, h in sorted(m.items())) for a, m in sorted(self.heads.items()))


def match_head(task: str, declared: Mapping[str, str]) -> Optional[str]:
    """The head (task name) that answers workload ``task``, from {head task: task type}."""
    if task in declared:
        return task
    for head, task_type in sorted(declared.items()):
        if task_type in WORKLOAD_TASK_TYPES.get(task, ()):
            return head
    return None


def declared_heads(adapter_dir: Path) -> dict[str, str]:
    """{head task: task type} from an adapter folder's heads file; {} when it has none or cannot be read."""
    try:
        from vlora import heads as heads_module
    except ImportError:
        return {}
    config_name = getattr(heads_module, "HEADS_CONFIG", None)
    if config_name is None or not heads_module.has_heads(adapter_dir):
        return {}
    try:
        config = json.loads((Path(adapter_dir) / config_name).read_text(encoding="utf-8"))
        return {str(h["task"]): str(h.get("task_type", "")) for h in config["heads"]}
    except (OSError, ValueError, KeyError, TypeError) as e:  # the server reports a broken head file
        log.warning("%s: cannot read its task heads (%s); treating the adapter as head-less", adapter_dir, e)
        return {}


def head_prompts(adapter_root: Optional[str | Path]) -> dict[str, dict[str, tuple[tuple[str, ...], str]]]:
    """adapter -> head task -> (labels, the prompt it was trained with), from the heads files of the adapter folders
    under ``adapter_root``; {} when it is unknown or none can be read."""
    from vlora.heads import HEADS_CONFIG

    found: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {}
    root = Path(adapter_root) if adapter_root else None
    for path in sorted(root.glob(f"*/{HEADS_CONFIG}")) if root is not None and root.is_dir() else ():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
            tasks = {str(h["task"]): (tuple(str(x) for x in h["labels"]), str(h["prompt"])) for h in config["heads"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if tasks:
            found[path.parent.name] = tasks
    return found
