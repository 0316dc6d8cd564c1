"""Segment patterns and random LoRA data for ATMM tests, the tuner and the benchmarks."""
from __future__ import annotations

import torch

from vlora.atmm.mapping import LoraBatchMapping

RANK_CYCLE = (8, 16, 32, 64, 128)
PATTERNS = ("one_long", "many_short", "empty", "no_adapter", "1x7", "7x1", "3x3", "many_tiny")


def segments(pattern: str, num_tokens: int, n_slots: int) -> tuple[list[int], list[int]]:
    """(lengths, slots) of one pattern over ``num_tokens`` tokens; ``n_slots`` adapter slots exist."""
    T = num_tokens
    if pattern == "one_long":
        return [T], [0]
    if pattern == "many_short":
        n = max(1, min(T, 64))
        lengths = [T // n + (1 if i < T % n else 0) for i in range(n)]
        return lengths, [i % n_slots for i in range(n)]
    if pattern == "empty":
        n = max(1, min(T, 6))
        body = [T // n + (1 if i < T % n else 0) for i in range(n)]
        lengths, slots = [0], [1 % n_slots]
        for i, b in enumerate(body):
            lengths += [b, 0]
            slots += [i % n_slots, (i + 2) % n_slots]
        return lengths, slots
    if pattern == "no_adapter":
        # Rows without an adapter (-1) and a slot whose rank is 0 for this layer (the last slot).
        n = max(1, min(T, 5))
        lengths = [T // n + (1 if i < T % n else 0) for i in range(n)]
        cycle = [-1, 0, n_slots - 1, 1 % n_slots, -1]
        return lengths, [cycle[i % len(cycle)] for i in range(n)]
    if pattern == "many_tiny":
        # Segments of 0-3 tokens (about one per token: over 256 at T >= 300), slot -1 and every slot in turn.
        lengths, slots, i = [], [], 0
        while sum(lengths) < T or not lengths:
            lengths.append(min((0, 2, 1, 0, 3)[i % 5], T - sum(lengths)))
            slots.append(i % (n_slots + 1) - 1)
            i += 1
        return lengths, slots
    if pattern in ("1x7", "7x1", "3x3"):
        groups, per = {"1x7": (1, 7), "7x1": (7, 1), "3x3": (3, 3)}[pattern]
        n = groups * per
        lengths = [T // n + (1 if i < T % n else 0) for i in range(n)]
        return lengths, [(i // per) % n_slots for i in range(n)]
    raise ValueError(pattern)


def mapping_for(pattern: str, num_tokens: int, n_slots: int, device: str | torch.device = "cpu") -> LoraBatchMapping:
    lengths, slots = segments(pattern, num_tokens, n_slots)
    indptr = [0]
    for n in lengths:
        indptr.append(indptr[-1] + n)
    return LoraBatchMapping.from_segments(indptr, slots, device)


def lora_weights(n_slots: int, d_in: int, d_out: int, ranks: tuple[int, ...], dtype: torch.dtype, device,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random lora_a [n, r_max, d_in] and lora_b [n, d_out, r_max], zero past each slot's rank,
    scaled so that x @ A^T @ B^T has entries of about unit size for unit-size x."""
    r_max = -(-max(max(ranks), 8) // 8) * 8  # a multiple of 8, as the CUDA path needs
    a = torch.randn(n_slots, r_max, d_in, generator=generator, device=device) / d_in ** 0.5
    b = torch.randn(n_slots, d_out, r_max, generator=generator, device=device)
    for s, r in enumerate(ranks):
        a[s, r:] = 0
        b[s, :, r:] = 0
        b[s] /= max(r, 1) ** 0.5
    return a.to(dtype), b.to(dtype)


def loop_fp64(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks, scales,
              mapping: LoraBatchMapping) -> torch.Tensor:
    """The dumbest correct ATMM: token by token, in float64. Returns a new float64 tensor."""
    out = y.double().clone()
    p = mapping.seg_indptr_host
    for i, slot in enumerate(mapping.seg_slot_host):
        if slot < 0 or ranks[slot] == 0:
            continue
        r = ranks[slot]
        A = a[slot, :r].double()
        B = b[slot, :, :r].double()
        for t in range(p[i], p[i + 1]):
            out[t] += (B @ (A @ x[t].double())) * scales[slot]
    return out
