"""Diagnostic (no result line): does a two-stream pipeline of row chunks beat shrink-then-expand at T = 4096?

One adapter of rank 128, d = 4096, bf16, the benchmark's graph-replay harness. Question (csrc/atmm/NOTES.md,
2026-11-25, row-chunk pipeline): plain Triton kernels in sequence stay at 1.33-1.36x their floor at T = 4096, because
neither kernel alone moves bytes at the copy rate (the shrink ~1.8 TB/s of x, the expand ~2.4 TB/s of y). If the rows
are cut into k chunks, the shrink of chunk i+1 (on the calling stream) can run beside the expand of chunk i (on a
second stream, after an event): the two kernels share the SMs and the memory system, and only the first shrink and the
last expand run alone. A chunk of 1024 rows has 16 row tiles, so its shrink splits d_in (S chunks added with atomics
into a zeroed fp32 v, as the extension's split Triton shrink does) to have enough programs.
Times, per T: the plain pair (bf16 v, and split into fp32 v), then pipelines over k chunks, S splits, G expand runs.
On the GPU machine, from the repository root: python3 benchmarks/atmm_pipeline_probe.py [T ...]   (about a minute)
"""
import itertools
import sys

import torch

sys.path.insert(0, "backend")
sys.path.insert(0, "benchmarks")
from atmm_split_probe import buffers, probe_main, shrink_k  # noqa: E402  (plain row-tile shrink: atomic adds into fp32 v when split)
from atmm_triton_probe import expand_cols_k  # noqa: E402  (plain column-stationary expand; v bf16 or fp32)
from vlora.atmm.timing import graph_time_us  # noqa: E402

D, R = 4096, 128
dt = torch.bfloat16
BM, BK, SW, SST = 64, 128, 4, 4  # shrink tiles (the best plain shrink of atmm_split_probe at T = 4096)
EBM, EBN, ENS, EW = 64, 128, 4, 8  # expand tiles


def shrink(x, v, A, S):
    t = x.shape[0]
    shrink_k[(t // BM, S)](x, A, v, K=D, R=R, BM=BM, BK=BK, KC=D // S, ATOMIC=S > 1, num_warps=SW, num_stages=SST)


def expand(v, B, y, G):
    expand_cols_k[(D // EBN, G)](v, B, y, 0.5, y.shape[0], N=D, R=R, BM=EBM, BN=EBN, NS=ENS, num_warps=EW)


def pipeline(x, v, y, A, B, k, S, G, side, events):
    """Shrinks of the k row chunks on the current stream, each chunk's expand on `side` after the chunk's event."""
    main = torch.cuda.current_stream()
    if S > 1:
        v.zero_()
    c = x.shape[0] // k
    for i in range(k):
        rows = slice(i * c, (i + 1) * c)
        shrink(x[rows], v[rows], A, S)
        events[i].record(main)
        with torch.cuda.stream(side):
            side.wait_event(events[i])
            expand(v[rows], B, y[rows], G)
    events[k].record(side)
    main.wait_event(events[k])


def run(T, bw, sms):
    xb, n, xs, ys, vb, vf, A, B = buffers(T)
    side = torch.cuda.Stream()
    events = [[torch.cuda.Event() for _ in range(17)] for _ in range(n)]
    floor = 3 * xb / bw / 1e3
    G0 = max(1, round(sms / (D // EBN)))
    print(f"T={T}: floor {floor:.1f} us (x {xb / bw / 1e3:.1f}, y r/w {2 * xb / bw / 1e3:.1f}), sets {n}", flush=True)

    # correctness first: the pipeline (4 chunks, split 4) against fp32
    y0 = ys[0].clone()
    ref = y0.float() + 0.5 * ((xs[0].float() @ A.float().t()).to(dt).float() @ B.float().t())
    pipeline(xs[0], vf[0], ys[0], A, B, 4, 4, G0, side, events[0])
    torch.cuda.synchronize()
    print(f"  pipeline k=4 S=4 rel err of y {((ys[0].float() - ref).norm() / ref.norm()).item():.2e}", flush=True)

    def seq(i, S, G):
        vv = vf[i] if S > 1 else vb[i]
        if S > 1:
            vv.zero_()
        shrink(xs[i], vv, A, S)
        expand(vv, B, ys[i], G)

    res = []
    for S, G in itertools.product((1, 2), (G0,)):
        t = graph_time_us([lambda i=i: seq(i, S, G) for i in range(n)])
        res.append((t, f"sequential S={S} G={G}"))
        print(f"  {res[-1][1]}: {t:.1f} us = {t / floor:.2f}x floor", flush=True)
    for k, S, G in itertools.product((2, 4, 8), (1, 2, 4, 8), (1, 2, G0)):
        tiles = T // k // BM
        if tiles < 1 or tiles * S > 2 * sms or tiles * S < sms // 4 or D // S < 2 * BK:
            continue
        if G > tiles:
            continue
        vv = vf if S > 1 else vb
        try:
            t = graph_time_us([lambda i=i: pipeline(xs[i], vv[i], ys[i], A, B, k, S, G, side, events[i]) for i in range(n)])
        except Exception as e:  # noqa: BLE001
            print(f"  pipeline k={k} S={S} G={G} failed: {type(e).__name__} {str(e)[:120]}", flush=True)
            continue
        res.append((t, f"pipeline k={k} S={S} G={G}"))
        print(f"  {res[-1][1]}: {t:.1f} us = {t / floor:.2f}x floor", flush=True)
    res.sort()
    print(f"  best: {res[0][1]} {res[0][0]:.1f} us = {res[0][0] / floor:.2f}x floor", flush=True)


if __name__ == "__main__":
    probe_main(run, [4096, 1024, 8192])
