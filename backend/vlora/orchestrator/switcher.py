"""Mode switching: merge an adapter's delta into the base weights, or take it out again.

``SwiftSwitcher`` (V-LoRA §4.4.1) works on the model runner's weight groups: the projections that
run as one GEMM (q/k/v, gate/up; o and down alone) keep their weights of all layers in one contiguous
stack [L, sum of d_out, d_in] (each layer's ``nn.Linear`` weights are views of it), and their LoRA slot
buffers of all layers in one stack per operand (:class:`~vlora.lora.layers.GroupSlots`, A [L, M,
S, r, d_in]; each layer's :class:`~vlora.lora.layers.LoraLinear` reads a view of it). A slot's A and B of
every layer are then one strided slice, which the merge operator's streaming kernel reads in place (no
gathering copies). Where the group's modules share d_out and all have slot buffers, the stack is M x L
matrices of one shape ([L*M, d_out, d_in]) and one call merges every layer and module at rank r;
otherwise each module is merged into its rows of the stack (one call per module). Switching from adapter
A to adapter B is one call too (``W += B_B A_B - B_A A_A``, rank 2r), so W is read and written once
instead of twice. ``PerLayerSwitcher`` is the dLoRA baseline: one ``addmm_`` per matrix. The slot
buffers hold ``scale * B``.

The adapter stays in its LoRA slot while merged (the engine pins it), so unmerging subtracts
exactly what was added, up to the rounding of the weights' dtype.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from vlora.atmm.merge import merge_lora_terms
from vlora.lora.layers import GroupSlots, LoraLinear

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


@dataclass(frozen=True)
class _Group:
    """One weight group as the swift switcher merges it. ``whole``: its modules share d_out and all have slot
    buffers, so its stack is L*M matrices of one shape and one merge covers it."""

    stack: torch.Tensor
    slots: GroupSlots
    rows: tuple[tuple[int, int], ...]  # (row offset in the stack, d_out) of each module with slot buffers
    wrappers: tuple[tuple[LoraLinear, ...], ...]  # each module's wrapper of every layer (for its ranks)
    whole: bool

    @property
    def matrices(self) -> int:
        return self.slots.a.shape[0] * self.slots.a.shape[1]

    def terms(self, old: Optional[int], new: Optional[int]) -> tuple:
        """((slot, sign, modules the adapter targets), ...): the new adapter first, then the old one taken out."""
        out = []
        for slot, sign in ((new, 1.0), (old, -1.0)):
            if slot is not None:
                ks = tuple(k for k, ws in enumerate(self.wrappers) if any(w.ranks[slot] for w in ws))
                if ks:
                    out.append((slot, sign, ks))
        return tuple(out)


class SwiftSwitcher(Switcher):
    name = "swift"

    def __init__(self, runner) -> None:
        super().__init__(runner)
        L = self.num_layers
        groups = []
        for group in runner.groups.values():
            slots = getattr(group, "slots", None)
            if slots is None:
                continue
            at = {name: (off, d) for name, off, d in group.modules}
            wrappers = tuple(tuple(self.layers[(li, m)] for li in range(L)) for m in slots.modules)
            whole = slots.b is not None and slots.modules == tuple(n for n, _, _ in group.modules)
            groups.append(_Group(group.stack, slots, tuple(at[m] for m in slots.modules), wrappers, whole))
        self.groups: list[_Group] = groups

    def _apply(self, old: Optional[int], new: Optional[int]) -> None:
        for g in self.groups:
            terms = g.terms(old, new)
            if not terms:
                continue  # neither adapter targets this group
            if g.whole:
                _merge_whole(g, terms)
            else:
                _merge_modules(g, terms)


def _view(t: torch.Tensor, *shape: int) -> torch.Tensor:
    """``t`` as ``shape`` without a copy where its strides allow (a slot's slice of a slot stack does)."""
    try:
        return t.view(*shape)
    except RuntimeError:
        return t.reshape(*shape)


def _merge_whole(g: _Group, terms: tuple) -> None:
    """One merge over the group's L*M matrices: W [L*M, d, d_in] += sum_i sign_i B_i @ A_i, each slot's A and B
    read in place from the slot stacks (strided views), the new and the old adapter in one pass."""
    d, d_in, r = g.slots.b.shape[3], g.stack.shape[2], g.slots.a.shape[3]
    m = g.matrices
    w = g.stack.view(m, d, d_in)
    merge_lora_terms(w, [(_view(g.slots.a[:, :, slot], m, r, d_in), _view(g.slots.b[:, :, slot], m, d, r), sign)
                         for slot, sign, _ in terms])


def _merge_modules(g: _Group, terms: tuple) -> None:
    """Modules of different widths (GQA): each into its own rows of the stack, one merge over the layers."""
    for k, (off, d) in enumerate(g.rows):
        parts = [(g.slots.a[:, k, slot], g.slots.b_parts[k][:, slot], sign) for slot, sign, ks in terms if k in ks]
        if parts:
            merge_lora_terms(g.stack[:, off:off + d], parts)


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
