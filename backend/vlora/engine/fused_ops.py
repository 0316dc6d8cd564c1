"""Fused elementwise kernels for the decoder layer: RMSNorm (with the residual add), rotary embedding + KV
cache write, and SiLU * up. They replace the ~30 small eager kernels per layer (LlamaRMSNorm's ~7,
rotate_half's ~10, residual adds, ``index_copy_``) with four launches, and give the *same bits* as the eager
PyTorch/Hugging Face code they replace (RMSNorm: with ``impl="triton"``, see below). The Qwen2-VL vision tower
takes two more (:meth:`vlora.models.qwen_vision.QwenVisionForward.use_ops`): :func:`vision_rotary` (its fp32
rotary, about a dozen fp32 kernels per block in eager) and :func:`quick_gelu` (QuickGELU, three); on an H200 they
took one 448x448 image's tower from 6.8 to 4.8 ms and eight images' from 41.9 to 28.8 ms (floor 15.8).

Every public function has a torch reference (the eager code itself, used on CPU, where triton is missing, or
with ``impl="torch"``) and a Triton kernel (used for CUDA tensors when triton imports, or with
``impl="triton"``). :func:`fused_available` tells which one ``impl="auto"`` picks.

RMSNorm has two kernels. ``impl="triton"`` sums the variance in PyTorch's order (bit-exact, below) at a cost:
its halving tree runs as a chain of layout changes, 5-16 us per call for 8-64 rows of 4,096 on an H200.
``impl="fast"`` holds the row in registers and sums it in Triton's own tree, one read and one write
(1.8-2.8 us for the same rows; 6.7 us against 21 us for 600 rows); it differs from eager only in the
variance's last bits (fp32 within 1e-6 relative; bf16/fp16 outputs within two rounding steps).
``impl="auto"`` takes the fast kernel on CUDA: the engine's graphs and its eager path both call ``auto``, so
they still agree bit for bit with each other.

Bit-exactness: the kernels compute in fp32 and round to the model dtype exactly where eager PyTorch does
(each eager op computes in fp32 "opmath" and rounds its output to bf16/fp16), they never let the compiler
contract a multiply and an add into an FMA (``enable_fp_fusion=False``), they divide with IEEE ``div_rn`` and
take ``exp``/``rsqrt`` from libdevice (the same CUDA math library functions PyTorch's kernels call).

- :func:`rotary_and_cache`, :func:`silu_mul`, :func:`vision_rotary`, :func:`quick_gelu`, and the residual of
  :func:`add_rms_norm`, are elementwise: identical to eager in bf16, fp16 and fp32.
- RMSNorm's variance is an fp32 sum over the hidden dim, and the order of that sum decides its last bits.
  The ``impl="triton"`` kernel reproduces the order of PyTorch's CUDA reduction (``ATen/native/cuda/Reduce.cuh``,
  ``setReduceConfig``: vectorised loads of 4, per-thread accumulators, block_x halving tree, and
  ``mean = sum * (float(T) / numel)``) for the (rows, hidden) it is called with. That layout is computed
  by :func:`torch_reduce_layout` and holds for hidden % 4 == 0 and 128 <= hidden < 131072 (every LLaMA size);
  outside that range the sum order differs from PyTorch's and results may differ in the last bit.
  The replication follows the Reduce.cuh shipped with this torch build (torch/include); a PyTorch that
  changes its reduction schedule would need :func:`torch_reduce_layout` updated (tests/gpu checks it).

All kernels take static shapes only (no host sync, allocation only from shapes), so they capture in CUDA
graphs; offsets are int64; T = 0 returns empty outputs without a launch.

Triton is optional: this module imports where it is not installed and then runs the references.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

try:  # optional dependency: CPU CI has no triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_HALF_TYPES = (torch.float16, torch.bfloat16, torch.float32)

# PyTorch's CUDA reduction constants (Reduce.cuh): mnt_wrapper<float>::MAX_NUM_THREADS, warp size, vector
# width of "vectorize along input", and the thresholds of setReduceConfig.
_RED_MAX_THREADS = 512
_RED_WARP = 32
_RED_VEC = 4
_RED_MIN_VALUES_PER_THREAD = 16
_RED_MAX_VALUES_PER_THREAD = 256


def triton_available() -> bool:
    return triton is not None


def fused_available(t: torch.Tensor) -> bool:
    """True where ``impl="auto"`` runs the Triton kernels for ``t``: triton imports and ``t`` is on CUDA."""
    return triton is not None and t.is_cuda


def _use_triton(impl: str, t: torch.Tensor) -> bool:
    if impl == "auto":
        return fused_available(t)
    if impl in ("triton", "fast"):
        if triton is None:
            raise RuntimeError("fused_ops: impl='triton' but triton is not installed")
        return True
    if impl == "torch":
        return False
    raise ValueError(f"fused_ops: impl must be 'auto', 'torch', 'triton' or 'fast' (RMSNorm), got {impl!r}")


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def torch_reduce_layout(rows: int, hidden: int) -> Optional[Tuple[int, int]]:
    """(threads per row along x, warps splitting the row) that PyTorch's CUDA ``mean(-1)`` uses on a contiguous
    fp32 [rows, hidden] tensor, or None where its schedule is not replicated (hidden % 4, hidden < 128, or a
    reduction split across blocks). Thread ``j = lane + warp * bw`` sums the float4 vectors j, j + P, j + 2P,
    ... (P = bw * warps) into 4 accumulators, combined ((a0 + a1) + a2) + a3; lanes then fold by halves
    (shared memory, then shfl_down with decreasing offsets), then warps fold by halves."""
    if hidden % _RED_VEC or hidden < 128:
        return None
    dim0, dim1 = hidden // _RED_VEC, max(rows, 1)
    d0 = _last_pow2(dim0) if dim0 < _RED_MAX_THREADS else _RED_MAX_THREADS
    d1 = _last_pow2(dim1) if dim1 < _RED_MAX_THREADS else _RED_MAX_THREADS
    bw = min(d0, _RED_WARP)
    bh = min(d1, _RED_MAX_THREADS // bw)
    bw = min(d0, _RED_MAX_THREADS // bh)
    values_per_thread = -(-hidden // bw)  # config.num_inputs is the element count, step_input = bw
    if values_per_thread >= min(bh * 16, _RED_MAX_VALUES_PER_THREAD):
        values_per_thread = -(-hidden // (bw * bh))
        if values_per_thread >= _RED_MAX_VALUES_PER_THREAD:
            return None  # may go to a cross-block (global) reduction that depends on the SM count
        return bw, bh
    return bw, 1


def _mean_factor(rows: int, hidden: int) -> float:
    """MeanOps' factor: ``static_cast<float>(num_outputs) / numel`` in float."""
    return float(np.float32(rows) / np.float32(rows * hidden))


def cuda_order_mean(sq: torch.Tensor) -> torch.Tensor:
    """``sq.mean(-1)`` of an fp32 [T, H] tensor, summed in the order PyTorch's CUDA reduction uses (see
    :func:`torch_reduce_layout`), on any device: an oracle for the kernels' order (tests)."""
    T, H = sq.shape
    layout = torch_reduce_layout(T, H)
    if layout is None:
        raise ValueError(f"cuda_order_mean: no replicated layout for [{T}, {H}]")
    bw, bh = layout
    nt = bw * bh
    n_iter = -(-(H // 4) // nt)
    pad = torch.zeros(T, n_iter * nt * 4, dtype=torch.float32, device=sq.device)
    pad[:, :H] = sq
    v = pad.view(T, n_iter, nt, 4)
    acc = v[:, 0]
    for it in range(1, n_iter):
        acc = acc + v[:, it]
    s = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    s = s.reshape(T, bh, bw)
    while s.shape[2] > 1:
        n = s.shape[2] // 2
        s = s[:, :, :n] + s[:, :, n:]
    s = s[:, :, 0]
    while s.shape[1] > 1:
        n = s.shape[1] // 2
        s = s[:, :n] + s[:, n:]
    return s[:, 0] * torch.tensor(_mean_factor(T, H), dtype=torch.float32, device=sq.device)


# -- torch references (the eager code the kernels replace) ---------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face LlamaRMSNorm.forward."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary_and_cache_reference(q, k, v, cos, sin, k_pool, v_pool, slot_mapping) -> torch.Tensor:
    """HF apply_rotary_pos_emb on [T, heads, D] with cos/sin [T, D], then ``index_copy_`` of k and v."""
    c, s = cos[:, None, :], sin[:, None, :]
    q_rot = (q * c) + (_rotate_half(q) * s)
    k_rot = (k * c) + (_rotate_half(k) * s)
    k_pool.index_copy_(0, slot_mapping, k_rot)
    v_pool.index_copy_(0, slot_mapping, v)
    return q_rot


def silu_mul_reference(gate: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """LlamaMLP's ``act_fn(gate) * up``; with one tensor, gate and up are its two halves.

    The gate is made contiguous first: PyTorch's CPU SiLU takes another vectorized path on a strided half
    than on the contiguous tensor Hugging Face's MLP gives it, and the two may differ in the last bit
    (seen on AVX-512). Contiguous, the result is HF's bit for bit on any CPU."""
    if up is None:
        gate, up = _halves(gate)
    return F.silu(gate.contiguous()) * up


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """transformers' QuickGELUActivation (CLIP's and the Qwen2-VL vision tower's MLP): ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


def _halves(gate_up: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up's last dim must be even, got {tuple(gate_up.shape)}")
    n = gate_up.shape[-1] // 2
    return gate_up[..., :n], gate_up[..., n:]


# -- Triton kernels ------------------------------------------------------------------------------------

if triton is not None:
    if _INTERPRET:  # the interpreter has no libdevice
        @triton.jit
        def _exp(x):
            return tl.exp(x)

        @triton.jit
        def _rsqrt(x):
            return tl.rsqrt(x)
    else:
        from triton.language.extra.cuda import libdevice as _libdevice

        @triton.jit
        def _exp(x):
            return _libdevice.exp(x)  # __nv_expf: CUDA's expf, as in PyTorch's silu

        @triton.jit
        def _rsqrt(x):
            return _libdevice.rsqrt(x)  # __nv_rsqrtf: CUDA's rsqrtf, as in torch.rsqrt

    @triton.jit
    def _rms_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, H, stride_x, stride_r, stride_o, stride_res,
                    eps, factor, HAS_RES: tl.constexpr, BW: tl.constexpr, BH: tl.constexpr,
                    LOG_BW: tl.constexpr, LOG_BH: tl.constexpr, N_ITER: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        NT: tl.constexpr = BW * BH
        DT = res_ptr.dtype.element_ty  # the input dtype (res_ptr is x_ptr itself without a residual)
        j = tl.arange(0, NT)
        lane = tl.arange(0, 4)
        acc = tl.zeros([NT, 4], dtype=tl.float32)
        x_row = x_ptr + row * stride_x
        r_row = r_ptr + row * stride_r
        res_row = res_ptr + row * stride_res
        # pass 1: torch's per-thread accumulation order (thread j: float4 vectors j, j + NT, ...). Unrolled:
        # the loads do not depend on the sum, so they issue together instead of one latency per tile
        # (the rolled loop took ~14 us per [32, 4096] call on the H100).
        for it in tl.static_range(N_ITER):
            offs = (it * NT + j).to(tl.int64)[:, None] * 4 + lane[None, :]
            m = offs < H
            xv = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                rv = tl.load(r_row + offs, mask=m, other=0.0).to(tl.float32)
                hv = (xv + rv).to(DT)
                tl.store(res_row + offs, hv, mask=m)
                xv = hv.to(tl.float32)
            acc = acc + xv * xv
        a0 = tl.sum(tl.where(lane[None, :] == 0, acc, 0.0), axis=1)
        a1 = tl.sum(tl.where(lane[None, :] == 1, acc, 0.0), axis=1)
        a2 = tl.sum(tl.where(lane[None, :] == 2, acc, 0.0), axis=1)
        a3 = tl.sum(tl.where(lane[None, :] == 3, acc, 0.0), axis=1)
        v = ((a0 + a1) + a2) + a3
        # lanes fold by halves (block_x_reduce), then warps (block_y_reduce); each step is one add
        v = tl.reshape(v, [BH, BW])
        for s in tl.static_range(LOG_BW):
            v = tl.sum(tl.reshape(v, [BH, 2, BW >> (s + 1)]), axis=1)
        v = tl.reshape(v, [BH])
        for s in tl.static_range(LOG_BH):
            v = tl.sum(tl.reshape(v, [2, BH >> (s + 1)]), axis=0)
        total = tl.sum(v, axis=0)
        rstd = _rsqrt(total * factor + eps)
        if HAS_RES:
            tl.debug_barrier()  # pass 2 reads the residual this program just wrote (possibly in place)
        # pass 2: weight * (x * rstd).to(dtype)
        cols = tl.arange(0, BLOCK)
        o_row = out_ptr + row * stride_o
        for start in range(0, H, BLOCK):  # names of its own: pass 1's unrolled names must not be loop-carried here
            c2 = start + cols
            m2 = c2 < H
            x2 = tl.load(res_row + c2, mask=m2, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + c2, mask=m2, other=0.0).to(tl.float32)
            y2 = (x2 * rstd).to(DT).to(tl.float32) * w2
            tl.store(o_row + c2, y2.to(out_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _rms_fast_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, H, stride_x, stride_r, stride_o, stride_res,
                         eps, factor, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        """One row per program, held in registers: one read of x (and r), one write of each output. The
        sum of squares is Triton's tree, not PyTorch's order (``impl="fast"``)."""
        row = tl.program_id(0).to(tl.int64)
        DT = res_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK)
        m = cols < H
        xv = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            rv = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
            hv = (xv + rv).to(DT)
            tl.store(res_ptr + row * stride_res + cols, hv, mask=m)
            xv = hv.to(tl.float32)
        rstd = _rsqrt(tl.sum(xv * xv, axis=0) * factor + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = (xv * rstd).to(DT).to(tl.float32) * w
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_pair(x1, x2, c1, s1, c2, s2, DT: tl.constexpr):
        """(x * cos) + (rotate_half(x) * sin) with eager's three roundings, for both halves."""
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        o1 = ((x1 * c1).to(DT).to(tl.float32) + ((-x2) * s1).to(DT).to(tl.float32)).to(DT)
        o2 = ((x2 * c2).to(DT).to(tl.float32) + (x1 * s2).to(DT).to(tl.float32)).to(DT)
        return o1, o2

    @triton.jit
    def _rotary_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kp_ptr, vp_ptr, slot_ptr, qo_ptr,
                             sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_t, ss_t, skp_r, skp_h, svp_r, svp_h,
                             sqo_t, sqo_h, HQ, HKV, HALF, BH: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h0 = tl.program_id(1) * BH
        DT = qo_ptr.dtype.element_ty
        d = tl.arange(0, BD)
        dm = d < HALF
        c1 = tl.load(cos_ptr + t * sc_t + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * sc_t + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * ss_t + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * ss_t + HALF + d, mask=dm, other=0.0).to(tl.float32)
        c1, c2, s1, s2 = c1[None, :], c2[None, :], s1[None, :], s2[None, :]
        h = h0 + tl.arange(0, BH)
        hl = h.to(tl.int64)[:, None]
        dd = d[None, :]
        # queries
        m = (h < HQ)[:, None] & dm[None, :]
        src = q_ptr + t * sq_t + hl * sq_h + dd
        o1, o2 = _rope_pair(tl.load(src, mask=m, other=0.0), tl.load(src + HALF, mask=m, other=0.0),
                            c1, s1, c2, s2, DT)
        dst = qo_ptr + t * sqo_t + hl * sqo_h + dd
        tl.store(dst, o1, mask=m)
        tl.store(dst + HALF, o2, mask=m)
        if h0 < HKV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            m = (h < HKV)[:, None] & dm[None, :] & ((hl * 0 + slot) >= 0)  # a negative slot (padding) writes nothing
            src = k_ptr + t * sk_t + hl * sk_h + dd
            o1, o2 = _rope_pair(tl.load(src, mask=m, other=0.0), tl.load(src + HALF, mask=m, other=0.0),
                                c1, s1, c2, s2, DT)
            dst = kp_ptr + slot * skp_r + hl * skp_h + dd
            tl.store(dst, o1.to(kp_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF, o2.to(kp_ptr.dtype.element_ty), mask=m)
            src = v_ptr + t * sv_t + hl * sv_h + dd
            dst = vp_ptr + slot * svp_r + hl * svp_h + dd
            tl.store(dst, tl.load(src, mask=m).to(vp_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF, tl.load(src + HALF, mask=m).to(vp_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, N, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < N
        DT = o_ptr.dtype.element_ty
        g = tl.load(g_ptr + t * stride_g + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + t * stride_u + c, mask=m, other=0.0).to(tl.float32)
        s = tl.div_rn(g, 1.0 + _exp(-g)).to(DT).to(tl.float32)  # F.silu: x / (1 + expf(-x)), rounded
        tl.store(o_ptr + t * stride_o + c, (s * u).to(DT), mask=m)

    @triton.jit
    def _rotate_fp32(src, dst, m, c1, s1, c2, s2, HALF, DT: tl.constexpr):
        """dst = (x * cos) + (rotate_half(x) * sin) in fp32, rounded to DT once (the vision tower's rotary)."""
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(dst, (x1 * c1 + (-x2) * s1).to(DT), mask=m)
        tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(DT), mask=m)

    @triton.jit
    def _vision_rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, sq_t, sq_h, sk_t, sk_h, sc_t, ss_t,
                              so_t, so_h, H, HALF, BH: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        DT = qo_ptr.dtype.element_ty
        d = tl.arange(0, BD)
        dm = d < HALF
        c1 = tl.load(cos_ptr + t * sc_t + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + t * sc_t + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + t * ss_t + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + t * ss_t + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        hl = h.to(tl.int64)[:, None]
        dd = d[None, :]
        m = (h < H)[:, None] & dm[None, :]
        out = t * so_t + hl * so_h + dd
        _rotate_fp32(q_ptr + t * sq_t + hl * sq_h + dd, qo_ptr + out, m, c1, s1, c2, s2, HALF, DT)
        _rotate_fp32(k_ptr + t * sk_t + hl * sk_h + dd, ko_ptr + out, m, c1, s1, c2, s2, HALF, DT)

    @triton.jit
    def _quick_gelu_kernel(x_ptr, o_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < N
        DT = o_ptr.dtype.element_ty
        x = tl.load(x_ptr + t * stride_x + c, mask=m, other=0.0).to(tl.float32)
        a = (x * 1.702).to(DT).to(tl.float32)  # 1.702 * x, rounded as eager's mul by a scalar
        s = tl.div_rn(1.0, 1.0 + _exp(-a)).to(DT).to(tl.float32)  # torch.sigmoid: 1 / (1 + expf(-a)), rounded
        tl.store(o_ptr + t * stride_o + c, (x * s).to(DT), mask=m)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as [T, H] with a unit last stride (a view where possible)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _check_float(name: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype not in _HALF_TYPES:
            raise TypeError(f"{name}: expected float16/bfloat16/float32 tensors, got {t.dtype}")


# -- public API ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _rms_params(T: int, H: int) -> tuple[int, tuple, dict]:
    """The launch of :func:`_rms_kernel` for [T, H] rows, which depends on (T, H) only: (grid, the mean's
    factor, the constexprs and options). Cached: every layer of a step makes the same call."""
    layout = torch_reduce_layout(T, H)
    bw, bh = layout if layout is not None else (min(32, _pow2(max(H // 4, 1))), 1)
    nt = bw * bh
    n_vec = -(-H // 4)
    n_iter = -(-n_vec // nt)
    block = min(_pow2(H), 4096)
    kw = dict(BW=bw, BH=bh, LOG_BW=bw.bit_length() - 1, LOG_BH=bh.bit_length() - 1, N_ITER=n_iter, BLOCK=block,
              num_warps=4 if H <= 4096 else 8, enable_fp_fusion=False)
    return (T,), _mean_factor(T, H), kw


_promote = functools.lru_cache(maxsize=64)(torch.promote_types)


@functools.lru_cache(maxsize=256)
def _rotary_params(HQ: int, D: int) -> tuple[int, int, int, int]:
    """(half, BD, BH, programs along heads) of :func:`_rotary_cache_kernel` for Hq heads of width D."""
    half = D // 2
    bd = _pow2(half)
    bh = max(1, min(_pow2(HQ), 2048 // bd))
    return half, bd, bh, -(-HQ // bh)


@functools.lru_cache(maxsize=256)
def _silu_params(N: int) -> tuple[int, int]:
    """(BLOCK, programs along the row) of :func:`_silu_mul_kernel` for rows of N."""
    block = min(_pow2(N), 2048)
    return block, -(-N // block)


# The one-pass RMSNorm holds a row in registers up to this width.
RMS_FAST_MAX_H = 16384


@functools.lru_cache(maxsize=1024)
def _rms_fast_params(T: int, H: int) -> tuple[float, dict]:
    """The mean's factor and the constexprs and options of :func:`_rms_fast_kernel` for [T, H] rows. Cached
    like :func:`_rms_params`: every layer of a step makes the same call."""
    block = _pow2(H)
    return _mean_factor(T, H), dict(BLOCK=block, num_warps=max(1, min(16, block // 512)))


def _rms_launch(x2, r2, weight, eps, out2, res2, fast: bool = False) -> None:
    T, H = x2.shape
    if fast and H <= RMS_FAST_MAX_H:
        factor, kw = _rms_fast_params(T, H)
        if r2 is None:
            _rms_fast_kernel[(T,)](x2, x2, weight, out2, x2, H, x2.stride(0), x2.stride(0), out2.stride(0),
                                   x2.stride(0), float(eps), factor, HAS_RES=False, **kw)
        else:
            _rms_fast_kernel[(T,)](x2, r2, weight, out2, res2, H, x2.stride(0), r2.stride(0), out2.stride(0),
                                   res2.stride(0), float(eps), factor, HAS_RES=True, **kw)
        return
    grid, factor, kw = _rms_params(T, H)
    if r2 is None:
        _rms_kernel[grid](x2, x2, weight, out2, x2, H, x2.stride(0), x2.stride(0), out2.stride(0), x2.stride(0),
                          float(eps), factor, HAS_RES=False, **kw)
    else:
        _rms_kernel[grid](x2, r2, weight, out2, res2, H, x2.stride(0), r2.stride(0), out2.stride(0), res2.stride(0),
                          float(eps), factor, HAS_RES=True, **kw)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: Optional[torch.Tensor] = None,
             impl: str = "auto") -> torch.Tensor:
    """Hugging Face LlamaRMSNorm: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.
    ``impl``: "auto" (CUDA: the one-pass kernel), "fast", "triton" (PyTorch's summation order) or "torch".

    x: [..., H] (rows may be strided, last dim contiguous); weight: [H]. Returns [..., H] in
    ``promote_types(weight.dtype, x.dtype)`` (``out`` if given)."""
    if not _use_triton(impl, x):
        y = rms_norm_reference(x, weight, eps)
        if out is not None:
            out.copy_(y)
            return out
        return y
    _check_float("rms_norm", x, weight)
    shape = x.shape
    x2 = _rows(x, "x")
    out_dtype = _promote(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=x.device)
    out2 = out if out.dim() == 2 else out.view(-1, shape[-1])
    if x2.shape[0] == 0:
        return out
    _rms_launch(x2, None, weight.contiguous(), eps, out2, None, fast=impl != "triton")
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None,
                 impl: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (rounded to the dtype, like the eager add) and ``rms_norm(h)``, in one kernel:
    ``normed, h = add_rms_norm(attn_out, h, w, eps)``. Returns (normed, h); ``residual_out`` may be
    ``residual`` itself (in place) or ``x``."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm: x {x.dtype} {tuple(x.shape)} and residual {residual.dtype} "
                         f"{tuple(residual.shape)} must match")
    if not _use_triton(impl, x):
        normed, h = add_rms_norm_reference(x, residual, weight, eps)
        if residual_out is not None:
            residual_out.copy_(h)
            h = residual_out
        if out is not None:
            out.copy_(normed)
            normed = out
        return normed, h
    _check_float("add_rms_norm", x, weight)
    shape = x.shape
    x2, r2 = _rows(x, "x"), _rows(residual, "residual")
    if residual_out is None:
        residual_out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(shape, dtype=_promote(weight.dtype, x.dtype), device=x.device)
    res2 = residual_out if residual_out.dim() == 2 else residual_out.view(-1, shape[-1])
    out2 = out if out.dim() == 2 else out.view(-1, shape[-1])
    if res2.stride(-1) != 1 or out2.stride(-1) != 1:
        raise ValueError("add_rms_norm: out and residual_out need a contiguous last dim")
    if x2.shape[0] == 0:
        return out, residual_out
    _rms_launch(x2, r2, weight.contiguous(), eps, out2, res2, fast=impl != "triton")
    return out, residual_out


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor, *,
                     out: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
    """LLaMA rotary embedding on q [T, Hq, D] and k [T, Hkv, D] (cos/sin [T, D] in the model dtype), rotated k
    and unrotated v written to ``k_pool``/``v_pool`` [rows, Hkv, D] at rows ``slot_mapping`` [T] (int64), as
    ``index_copy_(0, slot_mapping, ...)``. Returns rotated q [T, Hq, D] (``out`` if given).

    q/k/v may be strided views (e.g. heads of one fused qkv output); only their last dim must be contiguous.
    One launch, grid (T, Hq / heads-per-program). The Triton kernel skips rows whose slot is negative; the
    reference (``index_copy_``) requires valid slots."""
    if not _use_triton(impl, q):
        q_rot = rotary_and_cache_reference(q, k, v, cos, sin, k_pool, v_pool, slot_mapping)
        if out is not None:
            out.copy_(q_rot)
            return out
        return q_rot
    _check_float("rotary_and_cache", q, k, v, cos, sin)
    T, HQ, D = q.shape
    HKV = k.shape[1]
    if k.shape != (T, HKV, D) or v.shape != (T, HKV, D) or cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"rotary_and_cache: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"cos {tuple(cos.shape)} sin {tuple(sin.shape)}")
    if D % 2 or k_pool.shape[1:] != (HKV, D) or v_pool.shape[1:] != (HKV, D):
        raise ValueError(f"rotary_and_cache: head_dim {D}, pools {tuple(k_pool.shape)} {tuple(v_pool.shape)}")
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        raise TypeError(f"rotary_and_cache: q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype} must match")
    if slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rotary_and_cache: slot_mapping must be int64 [{T}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    q, k, v, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cos, sin))
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("rotary_and_cache: pools need a contiguous last dim")
    if out is None:
        out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    half, bd, bh, n_prog = _rotary_params(HQ, D)
    _rotary_cache_kernel[(T, n_prog)](q, k, v, cos, sin, k_pool, v_pool, slot_mapping, out,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               cos.stride(0), sin.stride(0), k_pool.stride(0), k_pool.stride(1),
                               v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
                               HQ, HKV, half, BH=bh, BD=bd, num_warps=4, enable_fp_fusion=False)
    return out


def silu_mul(gate: torch.Tensor, up: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
             impl: str = "auto") -> torch.Tensor:
    """``F.silu(gate) * up`` with eager's roundings (silu rounded to the dtype, then the product).

    ``silu_mul(gate_up)`` with gate_up [..., 2I] takes gate = first half, up = second half (a fused
    gate/up projection); ``silu_mul(gate, up)`` takes two [..., I] tensors. Returns [..., I]."""
    if up is None:
        gate, up = _halves(gate)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)}")
    if not _use_triton(impl, gate):
        y = silu_mul_reference(gate, up)
        if out is not None:
            out.copy_(y)
            return out
        return y
    _check_float("silu_mul", gate)
    shape = gate.shape
    g2, u2 = _rows(gate, "gate"), _rows(up, "up")
    if out is None:
        out = torch.empty(shape, dtype=gate.dtype, device=gate.device)
    o2 = out if out.dim() == 2 else out.view(-1, shape[-1])
    T, N = g2.shape
    if T == 0 or N == 0:
        return out
    block, n_prog = _silu_params(N)
    _silu_mul_kernel[(T, n_prog)](g2, u2, o2, N, g2.stride(0), u2.stride(0), o2.stride(0),
                                                BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out


def vision_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  impl: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """The Qwen2-VL / Qwen2.5-VL vision tower's rotary (transformers' ``apply_rotary_pos_emb_vision``): q and k
    [N, H, D] (strided views of one qkv output welcome; the last dim contiguous) rotated in fp32 by cos, sin
    [N, D] (fp32) and rounded back to their dtype once. One launch for both, where eager takes about a dozen
    fp32 kernels per block; the same bits as the reference, :func:`vlora.models.qwen_vision.rotary`. Returns
    new contiguous (q, k)."""
    if not _use_triton(impl, q):
        from vlora.models.qwen_vision import rotary

        return rotary(q, k, cos, sin)
    _check_float("vision_rotary", q, k, cos, sin)
    N, H, D = q.shape
    if k.shape != q.shape or k.dtype != q.dtype or cos.shape != (N, D) or sin.shape != (N, D) or D % 2:
        raise ValueError(f"vision_rotary: shapes q {tuple(q.shape)} {q.dtype} k {tuple(k.shape)} {k.dtype} "
                         f"cos {tuple(cos.shape)} sin {tuple(sin.shape)}")
    q, k, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin))
    qo = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty_like(qo)
    if N == 0:
        return qo, ko
    half, bd, bh, n_prog = _rotary_params(H, D)
    _vision_rotary_kernel[(N, n_prog)](q, k, cos, sin, qo, ko, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                       cos.stride(0), sin.stride(0), qo.stride(0), qo.stride(1), H, half,
                                       BH=bh, BD=bd, num_warps=4, enable_fp_fusion=False)
    return qo, ko


def quick_gelu(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (transformers' QuickGELUActivation) in one kernel, with eager's three roundings
    (the scaled input, the sigmoid, the product); eager takes three kernels and their round trips."""
    if not _use_triton(impl, x):
        return quick_gelu_reference(x)
    _check_float("quick_gelu", x)
    x2 = _rows(x, "x")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, x.shape[-1]) if x.dim() else out
    T, N = x2.shape
    if T == 0 or N == 0:
        return out
    block, n_prog = _silu_params(N)
    _quick_gelu_kernel[(T, n_prog)](x2, o2, N, x2.stride(0), o2.stride(0), BLOCK=block, num_warps=4,
                                    enable_fp_fusion=False)
    return out
