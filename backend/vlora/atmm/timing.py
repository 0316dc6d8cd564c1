"""Timing on the GPU the way every ATMM number here is taken: CUDA-graph replay over rotated inputs.

Eager launches cost tens of microseconds of Python each, which would hide the kernels; so the calls
are captured in one graph and replayed. Each replay walks over several input sets whose bytes add up
to more than the L2 cache, so the data comes from HBM as it would in serving.
"""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

ROTATE_BYTES = 256 << 20


def sets_needed(bytes_per_set: int, min_bytes: int = ROTATE_BYTES, max_sets: int = 256) -> int:
    """How many input sets one replay must touch so that it moves more than ``min_bytes``."""
    return max(1, min(max_sets, -(-min_bytes // max(bytes_per_set, 1))))


def graph_time_us(calls: Sequence[Callable[[], None]], min_batch_ms: float = 1.0, batches: int = 9) -> float:
    """Median time of one call, in microseconds, when all ``calls`` are replayed from one graph.

    Every call runs once eagerly first (warm-up, lazy initialisation), then the list is captured;
    replays are grouped into batches of at least ``min_batch_ms`` and timed with CUDA events.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    once_ms = max(start.elapsed_time(end), 1e-3)
    reps = max(1, int(min_batch_ms / once_ms + 0.999))
    samples = []
    for _ in range(batches):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    del graph
    return statistics.median(samples)


def event_time_ms(fn: Callable[[], None], warmup: int = 2, reps: int = 7) -> float:
    """Median of ``reps`` event-timed eager calls, for calls of milliseconds (the merge)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e))
    return statistics.median(samples)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.fill_(1)
    ms = event_time_ms(lambda: b.copy_(a), warmup=3, reps=10)
    return 2 * a.numel() / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense tensor-core rate on random data (an n^3 matrix product)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = event_time_ms(lambda: a @ b, warmup=3, reps=10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12
