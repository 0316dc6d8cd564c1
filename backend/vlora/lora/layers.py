"""LoRA linear wrappers: the base projection plus every adapter's delta through ``atmm``.

Each wrapped projection owns preallocated slot buffers (``lora_a``/``lora_b``, one slot per resident
adapter) and reads the step's :class:`LoraBatchMapping` from a :class:`LoraContext` shared by all
wrappers, so the per-step metadata is built once and never per layer.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from vlora.atmm import atmm
from vlora.lora.mapping import LoraBatchMapping


class LoraContext:
    """What the LoRA layers read during one step: set by the engine before the forward, cleared after.

    ``mapping``: which slot's delta each token adds. ``delora``: which merged slot's delta each token
    subtracts (mixture mode), or None. ``compute``: the batched LoRA operator (ATMM, or the padded
    einsum of the dLoRA baseline), with :func:`vlora.atmm.atmm`'s signature.
    """

    def __init__(self, compute: Callable = atmm) -> None:
        self.mapping: Optional[LoraBatchMapping] = None
        self.delora: Optional[LoraBatchMapping] = None
        self.compute = compute


class LoraLinear(nn.Module):
    """``y = base(x) + sum over segments of x @ A_s^T @ B_s^T * scale_s``.

    Shape: x [T, d_in] (or [..., d_in], flattened), y [T, d_out]. Slots whose adapter does not target
    this projection have rank 0 here and cost nothing.
    """

    def __init__(self, base: nn.Linear, ctx: LoraContext, num_slots: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.ctx = ctx
        w = base.weight
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.register_buffer("lora_a", torch.zeros(num_slots, max_rank, self.in_features, dtype=w.dtype, device=w.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, self.out_features, max_rank, dtype=w.dtype, device=w.device), persistent=False)
        self.ranks: list[int] = [0] * num_slots
        self.scales: list[float] = [0.0] * num_slots
        self._ranks_t: tuple[int, ...] = tuple(self.ranks)
        self._scales_t: tuple[float, ...] = tuple(self.scales)
        self._neg_scales_t: tuple[float, ...] = tuple(self.scales)

    @property
    def weight(self) -> torch.Tensor:  # modules that peek at .weight (dtype checks) keep working
        return self.base.weight

    def set_slot(self, slot: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor], scale: float) -> None:
        """Copy one adapter's A [r, d_in] and B [d_out, r] into ``slot`` (None: the adapter skips this layer)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is None or b is None:
            self.ranks[slot], self.scales[slot] = 0, 0.0
        else:
            r = a.shape[0]
            self.lora_a[slot, :r].copy_(a, non_blocking=True)
            self.lora_b[slot, :, :r].copy_(b, non_blocking=True)
            self.ranks[slot], self.scales[slot] = r, float(scale)
        self._ranks_t, self._scales_t = tuple(self.ranks), tuple(self.scales)
        self._neg_scales_t = tuple(-x for x in self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ctx = self.ctx
        plus = ctx.mapping is not None and ctx.mapping.has_lora
        minus = ctx.delora is not None and ctx.delora.has_lora
        if not (plus or minus):
            return y
        shape = y.shape
        x2 = x.reshape(-1, self.in_features)
        y2 = y.reshape(-1, self.out_features)
        if plus:
            if x2.shape[0] != ctx.mapping.num_tokens:
                raise RuntimeError(f"LoraLinear: {x2.shape[0]} tokens but the step mapping covers {ctx.mapping.num_tokens}")
            ctx.compute(y2, x2, self.lora_a, self.lora_b, self._ranks_t, self._scales_t, ctx.mapping)
        if minus:  # deLoRA: take the merged adapter's delta back out for tokens of other adapters
            ctx.compute(y2, x2, self.lora_a, self.lora_b, self._ranks_t, self._neg_scales_t, ctx.delora)
        return y2.view(shape)
