"""Diagnostic (no result line): which of the extension's general features costs its Triton kernels time?

4 adapters of rank 128 on equal segments, d = 4096, bf16, the benchmark's graph-replay harness. Question
(csrc/atmm/NOTES.md, 2026-11-25, bisecting the extension's kernels): at T = 4096 with 4 segments the extension's
lora_shrink takes ~3.5 us and lora_expand_cols ~4 us more than plain kernels of the same tiles (atmm_split_probe.py),
which is most of what separates prefill-T4096-4ad (53 us) from 1.3x its floor (46). Each kernel here is the plain one
with the extension's features added one at a time (constexpr switches), from "segments known at compile time" to the
extension's kernel itself (EVEN cubin, launched through Triton like atmm_split_probe.real):
  shrink: +RT   d_in and the loop bounds at run time (as the extension gets them)
          +MASK rows masked at the segment's end, v stored masked
          +SCAN the row tile's segment found by scanning seg_indptr (triton_lora._row_tile)
  expand: +RT   d_out, ld_y and r_max strides at run time
          +ROWS rows masked at the segment's end (loads and the store of y, the load of v)
          +LIVE v's columns past the slot's rank zeroed after the load (`live`, tl.where)
          +ROWS&LIVE both in the masks of v's load, the rank hinted a multiple of 8 (tl.multiple_of) so the load
                stays 16-byte vectors
          +WALK the program walks the segments of its run of rows (triton_lora._first_segment_past, one tl.range per
                segment), as lora_expand_cols does
On the GPU machine, from the repository root: python3 benchmarks/atmm_bisect_probe.py [T ...]   (under a minute)
"""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "backend")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, "csrc/atmm")
import triton_lora  # noqa: E402
from atmm_split_probe import probe_main, segment_buffers  # noqa: E402
from vlora.atmm.timing import graph_time_us  # noqa: E402

D, R, NSEG = 4096, 128, 4
dt = torch.bfloat16


@triton.jit
def shrink_b_k(x, a, v, seg_indptr, seg_slot, num_segments, d_in, r_max, K: tl.constexpr, R: tl.constexpr,
               BM: tl.constexpr, BK: tl.constexpr, TPS: tl.constexpr, RT: tl.constexpr, MASK: tl.constexpr,
               SCAN: tl.constexpr):
    pid = tl.program_id(0)
    if SCAN:
        seg, before = triton_lora._row_tile(pid, seg_indptr, seg_slot, num_segments, BM, 256)
    else:
        seg = pid // TPS
        before = seg * TPS
    if seg < num_segments:
        slot = tl.load(seg_slot + seg)
        hi = tl.load(seg_indptr + seg + 1)
        rows = tl.load(seg_indptr + seg) + (pid - before) * BM + tl.arange(0, BM)
        rm = rows < hi
        rr = tl.arange(0, R)
        if RT:
            kk_end = d_in
            ld = d_in
            ldv = r_max
        else:
            kk_end = K
            ld = K
            ldv = R
        x_rows = x + rows.to(tl.int64)[:, None] * ld
        a_base = a + slot.to(tl.int64) * R * ld + rr[None, :] * ld
        acc = tl.zeros((BM, R), tl.float32)
        for k in range(0, kk_end, BK):
            kk = k + tl.arange(0, BK)
            if MASK:
                xt = tl.load(x_rows + kk[None, :], mask=rm[:, None], other=0.0)
            else:
                xt = tl.load(x_rows + kk[None, :])
            acc = tl.dot(xt, tl.load(a_base + kk[:, None]), acc)
        out = v + rows.to(tl.int64)[:, None] * ldv + rr[None, :]
        if MASK:
            tl.store(out, acc.to(v.dtype.element_ty), mask=rm[:, None])
        else:
            tl.store(out, acc.to(v.dtype.element_ty))


@triton.jit
def _tiles_b(v, y, bt, lo, hi, t0, t1, live, rr, rn, ldv, ldy, scale, BM: tl.constexpr, NS: tl.constexpr,
             MASK: tl.constexpr):
    for t in tl.range(t0, t1, num_stages=NS):
        rows = lo + t * BM + tl.arange(0, BM)
        vp = v + rows.to(tl.int64)[:, None] * ldv + rr[None, :]
        yp = y + rows.to(tl.int64)[:, None] * ldy + rn[None, :]
        if MASK == 5:  # rows, and v's columns past the slot's rank in the same masked load (the rank a multiple of 8)
            rm = rows < hi
            vt = tl.load(vp, mask=rm[:, None] & live, other=0.0)
            yt = tl.load(yp, mask=rm[:, None], other=0.0)
        elif MASK % 2 == 1:  # rows
            rm = rows < hi
            vt = tl.load(vp, mask=rm[:, None], other=0.0)
            yt = tl.load(yp, mask=rm[:, None], other=0.0)
        else:
            vt = tl.load(vp)
            yt = tl.load(yp)
        if MASK == 2 or MASK == 3:  # v's columns past the slot's rank, zeroed after an unmasked load
            vt = tl.where(live, vt, 0.0).to(y.dtype.element_ty)
        o = (yt.to(tl.float32) + tl.dot(vt, bt) * scale).to(y.dtype.element_ty)
        if MASK % 2 == 1:
            tl.store(yp, o, mask=rm[:, None])
        else:
            tl.store(yp, o)


@triton.jit
def expand_b_k(v, b, y, scales, ranks, seg_indptr, seg_slot, num_segments, num_tokens, d_out, r_max, ld_y,
               N: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr,
               RT: tl.constexpr, MASK: tl.constexpr, WALK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rr = tl.arange(0, R)
    if RT:
        ldb = r_max
        ldv = r_max
        ldy = ld_y
        nb = d_out
    else:
        ldb = R
        ldv = R
        ldy = N
        nb = N
    rows_per = (num_tokens + tl.num_programs(1) * BM - 1) // (tl.num_programs(1) * BM) * BM
    ra = tl.program_id(1) * rows_per
    rb = ra + rows_per
    if WALK:
        seg = triton_lora._first_segment_past(ra, seg_indptr, num_segments, 256)
    else:
        seg = ra // (num_tokens // num_segments)  # runs are the segments (equal, aligned)
    lo = tl.load(seg_indptr + seg, mask=seg < num_segments, other=0)
    while (seg < num_segments) & (lo < rb):
        hi = tl.load(seg_indptr + seg + 1)
        slot = tl.load(seg_slot + seg)
        scale = tl.load(scales + slot)
        live = (rr < tl.multiple_of(tl.load(ranks + slot), 8))[None, :]
        t0 = (tl.maximum(ra, lo) - lo + BM - 1) // BM
        t1 = (tl.minimum(rb, hi) - lo + BM - 1) // BM
        bt = tl.load(b + slot.to(tl.int64) * nb * ldb + rr[:, None] + rn[None, :] * ldb)
        _tiles_b(v, y, bt, lo, hi, t0, t1, live, rr, rn, ldv, ldy, scale, BM, NS, MASK)
        if WALK:
            seg += 1
            lo = hi
        else:
            seg = num_segments


def run(T, bw, sms):
    xb, n, xs, ys, vb, part, A, B, scale, rank, indptr, slot = segment_buffers(T, NSEG)
    BM, BK, SW, SST = 64, 64, 4, 8  # the shrink the table picks for prefill-T4096-4ad (tr_s_m64k64_r128_w4s8)
    EBM, EBN, ENS, EW = 64, 128, 4, 8  # tr_c_m64n128_r128_w8s4_g1
    tps = T // NSEG // BM
    runs = NSEG * max(1, round(sms / (D // EBN) / NSEG))  # whole segments per run
    print(f"T={T}, {NSEG} segments of rank {R}: x {xb / bw / 1e3:.1f} us, y r/w {2 * xb / bw / 1e3:.1f} us at the copy "
          f"rate; expand runs {runs}", flush=True)

    ref = torch.cat([xs[0][indptr[j]:indptr[j + 1]].float() @ A[j].float().t() for j in range(NSEG)])
    shrinks = {"plain": (0, 0, 0), "+RT": (1, 0, 0), "+RT+MASK": (1, 1, 0), "+RT+MASK+SCAN": (1, 1, 1)}
    for name, (rt, mask, scan) in shrinks.items():
        def call(i, rt=rt, mask=mask, scan=scan):
            shrink_b_k[(T // BM + (NSEG if scan else 0),)](xs[i], A, vb[i], indptr, slot, NSEG, D, R, K=D, R=R, BM=BM,
                                                            BK=BK, TPS=tps, RT=rt, MASK=mask, SCAN=scan, num_warps=SW,
                                                            num_stages=SST)
        vb[0].fill_(float("nan"))
        call(0)
        torch.cuda.synchronize()
        err = ((vb[0].float() - ref).norm() / ref.norm()).item()
        t = graph_time_us([lambda i=i: call(i) for i in range(n)])
        print(f"  shrink {name:16s} {t:5.1f} us (err {err:.1e})", flush=True)

    def ext_shrink(i):
        triton_lora.lora_shrink[(T // BM + NSEG, 1)](xs[i], A, vb[i], part, indptr, slot, NSEG, T, D, R, D, 1, BM=BM,
                                                      BK=BK, R=R, SEGS=256, EVEN=True, num_warps=SW, num_stages=SST)
    print(f"  shrink extension EVEN {graph_time_us([lambda i=i: ext_shrink(i) for i in range(n)]):5.1f} us", flush=True)

    y0 = ys[0].clone()
    refy = y0.float() + 0.5 * torch.cat([vb[0][indptr[j]:indptr[j + 1]].float() @ B[j].float().t() for j in range(NSEG)])
    expands = {"plain": (0, 0, 0), "+RT": (1, 0, 0), "+RT+ROWS": (1, 1, 0), "+RT+LIVE": (1, 2, 0), "+RT+ROWS+LIVE": (1, 3, 0),
               "+RT+ROWS+LIVE+WALK": (1, 3, 1), "+RT+ROWS&LIVE": (1, 5, 0), "+RT+ROWS&LIVE+WALK": (1, 5, 1)}
    for name, (rt, mask, walk) in expands.items():
        def call(i, rt=rt, mask=mask, walk=walk):
            expand_b_k[(D // EBN, runs)](vb[i], B, ys[i], scale, rank, indptr, slot, NSEG, T, D, R, D, N=D, R=R, BM=EBM,
                                         BN=EBN, NS=ENS, RT=rt, MASK=mask, WALK=walk, num_warps=EW)
        ys[0].copy_(y0)
        call(0)
        torch.cuda.synchronize()
        err = ((ys[0].float() - refy).norm() / refy.norm()).item()
        t = graph_time_us([lambda i=i: call(i) for i in range(n)])
        print(f"  expand {name:20s} {t:5.1f} us (err of y {err:.1e})", flush=True)

    def ext_expand(i):
        triton_lora.lora_expand_cols[(D // EBN, runs)](ys[i], vb[i], part, B, scale, rank, indptr, slot, NSEG, T, D, R, D, 0,
                                                       BM=EBM, BN=EBN, R=R, NS=ENS, SEGS=256, EVEN=True, num_warps=EW)
    print(f"  expand extension EVEN {graph_time_us([lambda i=i: ext_expand(i) for i in range(n)]):5.1f} us", flush=True)


if __name__ == "__main__":
    probe_main(run, [4096, 8192, 1024])
