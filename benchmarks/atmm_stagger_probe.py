"""Diagnostic (no result line): do the shrink's programs queue on the same lora_A lines in L2?

One adapter of rank 128, d = 4096, bf16, the benchmark's graph-replay harness. Question (csrc/atmm/NOTES.md,
2026-11-25, staggered K): the shrink reads x at ~1.8-1.9 TB/s at T = 4096 whether it runs 64 programs or 128 (split
d_in), with pointer or TMA loads (atmm_tma_probe.py). Every program walks d_in in the same order, so at any moment
all of them read the same few lora_A lines, which live in a few L2 slices. If those slices are the queue, starting
each program at another point of its d_in range (a rotation) spreads the load. The same for the column-stationary
expand: all programs of one run of rows read the same v tile at once; rotating each program's run by its column
spreads that.
On the GPU machine, from the repository root: python3 benchmarks/atmm_stagger_probe.py [T ...]   (about a minute)
"""
import itertools
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "backend")
sys.path.insert(0, "benchmarks")
from atmm_split_probe import buffers, probe_main  # noqa: E402
from vlora.atmm.timing import graph_time_us  # noqa: E402

D, R = 4096, 128
dt = torch.bfloat16


@triton.jit
def shrink_rot_k(x, a, v, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr,
                 ROT: tl.constexpr, ATOMIC: tl.constexpr):
    """v[rows] (+)= x[rows, chunk] @ a[:, chunk].T; program p starts at step (p % ROT) * steps / ROT of its chunk."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    rr = tl.arange(0, R)
    k0 = tl.program_id(1) * KC
    steps: tl.constexpr = KC // BK
    s0 = (tl.program_id(0) % ROT) * (steps // ROT)
    acc = tl.zeros((BM, R), tl.float32)
    for i in range(0, steps):
        k = k0 + ((s0 + i) % steps) * BK
        xt = tl.load(x + rm[:, None].to(tl.int64) * K + (k + rk)[None, :])
        at = tl.load(a + rr[None, :] * K + (k + rk)[:, None])
        acc = tl.dot(xt, at, acc)
    vp = v + rm[:, None].to(tl.int64) * R + rr[None, :]
    if ATOMIC:
        tl.atomic_add(vp, acc, sem="relaxed")
    else:
        tl.store(vp, acc.to(v.dtype.element_ty))


@triton.jit
def expand_rot_k(v, b, y, s, T, N: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 NS: tl.constexpr, ROT: tl.constexpr):
    """Column-stationary expand (atmm_triton_probe.expand_cols_k), column program j starting its run at tile
    (j % ROT) * len / ROT and wrapping."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rr = tl.arange(0, R)
    bt = tl.load(b + rn[None, :] * R + rr[:, None])
    per = (T // BM + tl.num_programs(1) - 1) // tl.num_programs(1)
    lo = tl.program_id(1) * per
    n = tl.minimum(lo + per, T // BM) - lo
    off = (tl.program_id(0) % ROT) * n // ROT
    for i in tl.range(0, n, num_stages=NS):
        t = lo + (off + i) % n
        rm = t * BM + tl.arange(0, BM)
        vt = tl.load(v + rm[:, None].to(tl.int64) * R + rr[None, :])
        yp = y + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(yp, (tl.load(yp).to(tl.float32) + tl.dot(vt, bt) * s).to(tl.bfloat16))


def run(T, bw, sms):
    xb, n, xs, ys, vb, vf, A, B = buffers(T)
    floor = 3 * xb / bw / 1e3
    print(f"T={T}: floor {floor:.1f} us (x {xb / bw / 1e3:.1f}, y r/w {2 * xb / bw / 1e3:.1f}), sets {n}", flush=True)

    ref = xs[0].float() @ A.float().t()
    vb[0].fill_(float("nan"))
    shrink_rot_k[(T // 64, 1)](xs[0], A, vb[0], K=D, R=R, BM=64, BK=64, KC=D, ROT=8, ATOMIC=False, num_warps=4,
                               num_stages=8)
    torch.cuda.synchronize()
    print(f"  rotated shrink rel err {((vb[0].float() - ref).norm() / ref.norm()).item():.2e}", flush=True)
    y0 = ys[0].clone()
    refy = y0.float() + 0.5 * (vb[0].float() @ B.float().t())
    expand_rot_k[(D // 128, 4)](vb[0], B, ys[0], 0.5, T, N=D, R=R, BM=64, BN=128, NS=4, ROT=8, num_warps=8)
    torch.cuda.synchronize()
    print(f"  rotated expand rel err of y {((ys[0].float() - refy).norm() / refy.norm()).item():.2e}", flush=True)

    for (BM, BK, w, st), S, rot in itertools.product(((64, 64, 4, 8), (64, 128, 4, 4)), (1, 2), (1, 2, 4, 8, 16)):
        if T // BM * S > 2 * sms or D // S // BK < rot:
            continue
        vv = vf if S > 1 else vb

        def call(i, BM=BM, BK=BK, w=w, st=st, S=S, rot=rot, vv=vv):
            if S > 1:
                vv[i].zero_()
            shrink_rot_k[(T // BM, S)](xs[i], A, vv[i], K=D, R=R, BM=BM, BK=BK, KC=D // S, ROT=rot, ATOMIC=S > 1,
                                       num_warps=w, num_stages=st)
        t = graph_time_us([lambda i=i: call(i) for i in range(n)])
        print(f"  shrink BM={BM} BK={BK} w={w} st={st} S={S} rot={rot}: {t:.1f} us = {xb / t / 1e3:.0f} GB/s of x",
              flush=True)
    for (BM, BN, ns, w), rot in itertools.product(((64, 128, 4, 8), (64, 256, 3, 8)), (1, 2, 4, 8, 32)):
        G = max(1, round(sms / (D // BN)))
        t = graph_time_us([lambda i=i: expand_rot_k[(D // BN, G)](vb[i], B, ys[i], 0.5, T, N=D, R=R, BM=BM, BN=BN, NS=ns,
                                                                 ROT=rot, num_warps=w) for i in range(n)])
        print(f"  expand BM={BM} BN={BN} NS={ns} w={w} runs={G} rot={rot}: {t:.1f} us = {2 * xb / t / 1e3:.0f} GB/s of y",
              flush=True)


if __name__ == "__main__":
    probe_main(run, [4096, 8192])
