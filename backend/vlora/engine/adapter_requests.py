"""The engine's view of its adapters: how many requests run and wait for each, the registry as a client
lists it, and unloading deferred until an adapter's last request finishes (engine thread only)."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Optional

from vlora.orchestrator.policies import UNMERGE

log = logging.getLogger(__name__)


class AdapterRequests:
    def __init__(self, loras, scheduler, metrics) -> None:
        self.loras = loras
        self.scheduler = scheduler  # its running and waiting requests, and its orchestrator (merge state)
        self.metrics = metrics
        self._unloading: dict[str, list[Callable[[dict], None]]] = {}  # adapter -> who waits for its unload
        self._reported: tuple = ()  # the per-adapter counts, residency and KV use last sent to the metrics

    def request_finished(self, name: Optional[str]) -> None:
        """A request of ``name`` finished: the last one of an adapter being unloaded completes the unload."""
        if name in self._unloading:
            try:
                self._complete_unload(name)
            except Exception:  # the step goes on; the adapter stays "unloading" and the error is logged
                log.exception("completing the unload of %s failed", name)

    def counts(self) -> dict[Optional[str], tuple[int, int]]:
        """(running, waiting) requests per adapter name (None: the base model)."""
        running = Counter(s.req.lora_name for s in self.scheduler.running)
        waiting = Counter(s.req.lora_name for s in self.scheduler.waiting)
        return {name: (running[name], waiting[name]) for name in set(running) | set(waiting)}

    def describe(self, names=None) -> list[dict]:
        """The adapter registry as a client lists it: the manager's entries plus requests and merge state."""
        counts = self.counts()
        out = self.loras.describe(names)
        for entry in out:
            entry["running"], entry["waiting"] = counts.get(entry["name"], (0, 0))
            entry["merged"] = entry["name"] == self.scheduler.orchestrator.merged
        return out

    def unload(self, name: str, on_unloaded: Optional[Callable[[dict], None]] = None) -> dict:
        """Unload ``name``, deferred while requests use it.

        New requests for it are refused at once (LoraManager.begin_unload); its running and waiting
        requests finish, and the last one to finish completes the unload (a merge of it is undone
        first). Returns its entry: ``state`` "unloading" until then, "unloaded" after.
        ``on_unloaded(entry)`` is called on this thread when the unload completes (at once when no
        request uses it). Unloading twice is not an error.
        """
        self.loras.begin_unload(name)
        waiters = self._unloading.setdefault(name, [])
        if on_unloaded is not None:
            waiters.append(on_unloaded)
        self._complete_unload(name)
        return self._adapter_entry(name)

    def _complete_unload(self, name: str) -> None:
        """Unload ``name`` (being unloaded) once no request runs or waits for it, and tell its waiters."""
        if name not in self._unloading or name in self.counts():
            return
        if self.scheduler.orchestrator.merged == name:
            self.scheduler.orchestrator.enter(UNMERGE, None)
        self.loras.unload(name)
        entry = self._adapter_entry(name)
        for notify in self._unloading.pop(name):
            try:
                notify(entry)
            except Exception:
                log.exception("an unload waiter of %s failed", name)

    def _adapter_entry(self, name: str) -> dict:
        entries = self.describe([name])
        return entries[0] if entries else {"name": name, "id": self.loras.adapter_id(name), "loaded": False,
                                           "state": "unloaded"}

    def report(self) -> None:
        """Send the per-adapter request counts, the tiers' residency and the KV cache's use when they changed."""
        running = Counter(s.req.lora_name for s in self.scheduler.running)
        waiting = Counter(s.req.lora_name for s in self.scheduler.waiting)
        resident = self.loras.resident_counts()
        blocks = self.scheduler.kv.allocator
        kv = (blocks.num_blocks - blocks.num_free, blocks.num_blocks)
        if (running, waiting, resident, kv) == self._reported:
            return
        old = self._reported
        self._reported = (running, waiting, resident, kv)
        if not old or (running, waiting) != old[:2]:
            self.metrics.adapter_requests(dict(running), dict(waiting))
        if not old or resident != old[2]:
            self.metrics.adapters_resident(*resident)
        if not old or kv != old[3]:
            self.metrics.kv_cache_usage(*kv)
