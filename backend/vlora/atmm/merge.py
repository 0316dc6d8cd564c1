"""The merge operator for mode switching: every targeted layer's ``W += sign * scale * B @ A`` at once.

The orchestrator keeps the weights of each group of same-shaped layers (for example q, k, v and o
of all decoder layers) in one preallocated stack, and the LoRA slot buffers of each group in one stack
per operand, so one call updates all of them in place: the streaming kernel reads each matrix's W, A
and B where they are (strided views), with no gathering copies, and a swap (one adapter in, another
out) is one pass over W.
"""
from __future__ import annotations

from typing import Sequence

import torch

# The streaming merge's configurations (ATMM_MERGE_STREAM lines of csrc/atmm/tile_configs.def), in the order
# merge_lora tries them: the first whose max rank covers the rank of all terms together serves.
MERGE_CONFIGS = ("mg_m128n128_r64", "mg_m128n128_r128")


def _check(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, sign: int) -> None:
    if sign not in (1, -1):
        raise ValueError(f"merge_lora: sign must be +1 (merge) or -1 (unmerge), got {sign}")
    if weights.dim() != 3 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError("merge_lora: weights [L, d_out, d_in], lora_a [L, r, d_in], lora_b [L, d_out, r]")
    n, d_out, d_in = weights.shape
    if lora_a.shape[0] != n or lora_b.shape[0] != n or lora_a.shape[2] != d_in or lora_b.shape[1] != d_out \
            or lora_b.shape[2] != lora_a.shape[1]:
        raise ValueError(f"merge_lora: shapes W{tuple(weights.shape)} A{tuple(lora_a.shape)} B{tuple(lora_b.shape)} disagree")
    if weights.stride(2) != 1 or (d_out > 1 and weights.stride(1) != d_in):
        raise ValueError("merge_lora: each weight matrix must be row-major with rows d_in apart (a contiguous stack, "
                         "or a slice of one along its rows), updated in place")


def _stride0(t: torch.Tensor) -> int:
    """Elements from one matrix of a [L, rows, cols] operand to the next (a lone matrix: its own size)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1] * t.stride(1)


def _kernel_ok(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether the streaming kernel can read these operands in place: CUDA fp16/bf16, every matrix row-major with
    16-byte aligned rows and matrix strides (A's rows d_in apart, B's rows ld_b apart)."""
    d_in, r = weights.shape[2], lora_a.shape[1]
    if not (weights.is_cuda and weights.dtype in (torch.float16, torch.bfloat16)
            and lora_a.dtype == lora_b.dtype == weights.dtype and lora_a.device == lora_b.device == weights.device):
        return False
    if lora_a.stride(2) != 1 or (r > 1 and lora_a.stride(1) != d_in) or lora_b.stride(2) != 1:
        return False
    ld_b = lora_b.stride(1) if lora_b.shape[1] > 1 else r
    strides = (_stride0(weights), _stride0(lora_a), _stride0(lora_b), ld_b)
    return (d_in % 8 == 0 and r % 8 == 0 and ld_b >= r and all(s % 8 == 0 for s in strides)
            and all(t.data_ptr() % 16 == 0 for t in (weights, lora_a, lora_b)))


def stream_config(ext, total_rank: int) -> str | None:
    """The streaming merge configuration for ``total_rank`` (the rank of all terms together), or None."""
    if ext is None or not hasattr(ext, "merge_configs"):
        return None
    names, ranks = ext.merge_configs(), ext.merge_config_max_ranks()
    for name in MERGE_CONFIGS:
        if name in names and total_rank <= ranks[names.index(name)]:
            return name
    return None


def _extension():
    from vlora.atmm.dispatch import default_kernels

    return default_kernels().ext


def _launch(ext, weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, alpha: float, config: str,
            second: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> None:
    """One pass of the streaming kernel: W[l] += alpha * (B[l] @ A[l] [+/- B2[l] @ A2[l]])."""
    if weights.device.index is not None and weights.device.index != torch.cuda.current_device():
        with torch.cuda.device(weights.device):  # the extension launches on the current device
            return _launch(ext, weights, lora_a, lora_b, alpha, config, second)
    L, d_out, d_in = weights.shape
    ld_b = lora_b.stride(1) if d_out > 1 else lora_a.shape[1]
    extra = {}
    if second is not None:
        a2, b2, negate = second
        extra = {"lora_a2": a2.data_ptr(), "lora_b2": b2.data_ptr(), "negate2": negate}
    ext.merge(weights.data_ptr(), lora_a.data_ptr(), lora_b.data_ptr(), L, d_out, d_in, lora_a.shape[1], alpha,
              "bf16" if weights.dtype == torch.bfloat16 else "fp16", ext.merge_configs().index(config),
              torch.cuda.current_stream(weights.device).cuda_stream, stride_a=_stride0(lora_a),
              stride_b=_stride0(lora_b), ld_b=ld_b, stride_w=_stride0(weights), **extra)


def merge_lora(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scale: float | torch.Tensor, sign: int = 1, backend: str = "auto", config: str | None = None) -> torch.Tensor:
    """Merge (sign=+1) or unmerge (sign=-1) one adapter into a stack of same-shaped weights, in place.

    Semantics: W[l] += sign * scale[l] * B[l] @ A[l]   for every l
    Shape:
        weights [L, d_out, d_in]  each matrix row-major (a contiguous stack or a row slice of one), in place
        lora_a  [L, r, d_in]      PEFT lora_A.weight of each layer; may be a strided view (a slot of a slot stack)
        lora_b  [L, d_out, r]     PEFT lora_B.weight of each layer; may be a strided view
        scale   float, or [L] tensor of per-layer scales
    One pass over W (read and written once) by the streaming kernel of ``vlora_atmm_ext`` (``"stream"``: row
    tiles of W whose lora_B rows stay in registers while column chunks of W and lora_A stream through shared
    memory; ranks up to 128; it reads A and B in place), or ``torch.baddbmm_`` (``"torch"``). ``"auto"``
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
    if backend not in ("auto", "torch", "stream"):
        raise ValueError(f"merge_lora: backend must be auto, torch or stream, got {backend!r}")
    ext = _extension() if backend != "torch" and weights.is_cuda else None
    ok = ext is not None and _kernel_ok(weights, lora_a, lora_b)
    config = config or (stream_config(ext, lora_a.shape[1]) if ok else None)
    if backend == "stream" and not (ok and config):
        raise ValueError(f"merge_lora: the stream merge cannot serve W{tuple(weights.shape)} {weights.dtype} "
                         f"rank {lora_a.shape[1]} (needs the extension, CUDA fp16/bf16, d_in and rank multiples of 8, "
                         f"16-byte aligned rows, rank <= 128)")
    if ok and config:
        _launch(ext, weights, lora_a, lora_b, alpha, config)
        return weights
    return weights.baddbmm_(lora_b, lora_a, alpha=alpha)


def merge_lora_terms(weights: torch.Tensor, terms: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
                     backend: str = "auto") -> torch.Tensor:
    """``W[l] += sum_i sign_i * B_i[l] @ A_i[l]`` in place, for one or two terms of one rank: a merge, an
    unmerge, or a swap (the new adapter in, the old one out) in one pass over W.

    Shapes as :func:`merge_lora` (scale 1: the slot buffers hold ``scale * B``); the operands may be strided
    views, read in place. Two terms with the same strides (two slots of one slot stack) go to the streaming
    kernel as one launch of rank 2r; otherwise each term is merged on its own (``baddbmm_`` where the kernel
    cannot serve).
    """
    if not 1 <= len(terms) <= 2:
        raise ValueError(f"merge_lora_terms: one or two terms, got {len(terms)}")
    for a, b, sign in terms:
        _check(weights, a, b, sign)
    if backend not in ("auto", "torch", "stream"):
        raise ValueError(f"merge_lora_terms: backend must be auto, torch or stream, got {backend!r}")
    (a1, b1, s1) = terms[0]
    if len(terms) == 2 and weights.is_cuda and backend != "torch":
        a2, b2, s2 = terms[1]
        ext = _extension()
        same = (a1.shape == a2.shape and _stride0(a1) == _stride0(a2) and a1.stride()[1:] == a2.stride()[1:]
                and _stride0(b1) == _stride0(b2) and b1.stride()[1:] == b2.stride()[1:])
        config = stream_config(ext, 2 * a1.shape[1])
        if same and config and _kernel_ok(weights, a1, b1) and _kernel_ok(weights, a2, b2):
            _launch(ext, weights, a1, b1, float(s1), config, (a2, b2, s2 != s1))
            return weights
    for a, b, sign in terms:
        merge_lora(weights, a, b, 1.0, sign, backend)
    return weights


def merge_lora_reference(weights: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         scale: float | torch.Tensor, sign: int = 1) -> torch.Tensor:
    """Layer-by-layer fp32 reference of :func:`merge_lora`."""
    _check(weights, lora_a, lora_b, sign)
    scales = scale.tolist() if isinstance(scale, torch.Tensor) and scale.numel() > 1 else [float(scale)] * weights.shape[0]
    for l in range(weights.shape[0]):
        delta = lora_b[l].float() @ lora_a[l].float()
        weights[l].copy_((weights[l].float() + sign * scales[l] * delta).to(weights.dtype))
    return weights
