"""Tensors carved out of one host buffer with the GIL held throughout.

Every torch call that runs an operator (``view``, ``copy_``, ``is_pinned``) releases the GIL and must take it
back; beside busy threads (the engine's, the adapter loaders') each of those waits up to the switch interval
(5 ms). Basic indexing keeps the GIL. So an adapter's 256 tensors are indexed out of a few row views of the
buffer (one per dtype, row shape and phase), not viewed one by one: a few GIL waits per adapter, not 512.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

ALIGN = 256  # bytes: every tensor placed in a host buffer starts aligned for the copy engines


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`: the room a tensor of that many bytes takes in a buffer."""
    return -(-nbytes // ALIGN) * ALIGN


def carve(flat_of: Callable[[torch.dtype], torch.Tensor],
          items: Sequence[tuple[int, torch.dtype, Sequence[int]]]) -> list[torch.Tensor]:
    """Views of a buffer: ``items`` are (first element, dtype, shape), the element counted in ``flat_of(dtype)``
    (the whole buffer as a 1-D tensor of that dtype; asked once per dtype). Shapes with no element are the
    caller's."""
    flat: dict[torch.dtype, torch.Tensor] = {}
    rows: dict[tuple[torch.dtype, tuple[int, ...], int], torch.Tensor] = {}  # (dtype, shape[1:], phase) -> rows
    out: list[torch.Tensor] = []
    for first, dtype, shape in items:
        f = flat.get(dtype)
        if f is None:
            f = flat[dtype] = flat_of(dtype)
        if len(shape) < 2:
            out.append(f[first:first + math.prod(shape)] if len(shape) else f[first])
            continue
        # A view of f as rows of shape[1:], starting at this tensor's phase: the tensor is rows
        # [first // width, + shape[0]) of it, an indexing that keeps the GIL.
        width = math.prod(shape[1:])
        phase = first % width
        key = (dtype, tuple(shape[1:]), phase)
        base = rows.get(key)
        if base is None:
            whole = (f.numel() - phase) // width
            base = rows[key] = f[phase:phase + whole * width].view(whole, *shape[1:])
        out.append(base[first // width:first // width + shape[0]])
    return out


def carve_bytes(buf: torch.Tensor, items: Sequence[tuple[int, torch.dtype, Sequence[int]]]) -> list[torch.Tensor]:
    """:func:`carve` of a uint8 tensor, ``items`` at byte offsets (each a multiple of its dtype's size)."""
    return carve(lambda dtype: buf[:buf.numel() // dtype.itemsize * dtype.itemsize].view(dtype),
                 [(at // dtype.itemsize, dtype, shape) for at, dtype, shape in items])
