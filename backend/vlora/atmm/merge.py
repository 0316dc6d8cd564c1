"""The merge operator for mode switching: every targeted layer's ``W += sign * scale * B @ A`` at once.

The orchestrator keeps the weights of each group of same-shaped layers (for example q, k, v and o
of all decoder layers) in one preallocated contiguous tensor, so one call updates all of them in
place, with no reshape copies.
"""
from __future__ import annotations

import torch


def _check(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, sign: int) -> None:
    if sign not in (1, -1):
        raise ValueError(f"merge_lora: sign must be +1 (merge) or -1 (unmerge), got {sign}")
    if weights.dim() != 3 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError("merge_lora: weights [L, d_out, d_in], lora_a [L, r, d_in], lora_b [L, d_out, r]")
    n, d_out, d_in = weights.shape
    if lora_a.shape[0] != n or lora_b.shape[0] != n or lora_a.shape[2] != d_in or lora_b.shape[1] != d_out \
            or lora_b.shape[2] != lora_a.shape[1]:
        raise ValueError(f"merge_lora: shapes W{tuple(weights.shape)} A{tuple(lora_a.shape)} B{tuple(lora_b.shape)} disagree")
    if not weights.is_contiguous():
        raise ValueError("merge_lora: weights must be one contiguous tensor (preallocated for in-place merges)")


def merge_lora(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scale: float | torch.Tensor, sign: int = 1) -> torch.Tensor:
    """Merge (sign=+1) or unmerge (sign=-1) one adapter into a stack of same-shaped weights, in place.

    Semantics: W[l] += sign * scale[l] * B[l] @ A[l]   for every l
    Shape:
        weights [L, d_out, d_in]  contiguous, updated in place
        lora_a  [L, r, d_in]      PEFT lora_A.weight of each layer
        lora_b  [L, d_out, r]     PEFT lora_B.weight of each layer
        scale   float, or [L] tensor of per-layer scales
    One batched GEMM with beta=1 (``baddbmm_``): W is read and written once.
    """
    _check(weights, lora_a, lora_b, sign)
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        # Per-layer scales: fold them into B (small: L * d_out * r) rather than into W.
        lora_b = lora_b * (sign * scale.to(lora_b.dtype).view(-1, 1, 1))
        return weights.baddbmm_(lora_b, lora_a)
    return weights.baddbmm_(lora_b, lora_a, alpha=sign * float(scale))


def merge_lora_reference(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         scale: float | torch.Tensor, sign: int = 1) -> torch.Tensor:
    """Layer-by-layer fp32 reference of :func:`merge_lora`."""
    _check(weights, lora_a, lora_b, sign)
    scales = scale.tolist() if isinstance(scale, torch.Tensor) and scale.numel() > 1 else [float(scale)] * weights.shape[0]
    for l in range(weights.shape[0]):
        delta = lora_b[l].float() @ lora_a[l].float()
        weights[l].copy_((weights[l].float() + sign * scales[l] * delta).to(weights.dtype))
    return weights
