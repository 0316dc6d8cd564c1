"""ATMM kernels written in the Triton language, compiled ahead of time into the extension.

`triton_aot.py` compiles every ATMM_TRITON_SHRINK / ATMM_TRITON_EXPAND line of tile_configs.def into a
cubin at build time; `triton.cpp` loads the cubins and launches them like the hand-written kinds (same
FusedArgs contract: v in the activation dtype when d_in is not split, fp32 partials otherwise). Nothing
here runs through Triton's Python launcher, and serving needs no Triton at run time.

Why these exist (csrc/atmm/NOTES.md, 2026-11-25): on the H100, Triton's wgmma code for a plain
row-tile shrink and a column-chunk expand moved x and y ~15-20% faster at T >= 4096 than any CUTLASS or
hand-written (mma.sync) kernel here.

Row tiles are numbered segment by segment (segments with slot -1 or no tokens have none); each program
finds its segment by scanning seg_indptr in chunks of SEGS, so any number of segments works. The grid's
first dimension is the upper bound T // BM + num_segments; programs past the last tile return at once.
Every integer argument is a multiple of 8 (the extension checks widths, r_max and strides), which the
compiler is told, so masked loads stay 16-byte vectors.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents


@triton.jit
def _row_tile(pid, seg_indptr, seg_slot, num_segments, BM: tl.constexpr, SEGS: tl.constexpr):
    """The segment of row tile `pid` and the tiles before that segment; seg == num_segments: no tile."""
    seg = 0
    before = 0
    base = 0
    for c0 in range(0, num_segments, SEGS):
        s = c0 + tl.arange(0, SEGS)
        m = s < num_segments
        lo = tl.load(seg_indptr + s, mask=m, other=0)
        hi = tl.load(seg_indptr + s + 1, mask=m, other=0)
        sl = tl.load(seg_slot + s, mask=m, other=-1)
        n = tl.where(m & (sl >= 0), (hi - lo + BM - 1) // BM, 0)
        incl = tl.cumsum(n, 0) + base
        done = m & (incl <= pid)
        seg += tl.sum(done.to(tl.int32), 0)
        before += tl.sum(tl.where(done, n, 0), 0)
        base += tl.sum(n, 0)
    return seg, before


@triton.jit
def lora_shrink(x, lora_a, v, partial, seg_indptr, seg_slot, num_segments, num_tokens, d_in, r_max, k_chunk, splits,
                BM: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, SEGS: tl.constexpr):
    """v[rows] = x[rows] @ lora_a[slot, :R].T over d_in chunk program_id(1) (fp32 partials when split).
    An expand launched as its programmatic dependent (the stream expands) may start at once: it prefetches
    what the shrink does not write and waits (griddepcontrol.wait: this whole grid done) before reading v."""
    gdc_launch_dependents()
    seg, before = _row_tile(tl.program_id(0), seg_indptr, seg_slot, num_segments, BM, SEGS)
    if seg < num_segments:
        ks = tl.program_id(1)
        slot = tl.load(seg_slot + seg)
        hi = tl.load(seg_indptr + seg + 1)
        rows = tl.load(seg_indptr + seg) + (tl.program_id(0) - before) * BM + tl.arange(0, BM)
        rm = rows < hi
        rr = tl.arange(0, R)
        cm = rr < r_max
        kbeg = ks * k_chunk
        kend = tl.minimum(d_in, kbeg + k_chunk)
        x_rows = x + rows.to(tl.int64)[:, None] * d_in
        a_base = lora_a + slot.to(tl.int64) * r_max * d_in + rr[None, :] * d_in
        acc = tl.zeros((BM, R), tl.float32)
        for k in range(kbeg, kend, BK):
            kk = k + tl.arange(0, BK)
            km = kk < kend
            xt = tl.load(x_rows + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            at = tl.load(a_base + kk[:, None], mask=km[:, None] & cm[None, :], other=0.0)
            acc = tl.dot(xt, at, acc)
        out = rows.to(tl.int64)[:, None] * r_max + rr[None, :]
        om = rm[:, None] & cm[None, :]
        if splits == 1:
            tl.store(v + out, acc.to(v.dtype.element_ty), mask=om)
        else:
            tl.store(partial + ks.to(tl.int64) * num_tokens * r_max + out, acc, mask=om)


@triton.jit
def lora_expand(y, v, partial, lora_b, slot_scale, slot_rank, seg_indptr, seg_slot, num_segments, num_tokens, d_out, r_max, ld_y,
                splits, BM: tl.constexpr, BN: tl.constexpr, R: tl.constexpr, CH: tl.constexpr, SEGS: tl.constexpr):
    """y[rows, chunk] += scale * v[rows] @ lora_b[slot, chunk, :R].T for the CH columns of program_id(1);
    splits == 0: v was written by the shrink; else v is the sum of `splits` fp32 partials (rounded to the
    dtype, as the reference rounds it), as every shrink but the stream and Triton ones leaves it.
    Columns of v past the slot's padded rank may hold anything (a CUTLASS shrink writes only up to it):
    they are zeroed after the load, which keeps the loads 16-byte vectors (lora_b is zero there)."""
    seg, before = _row_tile(tl.program_id(0), seg_indptr, seg_slot, num_segments, BM, SEGS)
    if seg < num_segments:
        slot = tl.load(seg_slot + seg)
        scale = tl.load(slot_scale + slot)  # 0 for a slot of rank 0: y stays as it is
        if scale != 0.0:
            hi = tl.load(seg_indptr + seg + 1)
            rows = tl.load(seg_indptr + seg) + (tl.program_id(0) - before) * BM + tl.arange(0, BM)
            rm = rows < hi
            rr = tl.arange(0, R)
            cm = rr < r_max
            live = (rr < tl.load(slot_rank + slot))[None, :]
            vo = rows.to(tl.int64)[:, None] * r_max + rr[None, :]
            vm = rm[:, None] & cm[None, :]
            if splits == 0:  # the shrink wrote v itself
                vt = tl.where(live, tl.load(v + vo, mask=vm, other=0.0), 0.0)
            else:
                s = tl.zeros((BM, R), tl.float32)
                for k in range(0, splits):
                    s += tl.where(live, tl.load(partial + k.to(tl.int64) * num_tokens * r_max + vo, mask=vm, other=0.0), 0.0)
                vt = s.to(y.dtype.element_ty)
            n_lo = tl.program_id(1) * CH
            b_base = lora_b + slot.to(tl.int64) * d_out * r_max + rr[:, None]
            y_rows = y + rows.to(tl.int64)[:, None] * ld_y
            for i in range(CH // BN):  # a fixed trip count pipelines better than a bound read at run time
                rn = n_lo + i * BN + tl.arange(0, BN)
                nm = rn < d_out
                bt = tl.load(b_base + rn[None, :] * r_max, mask=cm[:, None] & nm[None, :], other=0.0)
                ym = rm[:, None] & nm[None, :]
                yt = tl.load(y_rows + rn[None, :], mask=ym, other=0.0)
                o = tl.dot(vt, bt)
                tl.store(y_rows + rn[None, :], (yt.to(tl.float32) + o * scale).to(y.dtype.element_ty), mask=ym)
