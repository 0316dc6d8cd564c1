"""PyTorch reference for ATMM: the CPU path and the oracle every kernel is tested against."""
from __future__ import annotations

import torch

from vlora.atmm.mapping import LoraBatchMapping


def atmm_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: tuple[int, ...],
    scales: tuple[float, ...],
    mapping: LoraBatchMapping,
) -> torch.Tensor:
    """Segment loop in the inputs' dtype (fp32 accumulation on CPU). See :func:`vlora.atmm.atmm`."""
    for i, slot in enumerate(mapping.seg_slot_host):
        lo, hi = mapping.seg_indptr_host[i], mapping.seg_indptr_host[i + 1]
        if slot < 0 or hi == lo:
            continue
        r = ranks[slot]
        if r == 0:
            continue
        v = x[lo:hi] @ lora_a[slot, :r].t()
        y[lo:hi] += (v @ lora_b[slot, :, :r].t()) * scales[slot]
    return y
