"""Per-step LoRA metadata shared by every LoRA layer.

The engine packs the step's tokens so that tokens of one request are contiguous, orders requests so
that requests of one adapter slot sit next to each other, and then describes the batch as segments:
``tokens[seg_indptr[i]:seg_indptr[i+1]]`` all use GPU slot ``seg_slot[i]`` (``-1``: no adapter).
One mapping object is built per step and read by every LoRA layer; it is never rebuilt per layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class LoraBatchMapping:
    """Segments of a packed token batch and the adapter slot each one uses.

    Shape: ``seg_indptr`` int32 [S+1] and ``seg_slot`` int32 [S] on the compute device; the same
    values as Python tuples (``*_host``) for code that must not synchronise with the device.

    A captured step's mapping (the backends' ``rows`` path) holds placeholder host tuples: only the device
    buffers are read. ``even`` says whether its segments all hold ``num_tokens / S`` rows (a decode graph's
    rows, a vision graph's images); False: a prefill graph's sequences, whose bounds only the device holds.
    """

    seg_indptr: torch.Tensor
    seg_slot: torch.Tensor
    seg_indptr_host: tuple[int, ...]
    seg_slot_host: tuple[int, ...]
    num_tokens: int
    has_lora: bool  # False when no token uses an adapter: LoRA layers take the early exit
    even: bool = True  # a captured step's segments are of equal length (see above)

    @property
    def num_segments(self) -> int:
        return len(self.seg_slot_host)

    @classmethod
    def from_token_slots(cls, lengths: Sequence[int], slots: Sequence[int], device: torch.device | str = "cpu") -> "LoraBatchMapping":
        """Build from per-request token counts and slots; neighbouring requests of one slot are merged."""
        if len(lengths) != len(slots):
            raise ValueError(f"lengths ({len(lengths)}) and slots ({len(slots)}) differ in length")
        indptr, seg_slot, _ = segment_runs(lengths, slots)
        return cls.from_segments(indptr, seg_slot, device)

    @classmethod
    def from_segments(cls, seg_indptr: Sequence[int], seg_slot: Sequence[int], device: torch.device | str = "cpu") -> "LoraBatchMapping":
        indptr = tuple(int(i) for i in seg_indptr)
        slots = tuple(int(s) for s in seg_slot)
        if len(indptr) != len(slots) + 1 or indptr[0] != 0 or any(b < a for a, b in zip(indptr, indptr[1:])):
            raise ValueError(f"bad segments: indptr={indptr} slots={slots}")
        return cls(
            seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
            seg_slot=torch.tensor(slots, dtype=torch.int32, device=device),
            seg_indptr_host=indptr,
            seg_slot_host=slots,
            num_tokens=indptr[-1],
            has_lora=uses_lora(indptr, slots),
        )


def segment_runs(lengths: Sequence[int], slots: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(indptr, slots, has_lora) of the runs of neighbouring requests of one slot: ``lengths[i]`` tokens of
    request i use slot ``slots[i]``; neighbours of one slot make one segment."""
    indptr = [0]
    seg: list[int] = []
    for n, s in zip(lengths, slots):
        if n < 0:
            raise ValueError(f"negative segment length {n}")
        if seg and seg[-1] == s:
            indptr[-1] += n
        else:
            seg.append(int(s))
            indptr.append(indptr[-1] + n)
    return tuple(indptr), tuple(seg), uses_lora(indptr, seg)


def uses_lora(indptr: Sequence[int], slots: Sequence[int]) -> bool:
    """Whether a token uses an adapter: a segment with a slot (>= 0) and tokens."""
    return any(s >= 0 and indptr[i + 1] > indptr[i] for i, s in enumerate(slots))
