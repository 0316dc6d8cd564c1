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


def _cutlass_ok(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    return (weights.is_cuda and weights.dtype in (torch.float16, torch.bfloat16)
            and lora_a.dtype == lora_b.dtype == weights.dtype and lora_a.is_contiguous() and lora_b.is_contiguous()
            and weights.shape[2] % 8 == 0 and lora_a.shape[1] % 8 == 0
            and all(t.data_ptr() % 16 == 0 for t in (weights, lora_a, lora_b)))


def _stream_config(ext, weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> str | None:
    """The streaming merge configuration for this rank, or None where it cannot serve."""
    if ext is None or not hasattr(ext, "merge_config_max_ranks") or not _cutlass_ok(weights, lora_a, lora_b):
        return None
    rank = lora_a.shape[1]
    for name in ("mg_m128n128_r64", "mg_m128n128_r128"):
        if name in ext.merge_configs() and rank <= ext.merge_config_max_ranks()[ext.merge_configs().index(name)]:
            return name
    return None


def merge_lora(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scale: float | torch.Tensor, sign: int = 1, backend: str = "auto", config: str | None = None) -> torch.Tensor:
    """Merge (sign=+1) or unmerge (sign=-1) one adapter into a stack of same-shaped weights, in place.

    Semantics: W[l] += sign * scale[l] * B[l] @ A[l]   for every l
    Shape:
        weights [L, d_out, d_in]  contiguous, updated in place
        lora_a  [L, r, d_in]      PEFT lora_A.weight of each layer
        lora_b  [L, d_out, r]     PEFT lora_B.weight of each layer
        scale   float, or [L] tensor of per-layer scales
    One pass over W (read and written once) by one of: the streaming kernel of ``vlora_atmm_ext``
    (``"stream"``: row tiles of W whose lora_B rows stay in registers while column chunks of W and
    lora_A stream through shared memory; ranks up to 128), ``torch.baddbmm_`` (``"torch"``), a batched
    CUTLASS GEMM with beta=1 (``"cutlass"``), or the hand-written WMMA kernel (``"fused"``). ``"auto"``
    picks ``"stream"`` where it can serve and ``"torch"`` elsewhere. ``config`` names one of
    ``vlora_atmm_ext.merge_configs()``. Measured times on the H100 are in benchmarks/RESULTS.md.
    """
    _check(weights, lora_a, lora_b, sign)
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        # Per-layer scales: fold them (and the sign) into B (small: L * d_out * r) rather than into W.
        lora_b = (lora_b * (sign * scale.to(lora_b.dtype).view(-1, 1, 1))).contiguous()
        alpha = 1.0
    else:
        alpha = sign * float(scale)
    if backend not in ("auto", "torch", "cutlass", "fused", "stream"):
        raise ValueError(f"merge_lora: backend must be auto, torch, cutlass, fused or stream, got {backend!r}")
    ext = None
    if backend != "torch" and weights.is_cuda:
        from vlora.atmm.dispatch import default_kernels

        ext = default_kernels().ext
    if backend == "auto":
        backend = "stream" if _stream_config(ext, weights, lora_a, lora_b) else "torch"
    if backend in ("cutlass", "fused", "stream"):
        if ext is not None and hasattr(ext, "merge") and _cutlass_ok(weights, lora_a, lora_b):
            L, d_out, d_in = weights.shape
            names = ext.merge_configs()
            if config:
                index = names.index(config)
            elif backend == "stream":
                index = names.index(_stream_config(ext, weights, lora_a, lora_b) or "mg_m128n128_r128")
            else:
                index = 0 if backend == "cutlass" else 2
            if weights.device.index is not None and weights.device.index != torch.cuda.current_device():
                with torch.cuda.device(weights.device):  # the extension launches on the current device
                    return merge_lora(weights, lora_a, lora_b, alpha, 1, backend, config)
            ext.merge(weights.data_ptr(), lora_a.data_ptr(), lora_b.data_ptr(), L, d_out, d_in, lora_a.shape[1], alpha,
                      "bf16" if weights.dtype == torch.bfloat16 else "fp16", index,
                      torch.cuda.current_stream(weights.device).cuda_stream)
            return weights
        raise ValueError(f"merge_lora: the {backend} merge cannot serve W{tuple(weights.shape)} {weights.dtype} "
                             f"rank {lora_a.shape[1]} (needs the extension, CUDA fp16/bf16, d_in and rank multiples of 8)")
    return weights.baddbmm_(lora_b, lora_a, alpha=alpha)


def merge_lora_reference(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         scale: float | torch.Tensor, sign: int = 1) -> torch.Tensor:
    """Layer-by-layer fp32 reference of :func:`merge_lora`."""
    _check(weights, lora_a, lora_b, sign)
    scales = scale.tolist() if isinstance(scale, torch.Tensor) and scale.numel() > 1 else [float(scale)] * weights.shape[0]
    for l in range(weights.shape[0]):
        delta = lora_b[l].float() @ lora_a[l].float()
        weights[l].copy_((weights[l].float() + sign * scales[l] * delta).to(weights.dtype))
    return weights
