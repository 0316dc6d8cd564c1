"""Mode switching: merge an adapter's delta into the base weights, or take it out again.

``SwiftSwitcher`` (V-LoRA §4.4.1) works on the model runner's weight groups: the projections that
run as one GEMM (q/k/v, gate/up; o and down alone) keep their weights of all layers in one contiguous
stack [L, sum of d_out, d_in] (each layer's ``nn.Linear`` weights are views of it), and their LoRA slot
buffers of all layers in one stack per operand (:class:`~vlora.engine.model_runner.GroupSlots`, A [L, M,
S, r, d_in]; each layer's :class:`~vlora.lora.layers.LoraLinear` reads a view of it). A slot's A and B of
every layer are then one strided slice, read without gathering per-layer buffers. Where the group's
modules share d_out and all have slot buffers, the stack is M x L matrices of one shape ([L*M, d_out,
d_in]) and one call of the merge operator merges every layer and module at rank r (the extension's
streaming merge on CUDA), one call for q/k/v and o together where the runner keeps their stacks in one
buffer; otherwise each module is merged into its rows of the stack (``baddbmm_`` over L). The kernel reads
contiguous operands: the slot's strided slices are copied into one A and one B first (a few hundred MB
at 7B width, about 0.1-0.3 ms on an H100). Switching from adapter A to adapter B is fused the same way (``[B_B, -B_A] @ [A_B; A_A]``, rank 2r),
so W is read and written once instead of twice. ``PerLayerSwitcher`` is the dLoRA baseline: one
``addmm_`` per matrix. The slot buffers hold ``scale * B``.

The adapter stays in its LoRA slot while merged (the engine pins it), so unmerging subtracts
exactly what was added, up to the rounding of the weights' dtype.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from vlora.atmm.merge import merge_lora
from vlora.lora.layers import LoraLinear

if TYPE_CHECKING:
    from vlora.engine.model_runner import GroupSlots

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
        # Whole groups whose stacks follow each other in memory with one matrix shape (q/k/v and o of a model
        # without GQA: the runner allocates them as one buffer) are merged by one call over all their matrices.
        self.units: list[list[_Group]] = []
        for g in groups:
            last = self.units[-1][-1] if self.units else None
            if last is not None and _adjacent(last, g):
                self.units[-1].append(g)
            else:
                self.units.append([g])

    def _apply(self, old: Optional[int], new: Optional[int]) -> None:
        for unit in self.units:
            jobs = [(g, g.terms(old, new)) for g in unit]
            signs = {tuple((s, sign) for s, sign, _ in terms) for _, terms in jobs}
            if len(unit) > 1 and len(signs) == 1 and all(terms for _, terms in jobs):
                _merge_whole(jobs)  # every group of the unit, one call
                continue
            for g, terms in jobs:
                if not terms:
                    continue  # neither adapter targets this group
                if g.whole:
                    _merge_whole([(g, terms)])
                else:
                    _merge_modules(g, terms)


def _adjacent(a: _Group, b: _Group) -> bool:
    """Whether ``b``'s stack starts where ``a``'s ends, with matrices of one shape and both whole."""
    if not (a.whole and b.whole) or a.stack.dtype != b.stack.dtype or a.stack.device != b.stack.device:
        return False
    shape_a = (a.slots.b.shape[3], a.stack.shape[2])
    shape_b = (b.slots.b.shape[3], b.stack.shape[2])
    if shape_a != shape_b or a.slots.a.shape[3] != b.slots.a.shape[3]:
        return False
    if a.stack.untyped_storage().data_ptr() != b.stack.untyped_storage().data_ptr():
        return False
    return a.stack.storage_offset() + a.stack.numel() == b.stack.storage_offset()


def _merge_whole(jobs: list[tuple[_Group, tuple]]) -> None:
    """One merge over the matrices of ``jobs``' groups (adjacent in memory, one matrix shape, the same slots and
    signs in their terms): W [N, d, d_in] += [sign_i B_i] @ [A_i] with each slot's A and B copied from its strided
    slices into one contiguous operand per side (what the extension's merge kernel reads), the sign folded in."""
    first = jobs[0][0]
    d, d_in, r = first.slots.b.shape[3], first.stack.shape[2], first.slots.a.shape[3]
    terms = jobs[0][1]
    n = sum(g.matrices for g, _ in jobs)
    w = torch.as_strided(first.stack, (n, d, d_in), (d * d_in, d_in, 1), first.stack.storage_offset())
    a = first.stack.new_empty(n, r * len(terms), d_in)
    b = first.stack.new_empty(n, d, r * len(terms))
    row = 0
    for g, _ in jobs:
        m = g.matrices
        for i, (slot, sign, _) in enumerate(terms):
            a[row:row + m, i * r:(i + 1) * r].copy_(g.slots.a[:, :, slot].reshape(m, r, d_in))  # strided views
            src, dst = g.slots.b[:, :, slot].reshape(m, d, r), b[row:row + m, :, i * r:(i + 1) * r]
            if sign < 0:
                torch.neg(src, out=dst)  # copied and negated in one pass
            else:
                dst.copy_(src)
        row += m
    merge_lora(w, a, b, 1.0, 1)


def _merge_modules(g: _Group, terms: tuple) -> None:
    """Modules of different widths (GQA): each into its own rows of the stack, ``baddbmm_`` over the layers."""
    for k, (off, d) in enumerate(g.rows):
        parts = [(slot, sign) for slot, sign, ks in terms if k in ks]
        if not parts:
            continue
        r = g.slots.a.shape[3]
        a = g.stack.new_empty(g.stack.shape[0], r * len(parts), g.stack.shape[2])
        b = g.stack.new_empty(g.stack.shape[0], d, r * len(parts))
        for i, (slot, sign) in enumerate(parts):
            a[:, i * r:(i + 1) * r].copy_(g.slots.a[:, k, slot])
            src, dst = g.slots.b_parts[k][:, slot], b[:, :, i * r:(i + 1) * r]
            if sign < 0:
                torch.neg(src, out=dst)
            else:
                dst.copy_(src)
        g.stack[:, off:off + d].baddbmm_(b, a)


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
