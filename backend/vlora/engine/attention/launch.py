"""Launch configuration of the Triton kernels, from static shapes only, so a captured graph replays the same
launches: decode context splits and key tiles, prefill tiles, the split-K workspace, and the device facts
(SM count, shared memory) the rules read."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Decode splits the context only when sequences x kv heads leave the GPU underused; each split keeps at
# least this many keys so that the partial results are worth their reduce.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Shared-memory budget the tile rules aim under (bytes); leaves headroom on A100 (164 KiB) and H100 (228 KiB).
SMEM_BUDGET = 96 * 1024


@dataclass(frozen=True, kw_only=True)
class KernelLaunch:
    """What every attention kernel's launch names: its key tile, warps and pipeline stages."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(KernelLaunch):
    num_splits: int


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(KernelLaunch):
    block_m: int
    heavy_first: bool = True  # the query tiles with the most keys first (see _prefill_kernel)
    split_mask: bool = True  # the tiles every query sees run without the causal mask


def choose_num_splits(batch: int, n_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Context splits for decode, from static shapes: enough programs for about two per SM on ``num_sms``,
    none shorter than MIN_TOKENS_PER_SPLIT keys.

    Measured on an H200 (132 SMs, ``benchmarks/step_kernels.py``, 32 kv heads, graphs as wide as 8,192
    tokens): batch 8 (256 programs) takes 31 us with one split and 27 with two at context 700, 78 and 67 us
    at 2,000; from batch 32 (1,024 programs) one split is best."""
    programs = batch * n_kv_heads
    if programs >= 2 * num_sms:
        return 1
    want = -(-2 * num_sms // max(programs, 1))
    cap = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


def _block_n(rows: int, head_dim: int, elem: int, stages: int, largest: int) -> int:
    """Largest key tile (16..largest) whose Q tile plus ``stages`` K/V tiles fit SMEM_BUDGET."""
    n = largest
    while n > 16 and rows * head_dim * elem + stages * 2 * n * head_dim * elem > SMEM_BUDGET:
        n //= 2
    return n


@functools.lru_cache(maxsize=512)
def decode_config(batch: int, n_kv_heads: int, groups: int, head_dim: int, max_context: int, dtype: torch.dtype,
                  num_sms: int) -> DecodeConfig:
    elem = torch.empty((), dtype=dtype).element_size()
    g_pad = max(16, triton_next_pow2(groups))
    return DecodeConfig(num_splits=choose_num_splits(batch, n_kv_heads, max_context, num_sms),
                        block_n=_block_n(g_pad, head_dim, elem, 2, 64))


@functools.lru_cache(maxsize=64)
def prefill_config(head_dim: int, dtype: torch.dtype, large_smem: bool = False) -> PrefillConfig:
    """``large_smem`` (Hopper: 228 KiB per SM): 64-query tiles, 64 keys, 4 warps and three K/V stages for
    16-bit heads up to 128 wide; otherwise tiles that fit SMEM_BUDGET. Both run the heaviest query tiles
    first and leave the causal mask off the key tiles every query sees.

    Measured on an H100 (``benchmarks/prefill_attention.py``, one fresh prompt, H = 32, D = 128, bf16, us
    per layer at 600 / 2,300 / 8,000 tokens): this launch 23 / 154 / 1,558; 128-query tiles with 8 warps
    27 / 173 / 1,763, and 36 / 233 / 2,001 in plain grid order with the mask on every tile (the launch
    before); 32-query tiles 39 / 368 / 4,122. cuDNN (through SDPA, gathers included) 34 / 143 / 1,004, so
    fresh prompts from CUDNN_MIN_TOKENS on go there (the flash backend)."""
    elem = torch.empty((), dtype=dtype).element_size()
    if large_smem and elem == 2 and head_dim <= 128:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    block_m = 64 if elem <= 2 or head_dim <= 64 else 32
    return PrefillConfig(block_m=block_m, block_n=_block_n(block_m, head_dim, elem, 2, 64),
                         num_warps=8 if head_dim >= 256 else 4)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_workspace(batch: int, n_heads: int, head_dim: int, num_splits: int, device: torch.device) -> torch.Tensor:
    """Split-K partials: [B, H, num_splits, head_dim + 2] fp32; columns [0, D) the unnormalised output,
    D the running max (log2 domain), D + 1 the softmax denominator. Every entry is rewritten per call."""
    return torch.empty(batch, n_heads, num_splits, head_dim + 2, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=16)
def _large_smem(device: torch.device) -> bool:
    """Hopper or newer (228 KiB of shared memory per SM): the prefill kernel's large tiles fit."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``; sizes the decode split rule."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter on CPU tensors: size as for an H100
