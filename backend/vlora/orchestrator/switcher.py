"""Mode switching: merge an adapter's delta into the base weights, or take it out again.

``SwiftSwitcher`` (V-LoRA §4.4.1) keeps each targeted projection's weights of all layers in one
preallocated contiguous tensor [L, d_out, d_in] (the layers' ``nn.Linear`` weights become views of
it), and merges or unmerges every layer with one call of the merge operator per projection type.
Switching from adapter A to adapter B is fused: one pass adds ``[s_B B_B, -s_A B_A] @ [A_B; A_A]``,
so W is read and written once instead of twice. ``PerLayerSwitcher`` is the dLoRA baseline: one
``addmm_`` per matrix.

The adapter stays in its LoRA slot while merged (the engine pins it), so unmerging subtracts
exactly what was added, up to the rounding of the weights' dtype.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from vlora.atmm.merge import merge_lora
from vlora.lora.layers import LoraLinear

log = logging.getLogger(__name__)


class Switcher:
    """Base class: tracks which slot is merged and times every switch."""

    name = ""

    def __init__(self, layers: dict[tuple[int, str], LoraLinear], num_layers: int) -> None:
        self.layers = layers
        self.num_layers = num_layers
        self.modules = sorted({m for _, m in layers})
        self.merged_slot: Optional[int] = None
        self.last_switch_s = 0.0
        self.total_switch_s = 0.0
        self.num_switches = 0

    def switch(self, slot: Optional[int]) -> float:
        """Make ``slot`` (None: no adapter) the merged one. Returns the seconds it took (0 if no change)."""
        if slot == self.merged_slot:
            return 0.0
        dev = next(iter(self.layers.values())).base.weight.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            self._apply(self.merged_slot, slot)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        log.debug("%s switch: slot %s -> %s in %.2f ms", self.name, self.merged_slot, slot, dt * 1e3)
        self.merged_slot = slot
        self.last_switch_s = dt
        self.total_switch_s += dt
        self.num_switches += 1
        return dt

    def _apply(self, old: Optional[int], new: Optional[int]) -> None:
        raise NotImplementedError

    def _stacked(self, module: str, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A [L, r_max, d_in], scale * B [L, d_out, r_max] and per-layer factors [L] of ``slot`` for
        ``module``: 1 where the adapter targets the layer (its scale is folded into ``lora_b``), else 0."""
        ls = [self.layers[(i, module)] for i in range(self.num_layers)]
        a = torch.stack([w.lora_a[slot] for w in ls])
        b = torch.stack([w.lora_b[slot] for w in ls])
        scales = torch.tensor([1.0 if w.ranks[slot] else 0.0 for w in ls], dtype=torch.float32, device=a.device)
        return a, b, scales


class SwiftSwitcher(Switcher):
    name = "swift"

    def __init__(self, layers: dict[tuple[int, str], LoraLinear], num_layers: int) -> None:
        super().__init__(layers, num_layers)
        self.stacks: dict[str, torch.Tensor] = {}
        for module in self.modules:
            ls = [layers[(i, module)] for i in range(num_layers)]
            w0 = ls[0].base.weight
            stack = torch.empty((num_layers,) + tuple(w0.shape), dtype=w0.dtype, device=w0.device)
            for i, w in enumerate(ls):  # one layer at a time: peak memory grows by one matrix, not a copy of all
                stack[i].copy_(w.base.weight.data)
                w.base.weight = torch.nn.Parameter(stack[i], requires_grad=False)
            self.stacks[module] = stack

    def _apply(self, old: Optional[int], new: Optional[int]) -> None:
        for module, stack in self.stacks.items():
            parts_a, parts_b = [], []
            for slot, sign in ((new, 1.0), (old, -1.0)):
                if slot is None:
                    continue
                a, b, scales = self._stacked(module, slot)
                if not torch.any(scales):
                    continue  # the adapter does not target this projection
                parts_a.append(a)
                parts_b.append(b * (sign * scales).to(b.dtype).view(-1, 1, 1))
            if parts_a:  # unmerge old and merge new in one pass over W: ranks concatenated
                merge_lora(stack, torch.cat(parts_a, dim=1).contiguous(), torch.cat(parts_b, dim=2).contiguous(), 1.0, 1)


class PerLayerSwitcher(Switcher):
    """dLoRA's switch: for every layer and projection, ``W.addmm_(B, A)`` (unmerge, then merge)."""

    name = "per-layer"

    def _apply(self, old: Optional[int], new: Optional[int]) -> None:
        for slot, sign in ((old, -1.0), (new, 1.0)):
            if slot is None:
                continue
            for w in self.layers.values():
                if w.ranks[slot]:  # lora_b holds scale * B
                    w.base.weight.data.addmm_(w.lora_b[slot], w.lora_a[slot], alpha=sign)


SWITCHERS = {c.name: c for c in (SwiftSwitcher, PerLayerSwitcher)}
