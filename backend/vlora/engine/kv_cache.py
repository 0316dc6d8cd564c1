"""Paged KV cache: fixed-size blocks in one preallocated pool per layer, and a block table per sequence.

Token ``p`` of a sequence lives in slot ``table[p // block_size] * block_size + p % block_size`` of
the flattened pool. Blocks are reserved for a request's whole budget (prompt + max_tokens) when it is
admitted, so a running request never has to be preempted for memory. One more block, never handed
out, is scratch: the padding rows of a captured decode step write their keys and values there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


class BlockAllocator:
    """Free list of block ids. Not thread-safe: only the engine thread calls it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache: asked for {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class SequenceBlocks:
    """The blocks one sequence holds and how many of its positions are filled."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    _table: Optional[np.ndarray] = field(default=None, repr=False, compare=False)

    def table(self) -> np.ndarray:
        """The block ids as int32, made once (a sequence's blocks are reserved at admission)."""
        if self._table is None or len(self._table) != len(self.blocks):
            self._table = np.asarray(self.blocks, dtype=np.int32)
        return self._table


class PagedKVCache:
    """Pools ``k[layer]``/``v[layer]`` of shape [num_blocks * block_size, n_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks  # the extra block, never allocated
        self.scratch_slot = num_blocks * block_size
        shape = ((num_blocks + 1) * block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slots(self, seq: SequenceBlocks, start: int, end: int) -> list[int]:
        """Pool slots of positions [start, end) of ``seq``."""
        bs = self.block_size
        return [seq.blocks[p // bs] * bs + p % bs for p in range(start, end)]
