"""Library kernels for the flash backend's prefill of fresh prompts in fp16/bf16, on the step's K/V read
back packed: cuDNN's fused attention through SDPA (:func:`cudnn_prefill`, one call per prompt) and PyTorch's
FlashAttention-2 varlen kernel (:func:`flash_prefill`), with the checks of where each runs."""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

# The flash backend's prefill takes FlashAttention-2 from this prompt length on (see FlashPrefillBackend).
FLASH_MIN_TOKENS = 4096


def flash_available(device: torch.device) -> bool:
    """Whether PyTorch's FlashAttention-2 varlen kernel runs on ``device`` (CUDA, sm80 or newer)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 8
            and hasattr(torch.ops.aten, "_flash_attention_forward"))


def flash_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  rows: torch.Tensor, max_q_len: int, scale: float) -> torch.Tensor:
    """Causal attention of fresh prompts with PyTorch's FlashAttention-2 varlen kernel (the one SDPA's
    flash backend runs, called with packed sequences): the step's K/V are read back from the pools at
    ``rows`` (one ``index_select`` each) and attended packed, so each sequence sees exactly its own
    tokens. GQA runs natively (Hkv divides H). Only for fresh prompts: every sequence's context is its
    new tokens (``cu_seqlens`` serves queries and keys).
    Shape:  q [T, H, D] fp16/bf16  k_pool/v_pool [rows, Hkv, D]  cu_seqlens_q [S+1] int32  rows [T] int64"""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flash_prefill: no kernel for dtype={q.dtype} (fp16/bf16)")
    k = k_pool.index_select(0, rows)
    v = v_pool.index_select(0, rows)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_q, max_q_len, max_q_len, 0.0,
                                                  True, False, scale=scale)[0]
    return out


# cuDNN's fused attention (through SDPA) for fresh prompts from this length on, for at most
# CUDNN_MAX_SEQS prompts per step (one call each); see FlashPrefillBackend. Below it the Triton kernel's
# one launch wins: at 600 tokens it takes 23 us per layer on an H100 against cuDNN's 34 (gathers and
# output copy included, four launches); at 2,300 cuDNN takes 143 against 154 (prefill_config).
CUDNN_MIN_TOKENS = 1024
CUDNN_MAX_SEQS = 8
# Shorter prompts of such a step go to SDPA's own kernel choice (cuDNN refuses a 1-token prompt).
CUDNN_MIN_SEQ_TOKENS = 16
# The engine takes the cuDNN path for these head widths and without GQA only: what was measured and tested
# (H = Hkv = 32, D = 128). The Qwen GPU tests (tiny Qwen2.5-VL: GQA, narrow heads) crashed once on an H200
# with an illegal memory access while it applied to them; they passed with it off and with
# CUDA_LAUNCH_BLOCKING=1, and the cause is not found. GQA models keep FlashAttention-2 / Triton.
CUDNN_HEAD_DIMS = (64, 128)


@functools.lru_cache(maxsize=32)
def cudnn_attention_available(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv_heads: int,
                              head_dim: int) -> bool:
    """Whether SDPA's cuDNN attention runs causal prefill of this shape on ``device`` (tried once on a
    tiny input: the support rules for GQA, head widths and dtypes differ between torch and cuDNN versions)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.CUDNN_ATTENTION
    except (ImportError, AttributeError):
        return False
    if not torch.backends.cudnn.is_available() or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    q = torch.zeros(1, n_heads, CUDNN_MIN_SEQ_TOKENS, head_dim, device=device, dtype=dtype)
    k = torch.zeros(1, n_kv_heads, CUDNN_MIN_SEQ_TOKENS, head_dim, device=device, dtype=dtype)
    try:
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=n_heads != n_kv_heads)
        torch.cuda.synchronize(device)
    except RuntimeError:
        return False
    return True


def cudnn_bucket(n: int) -> int:
    """The length a prompt of ``n`` tokens is padded to for cuDNN: cuDNN builds an execution plan for every
    new sequence length it sees (an H200 measured 1.5-4.0x the prefill's FLOP floor on prompts of new
    lengths against 1.26-1.46x on repeated ones), so lengths are rounded up to a fixed set whose plans the
    warm start builds (:func:`warm_cudnn_plans`). Multiples of 64 up to 1,024 tokens, then of an eighth of
    the power of two below (128 up to 2,048, 256 up to 4,096, ...): at most 12.5% more attention FLOPs, and
    40 lengths up to 8,192. Padding goes at the end of a prompt, so causal attention leaves the real rows exact."""
    if n <= 1024:
        return max(CUDNN_MIN_SEQ_TOKENS, -(-n // 64) * 64)
    g = 1 << ((n - 1).bit_length() - 4)
    return -(-n // g) * g


def cudnn_buckets(max_len: int) -> list[int]:
    """Every :func:`cudnn_bucket` length a prompt of at most ``max_len`` tokens can take, shortest first."""
    out, n = [], CUDNN_MIN_SEQ_TOKENS
    while True:
        b = cudnn_bucket(n)
        out.append(b)
        if b >= max_len:
            return out
        n = b + 1


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` [n, H, D] with zero rows appended to ``length``, as the [1, H, length, D] view SDPA takes; always
    of one memory layout (a contiguous [length, H, D]), the one the warm start planned for (a slice of the fused
    QKV projection's output is strided)."""
    t = F.pad(t, (0, 0, 0, 0, 0, length - t.shape[0])) if t.shape[0] != length else t.contiguous()
    return t.transpose(0, 1).unsqueeze(0)


def cudnn_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                  q_lens: Sequence[int], scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of fresh prompts with cuDNN's fused attention (SDPA restricted to it), one call per
    prompt on [1, H, L, D] views, each prompt padded with zero rows to its :func:`cudnn_bucket` length L (so
    no new length ever costs a plan on the hot path): the step's K/V are read back from the pools at ``rows``
    first. GQA runs natively where :func:`cudnn_attention_available` says so. A prompt shorter than
    CUDNN_MIN_SEQ_TOKENS (cuDNN has no kernel for one token) goes to SDPA's own choice. Only for fresh prompts.
    Shape:  q [T, H, D] fp16/bf16  k_pool/v_pool [rows, Hkv, D]  rows [T] int64  sum(q_lens) == T"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = k_pool.index_select(0, rows)
    v = v_pool.index_select(0, rows)
    out = torch.empty_like(q) if out is None else out
    gqa = q.shape[1] != k.shape[1]
    start = 0
    for n in q_lens:
        end = start + n
        if n >= CUDNN_MIN_SEQ_TOKENS:
            length = cudnn_bucket(n)
            args = [_padded(t[start:end], length) for t in (q, k, v)]
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            args = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start:end].copy_(o[0, :, :n].transpose(0, 1))
        start = end
    return out


def warm_cudnn_plans(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int,
                     max_len: int) -> int:
    """Build cuDNN's plan for every :func:`cudnn_bucket` length up to ``max_len`` (one tiny call each, with the
    layout :func:`cudnn_prefill` uses), so that no client prompt pays for one; returns how many."""
    lengths = cudnn_buckets(max_len)
    q = torch.zeros(lengths[-1], n_heads, head_dim, device=device, dtype=dtype)
    k = torch.zeros(lengths[-1], n_kv_heads, head_dim, device=device, dtype=dtype)
    rows = torch.arange(lengths[-1], device=device)
    for n in lengths:
        cudnn_prefill(q[:n], k, k, rows[:n], [n], head_dim ** -0.5)
    torch.cuda.synchronize(device)
    return len(lengths)
