"""The Triton kernels that read the paged pools in place, and their launchers :func:`paged_decode` and
:func:`paged_prefill` (the ``"triton"`` backend).

Decode runs one program per (sequence, kv head, context split) and handles all query heads of a kv head
together, so K/V are read once per group; with more than one split a small reduce kernel combines the
partial results (flash-decoding). Prefill is flash-attention style with online softmax over
BLOCK_M x BLOCK_N tiles. No gather copy, no padded copy, no ``repeat_interleave`` for GQA.

Triton is optional: this module imports where it is not installed, defines no kernels then, and
:func:`triton_available` says so.
"""
from __future__ import annotations

from typing import Optional

import torch

from vlora.engine.attention.launch import (PrefillConfig, _large_smem, decode_config, decode_workspace, num_sms,
                                           prefill_config, triton_next_pow2)
from vlora.engine.attention.metadata import _check_pools

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


def triton_available() -> bool:
    return triton is not None


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
