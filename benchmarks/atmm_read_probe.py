"""Diagnostic (no result line): how fast can a kernel read x in the shrink's tile order?

bf16 x of T x 4096, the benchmark's graph-replay harness, nothing computed but a sum. Question (csrc/atmm/NOTES.md,
2026-11-25, read-order probe): every shrink here reads x at 1.7-2.3 TB/s, with pointer or TMA loads, staggered or not
(atmm_tma_probe.py, atmm_stagger_probe.py). A shrink program walks its rows in tiles of BM rows x BK columns: at any
moment it touches BM rows, BK * 2 bytes each, 8 KB apart. A copy reads long runs of consecutive bytes. If the HBM
loses bandwidth to the scattered short runs (page locality), a read in the shrink's order is itself slow, longer
runs (larger BK) are faster, and a program reading its rows' block front to back reaches the copy's rate.
Second part: the plain shrink (atmm_split_probe.shrink_k) at ranks 64 and 128 with the program counts that read fastest
here: 32-row tiles give 128 programs at T = 4096 without splitting d_in (no atomics, no zeroed fp32 v).
Third part: y updated in place (y += 1) in the column-stationary expand's order against the expand itself
(atmm_triton_probe.expand_cols_k), over column widths and run counts: at T = 4096 a program of 4 runs x 32 column
tiles walks only 16 row tiles, so its pipeline's fill and drain weigh more than at T = 8192.
On the GPU machine, from the repository root: python3 benchmarks/atmm_read_probe.py [T ...]   (under a minute)
"""
import itertools
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "backend")
sys.path.insert(0, "benchmarks")
from atmm_split_probe import probe_main, shrink_k  # noqa: E402
from atmm_triton_probe import expand_cols_k  # noqa: E402
from vlora.atmm.timing import graph_time_us, sets_needed  # noqa: E402

D = 4096
dt = torch.bfloat16


@triton.jit
def read_tiles_k(x, out, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, NS: tl.constexpr):
    """Sum x[rows, chunk] in tiles of BM x BK, the shrink's order (program (i, j): row tile i, d_in chunk j)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    k0 = tl.program_id(1) * KC
    acc = tl.zeros((BM,), tl.float32)
    for k in tl.range(k0, k0 + KC, BK, num_stages=NS):
        acc += tl.sum(tl.load(x + rm[:, None].to(tl.int64) * K + (k + rk)[None, :]).to(tl.float32), 1)
    tl.store(out + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc, 0))


@triton.jit
def read_linear_k(x, out, n_per, BS: tl.constexpr, NS: tl.constexpr):
    """Sum a contiguous block of n_per elements per program, BS at a time (a copy's order)."""
    base = tl.program_id(0).to(tl.int64) * n_per
    acc = tl.zeros((BS,), tl.float32)
    for o in tl.range(0, n_per, BS, num_stages=NS):
        acc += tl.load(x + base + o + tl.arange(0, BS)).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def add_cols_k(y, T, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr):
    """y += 1 in the column-stationary expand's order: program (j, g) walks its run of row tiles in column tile j."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    per = (T // BM + tl.num_programs(1) - 1) // tl.num_programs(1)
    lo = tl.program_id(1) * per
    for t in tl.range(lo, tl.minimum(lo + per, T // BM), num_stages=NS):
        yp = y + (t * BM + tl.arange(0, BM))[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(yp, tl.load(yp) + 1.0)


def expand_part(T, xs, sms):
    """y updated in place in the expand's order, and the expand itself, over tile widths and run counts."""
    R = 128
    yb = T * D * 2
    vb = [torch.randn(T, R, device="cuda", dtype=dt) for _ in range(len(xs))]
    B = torch.randn(D, R, device="cuda", dtype=dt) / 16
    res = []
    for BM, BN, NS, w, g in ((64, 128, 4, 8, 1), (64, 128, 4, 4, 1), (64, 64, 4, 4, 1), (64, 64, 6, 4, 1),
                             (64, 64, 4, 4, 2), (32, 128, 4, 4, 1), (32, 128, 6, 4, 1), (32, 128, 4, 4, 2),
                             (64, 256, 3, 8, 1), (128, 128, 3, 8, 1), (64, 128, 4, 8, 2), (32, 64, 6, 4, 1)):
        G = max(1, min(T // BM, round(g * sms / (D // BN))))
        t = graph_time_us([lambda i=i: add_cols_k[(D // BN, G)](xs[i], T, N=D, BM=BM, BN=BN, NS=NS, num_warps=w)
                           for i in range(len(xs))])
        res.append((t, f"y += 1 BM={BM} BN={BN} NS={NS} w={w} runs={G} ({T // BM // G} tiles per program)"))
        try:
            t = graph_time_us([lambda i=i: expand_cols_k[(D // BN, G)](vb[i], B, xs[i], 0.5, T, N=D, R=R, BM=BM, BN=BN,
                                                                     NS=NS, num_warps=w) for i in range(len(xs))])
        except Exception as e:  # noqa: BLE001
            print(f"  expand BM={BM} BN={BN} failed: {type(e).__name__} {str(e)[:120]}")
            continue
        res.append((t, f"expand BM={BM} BN={BN} NS={NS} w={w} runs={G} ({T // BM // G} tiles per program)"))
    t = graph_time_us([lambda i=i: xs[i].add_(1.0) for i in range(len(xs))])
    res.append((t, "torch y.add_(1)"))
    res.sort()
    for t, name in res:
        print(f"  {name}: {t:.1f} us = {2 * yb / t / 1e3:.0f} GB/s of y", flush=True)


def run(T, bw, sms):
    xb = T * D * 2
    n = sets_needed(xb)
    xs = [torch.randn(T, D, device="cuda", dtype=dt) for _ in range(n)]
    out = torch.empty(1 << 16, device="cuda", dtype=torch.float32)
    print(f"T={T}: x {xb >> 20} MB, read at the copy rate {xb / bw / 1e3:.1f} us, sets {n}", flush=True)
    res = []
    for (BM, BK, NS), S in itertools.product(((64, 64, 8), (64, 128, 4), (64, 256, 3), (64, 512, 2), (32, 128, 6),
                                              (32, 512, 3), (16, 1024, 3), (128, 128, 3)), (1, 2, 4)):
        if T // BM * S > 4 * sms or D // S < BK:
            continue
        t = graph_time_us([lambda i=i: read_tiles_k[(T // BM, S)](xs[i], out, K=D, BM=BM, BK=BK, KC=D // S, NS=NS,
                                                                   num_warps=4) for i in range(n)])
        res.append((t, f"tiles BM={BM} BK={BK} ({BK * 2} B per row) S={S} programs={T // BM * S} NS={NS}"))
    for P, BS, NS in ((sms, 4096, 4), (2 * sms, 4096, 4), (T // 64, 4096, 4), (T // 64, 8192, 3), (4 * sms, 2048, 4)):
        per = T * D // P
        if per % BS or T * D % P:
            continue
        t = graph_time_us([lambda i=i: read_linear_k[(P,)](xs[i], out, per, BS=BS, NS=NS, num_warps=4) for i in range(n)])
        res.append((t, f"linear programs={P} BS={BS} NS={NS}"))
    t = graph_time_us([lambda i=i: xs[i].sum(dtype=torch.float32) for i in range(n)])
    res.append((t, "torch sum"))
    res.sort()
    for t, name in res:
        print(f"  {name}: {t:.1f} us = {xb / t / 1e3:.0f} GB/s", flush=True)
    for R in (64, 128):
        A = torch.randn(R, D, device="cuda", dtype=dt) / 64
        vb = [torch.empty(T, R, device="cuda", dtype=dt) for _ in range(n)]
        vf = [torch.zeros(T, R, device="cuda", dtype=torch.float32) for _ in range(n)]
        ref = xs[0].float() @ A.float().t()
        res = []
        for BM, BK, w, st, S in ((64, 128, 4, 4, 1), (64, 64, 4, 8, 1), (64, 128, 4, 4, 2), (64, 64, 4, 8, 2),
                                 (32, 128, 4, 4, 1), (32, 64, 4, 8, 1), (32, 128, 2, 4, 1), (32, 256, 4, 3, 1),
                                 (32, 128, 4, 6, 1), (16, 256, 4, 3, 1), (16, 128, 2, 6, 1), (32, 128, 4, 4, 2)):
            vv = vf if S > 1 else vb

            def call(i, BM=BM, BK=BK, w=w, st=st, S=S, vv=vv):
                if S > 1:
                    vv[i].zero_()
                shrink_k[(T // BM, S)](xs[i], A, vv[i], K=D, R=R, BM=BM, BK=BK, KC=D // S, ATOMIC=S > 1, num_warps=w,
                                       num_stages=st)
            try:
                vv[0].fill_(float("nan"))
                call(0)
                torch.cuda.synchronize()
                err = ((vv[0].float() - ref).norm() / ref.norm()).item()
                t = graph_time_us([lambda i=i: call(i) for i in range(n)])
            except Exception as e:  # noqa: BLE001
                print(f"  shrink R={R} BM={BM} BK={BK} w={w} st={st} S={S} failed: {type(e).__name__} {str(e)[:120]}")
                continue
            res.append((t, f"shrink R={R} BM={BM} BK={BK} w={w} st={st} S={S} programs={T // BM * S} (err {err:.1e})"))
        res.sort()
        for t, name in res:
            print(f"  {name}: {t:.1f} us = {xb / t / 1e3:.0f} GB/s of x", flush=True)
    expand_part(T, xs, sms)


if __name__ == "__main__":
    probe_main(run, [4096, 8192])
