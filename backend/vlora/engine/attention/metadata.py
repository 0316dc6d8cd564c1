"""The inputs every attention backend reads: the per-step metadata (:class:`AttentionMetadata`) and the
pool shape checks shared by the reference and the Triton launchers.

Pool layout (see :mod:`vlora.engine.kv_cache`): ``k_pool``/``v_pool`` are [num_blocks * block_size,
n_kv_heads, head_dim]; token ``p`` of a sequence lives at row
``block_table[p // block_size] * block_size + p % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


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
