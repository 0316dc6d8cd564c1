"""The attention backends, one class per kernel family, registered by name and chosen with
:func:`get_attention_backend`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch

from vlora.engine.attention.flash import (CUDNN_HEAD_DIMS, CUDNN_MAX_SEQS, CUDNN_MIN_TOKENS, FLASH_MIN_TOKENS,
                                          cudnn_attention_available, cudnn_prefill, flash_available, flash_prefill,
                                          warm_cudnn_plans)
from vlora.engine.attention.metadata import AttentionMetadata
from vlora.engine.attention.reference import paged_decode_reference, paged_prefill_reference
from vlora.engine.attention.triton_kernels import paged_decode, paged_prefill, triton_available


# -- backends ---------------------------------------------------------------------------------------


class AttentionBackend(ABC):
    """One attention implementation; subclasses register under ``name``."""

    name: ClassVar[str]
    registry: ClassVar[dict[str, type["AttentionBackend"]]] = {}
    # Whether decode and prefill read the lengths on the device only (no host sync), so a CUDA graph can hold them.
    graph_safe: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        AttentionBackend.registry[cls.name] = cls

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    @classmethod
    @abstractmethod
    def available(cls, device: torch.device) -> bool:
        """Whether this backend runs on ``device`` here."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
               scale: float, block_size: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [B, H, D] one new token per sequence -> [B, H, D]."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                scale: float, block_size: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, H, D] packed new tokens of meta's sequences -> [T, H, D]."""

    def warm_plans(self, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int, max_len: int) -> int:
        """Build whatever this backend plans per shape for prompts of up to ``max_len`` tokens (the warm
        start calls it); returns how many plans were built. Most backends plan nothing."""
        return 0


class TorchAttentionBackend(AttentionBackend):
    """Gather + SDPA per sequence: exact, any device; host-syncs on the lengths (no CUDA graphs)."""

    name = "torch"
    graph_safe = False

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return True

    def decode(self, q, k_pool, v_pool, meta, scale, block_size, out=None):
        return paged_decode_reference(q, k_pool, v_pool, meta.block_tables, meta.seq_lens, scale, block_size, out=out)

    def prefill(self, q, k_pool, v_pool, meta, scale, block_size, out=None):
        return paged_prefill_reference(q, k_pool, v_pool, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                       meta.max_q_len, scale, block_size, out=out)


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels: CUDA tensors, triton installed; decode is CUDA-graph safe."""

    name = "triton"

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return triton_available() and torch.device(device).type == "cuda"

    def decode(self, q, k_pool, v_pool, meta, scale, block_size, out=None, workspace=None):
        return paged_decode(q, k_pool, v_pool, meta.block_tables, meta.seq_lens, scale, block_size, out=out,
                            workspace=workspace)

    def prefill(self, q, k_pool, v_pool, meta, scale, block_size, out=None):
        return paged_prefill(q, k_pool, v_pool, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_q_len,
                             scale, block_size, out=out)


class FlashPrefillBackend(TritonAttentionBackend):
    """The Triton kernels, but a prefill of fresh prompts (fp16/bf16) runs a library kernel where it is
    faster: at most ``cudnn_max_seqs`` prompts whose longest has at least ``cudnn_min_tokens`` tokens run
    cuDNN's fused attention (:func:`cudnn_prefill`, where :func:`cudnn_attention_available`, without GQA and
    for head widths in CUDNN_HEAD_DIMS); otherwise a
    longest prompt of at least ``min_tokens`` runs PyTorch's FlashAttention-2 varlen kernel
    (:func:`flash_prefill`). A prefill that continues cached context, a shorter one, or fp32 stays on the
    Triton kernel.

    Measured per layer call at the 7B shapes (``benchmarks/prefill_attention.py``, H=32, D=128, bf16,
    CUDA-graph replays). H100: one prompt of 600 tokens, Triton 33 us against FlashAttention-2's 52 us;
    2,300 tokens 455 against 465 us; 8,000 tokens 3,819 against 3,087 us. H200, with cuDNN (its K/V
    gather included): 600 tokens Triton 34 / FA2 34 / cuDNN 30 us; 2,300 tokens 237 / 238 / 136 us;
    8,000 tokens 2,033 / 1,765 / 973 us (539 TFLOP/s, 0.69 of the matmul rate). Hence the thresholds."""

    name = "flash"
    min_tokens = FLASH_MIN_TOKENS
    cudnn_min_tokens = CUDNN_MIN_TOKENS
    cudnn_max_seqs = CUDNN_MAX_SEQS

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return TritonAttentionBackend.available(device) and flash_available(device)

    def _cudnn_serves(self, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
        return (n_heads == n_kv_heads and head_dim in CUDNN_HEAD_DIMS
                and cudnn_attention_available(self.device, dtype, n_heads, n_kv_heads, head_dim))

    def warm_plans(self, dtype, n_heads, n_kv_heads, head_dim, max_len):
        if max_len < self.cudnn_min_tokens or not self._cudnn_serves(dtype, n_heads, n_kv_heads, head_dim):
            return 0
        return warm_cudnn_plans(self.device, dtype, n_heads, n_kv_heads, head_dim, max_len)

    def prefill(self, q, k_pool, v_pool, meta, scale, block_size, out=None):
        if meta.fresh_rows is None or q.dtype not in (torch.float16, torch.bfloat16):
            return super().prefill(q, k_pool, v_pool, meta, scale, block_size, out=out)
        if (meta.q_lens and meta.max_q_len >= self.cudnn_min_tokens and len(meta.q_lens) <= self.cudnn_max_seqs
                and self._cudnn_serves(q.dtype, q.shape[1], k_pool.shape[1], q.shape[2])):
            return cudnn_prefill(q, k_pool, v_pool, meta.fresh_rows, meta.q_lens, scale, out=out)
        if meta.max_q_len < self.min_tokens:
            return super().prefill(q, k_pool, v_pool, meta, scale, block_size, out=out)
        o = flash_prefill(q, k_pool, v_pool, meta.cu_seqlens_q, meta.fresh_rows, meta.max_q_len, scale)
        if out is not None:
            out.copy_(o)
            return out
        return o


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` on ``device``; ``"auto"`` takes flash where FlashAttention-2 runs,
    else triton on CUDA when it imports, else torch."""
    device = torch.device(device)
    if name == "auto":
        name = next(n for n in ("flash", "triton", "torch") if AttentionBackend.registry[n].available(device))
    cls = AttentionBackend.registry.get(name)
    if cls is None:
        raise ValueError(f"attention backend {name!r}: unknown (have {sorted(AttentionBackend.registry)} or 'auto')")
    if not cls.available(device):
        raise RuntimeError(f"attention backend {name!r} is not available on {device} "
                           f"(triton {'installed' if triton_available() else 'not installed'})")
    return cls(device)
