"""Diagnostic (no result line): do TMA loads (Triton tensor descriptors) move x and y faster than pointer loads?

One adapter of rank 128, d = 4096, bf16, the benchmark's graph-replay harness. Question (csrc/atmm/NOTES.md,
2026-11-25, TMA probe): every shrink here reads x at 1.8-2.3 TB/s where a copy moves 2.9. The Triton kernels load
their tiles with pointer tensors: cp.async, one 16-byte copy per thread per vector, with 64-bit address arithmetic
per vector. A tensor descriptor (host-side here, the CUtensorMap passed by value) lets one thread issue the whole
tile as a bulk tensor copy. If the limit was issuing those copies, the TMA kernels move x (and y) faster.
Times, per T: the plain pointer shrink (atmm_split_probe.shrink_k) against TMA shrinks, the plain column-stationary
expand (atmm_triton_probe.expand_cols_k) against a TMA one, and the best pairs.
On the GPU machine, from the repository root: python3 benchmarks/atmm_tma_probe.py [T ...]   (about a minute)
"""
import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, "backend")
sys.path.insert(0, "benchmarks")
from atmm_split_probe import buffers, probe_main, shrink_k  # noqa: E402
from atmm_triton_probe import expand_cols_k  # noqa: E402
from vlora.atmm.timing import graph_time_us  # noqa: E402

D, R = 4096, 128
dt = torch.bfloat16


@triton.jit
def shrink_tma_k(x_desc, a_desc, v, K: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                 KC: tl.constexpr, ATOMIC: tl.constexpr):
    """v[rows] (+)= x[rows, chunk] @ a[:, chunk].T, x and a tiles loaded by TMA."""
    m0 = tl.program_id(0) * BM
    k0 = tl.program_id(1) * KC
    acc = tl.zeros((BM, R), tl.float32)
    for k in range(k0, k0 + KC, BK):
        acc = tl.dot(x_desc.load([m0, k]), a_desc.load([0, k]).T, acc)
    vp = v + (m0 + tl.arange(0, BM))[:, None].to(tl.int64) * R + tl.arange(0, R)[None, :]
    if ATOMIC:
        tl.atomic_add(vp, acc, sem="relaxed")
    else:
        tl.store(vp, acc.to(v.dtype.element_ty))


@triton.jit
def expand_tma_k(v_desc, b_desc, y_desc, s, T, BM: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr):
    """Column-stationary expand: one lora_B tile per program, its run of row tiles pipelined; v, y by TMA."""
    n0 = tl.program_id(0) * BN
    bt = b_desc.load([n0, 0]).T  # (R, BN)
    per = (T // BM + tl.num_programs(1) - 1) // tl.num_programs(1)
    lo = tl.program_id(1) * per
    for t in tl.range(lo, tl.minimum(lo + per, T // BM), num_stages=NS):
        yt = y_desc.load([t * BM, n0])
        o = tl.dot(v_desc.load([t * BM, 0]), bt)
        y_desc.store([t * BM, n0], (yt.to(tl.float32) + o * s).to(tl.bfloat16))


def run(T, bw, sms):
    xb, n, xs, ys, vb, vf, A, B = buffers(T)
    floor = 3 * xb / bw / 1e3
    print(f"T={T}: floor {floor:.1f} us (x {xb / bw / 1e3:.1f}, y r/w {2 * xb / bw / 1e3:.1f}), sets {n}", flush=True)

    def sdesc(i, BM, BK):
        return TensorDescriptor.from_tensor(xs[i], [BM, BK]), TensorDescriptor.from_tensor(A, [R, BK])

    # correctness first
    ref = xs[0].float() @ A.float().t()
    xd, ad = sdesc(0, 64, 128)
    vb[0].fill_(float("nan"))
    shrink_tma_k[(T // 64, 1)](xd, ad, vb[0], K=D, R=R, BM=64, BK=128, KC=D, ATOMIC=False, num_warps=4, num_stages=4)
    torch.cuda.synchronize()
    print(f"  TMA shrink rel err {((vb[0].float() - ref).norm() / ref.norm()).item():.2e}", flush=True)
    y0 = ys[0].clone()
    refy = y0.float() + 0.5 * (vb[0].float() @ B.float().t())
    expand_tma_k[(D // 128, 4)](TensorDescriptor.from_tensor(vb[0], [64, R]), TensorDescriptor.from_tensor(B, [128, R]),
                                TensorDescriptor.from_tensor(ys[0], [64, 128]), 0.5, T, BM=64, BN=128, NS=4, num_warps=8)
    torch.cuda.synchronize()
    print(f"  TMA expand rel err of y {((ys[0].float() - refy).norm() / refy.norm()).item():.2e}", flush=True)

    res = []
    for (BM, BK, w, st), S in itertools.product(((64, 128, 4, 4), (64, 64, 4, 8)), (1, 2, 4)):
        if T // BM * S > 2 * sms:
            continue

        def ptr_call(i, BM=BM, BK=BK, w=w, st=st, S=S):
            if S > 1:
                vf[i].zero_()
            shrink_k[(T // BM, S)](xs[i], A, vf[i] if S > 1 else vb[i], K=D, R=R, BM=BM, BK=BK, KC=D // S, ATOMIC=S > 1,
                                   num_warps=w, num_stages=st)
        res.append((graph_time_us([lambda i=i: ptr_call(i) for i in range(n)]), "ptr", BM, BK, w, st, S))
    for (BM, BK, w, st), S in itertools.product(((64, 128, 4, 4), (64, 64, 4, 6), (64, 128, 4, 3), (128, 64, 8, 4),
                                                  (128, 128, 8, 3), (64, 256, 4, 2), (128, 64, 4, 4)), (1, 2, 4)):
        if T // BM * S > 2 * sms:
            continue
        descs = [sdesc(i, BM, BK) for i in range(n)]
        vv = vf if S > 1 else vb

        def call(i, BM=BM, BK=BK, w=w, st=st, S=S, vv=vv):
            if S > 1:
                vv[i].zero_()
            shrink_tma_k[(T // BM, S)](descs[i][0], descs[i][1], vv[i], K=D, R=R, BM=BM, BK=BK, KC=D // S,
                                       ATOMIC=S > 1, num_warps=w, num_stages=st)
        try:
            t = graph_time_us([lambda i=i: call(i) for i in range(n)])
        except Exception as e:  # noqa: BLE001
            print(f"  TMA shrink BM={BM} BK={BK} w={w} st={st} S={S} failed: {type(e).__name__} {str(e)[:160]}", flush=True)
            continue
        res.append((t, "tma", BM, BK, w, st, S))
    res.sort()
    for t, kind, BM, BK, w, st, S in res[:12]:
        print(f"  shrink {kind} BM={BM} BK={BK} w={w} st={st} S={S}: {t:.1f} us = {xb / t / 1e3:.0f} GB/s of x", flush=True)

    eres = []
    for BM, BN, ns, w in ((64, 128, 4, 8), (64, 256, 3, 8), (64, 128, 3, 4)):
        G = max(1, round(sms / (D // BN)))
        t = graph_time_us([lambda i=i: expand_cols_k[(D // BN, G)](vb[i], B, ys[i], 0.5, T, N=D, R=R, BM=BM, BN=BN, NS=ns,
                                                                 num_warps=w) for i in range(n)])
        eres.append((t, "ptr", BM, BN, ns, w, G))
    for (BM, BN, ns, w), g in itertools.product(((64, 128, 4, 8), (64, 256, 3, 8), (64, 128, 3, 4), (128, 128, 3, 8),
                                                 (64, 128, 6, 4), (128, 64, 4, 4)), (1, 2)):
        G = max(1, round(g * sms / (D // BN)))
        descs = [(TensorDescriptor.from_tensor(vb[i], [BM, R]), TensorDescriptor.from_tensor(B, [BN, R]),
                  TensorDescriptor.from_tensor(ys[i], [BM, BN])) for i in range(n)]
        try:
            t = graph_time_us([lambda i=i, d=descs: expand_tma_k[(D // BN, G)](d[i][0], d[i][1], d[i][2], 0.5, T, BM=BM,
                                                                               BN=BN, NS=ns, num_warps=w)
                               for i in range(n)])
        except Exception as e:  # noqa: BLE001
            print(f"  TMA expand BM={BM} BN={BN} NS={ns} w={w} g={g} failed: {type(e).__name__} {str(e)[:160]}", flush=True)
            continue
        eres.append((t, "tma", BM, BN, ns, w, G))
    eres.sort()
    for t, kind, BM, BN, ns, w, G in eres[:10]:
        print(f"  expand {kind} BM={BM} BN={BN} NS={ns} w={w} runs={G}: {t:.1f} us = {2 * xb / t / 1e3:.0f} GB/s of y",
              flush=True)
    best_ptr = min(r for r in res if r[1] == "ptr")[0] + min(r for r in eres if r[1] == "ptr")[0]
    tma_s = [r for r in res if r[1] == "tma"]
    tma_e = [r for r in eres if r[1] == "tma"]
    if tma_s and tma_e:
        best_tma = tma_s[0][0] + tma_e[0][0]
        print(f"  sum of bests: pointer {best_ptr:.1f} us ({best_ptr / floor:.2f}x floor), TMA {best_tma:.1f} us "
              f"({best_tma / floor:.2f}x floor)", flush=True)


if __name__ == "__main__":
    probe_main(run, [4096, 8192, 1024])
