"""The one place that decides whether a load-test request is answered by a task head or by generation.

A video-analytics request (detection, action) uses ``task`` in ``sampling_parameters`` only when its
adapter declares a head for that task; otherwise it generates a short label with ``max_tokens``.
Heads are declared inside the adapter folder (issue 5); ``vlora.heads`` reads them. Until that module
offers a reader, or when the adapter folders are not visible to the load generator (a remote server
given with ``--url`` and no ``--adapters``), no adapter has heads and every request generates.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

log = logging.getLogger(__name__)

# Names of a vlora.heads function that, given an adapter folder, lists its heads (task names, or
# objects with a ``task`` or ``name`` attribute, or a mapping keyed by task).
_HEAD_READERS = ("list_heads", "read_heads", "load_head_specs")


@dataclass(frozen=True)
class HeadPolicy:
    """adapter name -> the tasks it has heads for."""

    heads: Mapping[str, frozenset[str]] = field(default_factory=dict)

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
            tasks = declared_head_tasks(root / name)
            if tasks:
                found[name] = frozenset(tasks)
        return cls(found)

    def head_task(self, adapter: Optional[str], task: str) -> Optional[str]:
        """The ``task`` value to send, or None to generate the answer instead."""
        if adapter is not None and task in self.heads.get(adapter, ()):
            return task
        return None

    def describe(self) -> str:
        if not self.heads:
            return "no adapter declares task heads: video tasks generate short labels"
        return "task heads: " + "; ".join(f"{a}: {', '.join(sorted(t))}" for a, t in sorted(self.heads.items()))


def declared_head_tasks(adapter_dir: Path) -> tuple[str, ...]:
    """The task names of the heads in one adapter folder, through ``vlora.heads`` when it can say."""
    try:
        from vlora import heads as heads_module
    except ImportError:
        return ()
    for attr in _HEAD_READERS:
        reader = getattr(heads_module, attr, None)
        if reader is None:
            continue
        try:
            declared = reader(adapter_dir)
        except FileNotFoundError:
            return ()
        except Exception as e:  # a broken head file is the server's to report; here it means "generate"
            log.warning("vlora.heads.%s(%s) failed (%s); treating the adapter as head-less", attr, adapter_dir, e)
            return ()
        return _task_names(declared)
    return ()


def _task_names(declared) -> tuple[str, ...]:
    if not declared:
        return ()
    if isinstance(declared, Mapping):
        return tuple(str(k) for k in declared)
    names = []
    for item in declared:
        if isinstance(item, str):
            names.append(item)
        else:
            name = getattr(item, "task", None) or getattr(item, "name", None)
            if name:
                names.append(str(name))
    return tuple(names)
