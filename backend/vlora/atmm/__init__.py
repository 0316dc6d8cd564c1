"""ATMM: adaptive-tiling matrix multiplication for a packed batch of tokens over many LoRA adapters.

``atmm`` is the one entry point. The CUDA extension (``csrc/atmm``) serves it where it is built and
the inputs live on a GPU; otherwise the PyTorch reference runs.
"""
from __future__ import annotations

import torch

from vlora.atmm.dispatch import AtmmKernels, default_kernels, set_default_kernels
from vlora.atmm.merge import merge_lora, merge_lora_reference, merge_lora_terms
from vlora.atmm.reference import atmm_reference
from vlora.atmm.mapping import LoraBatchMapping

__all__ = ["atmm", "atmm_reference", "AtmmKernels", "default_kernels", "set_default_kernels", "merge_lora",
           "merge_lora_reference", "merge_lora_terms"]


def atmm(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: tuple[int, ...],
    scales: tuple[float, ...],
    mapping: LoraBatchMapping,
    kernels: AtmmKernels | None = None,
) -> torch.Tensor:
    """Add every segment's LoRA product to ``y`` in place, and return ``y``.

    Semantics: for each segment i with slot s = seg_slot[i] >= 0 and rank r = ranks[s]:
        y[p[i]:p[i+1]] += x[p[i]:p[i+1]] @ A[s, :r].T @ B[s, :, :r].T * scales[s]
    where p = mapping.seg_indptr. Segments with slot -1, rank 0 or no tokens leave y unchanged.
    Shape:
        y       [T, d_out]              activations, updated in place
        x       [T, d_in]               same dtype and device as y
        lora_a  [n_slots, r_max, d_in]  PEFT ``lora_A.weight`` layout, zero-padded past each rank
        lora_b  [n_slots, d_out, r_max] PEFT ``lora_B.weight`` layout, zero-padded past each rank
        ranks   n_slots ints            rank of each slot for this layer (0: slot does not target it)
        scales  n_slots floats          lora_alpha / r (or the rsLoRA scale) of each slot
        mapping LoraBatchMapping        segments of this step, shared by every layer
        kernels AtmmKernels             the extension and its table (None: :func:`default_kernels`)
    The CUDA path (fp16/bf16, widths and r_max multiples of 8) relies on the zero padding past each
    rank: it rounds ranks up to a multiple of 8. The engine's layers do not come through here: their
    backend (:class:`vlora.lora.backends.AtmmBackend`) plans once per step and launches.
    """
    if not mapping.has_lora:
        return y
    if y.is_cuda:
        kernels = kernels if kernels is not None else default_kernels()
        if not kernels.unsupported(y, x, lora_a, lora_b, ranks, scales, mapping):
            return kernels.run(y, x, lora_a, lora_b, ranks, scales, mapping)
    return atmm_reference(y, x, lora_a, lora_b, ranks, scales, mapping)
