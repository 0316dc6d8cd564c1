"""Diagnostic (no result line): what HBM rate do plain Triton LoRA kernels reach, one adapter of rank 128, d = 4096?

Times a copy, an in-place `y += 1`, and sweeps of plain Triton shrink (x @ A^T), expand (y += s * v @ B^T) and
one-row-tile-does-both kernels (constexpr strides, no masks), with the same graph-replay harness as the benchmark.
It is what showed (csrc/atmm/NOTES.md, 2026-11-25) that an in-place update of y reaches copy speed, that
Triton's wgmma code beat the CUTLASS/mma.sync kernels, and that a column-stationary expand whose row loop carries
tl.range(num_stages=...) (y of the next tiles in flight) beats the row-tile ones; the general kernels are
csrc/atmm/triton_lora.py.
On the GPU machine, from the repository root: python3 benchmarks/atmm_triton_probe.py [T]   (about a minute)
"""
import sys, itertools, time
import torch, triton, triton.language as tl
sys.path.insert(0, "backend")
from vlora.atmm.timing import graph_time_us, sets_needed, copy_bandwidth_gbs

T, D, R = int(sys.argv[1]) if len(sys.argv) > 1 else 8192, 4096, 128
dt = torch.bfloat16


@triton.jit
def _xa(x, a, rm, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """x[rm] @ a.T in fp32 (one row tile, all of d_in)."""
    rk = tl.arange(0, BK)
    rr = tl.arange(0, R)
    acc = tl.zeros((BM, R), tl.float32)
    for k in range(0, K, BK):
        xt = tl.load(x + rm[:, None] * K + (k + rk)[None, :])
        at = tl.load(a + rr[None, :] * K + (k + rk)[:, None])
        acc = tl.dot(xt, at, acc)
    return acc


@triton.jit
def _update(vt, b, y, s, rm, lo, hi, N: tl.constexpr, R: tl.constexpr, BN: tl.constexpr):
    """y[rm, lo:hi] += s * vt @ b[lo:hi].T, BN columns at a time."""
    rr = tl.arange(0, R)
    for n0 in range(lo, hi, BN):
        rn = n0 + tl.arange(0, BN)
        bt = tl.load(b + rn[None, :] * R + rr[:, None])
        yp = y + rm[:, None] * N + rn[None, :]
        yt = tl.load(yp)
        tl.store(yp, (yt.to(tl.float32) + tl.dot(vt, bt) * s).to(tl.bfloat16))


@triton.jit
def shrink_k(x, a, v, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rr = tl.arange(0, R)
    tl.store(v + rm[:, None] * R + rr[None, :], _xa(x, a, rm, K, R, BM, BK).to(tl.bfloat16))


@triton.jit
def expand_k(v, b, y, s, N: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NCH: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rr = tl.arange(0, R)
    vt = tl.load(v + rm[:, None] * R + rr[None, :])
    _update(vt, b, y, s, rm, tl.program_id(1) * NCH, tl.program_id(1) * NCH + NCH, N, R, BN)


@triton.jit
def expand_cols_k(v, b, y, s, T, N: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr):
    """Column-stationary: one lora_B tile per program, its run of row tiles pipelined (y included) by tl.range."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rr = tl.arange(0, R)
    bt = tl.load(b + rn[None, :] * R + rr[:, None])
    per = (T // BM + tl.num_programs(1) - 1) // tl.num_programs(1)
    lo = tl.program_id(1) * per
    for t in tl.range(lo, tl.minimum(lo + per, T // BM), num_stages=NS):
        rm = t * BM + tl.arange(0, BM)
        vt = tl.load(v + rm[:, None].to(tl.int64) * R + rr[None, :]).to(tl.bfloat16)  # v may be fp32 (split probe)
        yp = y + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(yp, (tl.load(yp).to(tl.float32) + tl.dot(vt, bt) * s).to(tl.bfloat16))


@triton.jit
def fused_k(x, a, b, y, s, K: tl.constexpr, N: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
            BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    _update(_xa(x, a, rm, K, R, BM, BK).to(tl.bfloat16), b, y, s, rm, 0, N, N, R, BN)


@triton.jit
def add_k(y, n, BS: tl.constexpr):
    o = tl.program_id(0) * BS + tl.arange(0, BS)
    tl.store(y + o, tl.load(y + o) + 1.0)


def main():
    torch.manual_seed(0)
    bw = copy_bandwidth_gbs()
    print(f"copy 2GB: {bw:.0f} GB/s  T={T}", flush=True)
    xb, yb = T * D * 2, T * D * 2
    n = sets_needed(xb + yb)
    xs = [torch.randn(T, D, device="cuda", dtype=dt) for _ in range(n)]
    ys = [torch.randn(T, D, device="cuda", dtype=dt) for _ in range(n)]
    vs = [torch.empty(T, R, device="cuda", dtype=dt) for _ in range(n)]
    A = torch.randn(R, D, device="cuda", dtype=dt) / 64
    B = torch.randn(D, R, device="cuda", dtype=dt) / 16
    s = 0.5
    floor = (xb + 2 * yb) / bw / 1e3
    print(f"floor(x + y r/w) {floor:.1f} us; x read alone {xb / bw / 1e3:.1f}; y r/w alone {2 * yb / bw / 1e3:.1f}")

    t = graph_time_us([lambda i=i: ys[i].copy_(xs[i]) for i in range(n)])
    print(f"torch copy x->y: {t:.1f} us = {2 * xb / t / 1e3:.0f} GB/s", flush=True)
    t = graph_time_us([lambda i=i: ys[i].add_(1.0) for i in range(n)])
    print(f"torch y.add_(1): {t:.1f} us = {2 * yb / t / 1e3:.0f} GB/s", flush=True)
    for bs in (1024, 4096):
        t = graph_time_us([lambda i=i: add_k[(T * D // bs,)](ys[i], T * D, BS=bs) for i in range(n)])
        print(f"triton y+=1 BS={bs}: {t:.1f} us = {2 * yb / t / 1e3:.0f} GB/s", flush=True)

    # correctness of the fused kernel (fp32 reference), on fresh y (the timings above added to ys)
    x0, y0 = xs[0].clone(), torch.randn(T, D, device="cuda", dtype=dt)
    ref = y0.float() + s * ((x0.float() @ A.float().t()).to(dt).float() @ B.float().t())
    y_before = y0.clone()
    fused_k[(T // 64,)](x0, A, B, y0, s, K=D, N=D, R=R, BM=64, BK=64, BN=128, num_warps=8, num_stages=3)
    err = ((y0.float() - ref).norm() / (ref - y_before.float()).norm()).item()
    print(f"fused rel err of delta: {err:.2e}", flush=True)

    res = []
    for BM, BK, st, w in itertools.product((32, 64, 128), (64, 128), (3, 4, 5), (4, 8)):
        if BM == 128 and w == 4:
            continue
        try:
            t = graph_time_us([lambda i=i: shrink_k[(T // BM,)](xs[i], A, vs[i], K=D, R=R, BM=BM, BK=BK,
                                                               num_warps=w, num_stages=st) for i in range(n)])
        except Exception as e:  # noqa: BLE001
            print("shrink", BM, BK, st, w, "fail", type(e).__name__); continue
        res.append((t, f"shrink BM={BM} BK={BK} st={st} w={w}"))
    res.sort()
    for t, name in res[:6]:
        print(f"{name}: {t:.1f} us = {xb / t / 1e3:.0f} GB/s of x", flush=True)
    res = []
    for BM, BN, st, w, nsplit in itertools.product((32, 64, 128), (64, 128, 256), (2, 3), (4, 8), (1, 2, 4)):
        if T // BM * nsplit < 100 or T // BM * nsplit > 1100 or BM * BN > 16384:
            continue
        nch = D // nsplit
        try:
            t = graph_time_us([lambda i=i: expand_k[(T // BM, nsplit)](vs[i], B, ys[i], s, N=D, R=R, BM=BM, BN=BN, NCH=nch,
                                                                      num_warps=w, num_stages=st) for i in range(n)])
        except Exception as e:  # noqa: BLE001
            print("expand", BM, BN, st, w, nsplit, "fail", type(e).__name__); continue
        res.append((t, f"expand BM={BM} BN={BN} st={st} w={w} split={nsplit}"))
    res.sort()
    for t, name in res[:6]:
        print(f"{name}: {t:.1f} us = {2 * yb / t / 1e3:.0f} GB/s of y", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = []
    for BM, BN, ns, w, waves in ((64, 128, 4, 4, 1), (64, 128, 4, 8, 1), (128, 128, 3, 8, 1), (64, 256, 3, 8, 1),
                                 (64, 128, 3, 4, 2), (64, 128, 2, 4, 2)):
        G = max(1, round(waves * sms / (D // BN)))
        t = graph_time_us([lambda i=i: expand_cols_k[(D // BN, G)](vs[i], B, ys[i], s, T, N=D, R=R, BM=BM, BN=BN, NS=ns,
                                                                 num_warps=w) for i in range(n)])
        res.append((t, f"expand, column-stationary BM={BM} BN={BN} NS={ns} w={w} runs={G}"))
    res.sort()
    for t, name in res[:4]:
        print(f"{name}: {t:.1f} us = {2 * yb / t / 1e3:.0f} GB/s of y", flush=True)
    res = []
    for BM, BK, BN, st, w in itertools.product((16, 32, 64), (64, 128), (64, 128), (3, 4), (4, 8)):
        try:
            t = graph_time_us([lambda i=i: fused_k[(T // BM,)](xs[i], A, B, ys[i], s, K=D, N=D, R=R, BM=BM, BK=BK, BN=BN,
                                                              num_warps=w, num_stages=st) for i in range(n)])
        except Exception as e:  # noqa: BLE001
            print("fused", BM, BK, BN, st, w, "fail", type(e).__name__); continue
        res.append((t, f"fused BM={BM} BK={BK} BN={BN} st={st} w={w}"))
    res.sort()
    for t, name in res[:8]:
        print(f"{name}: {t:.1f} us = {t / floor:.2f}x floor", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f} s")
