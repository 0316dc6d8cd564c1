"""Diagnostic (no result line): can the shrink pull y into L2 for the expand, so that the two passes overlap?

One adapter of rank 128, d = 4096, bf16, the benchmark's graph-replay harness. Question (csrc/atmm/NOTES.md,
2026-11-25, what bounds T = 4096): reading x (32 MB at T = 4096) and updating y in place are two passes that run one
after the other, and the unsplit shrink reads x at the speed of its 64 programs (16.4 us against 13.6 with 128 or
more), leaving HBM partly idle while it runs. y is 32 MB at T = 4096 and the H100's L2 is 50 MB: if every shrink
program asks L2 for its own rows of y (`prefetch.global.L2::evict_last`, fire-and-forget: no data comes back to
the SM, so it does not compete with the x loads for the SM's load slots), the HBM reads y while the shrink runs, and
the expand then reads y from L2 and only its writes go to HBM.
Variants: where the prefetches are issued (spread over the d_in loop, a BK-wide strip of the tile's y per step, or
all at the start), and which row tiles prefetch (at T = 8192 y is 64 MB: (tile % mod) < lt, e.g. the first half of
each run of the column-stationary expand). Times: the shrink alone, the pair in sequence, each against the plain one.
On the GPU machine, from the repository root: python3 benchmarks/atmm_l2_probe.py [T ...]   (about a minute)
"""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "backend")
sys.path.insert(0, "benchmarks")
from atmm_split_probe import buffers, probe_main  # noqa: E402
from atmm_triton_probe import expand_cols_k  # noqa: E402  (the plain column-stationary expand)
from vlora.atmm.timing import graph_time_us  # noqa: E402

D, R = 4096, 128
BM, BK, SW, SST = 64, 128, 4, 4  # shrink tiles (the best plain shrink at T = 4096)
EBM, EBN, ENS, EW = 64, 128, 4, 8  # expand tiles


@triton.jit
def _prefetch_l2(p):
    """Ask L2 for the 128-byte line of each address (kept with priority: evict_last); nothing comes back."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def shrink_pf_k(x, a, v, y, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PF: tl.constexpr,
                MOD: tl.constexpr, LT: tl.constexpr):
    """v[rows] = x[rows] @ a.T; PF 1: each d_in step also prefetches y[rows, k:k+BK] into L2, PF 2: all of y[rows]
    at the start; only row tiles with (tile % MOD) < LT prefetch."""
    pid = tl.program_id(0)
    rm = pid * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    rr = tl.arange(0, R)
    pf = (PF != 0) & ((pid % MOD) < LT)
    yrow = y + rm[:, None].to(tl.int64) * K
    if (PF == 2) & pf:
        _prefetch_l2(yrow + (tl.arange(0, K // 64) * 64)[None, :])
    acc = tl.zeros((BM, R), tl.float32)
    for k in range(0, K, BK):
        if (PF == 1) & pf:
            _prefetch_l2(yrow + (k + tl.arange(0, BK // 64) * 64)[None, :])
        xt = tl.load(x + rm[:, None].to(tl.int64) * K + (k + rk)[None, :])
        at = tl.load(a + rr[None, :] * K + (k + rk)[:, None])
        acc = tl.dot(xt, at, acc)
    tl.store(v + rm[:, None].to(tl.int64) * R + rr[None, :], acc.to(v.dtype.element_ty))


def run(T, bw, sms):
    xb, n, xs, ys, vb, vf, A, B = buffers(T)
    tiles = T // BM
    G = max(1, round(sms / (D // EBN)))
    floor = 3 * xb / bw / 1e3
    print(f"T={T}: floor {floor:.1f} us (x {xb / bw / 1e3:.1f}), sets {n}, expand runs {G}", flush=True)

    def shrink(i, pf, mod, lt):
        shrink_pf_k[(tiles,)](xs[i], A, vb[i], ys[i], K=D, R=R, BM=BM, BK=BK, PF=pf, MOD=mod, LT=lt, num_warps=SW,
                              num_stages=SST)

    def pair(i, pf, mod, lt):
        shrink(i, pf, mod, lt)
        expand_cols_k[(D // EBN, G)](vb[i], B, ys[i], 0.5, T, N=D, R=R, BM=EBM, BN=EBN, NS=ENS, num_warps=EW)

    # correctness first: the prefetching pair against fp32 (a prefetch changes no value)
    y0 = ys[0].clone()
    ref = y0.float() + 0.5 * ((xs[0].float() @ A.float().t()).to(torch.bfloat16).float() @ B.float().t())
    pair(0, 1, 1, 1)
    torch.cuda.synchronize()
    print(f"  pair PF=1 rel err of y {((ys[0].float() - ref).norm() / ref.norm()).item():.2e}", flush=True)

    per_run = max(1, tiles // G)
    fracs = [(1, 1)] if T * D * 2 <= 40 << 20 else [(per_run, per_run // 2), (per_run, per_run // 4), (1, 1)]
    variants = [(0, 1, 1)] + [(pf, m, lt) for pf in (1, 2) for m, lt in fracs]
    for what, fn in (("shrink", shrink), ("pair", pair)):
        base = None
        for pf, m, lt in variants:
            t = graph_time_us([lambda i=i: fn(i, pf, m, lt) for i in range(n)])
            base = base or t
            print(f"  {what} PF={pf} tiles%{m}<{lt}: {t:.1f} us ({t / base:.2f}x plain"
                  + (f", {t / floor:.2f}x floor)" if what == "pair" else ")"), flush=True)


if __name__ == "__main__":
    probe_main(run, [4096, 1024, 8192])
