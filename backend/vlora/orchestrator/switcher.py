"""Mode switching: merge an adapter's delta into the base weights, or take it out again.

``SwiftSwitcher`` (V-LoRA §4.4.1) works on the model runner's weight groups: the projections that
run as one GEMM (q/k/v, gate/up; o and down alone) keep their weights of all layers in one contiguous
stack [L, sum of d_out, d_in] (each layer's ``nn.Linear`` weights are views of it), and one call of
the merge operator per group merges or unmerges every layer: B is laid out block-diagonally, each
module's ``scale * B`` in its own rows and rank columns, against the modules' A concatenated along the
rank. Switching from adapter A to adapter B is fused the same way (``[B_B, -B_A] @ [A_B; A_A]``), so W
is read and written once instead of twice. ``PerLayerSwitcher`` is the dLoRA baseline: one
``addmm_`` per matrix. The slot buffers hold ``scale * B`` (:class:`~vlora.lora.layers.LoraLinear`).

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

    def __init__(self, runner) -> None:
        self.runner = runner
        self.layers: dict[tuple[int, str], LoraLinear] = runner.lora_layers
        self.num_layers = runner.num_layers
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


class SwiftSwitcher(Switcher):
    name = "swift"

    def _apply(self, old: Optional[int], new: Optional[int]) -> None:
        L = self.num_layers
        for group in self.runner.groups.values():
            stack = group.stack
            modules = [(off, d, [group.lora[li][k][2] for li in range(L)])
                       for k, (off, d, _) in enumerate(group.lora[0])]
            parts_a, blocks = [], []  # blocks: (row offset, rows, signed B [L, d, r])
            for slot, sign in ((new, 1.0), (old, -1.0)):
                if slot is None:
                    continue
                for off, d, ws in modules:
                    if not any(w.ranks[slot] for w in ws):
                        continue  # the adapter does not target this projection
                    parts_a.append(torch.stack([w.lora_a[slot] for w in ws]))
                    b = torch.stack([w.lora_b[slot] for w in ws])
                    blocks.append((off, d, b if sign > 0 else -b))
            if not parts_a:
                continue
            a = torch.cat(parts_a, dim=1).contiguous()
            b = stack.new_zeros(L, stack.shape[1], a.shape[1])
            col = 0
            for off, d, blk in blocks:  # block-diagonal: each module's delta lands in its own rows only
                b[:, off:off + d, col:col + blk.shape[2]] = blk
                col += blk.shape[2]
            merge_lora(stack, a, b, 1.0, 1)


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
