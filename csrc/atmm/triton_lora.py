"""ATMM kernels written in the Triton language, compiled ahead of time into the extension.

`triton_aot.py` compiles every ATMM_TRITON_SHRINK / _EXPAND / _EXPAND_COLS line of tile_configs.def into a
cubin at build time; `triton.cu` loads the cubins and launches them like the hand-written kinds (same
FusedArgs contract: v in the activation dtype when d_in is not split, fp32 partials otherwise; the Triton
shrink leaves one fp32 partial when split: its d_in chunks add into it with atomics, and the expands read it
as `splits` == 1). Nothing here runs through Triton's Python launcher, and serving needs no Triton at run time.

Why these exist (csrc/atmm/NOTES.md, 2026-11-25): on the H100, Triton's wgmma code for a plain
row-tile shrink and a column-chunk expand moved x and y ~15-20% faster at T >= 4096 than any CUTLASS or
hand-written (mma.sync) kernel here.

Row tiles are numbered segment by segment (segments with slot -1 or no tokens have none); in the shrink
and the row-tile expand each program finds its segment by scanning seg_indptr in chunks of SEGS, so any
number of segments works. Their grid's first dimension is the upper bound T // BM + num_segments; programs
past the last tile return at once. The column-stationary expand (lora_expand_cols) shares the segments' work
items (runs of rows) out among its programs instead, scanning the same way.
Every integer argument is a multiple of 8 (the extension checks widths, r_max and strides), which the
compiler is told, so masked loads stay 16-byte vectors.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _row_tile(pid, seg_indptr, seg_slot, num_segments, BM, SEGS: tl.constexpr):
    """The segment of row tile `pid` (tiles of BM rows from each segment's first row; the expand_cols' work items
    with BM its run-time item size) and the tiles before that segment; seg == num_segments: no tile."""
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
def _clamped(rows, hi):
    """A tile's rows for loading: those past the segment's end (hi) read its last row instead, so the loads need no
    row mask (only the stores do). The loads of the last, partial tile of a segment stay inside it, and every other
    load is unmasked (csrc/atmm/NOTES.md, bisecting the extension's kernels: row masks on the loads cost time)."""
    return tl.minimum(rows, hi - 1)


@triton.jit
def _update_y(y, rows_c, rm, rn, nm, ld_y, vt, bt, scale):
    """y[rows, rn] += scale * vt @ bt, in place: rows_c are the tile's rows clamped to the segment (_clamped), rm
    marks the real ones, which alone are stored; columns past d_out masked."""
    yp = y + rows_c.to(tl.int64)[:, None] * ld_y + rn[None, :]
    yt = tl.load(yp, mask=nm[None, :], other=0.0)
    o = tl.dot(vt, bt)
    tl.store(yp, (yt.to(tl.float32) + o * scale).to(y.dtype.element_ty), mask=rm[:, None] & nm[None, :])


@triton.jit
def _live_columns(rr, slot_rank, slot):
    """The columns of v within the slot's padded rank. That rank is a multiple of 8 (the extension pads ranks to 8),
    which the compiler is told: a load masked with this stays 16-byte vectors, so v's columns past the rank are
    zeroed by the load's mask itself (a tl.where after an unmasked load cost the column-stationary expand 1-2 us at
    T = 1024-8192: csrc/atmm/NOTES.md, bisecting the extension's kernels)."""
    return rr < tl.multiple_of(tl.load(slot_rank + slot), 8)


@triton.jit
def _partials_sum(partial, vo, vm, splits, num_tokens, r_max, BM: tl.constexpr, R: tl.constexpr):
    """v of the rows at offsets vo: the sum of `splits` fp32 partials, masked (vm) to the live columns."""
    acc = tl.zeros((BM, R), tl.float32)
    stride = num_tokens.to(tl.int64) * r_max  # one partial's elements, in int64 (the loop index is a plain int in the interpreter)
    for k in range(0, splits):
        acc += tl.load(partial + k * stride + vo, mask=vm, other=0.0)
    return acc


@triton.jit
def lora_shrink(x, lora_a, v, partial, seg_indptr, seg_slot, num_segments, num_tokens, d_in, r_max, k_chunk, splits,
                BM: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, SEGS: tl.constexpr, EVEN: tl.constexpr = False):
    """v[rows] = x[rows] @ lora_a[slot, :R].T over d_in chunk program_id(1). Split (splits > 1), every chunk adds
    its product into partial[0] (fp32, zeroed by the kernel this one runs after: atmm.cu), so no program sums
    the others' (2d9be1d's serial tail) and the expand reads one partial. With 3 or more chunks the order of
    the adds varies between runs: v may differ in the last fp32 bit before it is rounded to the dtype.
    An expand launched as its programmatic dependent may start at once: it prefetches what the shrink does
    not write and waits (griddepcontrol.wait: this whole grid done) before reading v. The shrink itself may
    run as the dependent of the slot-scale kernel (triton.cu): it finds its tile while that kernel runs."""
    seg, before = _row_tile(tl.program_id(0), seg_indptr, seg_slot, num_segments, BM, SEGS)
    # Launched as the slot-scale kernel's programmatic dependent, wait for that grid (a no-op otherwise),
    # then let the expand start: it reads the slot scales before its own wait, which covers this grid only.
    # A program with no tile lets it start by exiting; the expand has nothing to do for those rows.
    gdc_wait()
    gdc_launch_dependents()
    if seg < num_segments:
        ks = tl.program_id(1)
        slot = tl.load(seg_slot + seg)
        hi = tl.load(seg_indptr + seg + 1)
        rows = tl.load(seg_indptr + seg) + (tl.program_id(0) - before) * BM + tl.arange(0, BM)
        rm = rows < hi
        rr = tl.arange(0, R)
        cm = tl.full((R,), 1, tl.int1) if EVEN else rr < r_max  # EVEN: chunks of whole BK tiles and r_max == R
        kbeg = ks * k_chunk
        kend = tl.minimum(d_in, kbeg + k_chunk)
        x_rows = x + _clamped(rows, hi).to(tl.int64)[:, None] * d_in
        a_base = lora_a + slot.to(tl.int64) * r_max * d_in + rr[None, :] * d_in
        acc = tl.zeros((BM, R), tl.float32)
        for k in range(kbeg, kend, BK):
            kk = k + tl.arange(0, BK)
            km = tl.full((BK,), 1, tl.int1) if EVEN else kk < kend
            xt = tl.load(x_rows + kk[None, :], mask=km[None, :], other=0.0)
            at = tl.load(a_base + kk[:, None], mask=km[:, None] & cm[None, :], other=0.0)
            acc = tl.dot(xt, at, acc)
        out = rows.to(tl.int64)[:, None] * r_max + rr[None, :]
        om = rm[:, None] & cm[None, :]
        if splits == 1:
            tl.store(v + out, acc.to(v.dtype.element_ty), mask=om)
        else:
            tl.atomic_add(partial + out, acc, mask=om, sem="relaxed")


@triton.jit
def lora_expand(y, v, partial, lora_b, slot_scale, slot_rank, seg_indptr, seg_slot, num_segments, num_tokens, d_out, r_max, ld_y,
                splits, BM: tl.constexpr, BN: tl.constexpr, R: tl.constexpr, CH: tl.constexpr, SEGS: tl.constexpr,
                EVEN: tl.constexpr = False):
    """y[rows, chunk] += scale * v[rows] @ lora_b[slot, chunk, :R].T for the CH columns of program_id(1);
    splits == 0: v was written by the shrink; else v is the sum of `splits` fp32 partials (rounded to the
    dtype, as the reference rounds it), as a split shrink leaves it (one, already summed, from a Triton shrink).
    Columns of v past the slot's padded rank may hold anything (a CUTLASS or stream shrink writes only up to it):
    the loads of v mask them out (_live_columns).
    Launched as the shrink's programmatic dependent (PDL), it finds its tile before waiting for the shrink."""
    seg, before = _row_tile(tl.program_id(0), seg_indptr, seg_slot, num_segments, BM, SEGS)
    if seg < num_segments:
        slot = tl.load(seg_slot + seg)
        scale = tl.load(slot_scale + slot)  # 0 for a slot of rank 0: y stays as it is
        if scale != 0.0:
            hi = tl.load(seg_indptr + seg + 1)
            rows = tl.load(seg_indptr + seg) + (tl.program_id(0) - before) * BM + tl.arange(0, BM)
            rm = rows < hi
            rows_c = _clamped(rows, hi)
            rr = tl.arange(0, R)
            cm = tl.full((R,), 1, tl.int1) if EVEN else rr < r_max
            vo = rows_c.to(tl.int64)[:, None] * r_max + rr[None, :]
            vm = (cm & _live_columns(rr, slot_rank, slot))[None, :]
            gdc_wait()  # launched as the shrink's programmatic dependent: v is complete from here on
            if splits == 0:  # the shrink wrote v itself
                vt = tl.load(v + vo, mask=vm, other=0.0)
            else:
                vt = _partials_sum(partial, vo, vm, splits, num_tokens, r_max, BM, R).to(y.dtype.element_ty)
            n_lo = tl.program_id(1) * CH
            b_base = lora_b + slot.to(tl.int64) * d_out * r_max + rr[:, None]
            for i in range(CH // BN):  # a fixed trip count pipelines better than a bound read at run time
                rn = n_lo + i * BN + tl.arange(0, BN)
                nm = tl.full((BN,), 1, tl.int1) if EVEN else rn < d_out
                bt = tl.load(b_base + rn[None, :] * r_max, mask=cm[:, None] & nm[None, :], other=0.0)
                _update_y(y, rows_c, rm, rn, nm, ld_y, vt, bt, scale)


@triton.jit
def _cols_tiles(src, y, lo, hi, t0, t1, rr, vcm, rn, nm, r_max, ld_y, bt, scale, BM: tl.constexpr, NS: tl.constexpr):
    """y of the segment's row tiles t0..t1 (rows from lo, up to hi) += scale * v @ bt, v read from src (v itself,
    or one fp32 partial rounded to the dtype) in its columns vcm, pipelined with tl.range(num_stages=NS): y of the
    next tiles in flight."""
    for t in tl.range(t0, t1, num_stages=NS):
        rows = lo + t * BM + tl.arange(0, BM)
        rows_c = _clamped(rows, hi)
        vt = tl.load(src + rows_c.to(tl.int64)[:, None] * r_max + rr[None, :], mask=vcm[None, :], other=0.0)
        _update_y(y, rows_c, rows < hi, rn, nm, ld_y, vt.to(y.dtype.element_ty), bt, scale)


@triton.jit
def _cols_item(y, v, partial, lora_b, slot_scale, slot_rank, slot, lo, hi, t0, t1, rn, nm, rr, cm, num_tokens, d_out,
               r_max, ld_y, splits, BM: tl.constexpr, R: tl.constexpr, NS: tl.constexpr, PDL: tl.constexpr):
    """y of one segment's row tiles t0..t1 (tiles of BM rows from its first row lo, up to hi) += its slot's scale *
    v @ B[slot] for this program's columns rn."""
    scale = tl.load(slot_scale + slot)
    if scale != 0.0:  # scale 0: a slot of rank 0, its rows stay as they are
        vcm = cm & _live_columns(rr, slot_rank, slot)  # v's columns within r_max and the slot's rank
        bt = tl.load(lora_b + slot.to(tl.int64) * d_out * r_max + rr[:, None] + rn[None, :] * r_max,
                     mask=cm[:, None] & nm[None, :], other=0.0)
        if PDL:
            gdc_wait()  # launched as the shrink's programmatic dependent: v is complete from here on
        if splits == 0:  # v written by the shrink: the pipelined loop
            _cols_tiles(v, y, lo, hi, t0, t1, rr, vcm, rn, nm, r_max, ld_y, bt, scale, BM, NS)
        elif splits == 1:  # one fp32 partial (a split Triton shrink adds into it): the same loop, rounding v
            _cols_tiles(partial, y, lo, hi, t0, t1, rr, vcm, rn, nm, r_max, ld_y, bt, scale, BM, NS)
        else:  # v is the sum of `splits` fp32 partials, rounded to the dtype as the reference rounds it
            for t in range(t0, t1):
                rows = lo + t * BM + tl.arange(0, BM)
                rows_c = _clamped(rows, hi)
                vo = rows_c.to(tl.int64)[:, None] * r_max + rr[None, :]
                acc = _partials_sum(partial, vo, vcm[None, :], splits, num_tokens, r_max, BM, R)
                _update_y(y, rows_c, rows < hi, rn, nm, ld_y, acc.to(y.dtype.element_ty), bt, scale)


@triton.jit
def lora_expand_cols(y, v, partial, lora_b, slot_scale, slot_rank, seg_indptr, seg_slot, num_segments, num_tokens, d_out,
                     r_max, ld_y, splits, BM: tl.constexpr, BN: tl.constexpr, R: tl.constexpr, NS: tl.constexpr,
                     SEGS: tl.constexpr, EVEN: tl.constexpr = False, PDL: tl.constexpr = True):
    """The expand of lora_expand, column-stationary: program (j, g) owns columns [j*BN, (j+1)*BN) and the g-th of G
    equal shares (G = programs along axis 1, set by the launcher to fill the GPU about once) of the work items.
    The items are numbered segment by segment: a segment's rows cut into runs of `size` rows from its first row
    (size = T spread over the G programs, in whole row tiles of BM; a segment of n rows has ceil(n / size) items,
    one with no slot none), so one prompt of all T rows gives each program one run, as a column-stationary kernel
    wants, while a step's short segments (its decode rows, one each) are spread over the programs, not walked
    one after another by the program whose rows they are (csrc/atmm/NOTES.md, a prefill graph's expand on mixed
    steps: 30 of them took a call from 17-27 to 124-173 us). Within an item the slot's lora_b tile is loaded once
    and the loop over its row tiles is pipelined with tl.range(num_stages=NS), which (unlike the kernel's
    num_stages) also keeps y of the next tiles in flight.

    Why (csrc/atmm/NOTES.md, 2026-11-25, column-stationary expand): Triton pipelines only the loads that feed a dot
    unless the loop carries its own num_stages, so the row-tile expand never had y loads in flight ahead of use.
    Launched as the shrink's programmatic dependent (PDL), it finds its items and loads its first lora_b tile
    before waiting for the shrink (PDL False: no wait, for Triton's interpreter)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rr = tl.arange(0, R)
    nm = tl.full((BN,), 1, tl.int1) if EVEN else rn < d_out  # EVEN: whole tiles of BN and r_max == R
    cm = tl.full((R,), 1, tl.int1) if EVEN else rr < r_max
    g = tl.num_programs(1)
    size = (num_tokens + g * BM - 1) // (g * BM) * BM  # rows of an item: whole row tiles
    # every item: those before a pid past them all (a segment of n rows has at most n // size + 1 items)
    _, total = _row_tile(num_tokens + num_segments, seg_indptr, seg_slot, num_segments, size, SEGS)
    per = (total + g - 1) // g
    it = tl.program_id(1) * per  # this program's items: [it, end)
    end = tl.minimum(it + per, total)
    seg, before = _row_tile(it, seg_indptr, seg_slot, num_segments, size, SEGS)
    while (it < end) & (seg < num_segments):
        lo = tl.load(seg_indptr + seg)
        hi = tl.load(seg_indptr + seg + 1)
        slot = tl.load(seg_slot + seg)
        n = tl.where(slot >= 0, (hi - lo + size - 1) // size, 0)
        last = tl.minimum(end - before, n)  # this segment's items that are this program's: [it - before, last)
        k = it - before
        if k < last:
            t0 = k * (size // BM)  # row tiles of BM rows from lo; an item is size // BM of them
            t1 = tl.minimum(last * (size // BM), (hi - lo + BM - 1) // BM)
            _cols_item(y, v, partial, lora_b, slot_scale, slot_rank, slot, lo, hi, t0, t1, rn, nm, rr, cm, num_tokens,
                       d_out, r_max, ld_y, splits, BM, R, NS, PDL)
            it = before + last
        before += n
        seg += 1
