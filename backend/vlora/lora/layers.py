"""LoRA linear wrappers: the base projection plus every adapter's delta through a LoRA backend.

Each wrapped projection owns preallocated slot buffers (``lora_a``/``lora_b``, one slot per resident
adapter, at fixed device addresses) and reads the step's :class:`LoraBatchMapping` from a
:class:`LoraContext` shared by all wrappers, so the per-step metadata is built once and never per layer.
``lora_b`` holds B already multiplied by the adapter's scale, so the compute takes a unit scale and a
slot can change adapters without changing any launch argument (what lets decode steps replay as CUDA
graphs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from vlora.atmm.mapping import LoraBatchMapping
from vlora.lora.backends import LoraBackend, SegmentsBackend, get_lora_backend


class LoraContext:
    """What the LoRA layers read during one step: set by the runner before the forward, cleared after.

    ``mapping``: which slot's delta each token adds. ``delora``: which merged slot's delta each token
    subtracts (mixture mode), or None. ``rows``: True in a captured decode step, where the mappings
    are per-row slot buffers (one token per row) that the backend must read on the device only.
    ``backend``: the LoRA compute (:mod:`vlora.lora.backends`), chosen by name. :meth:`bind` sets the
    step's mappings and has the backend prepare them, once per step.
    """

    def __init__(self, backend: Optional[LoraBackend] = None) -> None:
        self.mapping: Optional[LoraBatchMapping] = None
        self.delora: Optional[LoraBatchMapping] = None
        self.rows = False
        self.backend = backend or get_lora_backend("atmm")

    @property
    def backend(self) -> LoraBackend:
        return self._backend

    @backend.setter
    def backend(self, backend) -> None:
        self._backend = backend if isinstance(backend, LoraBackend) else SegmentsBackend(backend)

    def bind(self, mapping: Optional[LoraBatchMapping], delora: Optional[LoraBatchMapping] = None,
             rows: bool = False) -> None:
        """The step's LoRA metadata (views of the step plan): every layer of the step reads it, and the
        backend prepares its launches from it here, once."""
        self.mapping, self.delora, self.rows = mapping, delora, rows
        if (mapping is not None and mapping.has_lora) or (delora is not None and delora.has_lora):
            self.backend.prepare(self)

    def clear(self) -> None:
        self.mapping = self.delora = None
        self.rows = False


@dataclass
class SlotCopyPlan:
    """One adapter's copy into a slot (:meth:`LoraLinear.copy_plan`): the slot tensors to zero, the destinations of
    the adapter's A and B tensors in load order, and the B destinations its scales multiply."""

    zero: list
    dsts: list
    scaled: list

    def run(self, srcs: list, scales: list, put_many: Optional[Callable[[list, list], None]] = None) -> None:
        """Zero, copy ``srcs`` (A, B of each layer the adapter has, in the plan's order) and scale, on the current
        stream, in three batched calls at most."""
        if self.zero:
            torch._foreach_zero_(self.zero)
        if self.dsts:
            if put_many is None:
                torch._foreach_copy_(self.dsts, srcs, non_blocking=True)
            else:
                put_many(self.dsts, srcs)
            torch._foreach_mul_(self.scaled, scales)


class LoraLinear(nn.Module):
    """``y = base(x) + sum over segments of x @ A_s^T @ B_s^T * scale_s``.

    Shape: x [T, d_in] (or [..., d_in], flattened), y [T, d_out]. Slots whose adapter does not target
    this projection have rank 0 here and cost nothing in eager steps.
    """

    def __init__(self, base: nn.Linear, ctx: LoraContext, num_slots: int, max_rank: int,
                 lora_a: Optional[torch.Tensor] = None, lora_b: Optional[torch.Tensor] = None) -> None:
        """``lora_a`` [num_slots, max_rank, d_in] and ``lora_b`` [num_slots, d_out, max_rank], contiguous: slot
        buffers owned by someone else (the model runner keeps every layer's in one stack per weight group,
        which the swift switcher merges from without a gather); None: allocated here."""
        super().__init__()
        self.base = base
        self.ctx = ctx
        w = base.weight
        self.in_features = base.in_features
        self.out_features = base.out_features
        if lora_a is None or lora_b is None:
            lora_a = torch.zeros(num_slots, max_rank, self.in_features, dtype=w.dtype, device=w.device)
            lora_b = torch.zeros(num_slots, self.out_features, max_rank, dtype=w.dtype, device=w.device)
        want_a, want_b = (num_slots, max_rank, self.in_features), (num_slots, self.out_features, max_rank)
        if tuple(lora_a.shape) != want_a or tuple(lora_b.shape) != want_b or not (lora_a.is_contiguous() and lora_b.is_contiguous()):
            raise ValueError(f"LoraLinear: slot buffers A{tuple(lora_a.shape)} B{tuple(lora_b.shape)} must be contiguous "
                             f"A{want_a} B{want_b}")
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.ranks: list[int] = [0] * num_slots
        self.scales: list[float] = [0.0] * num_slots  # each slot's adapter scale (already folded into lora_b)
        self.atmm_check: Optional[str] = None  # why the ATMM extension cannot take the slot buffers ("": it can), once
        self._slots_changed()

    def _slots_changed(self) -> None:
        """What the backends read per call, made when a slot changes (adapter load), never per call: the ranks,
        the per-slot unit scales (1 for a slot holding this layer's delta, -1 to take it out, 0 for none) as
        the extension takes them and as tuples, and the launch-plan key (d_in, d_out, r_max, ranks)."""
        self.ranks_t: tuple[int, ...] = tuple(self.ranks)
        self.unit_scales: list[float] = [1.0 if r else 0.0 for r in self.ranks]
        self.neg_scales: list[float] = [-x for x in self.unit_scales]
        self.unit_scales_t, self.neg_scales_t = tuple(self.unit_scales), tuple(self.neg_scales)
        self.atmm_key = (self.in_features, self.out_features, self.lora_a.shape[1], self.ranks_t)

    @property
    def weight(self) -> torch.Tensor:  # modules that peek at .weight (dtype checks) keep working
        return self.base.weight

    def set_slot(self, slot: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor], scale: float) -> None:
        """Copy one adapter's A [r, d_in] and ``scale * B`` [d_out, r] into ``slot`` (None: the adapter
        skips this layer): :meth:`copy_slot`, then :meth:`note_slot`."""
        self.copy_slot(slot, a, b, scale)
        self.note_slot(slot, 0 if a is None or b is None else a.shape[0], scale)

    def copy_slot(self, slot: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor], scale: float) -> None:
        """The data of :meth:`set_slot`, on the current stream: on a CPU, B folded with its scale in fp32; on a
        device, :meth:`copy_slots` for this layer alone."""
        if self.lora_a.device.type != "cpu":
            LoraLinear.copy_slots(slot, [(self, a, b, scale)])
            return
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            self.lora_a[slot, :r].copy_(a)
            self.lora_b[slot, :, :r].copy_(b.float() * float(scale))  # folded in fp32

    @staticmethod
    def copy_plan(slot: int, ranks: "Sequence[tuple[LoraLinear, int]]") -> "SlotCopyPlan":
        """What :meth:`copy_slots` writes for an adapter of these per-layer ``ranks`` (0: the layer is skipped) in
        ``slot``: the slot tensors to zero (skipped layers, and ranks below the slots' where the copy does not
        overwrite it all), the destinations of each layer's A and B, and the B destinations to scale. Made once per
        (slot, ranks) and reused: the copy thread then runs no per-tensor Python, which beside busy threads runs
        at a fraction of a core's speed (each thread holding the GIL in turn)."""
        plan = SlotCopyPlan([], [], [])
        for wrapper, r in ranks:
            if r < wrapper.lora_a.shape[1]:  # a full-rank copy overwrites it all
                plan.zero += [wrapper.lora_a[slot], wrapper.lora_b[slot]]
            if r:
                b_dst = wrapper.lora_b[slot, :, :r]
                plan.dsts += [wrapper.lora_a[slot, :r], b_dst]
                plan.scaled.append(b_dst)
        return plan

    @staticmethod
    def copy_slots(slot: int, entries: "Sequence[tuple[LoraLinear, Optional[torch.Tensor], Optional[torch.Tensor], float]]",
                   put_many: Optional[Callable[[list, list], None]] = None) -> None:
        """Copy one adapter into ``slot`` of many layers on a device, in a few batched calls (each zeroes, copies or
        scales every layer's tensors at once): ``entries`` are (wrapper, A [r, d_in], B [d_out, r], scale), A and B
        None where the adapter skips that layer. The slot is zeroed, A goes into its first r rows and B into its
        first r columns, then is scaled in the slots' dtype. ``put_many(dsts, srcs)`` moves the host tensors (on
        CUDA the copy thread's page-locked staging, vlora.lora.transfers.SlotCopies.put_many; default: plain
        asynchronous copies). A thread that made one call per tensor (six per layer, a thousand for a rank-64
        q/k/v/o adapter) waited for the GIL at each beside a busy engine thread; the zeroing is skipped where a
        full-rank copy overwrites the whole slot, which saves that thread one more wait."""
        plan = LoraLinear.copy_plan(slot, [(w, 0 if a is None or b is None else a.shape[0]) for w, a, b, _ in entries])
        srcs = [t for _, a, b, _ in entries if a is not None and b is not None for t in (a, b)]
        scales = [float(scale) for _, a, b, scale in entries if a is not None and b is not None]
        plan.run(srcs, scales, put_many)

    def note_slot(self, slot: int, rank: int, scale: float) -> None:
        """The host-side record of what :meth:`copy_slot` put in ``slot`` (rank 0: nothing), on the engine
        thread: what the backends read per call changes only between steps."""
        self.ranks[slot], self.scales[slot] = rank, float(scale) if rank else 0.0
        self._slots_changed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        shape = y.shape
        y2 = self.add_lora(x.reshape(-1, self.in_features), y.reshape(-1, self.out_features))
        return y2.view(shape)

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the step's LoRA deltas to ``y`` in place. Shape: x [T, d_in], y [T, d_out] (y may be the
        columns of a fused projection's output: rows strided). Returns y."""
        ctx = self.ctx
        plus = ctx.mapping is not None and ctx.mapping.has_lora
        minus = ctx.delora is not None and ctx.delora.has_lora
        if not (plus or minus):
            return y
        if ctx.rows:
            if plus:
                ctx.backend.add_rows(y, x, self, ctx.mapping, 1.0)
            if minus:
                ctx.backend.add_rows(y, x, self, ctx.delora, -1.0)
            return y
        if plus:
            if x.shape[0] != ctx.mapping.num_tokens:
                raise RuntimeError(f"LoraLinear: {x.shape[0]} tokens but the step mapping covers {ctx.mapping.num_tokens}")
            ctx.backend.add(y, x, self, ctx.mapping, 1.0)
        if minus:  # deLoRA: take the merged adapter's delta back out for tokens of other adapters
            ctx.backend.add(y, x, self, ctx.delora, -1.0)
        return y


@dataclass
class GroupSlots:
    """The LoRA slot buffers of one weight group's wrapped modules, every layer's in one stack per operand.

    Each layer's :class:`LoraLinear` reads a contiguous view ``a[layer, k]`` [S, r, d_in] and
    ``b_parts[k][layer]`` [S, d_out, r] (what the ATMM kernels take), while one slot's A and B of every
    layer are one strided slice, ``a[:, :, slot]`` [L, M, r, d_in]: the swift switcher merges from it
    without gathering per-layer buffers.

    Shape: a [L, M, S, r, d_in]; b [L, M, S, d_out, r] when the M modules share d_out, else None;
    b_parts: per module [L, S, d_out_k, r] (views of b when it exists); modules: the wrapped modules' names.
    """

    modules: tuple[str, ...]
    a: torch.Tensor
    b: Optional[torch.Tensor]
    b_parts: tuple[torch.Tensor, ...]
