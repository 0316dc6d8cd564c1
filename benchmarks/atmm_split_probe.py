"""Diagnostic (no result line): can a split-d_in shrink that adds into one fp32 v beat the row-tile shrink?

One adapter of rank 128, d = 4096, bf16, the benchmark's graph-replay harness. Question (csrc/atmm/NOTES.md,
2026-11-25, split shrink with atomic adds): at T = 4096 the shrink takes ~19.5 us where x alone is ~11.3, and
splitting d_in into 2 programs per row tile did not help. If its limit is the L2 -> SM traffic (every 64-row
tile reads all of lora_A: twice the bytes of its x), 128-row tiles halve that traffic, and split d_in chunks
fill the GPU again. Their partials are added with atomics into a zeroed fp32 v, so no program sums the others'
(the serial tail of the handover tried at 2d9be1d), and the column-stationary expand keeps its pipelined loop,
reading fp32 v. Times: each shrink alone, the zeroing, the expand from bf16 and from fp32 v, and the pairs.
Second question: what do the extension's own kernels (csrc/atmm/triton_lora.py: segments, masks, run-time widths)
lose against these plain ones on the same shapes, and how much of it do their EVEN variants (no column masks) win back?
On the GPU machine, from the repository root: python3 benchmarks/atmm_split_probe.py [T ...]   (about 2 minutes)
"""
import itertools
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, "backend")
sys.path.insert(0, "csrc/atmm")
sys.path.insert(0, "benchmarks")
import triton_lora  # noqa: E402
from atmm_triton_probe import expand_cols_k  # noqa: E402  (the plain column-stationary expand; v bf16 or fp32)
from vlora.atmm.timing import copy_bandwidth_gbs, graph_time_us, sets_needed  # noqa: E402

D, R = 4096, 128
dt = torch.bfloat16


@triton.jit
def shrink_k(x, a, v, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr,
             ATOMIC: tl.constexpr):
    """v[rows] (+)= x[rows, chunk] @ a[:, chunk].T for the KC columns of d_in of program_id(1)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    rr = tl.arange(0, R)
    k0 = tl.program_id(1) * KC
    acc = tl.zeros((BM, R), tl.float32)
    for k in range(k0, k0 + KC, BK):
        xt = tl.load(x + rm[:, None].to(tl.int64) * K + (k + rk)[None, :])
        at = tl.load(a + rr[None, :] * K + (k + rk)[:, None])
        acc = tl.dot(xt, at, acc)
    vp = v + rm[:, None].to(tl.int64) * R + rr[None, :]
    if ATOMIC:
        tl.atomic_add(vp, acc, sem="relaxed")
    else:
        tl.store(vp, acc.to(v.dtype.element_ty))


def buffers(T):
    """The probes' inputs at T tokens: bytes of x, the number of rotated sets (> 256 MB per replay with y read and
    written), per set x, y, v (bf16) and v (fp32, zeroed), and one adapter's A (R x D) and B (D x R)."""
    xb = T * D * 2
    n = sets_needed(3 * xb)
    xs = [torch.randn(T, D, device="cuda", dtype=dt) for _ in range(n)]
    ys = [torch.randn(T, D, device="cuda", dtype=dt) for _ in range(n)]
    vb = [torch.empty(T, R, device="cuda", dtype=dt) for _ in range(n)]
    vf = [torch.zeros(T, R, device="cuda", dtype=torch.float32) for _ in range(n)]
    A = torch.randn(R, D, device="cuda", dtype=dt) / 64
    B = torch.randn(D, R, device="cuda", dtype=dt) / 16
    return xb, n, xs, ys, vb, vf, A, B


def segment_buffers(T, nseg):
    """The inputs of the extension's kernels at T tokens on nseg equal segments, adapter i of rank R in slot i: bytes of
    x, the number of rotated sets, per set x, y and v (bf16), a one-element partial (the kernels take one, unsplit
    calls read none), A (nseg x R x D), B (nseg x D x R), slot scales 0.5, slot ranks R, seg_indptr and seg_slot."""
    xb = T * D * 2
    n = sets_needed(3 * xb)
    xs = [torch.randn(T, D, device="cuda", dtype=dt) for _ in range(n)]
    ys = [torch.randn(T, D, device="cuda", dtype=dt) for _ in range(n)]
    vb = [torch.empty(T, R, device="cuda", dtype=dt) for _ in range(n)]
    part = torch.empty(1, device="cuda", dtype=torch.float32)
    A = torch.randn(nseg, R, D, device="cuda", dtype=dt) / 64
    B = torch.randn(nseg, D, R, device="cuda", dtype=dt) / 16
    scale = torch.full((nseg,), 0.5, device="cuda")
    rank = torch.full((nseg,), R, device="cuda", dtype=torch.int32)
    indptr = torch.tensor([T * i // nseg for i in range(nseg + 1)], device="cuda", dtype=torch.int32)
    slot = torch.arange(nseg, device="cuda", dtype=torch.int32)
    return xb, n, xs, ys, vb, part, A, B, scale, rank, indptr, slot


def probe_main(run, default_ts):
    """The probes' main: seed, measure the copy rate, then run(T, copy GB/s, SMs) for each T of argv (or the defaults)."""
    t0 = time.time()
    torch.manual_seed(0)
    bw = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy 2GB: {bw:.0f} GB/s, {sms} SMs, triton {triton.__version__}", flush=True)
    for T in [int(a) for a in sys.argv[1:]] or default_ts:
        run(T, bw, sms)
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s")


def run(T, bw, sms):
    xb, n, xs, ys, vb, vf, A, B = buffers(T)
    s = 0.5
    print(f"T={T}: x read {xb / bw / 1e3:.1f} us, y r/w {2 * xb / bw / 1e3:.1f} us, sets {n}", flush=True)

    # correctness first: split-4 atomic shrink and the plain one against fp32
    ref = xs[0].float() @ A.float().t()
    vf[0].zero_()
    shrink_k[(T // 128, 4)](xs[0], A, vf[0], K=D, R=R, BM=128, BK=64, KC=D // 4, ATOMIC=True, num_warps=8, num_stages=4)
    shrink_k[(T // 64, 1)](xs[0], A, vb[0], K=D, R=R, BM=64, BK=128, KC=D, ATOMIC=False, num_warps=4, num_stages=4)
    torch.cuda.synchronize()
    for name, got in (("atomic split 4", vf[0]), ("plain", vb[0].float())):
        print(f"  {name} rel err {((got - ref).norm() / ref.norm()).item():.2e}", flush=True)

    t_zero = graph_time_us([lambda i=i: vf[i].zero_() for i in range(n)])
    print(f"  zero fp32 v ({T * R * 4 >> 10} KiB): {t_zero:.1f} us", flush=True)
    res = []
    for BM, BK, w, st in ((64, 128, 4, 4), (64, 64, 4, 8), (64, 128, 8, 4), (128, 64, 8, 4), (128, 64, 8, 3),
                          (128, 128, 8, 3)):
        t = graph_time_us([lambda i=i: shrink_k[(T // BM, 1)](xs[i], A, vb[i], K=D, R=R, BM=BM, BK=BK, KC=D, ATOMIC=False,
                                                               num_warps=w, num_stages=st) for i in range(n)])
        res.append((t, f"plain BM={BM} BK={BK} w={w} st={st} programs={T // BM}"))
    for (BM, BK, w, st), S in itertools.product(((64, 128, 4, 4), (64, 64, 4, 6), (128, 64, 8, 4), (128, 64, 8, 3),
                                                  (128, 128, 8, 3), (256, 64, 8, 3)), (1, 2, 4, 8)):
        if T // BM * S > 4 * sms or D // S < 2 * BK:
            continue
        try:
            t = graph_time_us([lambda i=i: shrink_k[(T // BM, S)](xs[i], A, vf[i], K=D, R=R, BM=BM, BK=BK, KC=D // S,
                                                                   ATOMIC=True, num_warps=w, num_stages=st)
                               for i in range(n)])
        except Exception as e:  # noqa: BLE001
            print("  atomic", BM, BK, w, st, S, "failed:", type(e).__name__, str(e)[:120], flush=True)
            continue
        res.append((t, f"atomic BM={BM} BK={BK} w={w} st={st} split={S} programs={T // BM * S}"))
    res.sort()
    for t, name in res[:10]:
        print(f"  shrink {name}: {t:.1f} us = {xb / t / 1e3:.0f} GB/s of x", flush=True)
    best_plain = min(r for r in res if r[1].startswith("plain"))
    best_atomic = min((r for r in res if r[1].startswith("atomic")), default=None)

    res = []
    for (BM, BN, ns, w), vname in itertools.product(((64, 128, 4, 8), (64, 256, 3, 8), (64, 128, 3, 4)), ("bf16", "fp32")):
        vv = vb if vname == "bf16" else vf
        G = max(1, round(sms / (D // BN)))
        t = graph_time_us([lambda i=i: expand_cols_k[(D // BN, G)](vv[i], B, ys[i], s, T, N=D, R=R, BM=BM, BN=BN, NS=ns,
                                                                 num_warps=w) for i in range(n)])
        res.append((t, vname, f"BM={BM} BN={BN} NS={ns} w={w} runs={G}"))
    res.sort()
    for t, vname, name in res:
        print(f"  expand cols, v {vname}, {name}: {t:.1f} us = {2 * xb / t / 1e3:.0f} GB/s of y", flush=True)
    eb = min(r for r in res if r[1] == "bf16")
    ef = min(r for r in res if r[1] == "fp32")

    def pair(shrink_desc, expand, atomic):
        f = dict(kv.split("=") for kv in shrink_desc.split()[1:])
        BM, BK, w, st = int(f["BM"]), int(f["BK"]), int(f["w"]), int(f["st"])
        S = int(f.get("split", 1))
        eBM, eBN, ens, ew = (int(dict(kv.split("=") for kv in expand[2].split())[k]) for k in ("BM", "BN", "NS", "w"))
        G = max(1, round(sms / (D // eBN)))
        vv = vf if atomic else vb

        def call(i):
            if atomic:
                vf[i].zero_()
            shrink_k[(T // BM, S)](xs[i], A, vv[i], K=D, R=R, BM=BM, BK=BK, KC=D // S, ATOMIC=atomic, num_warps=w,
                                   num_stages=st)
            expand_cols_k[(D // eBN, G)](vv[i], B, ys[i], s, T, N=D, R=R, BM=eBM, BN=eBN, NS=ens, num_warps=ew)
        return graph_time_us([lambda i=i: call(i) for i in range(n)])

    floor = 3 * xb / bw / 1e3
    tp = pair(best_plain[1], eb, False)
    print(f"  pair plain ({best_plain[1]} + {eb[2]}): {tp:.1f} us = {tp / floor:.2f}x floor {floor:.1f}", flush=True)
    if best_atomic:
        ta = pair(best_atomic[1], ef, True)
        print(f"  pair atomic (zero + {best_atomic[1]} + {ef[2]}): {ta:.1f} us = {ta / floor:.2f}x floor", flush=True)


def real(T, bw, sms, nseg):
    """The extension's lora_shrink / lora_expand_cols (launched through Triton here), nseg equal segments."""
    xb, n, xs, ys, vb, part, A, B, scale, rank, indptr, slot = segment_buffers(T, nseg)
    print(f"T={T}, {nseg} segments, the extension's kernels:", flush=True)

    def shrink(i, BM, BK, w, st, even):
        triton_lora.lora_shrink[(T // BM + nseg, 1)](xs[i], A, vb[i], part, indptr, slot, nseg, T, D, R, D, 1, BM=BM,
                                                      BK=BK, R=R, SEGS=256, EVEN=even, num_warps=w, num_stages=st)

    def expand(i, BM, BN, w, st, g, even):
        cols = D // BN
        runs = max(1, min(T // BM, (g * sms + cols // 2) // cols))
        triton_lora.lora_expand_cols[(cols, runs)](ys[i], vb[i], part, B, scale, rank, indptr, slot, nseg, T, D, R, D, 0,
                                                   BM=BM, BN=BN, R=R, NS=st, SEGS=256, EVEN=even, num_warps=w)

    ref = torch.cat([xs[0][indptr[j]:indptr[j + 1]].float() @ A[j].float().t() for j in range(nseg)])
    for even in (False, True):
        vb[0].fill_(float("nan"))
        shrink(0, 64, 128, 4, 4, even)
        torch.cuda.synchronize()
        print(f"  shrink EVEN={even} rel err {((vb[0].float() - ref).norm() / ref.norm()).item():.2e}", flush=True)
    for (BM, BK, w, st), even in itertools.product(((64, 128, 4, 4), (64, 64, 4, 8), (64, 128, 8, 4)), (False, True)):
        t = graph_time_us([lambda i=i: shrink(i, BM, BK, w, st, even) for i in range(n)])
        print(f"  lora_shrink BM={BM} BK={BK} w={w} st={st} EVEN={even}: {t:.1f} us = {xb / t / 1e3:.0f} GB/s of x",
              flush=True)
    y0 = ys[0].clone()
    refy = y0.float() + 0.5 * torch.cat([vb[0][indptr[j]:indptr[j + 1]].float() @ B[j].float().t() for j in range(nseg)])
    for even in (False, True):
        ys[0].copy_(y0)
        expand(0, 64, 128, 8, 4, 1, even)
        torch.cuda.synchronize()
        print(f"  expand EVEN={even} rel err of y {((ys[0].float() - refy).norm() / refy.norm()).item():.2e}", flush=True)
    for (BM, BN, w, st, g), even in itertools.product(((64, 128, 8, 4, 1), (64, 256, 8, 3, 1), (64, 128, 4, 2, 2)),
                                                      (False, True)):
        t = graph_time_us([lambda i=i: expand(i, BM, BN, w, st, g, even) for i in range(n)])
        print(f"  lora_expand_cols BM={BM} BN={BN} w={w} st={st} g={g} EVEN={even}: {t:.1f} us = "
              f"{2 * xb / t / 1e3:.0f} GB/s of y", flush=True)


def run_all(T, bw, sms):
    for nseg in (2, 4):
        real(T, bw, sms, nseg)
    run(T, bw, sms)


if __name__ == "__main__":
    probe_main(run_all, [4096, 8192, 1024])
