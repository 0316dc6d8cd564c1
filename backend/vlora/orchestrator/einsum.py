"""dLoRA's unmerged LoRA compute, the baseline for ATMM: pad every segment to the longest one,
gather each segment's adapter, and run two batched einsums. Same signature as ``vlora.atmm.atmm``."""
from __future__ import annotations

import torch

from vlora.lora.mapping import LoraBatchMapping


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
