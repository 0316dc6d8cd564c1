"""The vision side of a step: the encoder cache of projected image features, and LoRA on the vision tower
and projector (:class:`VisionLora`), whose per-image segments the step plan's writer makes."""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from vlora.engine.plan import PlanBuilder
from vlora.lora.backends import LoraBackend
from vlora.lora.layers import LoraContext, LoraLinear


class EncoderCache:
    """Projected vision features by (vision-side weights: the adapter's name@version or "" for the base
    model's, video or image, content hash), least recently used first out, within a byte budget. Engine
    thread only. Counters: hits, misses, evictions, bytes."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._items: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: tuple) -> Optional[torch.Tensor]:
        f = self._items.get(key)
        if f is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return f

    def put(self, key: tuple, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if key in self._items or size > self.budget:
            return
        self._items[key] = features
        self.bytes += size
        while self.bytes > self.budget:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
            self.evictions += 1

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "bytes": self.bytes}


class VisionLora:
    """LoRA on the vision tower and projector (or merger): the wrappers and one :class:`LoraContext` per
    stage, each stage with its own per-image segments (its rows per image differ, see
    :data:`vlora.models.family.VISION_STAGE`). The decoder's LoRA backend computes them, and an adapter's
    slot index is the same here as in the decoder's wrappers (one slot holds both sides of an adapter)."""

    def __init__(self, model: nn.Module, sites, num_slots: int, max_rank: int) -> None:
        self.contexts: dict[str, LoraContext] = {}
        self.layers: dict[tuple[int, str], LoraLinear] = {}  # (block, target) -> wrapper
        for site in sites:
            parent_path, _, attr = site.path.rpartition(".")
            parent = model.get_submodule(parent_path)
            ctx = self.contexts.setdefault(site.stage, LoraContext())
            wrapper = LoraLinear(getattr(parent, attr), ctx, num_slots, max_rank)
            setattr(parent, attr, wrapper)
            self.layers[(site.layer, site.target)] = wrapper

    @contextmanager
    def bind(self, rows: dict[str, list[int]], slots: list[int], backend: LoraBackend, plans: PlanBuilder):
        """Drive the wrappers for one encoder forward: item i's rows of each stage use ``slots[i]`` (the
        stages' segments written by the step plan's writer, in one copy)."""
        stages = list(self.contexts)
        mappings = plans.segment_mappings([(rows[stage], slots) for stage in stages])
        for stage, mapping in zip(stages, mappings):
            ctx = self.contexts[stage]
            ctx.backend = backend
            ctx.bind(mapping)
        try:
            yield
        finally:
            for ctx in self.contexts.values():
                ctx.clear()
