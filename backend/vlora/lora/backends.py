"""The LoRA compute backends, chosen by name: one class per kernel family.

Every backend serves two kinds of step metadata:
- ``segments``: an eager step's :class:`~vlora.atmm.mapping.LoraBatchMapping` (segments of a packed
  batch, with host copies of the segment bounds), the signature of :func:`vlora.atmm.atmm`;
- ``rows``: a captured decode step's per-row slot buffer at a fixed device address (one token per row,
  slot -1 for rows without an adapter). Nothing in it may read device values on the host, so that the
  step can be captured once and replayed as a CUDA graph while the buffer's contents change.

The slot buffers hold ``lora_b`` pre-multiplied by each adapter's scale
(:meth:`vlora.lora.layers.LoraLinear.set_slot`): backends pass a unit scale (``sign``: +1 adds the
delta, -1 takes it out again, deLoRA's mixture mode), so a slot can change adapters without changing
a captured launch's arguments. Ranks in the ``rows`` path are the slot buffers' ``r_max``: the buffers
are zero past each adapter's rank.
"""
from __future__ import annotations

from typing import Callable

import torch

from vlora.atmm import atmm, atmm_reference
from vlora.atmm.dispatch import default_kernels
from vlora.atmm.mapping import LoraBatchMapping


def lora_rows_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    row_slot: torch.Tensor, sign: float) -> torch.Tensor:
    """Graph-safe per-row LoRA in plain PyTorch (gathers each row's adapter: bytes grow with the rows).

    Semantics: y[i] += sign * B[s_i] @ (A[s_i] @ x[i])  for rows with s_i = row_slot[i] >= 0
    Shape: y [T, d_out]  x [T, d_in]  lora_a [n, r, d_in]  lora_b [n, d_out, r]  row_slot [T] int32
    """
    idx = row_slot.clamp(min=0).long()
    keep = (row_slot >= 0).to(y.dtype).unsqueeze(1) * sign
    v = torch.bmm(lora_a.index_select(0, idx), x.unsqueeze(2))  # [T, r, 1]
    y += torch.bmm(lora_b.index_select(0, idx), v).squeeze(2) * keep
    return y


def lora_padded_einsum(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       ranks: tuple[int, ...], scales: tuple[float, ...], mapping: LoraBatchMapping) -> torch.Tensor:
    """Semantics as :func:`vlora.atmm.atmm` (ranks are padded to r_max: the slot buffers are zero there)."""
    segs = [(mapping.seg_indptr_host[i], mapping.seg_indptr_host[i + 1], s) for i, s in enumerate(mapping.seg_slot_host)
            if s >= 0 and ranks[s] > 0 and mapping.seg_indptr_host[i + 1] > mapping.seg_indptr_host[i]]
    if not segs:
        return y
    longest = max(hi - lo for lo, hi, _ in segs)
    xp = x.new_zeros(len(segs), longest, x.shape[1])
    for i, (lo, hi, _) in enumerate(segs):
        xp[i, : hi - lo] = x[lo:hi]
    idx = torch.tensor([s for _, _, s in segs], device=x.device)
    scale = torch.tensor([scales[s] for _, _, s in segs], dtype=x.dtype, device=x.device)
    v = torch.einsum("sld,srd->slr", xp, lora_a.index_select(0, idx))
    out = torch.einsum("slr,sor->slo", v, lora_b.index_select(0, idx)) * scale.view(-1, 1, 1)
    for i, (lo, hi, _) in enumerate(segs):
        y[lo:hi] += out[i, : hi - lo]
    return y


class LoraBackend:
    """Base class. ``segments`` has :func:`vlora.atmm.atmm`'s signature; ``rows`` is the graph-safe path."""

    name = ""

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping: LoraBatchMapping) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, y, x, lora_a, lora_b, mapping: LoraBatchMapping, sign: float) -> torch.Tensor:
        return lora_rows_torch(y, x, lora_a, lora_b, mapping.seg_slot, sign)


class AtmmBackend(LoraBackend):
    """ATMM: the CUDA extension where it serves (fp16/bf16 on CUDA), the PyTorch reference elsewhere."""

    name = "atmm"

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        return atmm(y, x, lora_a, lora_b, ranks, scales, mapping)

    def rows(self, y, x, lora_a, lora_b, mapping, sign):
        if y.is_cuda:
            kernels = default_kernels()
            if kernels.run_rows(y, x, lora_a, lora_b, mapping, sign):
                return y
        return lora_rows_torch(y, x, lora_a, lora_b, mapping.seg_slot, sign)


class ReferenceBackend(LoraBackend):
    """The PyTorch segment loop that every kernel is tested against."""

    name = "reference"

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        return atmm_reference(y, x, lora_a, lora_b, ranks, scales, mapping)


class PaddedEinsumBackend(LoraBackend):
    """dLoRA's baseline: segments padded to the longest, two batched einsums."""

    name = "padded-einsum"

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        return lora_padded_einsum(y, x, lora_a, lora_b, ranks, scales, mapping)


BACKENDS: dict[str, Callable[[], LoraBackend]] = {c.name: c for c in (AtmmBackend, ReferenceBackend, PaddedEinsumBackend)}


def get_lora_backend(name: str) -> LoraBackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown LoRA backend {name!r}; known: {sorted(BACKENDS)}") from None
