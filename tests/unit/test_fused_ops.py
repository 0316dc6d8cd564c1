"""vlora.engine.fused_ops on CPU: the torch references against Hugging Face's own modules (LlamaRMSNorm,
apply_rotary_pos_emb, LlamaMLP's activation) and ``index_copy_``, bit-exact in fp32 and bf16; the replica of
PyTorch's CUDA reduction order; and, when triton is importable and TRITON_INTERPRET=1 (for example
``TRITON_INTERPRET=1 PYTHONPATH=/path/to/triton pytest ...``), the Triton kernels under the interpreter
against the references. The interpreter computes in numpy: fp32 and fp16 behave like the GPU, but its casts
to bf16 do not round to nearest, so bf16 is only checked to within one bf16 step there (the GPU tests check
bf16 bit-exactly)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from vlora.engine import fused_ops as fo

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (hidden, rows): the tiny model's hidden size, a non-power-of-two, LLaMA-7B/13B sizes
RMS_SHAPES = [(128, 5), (320, 3), (4096, 2), (5120, 7)]


def _hf_norm(H, dtype, seed):
    norm = LlamaRMSNorm(H, eps=1e-5)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
    return norm.to(dtype)


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def _cos_sin(T, D, dtype, seed=0, n_heads=4):
    cfg = LlamaConfig(hidden_size=D * n_heads, num_attention_heads=n_heads, max_position_embeddings=4096)
    rope = LlamaRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4096, (1, T), generator=g)
    cos, sin = rope(torch.zeros(1, dtype=dtype), pos)
    return cos[0], sin[0]


def _qkv(T, HQ, HKV, D, dtype, seed):
    """q, k, v as head views of one fused [T, (HQ + 2 HKV) * D] buffer (strided, like a fused qkv GEMM)."""
    buf = _randn(T, (HQ + 2 * HKV) * D, dtype=dtype, seed=seed)
    q = buf[:, : HQ * D].view(T, HQ, D)
    k = buf[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
    v = buf[:, (HQ + HKV) * D:].view(T, HKV, D)
    return q, k, v


# -- references vs Hugging Face -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, T", RMS_SHAPES)
def test_rms_norm_reference_is_hf(dtype, H, T):
    norm = _hf_norm(H, dtype, seed=H)
    x = _randn(T, H, dtype=dtype, seed=T, scale=3.0)
    with torch.no_grad():
        want = norm(x)
        assert torch.equal(fo.rms_norm_reference(x, norm.weight, 1e-5), want)
        assert torch.equal(fo.rms_norm(x, norm.weight, 1e-5), want)  # auto on CPU is the reference
        x3 = x.view(1, T, H)  # HF's [B, T, H]
        assert torch.equal(fo.rms_norm(x3, norm.weight, 1e-5), norm(x3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_reference_is_hf(dtype):
    H, T = 320, 6
    norm = _hf_norm(H, dtype, seed=1)
    x, r = _randn(T, H, dtype=dtype, seed=2), _randn(T, H, dtype=dtype, seed=3, scale=4.0)
    with torch.no_grad():
        h = r + x  # the decoder's `h = h + o_proj(...)`
        normed, h_out = fo.add_rms_norm(x, r, norm.weight, 1e-5)
        assert torch.equal(h_out, h) and torch.equal(normed, norm(h))
        res = r.clone()
        normed2, h2 = fo.add_rms_norm(x, res, norm.weight, 1e-5, residual_out=res)
        assert h2 is res and torch.equal(res, h) and torch.equal(normed2, normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("HQ, HKV", [(4, 2), (8, 8)])
def test_rotary_and_cache_reference_is_hf(dtype, HQ, HKV):
    T, D, rows = 9, 32, 40
    q, k, v = _qkv(T, HQ, HKV, D, dtype, seed=HQ)
    cos, sin = _cos_sin(T, D, dtype)
    assert cos.dtype == dtype
    slots = torch.randperm(rows, generator=torch.Generator().manual_seed(5))[:T]
    kp, vp = torch.zeros(rows, HKV, D, dtype=dtype), torch.zeros(rows, HKV, D, dtype=dtype)
    q_rot = fo.rotary_and_cache(q, k, v, cos, sin, kp, vp, slots)
    # HF on [B, heads, T, D] with cos/sin [B, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    q_hf, k_hf = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)
    assert torch.equal(q_rot, q_hf)
    kw, vw = torch.zeros_like(kp), torch.zeros_like(vp)
    kw.index_copy_(0, slots, k_hf)
    vw.index_copy_(0, slots, v)
    assert torch.equal(kp, kw) and torch.equal(vp, vw)
    # rows outside slot_mapping untouched
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[slots] = False
    assert not kp[untouched].any() and not vp[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reference_is_hf_mlp(dtype):
    T, H, I = 5, 64, 176
    cfg = LlamaConfig(hidden_size=H, intermediate_size=I, hidden_act="silu")
    mlp = LlamaMLP(cfg).to(dtype)
    x = _randn(T, H, dtype=dtype, seed=0)
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        want = mlp.act_fn(gate) * up
        assert isinstance(mlp.act_fn, type(ACT2FN["silu"]))
        assert torch.equal(fo.silu_mul(gate, up), want)
        assert torch.equal(fo.silu_mul(torch.cat([gate, up], dim=-1)), want)
        assert torch.equal(mlp.down_proj(fo.silu_mul(gate, up)), mlp(x))


def test_references_empty_batch():
    H, D = 128, 32
    w = torch.ones(H)
    x = torch.empty(0, H)
    assert fo.rms_norm(x, w, 1e-5).shape == (0, H)
    n, h = fo.add_rms_norm(x, x, w, 1e-5)
    assert n.shape == h.shape == (0, H)
    assert fo.silu_mul(torch.empty(0, 2 * H)).shape == (0, H)
    q = fo.rotary_and_cache(torch.empty(0, 4, D), torch.empty(0, 2, D), torch.empty(0, 2, D), torch.empty(0, D),
                            torch.empty(0, D), torch.zeros(8, 2, D), torch.zeros(8, 2, D),
                            torch.empty(0, dtype=torch.long))
    assert q.shape == (0, 4, D)


def test_fused_available_on_cpu():
    assert not fo.fused_available(torch.zeros(1))
    with pytest.raises(ValueError):
        fo.rms_norm(torch.zeros(1, 4), torch.ones(4), 1e-5, impl="bogus")


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "from vlora.engine import fused_ops as f\n"
            "import torch\n"
            "assert not f.triton_available() and not f.fused_available(torch.zeros(1))\n"
            "x = torch.randn(3, 128); w = torch.ones(128)\n"
            "assert f.rms_norm(x, w, 1e-5).shape == (3, 128)\n"
            "try:\n"
            "    f.silu_mul(x, impl='triton')\n"
            "    raise SystemExit('impl=triton without triton must raise')\n"
            "except RuntimeError:\n"
            "    pass\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- PyTorch's CUDA reduction layout -------------------------------------------------------------------


@pytest.mark.parametrize("T, H, want", [
    (1, 4096, (512, 1)), (2, 4096, (256, 1)), (7, 4096, (128, 1)), (8, 4096, (64, 1)), (32, 4096, (32, 1)),
    (600, 4096, (32, 1)), (600, 5120, (32, 1)), (1, 128, (32, 1)), (600, 128, (32, 1)),
    (32, 8192, (32, 16)), (1, 8192, (512, 1)), (7, 100, None), (3, 130, None)])
def test_torch_reduce_layout(T, H, want):
    assert fo.torch_reduce_layout(T, H) == want


@pytest.mark.parametrize("H, T", RMS_SHAPES + [(8192, 20)])
def test_cuda_order_mean_close_to_mean(H, T):
    sq = _randn(T, H, dtype=torch.float32, seed=H).pow(2)
    torch.testing.assert_close(fo.cuda_order_mean(sq), sq.mean(-1), rtol=2e-6, atol=0)


# -- the Triton kernels under the interpreter ----------------------------------------------------------

# Skipped unless triton is importable and TRITON_INTERPRET=1 (tests/conftest.py); `make test` runs them
# in a second pytest run under the interpreter.
interpreter = pytest.mark.interpreter

INTERP_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
# one step of the dtype: bf16 only to within a step (the interpreter's bf16 casts truncate)
STEP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _cuda_order_rms(x, w, eps):
    """rms_norm_reference with the variance summed in PyTorch's CUDA order."""
    xf = x.float()
    var = fo.cuda_order_mean(xf * xf)[:, None]
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)


@interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES + [pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("H, T", RMS_SHAPES + [(4096, 1), (8192, 17)])
def test_triton_rms_norm(dtype, H, T):
    w = _hf_norm(H, dtype, seed=H).weight.detach()
    x = _randn(T, H, dtype=dtype, seed=T + H, scale=2.0)
    got = fo.rms_norm(x, w, 1e-5, impl="triton")
    assert got.dtype == dtype and got.shape == (T, H)
    want = _cuda_order_rms(x, w, 1e-5)
    if dtype != torch.bfloat16:  # same summation order, same roundings: same bits
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2.5 * STEP[dtype], atol=0)
    # torch's CPU mean sums in another order: a few ulps in fp32
    torch.testing.assert_close(got.float(), fo.rms_norm_reference(x, w, 1e-5).float(),
                               rtol=(8 if dtype == torch.float32 else 2.5) * STEP[dtype], atol=1e-30)


@interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
def test_triton_rms_norm_variance_order_exact(dtype):
    """With unit weight and fp32 the output is x * rsqrt(var + eps): the kernel's var must equal the
    CUDA-order oracle's exactly for x * r to agree (checked through r = out / x on x = 1-ish)."""
    H, T = 4096, 3
    x = torch.ones(T, H, dtype=torch.float32) + _randn(T, H, dtype=torch.float32, seed=9, scale=1e-3)
    x[:, 0] = 1.0
    got = fo.rms_norm(x, torch.ones(H), 1e-5, impl="triton")
    var = fo.cuda_order_mean(x * x)
    torch.testing.assert_close(got[:, 0], torch.rsqrt(var + 1e-5), rtol=STEP[torch.float32], atol=0)


@interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES + [pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("H, T", [(128, 5), (320, 3), (5120, 2)])
def test_triton_add_rms_norm(dtype, H, T):
    w = _hf_norm(H, dtype, seed=H).weight.detach()
    x, r = _randn(T, H, dtype=dtype, seed=1), _randn(T, H, dtype=dtype, seed=2, scale=3.0)
    normed, h = fo.add_rms_norm(x, r, w, 1e-5, impl="triton")
    if dtype != torch.bfloat16:
        assert torch.equal(h, x + r)
    else:
        torch.testing.assert_close(h, x + r, rtol=STEP[dtype], atol=0)
    if dtype != torch.bfloat16:
        assert torch.equal(normed, _cuda_order_rms(x + r, w, 1e-5))
    else:
        torch.testing.assert_close(normed, _cuda_order_rms(h, w, 1e-5), rtol=2.5 * STEP[dtype], atol=0)
    # in place into the residual, and equal to the two-kernel form
    res = r.clone()
    n2, h2 = fo.add_rms_norm(x, res, w, 1e-5, impl="triton", residual_out=res)
    assert h2 is res and torch.equal(res, h) and torch.equal(n2, normed)
    assert torch.equal(fo.rms_norm(h, w, 1e-5, impl="triton"), normed)


@interpreter
def test_triton_rms_norm_strided_rows_and_empty():
    H, T = 320, 4
    w = _hf_norm(H, torch.float32, seed=0).weight.detach()
    big = _randn(T, 2 * H, dtype=torch.float32, seed=3)
    x = big[:, H:]  # row stride 2H
    assert torch.equal(fo.rms_norm(x, w, 1e-5, impl="triton"), fo.rms_norm(x.contiguous(), w, 1e-5, impl="triton"))
    assert fo.rms_norm(torch.empty(0, H), w, 1e-5, impl="triton").shape == (0, H)
    n, h = fo.add_rms_norm(torch.empty(0, H), torch.empty(0, H), w, 1e-5, impl="triton")
    assert n.shape == h.shape == (0, H)


@interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES + [pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("HQ, HKV, D", [(4, 2, 32), (8, 8, 64), (6, 2, 96), (32, 8, 128)])
def test_triton_rotary_and_cache(dtype, HQ, HKV, D):
    T, rows = 7, 50
    q, k, v = _qkv(T, HQ, HKV, D, dtype, seed=HQ + D)
    cos, sin = _cos_sin(T, D, dtype, seed=D)
    slots = torch.randperm(rows, generator=torch.Generator().manual_seed(D))[:T]
    nan = float("nan")
    kp, vp = torch.full((rows, HKV, D), nan, dtype=dtype), torch.full((rows, HKV, D), nan, dtype=dtype)
    kr, vr = kp.clone(), vp.clone()
    got = fo.rotary_and_cache(q, k, v, cos, sin, kp, vp, slots, impl="triton")
    want = fo.rotary_and_cache_reference(q, k, v, cos, sin, kr, vr, slots)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2 * STEP[dtype], atol=1e-2)
        torch.testing.assert_close(kp, kr, rtol=2 * STEP[dtype], atol=1e-2, equal_nan=True)
    else:
        assert torch.equal(got, want)
        assert torch.equal(kp[slots], kr[slots])
        assert torch.isnan(kp).sum() == torch.isnan(kr).sum()  # nothing written outside the slots
    assert torch.equal(vp[slots], vr[slots]) and torch.isnan(vp).sum() == torch.isnan(vr).sum()


@interpreter
def test_triton_rotary_and_cache_skips_negative_slots_and_empty():
    T, HQ, HKV, D, rows = 4, 4, 2, 32, 10
    q, k, v = _qkv(T, HQ, HKV, D, torch.float32, seed=0)
    cos, sin = _cos_sin(T, D, torch.float32)
    slots = torch.tensor([3, -1, 7, -1])
    kp, vp = torch.zeros(rows, HKV, D), torch.zeros(rows, HKV, D)
    out = torch.empty(T, HQ, D)
    got = fo.rotary_and_cache(q, k, v, cos, sin, kp, vp, slots, impl="triton", out=out)
    assert got is out
    kr, vr = torch.zeros_like(kp), torch.zeros_like(vp)
    want = fo.rotary_and_cache_reference(q[[0, 2]], k[[0, 2]], v[[0, 2]], cos[[0, 2]], sin[[0, 2]], kr, vr,
                                         slots[[0, 2]])
    assert torch.equal(got[[0, 2]], want) and torch.equal(kp, kr) and torch.equal(vp, vr)
    e = fo.rotary_and_cache(q[:0], k[:0], v[:0], cos[:0], sin[:0], kp, vp, slots[:0], impl="triton")
    assert e.shape == (0, HQ, D)


@interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES + [pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("T, I", [(3, 256), (2, 11008), (4, 300)])
def test_triton_silu_mul(dtype, T, I):
    gu = _randn(T, 2 * I, dtype=dtype, seed=I, scale=3.0)
    want = fo.silu_mul_reference(gu)
    got = fo.silu_mul(gu, impl="triton")  # halves of a fused gate_up (strided views)
    got2 = fo.silu_mul(gu[:, :I].contiguous(), gu[:, I:].contiguous(), impl="triton")
    assert torch.equal(got, got2)
    # exp differs by an ulp between numpy and torch's CPU kernels; eager CUDA and the kernel share expf
    torch.testing.assert_close(got, want, rtol=(4 if dtype == torch.float32 else 2.5) * STEP[dtype], atol=1e-30)
    assert fo.silu_mul(gu[:0], impl="triton").shape == (0, I)


@interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES + [pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("N, H, D", [(3, 16, 80), (5, 2, 8), (1, 3, 64)])
def test_triton_vision_rotary(dtype, N, H, D):
    """The Qwen2-VL tower's fp32 rotary on q, k as head views of one qkv output, against transformers' own."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    qkv = _randn(N, 3 * H * D, dtype=dtype, seed=N + H, scale=3.0)
    q, k, _ = qkv.reshape(N, 3, H, D).permute(1, 0, 2, 3).unbind(0)
    ang = _randn(N, D // 2, dtype=torch.float32, seed=D, scale=20.0)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    want = apply_rotary_pos_emb_vision(q, k, cos, sin)
    got = fo.vision_rotary(q, k, cos, sin, impl="triton")
    assert torch.equal(fo.vision_rotary(q, k, cos, sin, impl="torch")[0], want[0])
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.shape == w.shape
        if dtype == torch.bfloat16:  # the interpreter's bf16 casts truncate
            torch.testing.assert_close(g.float(), w.float(), rtol=STEP[dtype], atol=1e-30)
        else:
            assert torch.equal(g, w)
    assert fo.vision_rotary(q[:0], k[:0], cos[:0], sin[:0], impl="triton")[0].shape == (0, H, D)


@interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES + [pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("T, I", [(3, 256), (2, 5120), (4, 300)])
def test_triton_quick_gelu(dtype, T, I):
    """QuickGELU (x * sigmoid(1.702 x)) against transformers' module, a row-strided view too."""
    from transformers.activations import QuickGELUActivation

    x = _randn(T, 2 * I, dtype=dtype, seed=I, scale=4.0)
    for inp in (x, x[:, :I]):
        want = QuickGELUActivation()(inp)
        assert torch.equal(fo.quick_gelu(inp, impl="torch"), want)
        # exp differs by an ulp between numpy and torch's CPU kernels (eager CUDA and the kernel share expf),
        # and three roundings follow it. bf16: the interpreter truncates 1.702 x, and a step of that moves the
        # sigmoid of a large negative x by several percent of its (tiny) value: an absolute bound there.
        atol = 4e-3 if dtype == torch.bfloat16 else 1e-30
        torch.testing.assert_close(fo.quick_gelu(inp, impl="triton"), want,
                                   rtol=(4 if dtype == torch.float32 else 2.5) * STEP[dtype], atol=atol)
    assert fo.quick_gelu(x[:0], impl="triton").shape == (0, 2 * I)
