"""Paged KV cache: fixed-size blocks in one preallocated pool per layer, and a block table per sequence.

Token ``p`` of a sequence lives in slot ``table[p // block_size] * block_size + p % block_size`` of
the flattened pool. Blocks are reserved for a request's whole budget (prompt + max_tokens) when it is
admitted, so a running request never has to be preempted for memory. One more block, never handed
out, is scratch: the padding rows of a captured decode step write their keys and values there.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


class BlockAllocator:
    """Block ids with reference counts, and the prefix cache's index of full blocks by content hash.

    A block is free, held by one or more sequences (its count), or cached: its count fell to 0 but its
    hash still names it, so a later request with the same prefix can take it back (:meth:`lookup`,
    :meth:`share`). Cached blocks are evicted least recently used when :meth:`allocate` runs out of free
    ones. Not thread-safe: only the engine thread calls it.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, count 0: oldest first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"KV cache: asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # the least recently used cached block leaves the cache
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] > 0:
                continue
            if b in self._hash_of:
                self._evictable[b] = None  # most recently used last
            else:
                self._free.append(b)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (a chain: block i's hash covers 0..i)."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def share(self, blocks: list[int]) -> None:
        """Hold cached ``blocks`` for one more sequence."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """``block`` (held, fully written) now holds the prefix whose hash is ``h``."""
        if h in self._by_hash or block in self._hash_of:
            return
        self._by_hash[h] = block
        self._hash_of[block] = h


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
