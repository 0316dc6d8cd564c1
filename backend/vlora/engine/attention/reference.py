"""The PyTorch reference: per-sequence gather + ``F.scaled_dot_product_attention``. Exact, runs everywhere;
the CPU path (the ``"torch"`` backend) and the test oracle. Reads the lengths on the host."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vlora.engine.attention.metadata import _check_pools


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
