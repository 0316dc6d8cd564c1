"""Attention over the paged KV cache, read in place: decode and variable-length prefill.

Two backends share one interface and are chosen by name (:func:`get_attention_backend`):

- ``"triton"``: Triton kernels that fetch keys and values through the block table (no gather copy, no
  padded copy, no ``repeat_interleave`` for GQA). Decode runs one program per (sequence, kv head,
  context split) and handles all query heads of a kv head together, so K/V are read once per group;
  with more than one split a small reduce kernel combines the partial results (flash-decoding).
  Prefill is flash-attention style with online softmax over BLOCK_M x BLOCK_N tiles.
- ``"flash"``: the Triton kernels, except that a prefill of fresh prompts (no cached context) in fp16/bf16
  runs a library kernel on the step's K/V read back packed: cuDNN's fused attention through SDPA, one
  call per prompt, for a few prompts of 1,024 tokens or more (no GQA); else PyTorch's FlashAttention-2
  varlen kernel for prompts of 4,096 tokens or more.
- ``"torch"``: per-sequence gather + ``F.scaled_dot_product_attention``; exact, runs everywhere, is the
  CPU path and the test oracle.

Pool layout (see :mod:`vlora.engine.kv_cache`): ``k_pool``/``v_pool`` are [num_blocks * block_size,
n_kv_heads, head_dim]; token ``p`` of a sequence lives at row
``block_table[p // block_size] * block_size + p % block_size``. The step's new K/V are already in the
pools when attention runs.

Triton is optional: this module imports where it is not installed and then offers only ``"torch"``.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch
import torch.nn.functional as F

try:  # optional dependency: CPU CI has no triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

LOG2E = 1.4426950408889634
# Masked scores: a large finite negative instead of -inf, so that a tile with no visible key gives
# exp2(NEG - NEG) = 1 rather than NaN; such entries are then zeroed explicitly.
NEG = -1.0e30
# Decode splits the context only when sequences x kv heads leave the GPU underused; each split keeps at
# least this many keys so that the partial results are worth their reduce.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Shared-memory budget the tile rules aim under (bytes); leaves headroom on A100 (164 KiB) and H100 (228 KiB).
SMEM_BUDGET = 96 * 1024


def triton_available() -> bool:
    return triton is not None


# -- per-step metadata ------------------------------------------------------------------------------


@dataclass
class AttentionMetadata:
    """Device tensors that every layer of one step reads; built (or refilled) once per step.

    Decode: ``block_tables`` int32 [B, max_blocks] (padded with 0), ``seq_lens`` int32 [B] context length
    including the new token; a row with seq_len 0 is padding and yields zeros. ``cu_seqlens_q`` is None.

    Prefill: ``cu_seqlens_q`` int32 [S+1] offsets of each sequence's new tokens in the packed q,
    ``seq_lens`` int32 [S] total context length including the new tokens, ``block_tables`` int32
    [S, max_blocks], ``max_q_len`` the largest q length (host int: it sizes the grid). Query ``i`` of
    sequence ``s`` sits at position ``seq_lens[s] - q_len[s] + i`` and sees keys at positions <= that.

    For CUDA graphs, :meth:`allocate_decode` makes buffers for the largest batch once and
    :meth:`fill_decode` rewrites them in place; :meth:`rows` gives the first ``n`` rows at the same
    addresses, one view per captured batch bucket.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor] = None
    max_q_len: int = 1
    # Prefill of fresh prompts only (no sequence continues cached context): each new token's pool row,
    # int64 [T], so a backend may read the step's K/V packed (:func:`flash_prefill`). None otherwise.
    fresh_rows: Optional[torch.Tensor] = None
    # Prefill: each sequence's new-token count on the host (a backend may loop over sequences without a
    # device read); empty where the builder did not give them.
    q_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.block_tables.dim() != 2 or self.block_tables.dtype != torch.int32:
            raise ValueError(f"AttentionMetadata: block_tables must be int32 [rows, max_blocks], got "
                             f"{self.block_tables.dtype} {tuple(self.block_tables.shape)}")
        if self.seq_lens.shape != self.block_tables.shape[:1] or self.seq_lens.dtype != torch.int32:
            raise ValueError(f"AttentionMetadata: seq_lens must be int32 [{self.block_tables.shape[0]}], got "
                             f"{self.seq_lens.dtype} {tuple(self.seq_lens.shape)}")
        if self.cu_seqlens_q is not None and (self.cu_seqlens_q.dtype != torch.int32
                                              or self.cu_seqlens_q.shape != (self.seq_lens.shape[0] + 1,)):
            raise ValueError(f"AttentionMetadata: cu_seqlens_q must be int32 [{self.seq_lens.shape[0] + 1}], got "
                             f"{self.cu_seqlens_q.dtype} {tuple(self.cu_seqlens_q.shape)}")

    @property
    def is_prefill(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    @classmethod
    def for_decode(cls, block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], device: torch.device,
                   max_blocks: Optional[int] = None) -> "AttentionMetadata":
        """Decode metadata from host lists (one host-to-device copy per tensor)."""
        width = max_blocks if max_blocks is not None else max((len(t) for t in block_tables), default=1)
        meta = cls.allocate_decode(len(seq_lens), max(width, 1), device)
        meta.fill_decode(block_tables, seq_lens)
        return meta

    @classmethod
    def for_prefill(cls, block_tables: Sequence[Sequence[int]], q_lens: Sequence[int], seq_lens: Sequence[int],
                    device: torch.device) -> "AttentionMetadata":
        """Prefill metadata from host lists: q_lens[s] new tokens, seq_lens[s] total context."""
        if len(block_tables) != len(q_lens) or len(q_lens) != len(seq_lens):
            raise ValueError(f"for_prefill: {len(block_tables)} tables, {len(q_lens)} q lengths, {len(seq_lens)} seq lengths")
        for s, (n, L) in enumerate(zip(q_lens, seq_lens)):
            if not 0 < n <= L:
                raise ValueError(f"for_prefill: sequence {s} has q_len={n} seq_len={L} (need 0 < q_len <= seq_len)")
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        width = max(max((len(t) for t in block_tables), default=1), 1)
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for s, t in enumerate(block_tables):
            tables[s, : len(t)] = torch.tensor(list(t), dtype=torch.int32)
        return cls(block_tables=tables.to(device), seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32).to(device),
                   cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(device), max_q_len=max(q_lens, default=1),
                   q_lens=tuple(int(n) for n in q_lens))

    @classmethod
    def allocate_decode(cls, max_batch: int, max_blocks: int, device: torch.device) -> "AttentionMetadata":
        """Zeroed decode buffers at fixed addresses: every row is padding until filled."""
        return cls(block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
                   seq_lens=torch.zeros(max_batch, dtype=torch.int32, device=device))

    def fill_decode(self, block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> None:
        """Rewrite the decode buffers in place; rows past ``len(seq_lens)`` become padding (seq_len 0)."""
        rows, width = self.block_tables.shape
        if len(seq_lens) > rows or len(block_tables) != len(seq_lens):
            raise ValueError(f"fill_decode: {len(seq_lens)} sequences ({len(block_tables)} tables) for {rows} rows")
        tables = torch.zeros(rows, width, dtype=torch.int32)
        for b, t in enumerate(block_tables):
            if len(t) > width:
                raise ValueError(f"fill_decode: sequence {b} has {len(t)} blocks, buffers hold {width}")
            tables[b, : len(t)] = torch.tensor(list(t), dtype=torch.int32)
        lens = torch.zeros(rows, dtype=torch.int32)
        lens[: len(seq_lens)] = torch.tensor(list(seq_lens), dtype=torch.int32)
        pin = self.block_tables.is_cuda
        self.block_tables.copy_(tables.pin_memory() if pin else tables, non_blocking=pin)
        self.seq_lens.copy_(lens.pin_memory() if pin else lens, non_blocking=pin)

    def rows(self, n: int) -> "AttentionMetadata":
        """The first ``n`` decode rows, as views at the same addresses (one per CUDA-graph batch bucket)."""
        if self.is_prefill:
            raise ValueError("rows: only decode metadata is sliced by rows")
        return AttentionMetadata(block_tables=self.block_tables[:n], seq_lens=self.seq_lens[:n])


# -- launch configuration (static shapes only, so a captured graph replays the same launches) --------


@dataclass(frozen=True)
class DecodeConfig:
    num_splits: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
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


# -- checks shared by both backends ---------------------------------------------------------------------


def _check_pools(fn: str, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int) -> int:
    """Validates shapes and returns the GQA group count."""
    if k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise ValueError(f"{fn}: k_pool/v_pool must both be [rows, n_kv_heads, head_dim], got "
                         f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    H, D = q.shape[1], q.shape[2]
    Hkv = k_pool.shape[1]
    if k_pool.shape[2] != D or H % Hkv:
        raise ValueError(f"{fn}: q has {H} heads of dim {D}, pools {Hkv} kv heads of dim {k_pool.shape[2]}")
    if q.dtype != k_pool.dtype or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"{fn}: dtypes differ: q {q.dtype}, k_pool {k_pool.dtype}, v_pool {v_pool.dtype}")
    if k_pool.shape[0] % block_size:
        raise ValueError(f"{fn}: pool rows {k_pool.shape[0]} not a multiple of block_size={block_size}")
    return H // Hkv


# -- PyTorch reference ------------------------------------------------------------------------------


def _gather(pool: torch.Tensor, table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Rows of positions [0, length) of one sequence: [length, Hkv, D]."""
    pos = torch.arange(length, device=pool.device)
    rows = table[pos // block_size].long() * block_size + pos % block_size
    return pool[rows]


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[L, Hkv, D] -> [1, Hkv * groups, L, D], query head h reading kv head h // groups."""
    L, Hkv, D = x.shape
    x = x.permute(1, 0, 2)[None]
    return x[:, :, None].expand(1, Hkv, groups, L, D).reshape(1, Hkv * groups, L, D)


def paged_decode_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, block_size: int,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Semantics: out[b, h] = softmax(scale * q[b, h] . K_b[:, h // g]^T) @ V_b[:, h // g], over the
    seq_lens[b] cached positions of sequence b; zeros where seq_lens[b] == 0.
    Shape:  q [B, H, D]  k_pool/v_pool [rows, Hkv, D]  block_tables [B, max_blocks] int32  seq_lens [B] int32
    Reads seq_lens on the host (one sync): reference only, not for CUDA graphs."""
    groups = _check_pools("paged_decode_reference", q, k_pool, v_pool, block_size)
    out = torch.zeros_like(q) if out is None else out.zero_()
    for b, L in enumerate(seq_lens.tolist()):
        if L <= 0:
            continue
        k = _expand_heads(_gather(k_pool, block_tables[b], L, block_size), groups)
        v = _expand_heads(_gather(v_pool, block_tables[b], L, block_size), groups)
        o = F.scaled_dot_product_attention(q[b][None, :, None, :], k, v, scale=scale)  # [1, H, 1, D]
        out[b] = o[0, :, 0, :]
    return out


def paged_prefill_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int, scale: float,
                            block_size: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Semantics: for sequence s with n = cu[s+1] - cu[s] new tokens and L = seq_lens[s], query i (packed
    row cu[s] + i, position L - n + i) attends causally to cached positions 0 .. L - n + i.
    Shape:  q [T, H, D]  k_pool/v_pool [rows, Hkv, D]  cu_seqlens_q [S+1] int32  seq_lens [S] int32
            block_tables [S, max_blocks] int32
    Reads the lengths on the host (one sync): reference only. ``max_q_len`` is unused here."""
    del max_q_len
    groups = _check_pools("paged_prefill_reference", q, k_pool, v_pool, block_size)
    out = torch.zeros_like(q) if out is None else out.zero_()
    cu = cu_seqlens_q.tolist()
    for s, L in enumerate(seq_lens.tolist()):
        start, n = cu[s], cu[s + 1] - cu[s]
        if n <= 0:
            continue
        k = _expand_heads(_gather(k_pool, block_tables[s], L, block_size), groups)
        v = _expand_heads(_gather(v_pool, block_tables[s], L, block_size), groups)
        qpos = torch.arange(L - n, L, device=q.device)[:, None]
        mask = torch.arange(L, device=q.device)[None, :] <= qpos  # [n, L], True = visible
        qs = q[start:start + n].transpose(0, 1)[None]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[start:start + n] = o[0].transpose(0, 1)
    return out


# -- Triton kernels ---------------------------------------------------------------------------------

if triton is not None:

    _NEG = tl.constexpr(NEG)  # jit code reads only constexpr globals

    @triton.jit
    def _decode_kernel(Q, K, V, BT, SL, Out, WS,
                       stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                       stride_ob, stride_oh, stride_wb, stride_wh, stride_ws,
                       scale_log2, max_blocks,
                       GROUPS: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
        """One program per (sequence b, kv head kh, context split sp), all GROUPS query heads at once.

        The split owns key tiles [sp * tps, (sp + 1) * tps) of the sequence's cdiv(seq_len, BLOCK_N)
        tiles, tps = cdiv(tiles, NUM_SPLITS): the work division reads seq_len on the device, the grid does
        not. NUM_SPLITS == 1 writes the normalised output; otherwise (acc, max, denominator) go to WS."""
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(SL + b)
        tiles = tl.cdiv(seq_len, BLOCK_N)
        tiles_per_split = tl.cdiv(tiles, NUM_SPLITS)
        start = sp * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        g_mask = g < GROUPS
        h = kh * GROUPS + g
        b64 = b.to(tl.int64)
        q = tl.load(Q + b64 * stride_qb + h[:, None].to(tl.int64) * stride_qh + d[None, :],
                    mask=g_mask[:, None], other=0.0)
        table = BT + b64 * stride_bt
        k_base = K + kh.to(tl.int64) * stride_kh
        v_base = V + kh.to(tl.int64) * stride_vh

        m_i = tl.full([G_PAD], _NEG, dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + n
            valid = pos < end
            blk_idx = pos // BLOCK_SIZE
            blk = tl.load(table + blk_idx, mask=valid & (blk_idx < max_blocks), other=0)
            row = blk.to(tl.int64) * BLOCK_SIZE + (pos % BLOCK_SIZE)
            k = tl.load(k_base + row[:, None] * stride_kt + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [G_PAD, BLOCK_N]
            s = tl.where(valid[None, :], s, _NEG)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.where(valid[None, :], tl.exp2(s - m_new[:, None]), 0.0)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + row[:, None] * stride_vt + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(Out + b64 * stride_ob + h[:, None].to(tl.int64) * stride_oh + d[None, :],
                     o.to(Out.dtype.element_ty), mask=g_mask[:, None])
        else:
            w = WS + b64 * stride_wb + h.to(tl.int64) * stride_wh + sp * stride_ws  # [G_PAD] pointers
            tl.store(w[:, None] + d[None, :], acc, mask=g_mask[:, None])
            tl.store(w + HEAD_DIM, m_i, mask=g_mask)
            tl.store(w + HEAD_DIM + 1, l_i, mask=g_mask)

    @triton.jit
    def _decode_reduce_kernel(WS, Out, stride_wb, stride_wh, stride_ws, stride_ob, stride_oh,
                              HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
        """One program per (sequence, query head): out = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - M).
        Splits with l_s == 0 (past the sequence's end, or a padding row) weigh nothing."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        s_mask = sp < NUM_SPLITS
        base = WS + b * stride_wb + h * stride_wh + sp * stride_ws
        m = tl.load(base + HEAD_DIM, mask=s_mask, other=_NEG)
        l = tl.load(base + HEAD_DIM + 1, mask=s_mask, other=0.0)
        w = tl.where(l > 0.0, tl.exp2(m - tl.max(m, 0)), 0.0)
        acc = tl.load(base[:, None] + d[None, :], mask=s_mask[:, None], other=0.0)
        num = tl.sum(acc * w[:, None], 0)
        den = tl.sum(l * w, 0)
        o = num / tl.where(den > 0.0, den, 1.0)
        tl.store(Out + b * stride_ob + h * stride_oh + d, o.to(Out.dtype.element_ty))

    @triton.jit
    def _prefill_kernel(Q, K, V, CU, SL, BT, Out,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                        stride_ot, stride_oh, scale_log2, max_blocks,
                        GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        HEAVY_FIRST: tl.constexpr, SPLIT_MASK: tl.constexpr):
        """One program per (query tile mt, sequence s, query head h); key tiles stop at the causal limit
        of the tile's last query.

        HEAVY_FIRST: the grid is (H, S, query tiles) and runs the last query tiles (the most key tiles)
        first, every head's, so that the short tiles fill the tail of the launch; otherwise (query tiles,
        S, H) in order. SPLIT_MASK: the key tiles every query of the tile sees run without the causal
        mask, the rest with it."""
        if HEAVY_FIRST:
            h = tl.program_id(0)
            s = tl.program_id(1)
            mt = tl.num_programs(2) - 1 - tl.program_id(2)
        else:
            mt = tl.program_id(0)
            s = tl.program_id(1)
            h = tl.program_id(2)
        q_start = tl.load(CU + s)
        q_len = tl.load(CU + s + 1) - q_start
        m0 = mt * BLOCK_M
        if m0 >= q_len:
            return
        seq_len = tl.load(SL + s)
        ctx = seq_len - q_len  # cached positions before the first new token
        kh = h // GROUPS

        i = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        row_mask = i < q_len
        q_pos = ctx + i
        q_rows = (q_start + i).to(tl.int64)
        h64 = h.to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + h64 * stride_qh + d[None, :], mask=row_mask[:, None], other=0.0)
        table = BT + s.to(tl.int64) * stride_bt
        k_base = K + kh.to(tl.int64) * stride_kh
        v_base = V + kh.to(tl.int64) * stride_vh

        m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        kv_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
        full_end = 0
        if SPLIT_MASK:  # keys [0, ctx + m0] are visible to every query of the tile
            full_end = (ctx + m0 + 1) // BLOCK_N * BLOCK_N
            acc, l_i, m_i = _prefill_tiles(q, acc, l_i, m_i, k_base, v_base, table, q_pos, 0, full_end, kv_end,
                                           stride_kt, stride_vt, scale_log2, max_blocks, HEAD_DIM, BLOCK_SIZE,
                                           BLOCK_N, DOT_PRECISION, False)
        acc, l_i, m_i = _prefill_tiles(q, acc, l_i, m_i, k_base, v_base, table, q_pos, full_end, kv_end, kv_end,
                                       stride_kt, stride_vt, scale_log2, max_blocks, HEAD_DIM, BLOCK_SIZE,
                                       BLOCK_N, DOT_PRECISION, True)

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(Out + q_rows[:, None] * stride_ot + h64 * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
                 mask=row_mask[:, None])

    @triton.jit
    def _prefill_tiles(q, acc, l_i, m_i, k_base, v_base, table, q_pos, start, end, kv_end,
                       stride_kt, stride_vt, scale_log2, max_blocks,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
        """Online softmax over the key tiles [start, end) (BLOCK_N apart); MASKED: keys at or past
        ``kv_end`` and past each query's position are left out, else every key is visible."""
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + n
            blk_idx = pos // BLOCK_SIZE
            if MASKED:
                k_valid = pos < kv_end
                blk = tl.load(table + blk_idx, mask=k_valid & (blk_idx < max_blocks), other=0)
            else:
                blk = tl.load(table + blk_idx)
            row = blk.to(tl.int64) * BLOCK_SIZE + (pos % BLOCK_SIZE)
            if MASKED:
                k = tl.load(k_base + row[:, None] * stride_kt + d[None, :], mask=k_valid[:, None], other=0.0)
            else:
                k = tl.load(k_base + row[:, None] * stride_kt + d[None, :])
            sc = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            if MASKED:
                visible = k_valid[None, :] & (pos[None, :] <= q_pos[:, None])
                sc = tl.where(visible, sc, _NEG)
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            if MASKED:
                p = tl.where(visible, tl.exp2(sc - m_new[:, None]), 0.0)
            else:
                p = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(v_base + row[:, None] * stride_vt + d[None, :], mask=k_valid[:, None], other=0.0)
            else:
                v = tl.load(v_base + row[:, None] * stride_vt + d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i


def _check_triton(fn: str, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                  tables: torch.Tensor, block_size: int) -> None:
    if triton is None:
        raise RuntimeError(f"{fn}: triton is not installed")
    D = q.shape[-1]
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"{fn}: no kernel for head_dim={D} (power of two in [16, 256])")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"{fn}: no kernel for block_size={block_size} (power of two)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{fn}: no kernel for dtype={q.dtype}")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in head_dim (stride {t.stride(-1)})")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"{fn}: out is {out.dtype} {tuple(out.shape)}, q {q.dtype} {tuple(q.shape)}")
    if tables.stride(-1) != 1:
        raise ValueError(f"{fn}: block_tables must be contiguous in its last dim")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 engines (parity tests) need exact fp32 products; 16-bit inputs ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=16)
def _large_smem(device: torch.device) -> bool:
    """Hopper or newer (228 KiB of shared memory per SM): the prefill kernel's large tiles fit."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``; sizes the decode split rule."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter on CPU tensors: size as for an H100


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, block_size: int, out: Optional[torch.Tensor] = None,
                 workspace: Optional[torch.Tensor] = None, num_splits: Optional[int] = None) -> torch.Tensor:
    """Semantics: as :func:`paged_decode_reference`, reading the pools in place (Triton).
    Shape:  q [B, H, D]  k_pool/v_pool [rows, Hkv, D]  block_tables [B, max_blocks] int32  seq_lens [B] int32
            out [B, H, D] (optional)  workspace from :func:`decode_workspace` (optional; needed only when
            num_splits > 1, allocated here from static shapes when not given)
    The launch depends on shapes only (num_splits defaults to a rule on B, Hkv and max_blocks * block_size),
    never on seq_lens values: no host sync, safe to capture in a CUDA graph."""
    groups = _check_pools("paged_decode", q, k_pool, v_pool, block_size)
    out = torch.empty_like(q) if out is None else out
    _check_triton("paged_decode", q, k_pool, v_pool, out, block_tables, block_size)
    B, H, D = q.shape
    Hkv = k_pool.shape[1]
    max_blocks = block_tables.shape[1]
    cfg = decode_config(B, Hkv, groups, D, max_blocks * block_size, q.dtype, num_sms(q.device))
    splits = cfg.num_splits if num_splits is None else num_splits
    if B == 0:
        return out
    if splits > 1:
        if workspace is None:
            workspace = decode_workspace(B, H, D, splits, q.device)
        elif workspace.shape != (B, H, splits, D + 2) or workspace.dtype != torch.float32 or workspace.stride(-1) != 1:
            raise ValueError(f"paged_decode: workspace is {workspace.dtype} {tuple(workspace.shape)}, "
                             f"need float32 {(B, H, splits, D + 2)}")
    ws = workspace if splits > 1 else out  # unused by the kernel when splits == 1
    ws_strides = (ws.stride(0), ws.stride(1), ws.stride(2)) if splits > 1 else (0, 0, 0)
    _decode_kernel[(B, Hkv, splits)](
        q, k_pool, v_pool, block_tables, seq_lens, out, ws,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), *ws_strides,
        scale * LOG2E, max_blocks,
        GROUPS=groups, G_PAD=max(16, triton_next_pow2(groups)), HEAD_DIM=D, BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n, NUM_SPLITS=splits, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        _decode_reduce_kernel[(B, H)](
            workspace, out, workspace.stride(0), workspace.stride(1), workspace.stride(2), out.stride(0), out.stride(1),
            HEAD_DIM=D, NUM_SPLITS=splits, SPLITS_PAD=triton_next_pow2(splits), num_warps=4)
    return out


def paged_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int, scale: float,
                  block_size: int, out: Optional[torch.Tensor] = None,
                  cfg: Optional["PrefillConfig"] = None) -> torch.Tensor:
    """Semantics: as :func:`paged_prefill_reference`, reading the pools in place (Triton, one launch).
    Shape:  q [T, H, D]  k_pool/v_pool [rows, Hkv, D]  cu_seqlens_q [S+1] int32  seq_lens [S] int32
            block_tables [S, max_blocks] int32  max_q_len >= every q length (sizes the grid)
    Grid (H, S, cdiv(max_q_len, BLOCK_M)), the last query tiles first (see ``_prefill_kernel``); tiles past
    a sequence's q length return at once. ``cfg``: the launch (default :func:`prefill_config`)."""
    groups = _check_pools("paged_prefill", q, k_pool, v_pool, block_size)
    out = torch.empty_like(q) if out is None else out
    _check_triton("paged_prefill", q, k_pool, v_pool, out, block_tables, block_size)
    T, H, D = q.shape
    S = seq_lens.shape[0]
    if T == 0 or S == 0 or max_q_len <= 0:
        return out
    if cfg is None:
        cfg = prefill_config(D, q.dtype, large_smem=q.is_cuda and _large_smem(q.device))
    tiles = triton.cdiv(max_q_len, cfg.block_m)
    _prefill_kernel[(H, S, tiles) if cfg.heavy_first else (tiles, S, H)](
        q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E, block_tables.shape[1],
        GROUPS=groups, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_PRECISION=_dot_precision(q.dtype), HEAVY_FIRST=cfg.heavy_first, SPLIT_MASK=cfg.split_mask,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


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


def cudnn_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                  q_lens: Sequence[int], scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of fresh prompts with cuDNN's fused attention (SDPA restricted to it), one call per
    prompt on [1, H, T, D] views: the step's K/V are read back from the pools at ``rows`` first. GQA runs
    natively where :func:`cudnn_attention_available` says so. A prompt shorter than CUDNN_MIN_SEQ_TOKENS
    (cuDNN has no kernel for one token) goes to SDPA's own choice. Only for fresh prompts.
    Shape:  q [T, H, D] fp16/bf16  k_pool/v_pool [rows, Hkv, D]  rows [T] int64  sum(q_lens) == T"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = k_pool.index_select(0, rows)
    v = v_pool.index_select(0, rows)
    out = torch.empty_like(q) if out is None else out
    gqa = q.shape[1] != k.shape[1]
    start = 0
    for n in q_lens:
        end = start + n
        args = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        if n >= CUDNN_MIN_SEQ_TOKENS:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start:end].copy_(o[0].transpose(0, 1))
        start = end
    return out


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
        return triton is not None and torch.device(device).type == "cuda"

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

    def prefill(self, q, k_pool, v_pool, meta, scale, block_size, out=None):
        if meta.fresh_rows is None or q.dtype not in (torch.float16, torch.bfloat16):
            return super().prefill(q, k_pool, v_pool, meta, scale, block_size, out=out)
        if (meta.q_lens and meta.max_q_len >= self.cudnn_min_tokens and len(meta.q_lens) <= self.cudnn_max_seqs
                and q.shape[1] == k_pool.shape[1] and q.shape[2] in CUDNN_HEAD_DIMS
                and cudnn_attention_available(q.device, q.dtype, q.shape[1], k_pool.shape[1], q.shape[2])):
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
                           f"(triton {'installed' if triton is not None else 'not installed'})")
    return cls(device)
