"""Adapter residency: a registry of adapters under the adapter root, a host-memory LRU tier, and the
device slots that the LoRA layers read.

``validate`` runs on request threads (it loads and checks an adapter into the host tier, so a bad
adapter is refused before anything is queued); ``acquire``/``release`` run on the engine thread and
pin a slot while a request that uses it is running.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from vlora.config import LoraConfig
from vlora.engine.api import InvalidRequest
from vlora.lora.adapter import AdapterWeights, list_adapters, load_adapter, resolve_adapter_dir
from vlora.lora.layers import LoraLinear

log = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, root: Optional[Path], layers: dict[tuple[int, str], LoraLinear], num_layers: int,
                 module_dims: dict[str, tuple[int, int]], cfg: LoraConfig) -> None:
        self.root = Path(root).resolve() if root is not None else None
        self.layers = layers
        self.num_layers = num_layers
        self.module_dims = module_dims
        self.cfg = cfg
        self._lock = threading.Lock()
        self._host: "OrderedDict[str, AdapterWeights]" = OrderedDict()
        self._slot_of: dict[str, int] = {}
        self._name_in: list[Optional[str]] = [None] * cfg.max_gpu_adapters
        self._pins = [0] * cfg.max_gpu_adapters
        self._slot_lru: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(cfg.max_gpu_adapters))
        self._heads_in: list[dict] = [{} for _ in range(cfg.max_gpu_adapters)]  # slot -> task -> TaskHead on the device
        first = next(iter(layers.values()), None)
        self.device = first.lora_a.device if first is not None else None
        self.swaps_in = 0
        self._in_memory: dict[str, AdapterWeights] = {}  # registered without a folder; never evicted

    def register(self, name: str, weights: AdapterWeights) -> None:
        """Make ``weights`` servable as ``name`` without a folder under the adapter root (benchmarks
        and tests that need hundreds of adapters). Such adapters stay in the host tier for good."""
        with self._lock:
            self._in_memory[name] = weights

    # -- registry (any thread) -----------------------------------------------------------------
    def list_adapters(self) -> list[str]:
        on_disk = list_adapters(self.root) if self.root is not None else []
        return sorted(set(on_disk) | set(self._in_memory))

    def validate(self, name: str) -> AdapterWeights:
        """Resolve, load and check ``name`` into the host tier. Raises InvalidRequest/AdapterError."""
        w = self._in_memory.get(name)
        if w is not None:
            return w
        if self.root is None:
            raise InvalidRequest(f"unknown adapter {name!r}: this server has no adapter root configured")
        with self._lock:
            w = self._host.get(name)
            if w is not None:
                self._host.move_to_end(name)
                return w
        path = resolve_adapter_dir(self.root, name)  # refuses traversal and unknown names
        w = load_adapter(self.root, name, num_layers=self.num_layers, module_dims=self.module_dims,
                         max_rank=self.cfg.max_rank, supported_modules=self.cfg.target_modules)
        log.info("loaded adapter %s from %s (rank %d)", name, path, w.max_rank)
        with self._lock:
            self._host[name] = w
            self._host.move_to_end(name)
            self._evict_host()
        return w

    def _evict_host(self) -> None:
        while len(self._host) > self.cfg.max_cpu_adapters:
            victim = next((n for n in self._host if n not in self._slot_of), None)
            if victim is None:
                break
            del self._host[victim]

    # -- device slots (engine thread) ----------------------------------------------------------
    def acquire(self, name: Optional[str]) -> Optional[int]:
        """Pin a slot holding ``name`` (-1 for the base model); None if every slot is pinned."""
        if name is None:
            return -1
        slot = self._slot_of.get(name)
        if slot is None:
            slot = next((s for s in self._slot_lru if self._pins[s] == 0), None)
            if slot is None:
                return None
            self._load_slot(slot, name)
        self._pins[slot] += 1
        self._slot_lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot >= 0:
            self._pins[slot] -= 1

    def _load_slot(self, slot: int, name: str) -> None:
        w = self.validate(name)
        old = self._name_in[slot]
        if old is not None:
            del self._slot_of[old]
        for (layer, module), wrapper in self.layers.items():
            pair = w.pairs.get((layer, module))
            if pair is None:
                wrapper.set_slot(slot, None, None, 0.0)
            else:
                wrapper.set_slot(slot, pair.a, pair.b, pair.scale)
        self._heads_in[slot] = {t: (h.to(self.device) if self.device is not None else h) for t, h in w.heads.items()}
        self._name_in[slot] = name
        self._slot_of[name] = slot
        self.swaps_in += 1
        log.debug("adapter %s -> slot %d (evicted %s)", name, slot, old)

    def head(self, slot: int, task: str):
        """The task head ``task`` of the adapter in ``slot`` (on the device), or None."""
        return self._heads_in[slot].get(task) if slot >= 0 else None

    @property
    def resident(self) -> dict[str, int]:
        return dict(self._slot_of)
