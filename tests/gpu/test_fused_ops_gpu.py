"""The fused Triton kernels of vlora.engine.fused_ops on CUDA against the eager code they replace (Hugging
Face's LlamaRMSNorm, apply_rotary_pos_emb, SiLU * up, index_copy_), at the 7B model's sizes (H=4096, Hq=32,
Hkv=32 and 8, D=128, I=11008) and T in {1, 7, 32, 600}: bf16 and fp16 bit-exact (torch.equal), fp32 within
1e-6; q/k/v as strided head views of one fused qkv buffer; pools past 2^31 elements; and all four kernels
captured once in a CUDA graph and replayed on new inputs. RMSNorm's one-pass kernel (``impl="auto"``, the
engine's) sums in its own order: fp32 within 1e-6, bf16/fp16 within two rounding steps of eager."""
from __future__ import annotations

import pytest
import torch

from helpers import require_cuda

pytestmark = pytest.mark.gpu
require_cuda(triton=True)

from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402

from vlora.engine import fused_ops as fo  # noqa: E402

DEV = torch.device("cuda")
H, HQ, D, I = 4096, 32, 128, 11008
TS = [1, 7, 32, 600]
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
ALL = HALF + [pytest.param(torch.float32, id="fp32")]
KV_HEADS = [pytest.param(32, id="mha"), pytest.param(8, id="gqa4")]
EPS = 1e-5


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, device=DEV)).to(dtype)


def check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        bad = (got != want).sum().item()
        assert torch.equal(got, want), f"{bad} of {got.numel()} elements differ"


def check_norm(got, want, dtype, impl):
    """The PyTorch-order kernel is bit-exact; the one-pass kernel within two rounding steps (x * rstd is
    rounded before the weight multiplies it, and the output again)."""
    if impl == "triton" or dtype == torch.float32:
        check(got, want, dtype)
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


NORM_IMPLS = [pytest.param("triton", id="torch-order"), pytest.param("auto", id="one-pass")]


def hf_norm(hidden, dtype, seed=0):
    norm = LlamaRMSNorm(hidden, eps=EPS).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=torch.Generator(device=DEV).manual_seed(seed),
                                                device=DEV))
    return norm.to(dtype)


def cos_sin(T, dtype, seed=0):
    """LLaMA rotary tables at random positions, cast to the model dtype as HF's rotary_emb does."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    pos = torch.randint(0, 4096, (T,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))
    freqs = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qkv_views(T, hkv, dtype, seed):
    buf = randn(T, (HQ + 2 * hkv) * D, dtype=dtype, seed=seed, scale=2.0)
    q = buf[:, : HQ * D].view(T, HQ, D)
    k = buf[:, HQ * D:(HQ + hkv) * D].view(T, hkv, D)
    v = buf[:, (HQ + hkv) * D:].view(T, hkv, D)
    return q, k, v


# -- RMSNorm ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("hidden", [4096, 5120, 128])
def test_reduction_order_matches_torch_cuda_mean(T, hidden):
    """The order the kernels sum the variance in (fo.cuda_order_mean) is PyTorch's CUDA mean's, bit for bit."""
    sq = randn(T, hidden, dtype=torch.float32, seed=T + hidden, scale=3.0).pow(2)
    assert torch.equal(fo.cuda_order_mean(sq), sq.mean(-1))


@pytest.mark.parametrize("impl", NORM_IMPLS)
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_rms_norm_matches_hf(dtype, T, hidden, impl):
    norm = hf_norm(hidden, dtype, seed=hidden)
    x = randn(T, hidden, dtype=dtype, seed=T, scale=3.0)
    with torch.no_grad():
        check_norm(fo.rms_norm(x, norm.weight, EPS, impl=impl), norm(x), dtype, impl)


@pytest.mark.parametrize("impl", NORM_IMPLS)
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("T", TS)
def test_add_rms_norm_matches_eager(dtype, T, impl):
    norm = hf_norm(H, dtype, seed=1)
    x, r = randn(T, H, dtype=dtype, seed=T), randn(T, H, dtype=dtype, seed=T + 1, scale=4.0)
    with torch.no_grad():
        h = r + x
        want = norm(h)
        normed, h_out = fo.add_rms_norm(x, r, norm.weight, EPS, impl=impl)
        assert torch.equal(h_out, h)
        check_norm(normed, want, dtype, impl)
        res = r.clone()
        normed2, h2 = fo.add_rms_norm(x, res, norm.weight, EPS, residual_out=res, impl=impl)  # in place
        assert h2 is res and torch.equal(res, h) and torch.equal(normed2, normed)


def test_rms_norm_empty():
    w = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    x = torch.empty(0, H, device=DEV, dtype=torch.bfloat16)
    assert fo.rms_norm(x, w, EPS).shape == (0, H)
    n, h = fo.add_rms_norm(x, x, w, EPS)
    assert n.shape == h.shape == (0, H)


# -- rotary + KV cache write --------------------------------------------------------------------------


def rotary_eager(q, k, v, cos, sin, k_pool, v_pool, slots):
    qh, kh = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # [T, heads, D] with cos [T, D]
    k_pool.index_copy_(0, slots, kh)
    v_pool.index_copy_(0, slots, v)
    return qh


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("hkv", KV_HEADS)
@pytest.mark.parametrize("T", TS)
def test_rotary_and_cache_matches_eager(dtype, hkv, T):
    rows = 4 * T + 64
    q, k, v = qkv_views(T, hkv, dtype, seed=T + hkv)
    assert T == 1 or (not q.is_contiguous() and not k.is_contiguous())  # one token: every view is contiguous
    cos, sin = cos_sin(T, dtype, seed=T)
    slots = torch.randperm(rows, device=DEV, generator=torch.Generator(device=DEV).manual_seed(T))[:T]
    kp = torch.full((rows, hkv, D), float("nan"), dtype=dtype, device=DEV)
    vp = torch.full_like(kp, float("nan"))
    kr, vr = kp.clone(), vp.clone()
    got = fo.rotary_and_cache(q, k, v, cos, sin, kp, vp, slots)
    want = rotary_eager(q, k, v, cos, sin, kr, vr, slots)
    check(got, want, dtype)
    check(kp[slots], kr[slots], dtype)
    assert torch.equal(vp[slots], vr[slots])
    assert torch.isnan(kp).sum() == torch.isnan(kr).sum() and torch.isnan(vp).sum() == torch.isnan(vr).sum()


def test_rotary_and_cache_pool_past_int32():
    """Pools of more than 2^31 elements: rows near the end are written at the right place."""
    dtype, hkv, T = torch.bfloat16, 8, 7
    rows = (2 ** 31) // (hkv * D) + 4096
    try:
        kp = torch.zeros(rows, hkv, D, dtype=dtype, device=DEV)
        vp = torch.zeros(rows, hkv, D, dtype=dtype, device=DEV)
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for two 4 GiB pools")
    q, k, v = qkv_views(T, hkv, dtype, seed=3)
    cos, sin = cos_sin(T, dtype, seed=3)
    slots = torch.tensor([rows - 1, rows - 2, rows - 4000, 5, rows - 77, 2 ** 21, rows - 3], device=DEV)
    got = fo.rotary_and_cache(q, k, v, cos, sin, kp, vp, slots)
    kr, vr = torch.zeros(T, hkv, D, dtype=dtype, device=DEV), torch.zeros(T, hkv, D, dtype=dtype, device=DEV)
    want = rotary_eager(q, k, v, cos, sin, kr, vr, torch.arange(T, device=DEV))
    assert torch.equal(got, want) and torch.equal(kp[slots], kr) and torch.equal(vp[slots], vr)
    assert kp.count_nonzero() == kr.count_nonzero()
    del kp, vp
    torch.cuda.empty_cache()


def test_rotary_and_cache_empty():
    q, k, v = qkv_views(0, 8, torch.bfloat16, seed=0)
    cos, sin = cos_sin(0, torch.bfloat16)
    kp = torch.zeros(16, 8, D, dtype=torch.bfloat16, device=DEV)
    out = fo.rotary_and_cache(q, k, v, cos, sin, kp, kp.clone(), torch.empty(0, dtype=torch.long, device=DEV))
    assert out.shape == (0, HQ, D) and not kp.any()


# -- SiLU * up ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("T", TS)
def test_silu_mul_matches_eager(dtype, T):
    gu = randn(T, 2 * I, dtype=dtype, seed=T, scale=4.0)
    gate, up = gu[:, :I], gu[:, I:]
    want = torch.nn.functional.silu(gate) * up
    check(fo.silu_mul(gu), want, dtype)
    check(fo.silu_mul(gate.contiguous(), up.contiguous()), want, dtype)
    assert fo.silu_mul(gu[:0]).shape == (0, I)


# -- CUDA graph ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_cuda_graph_capture_and_replay(dtype):
    """One decode-like step (norm, rotary + cache write, add+norm, silu*up) captured once, replayed on new
    inputs written into the static buffers: same bits as eager each time."""
    T, hkv, rows = 32, 8, 256
    norm = hf_norm(H, dtype, seed=2)
    w = norm.weight.detach()
    h_in = randn(T, H, dtype=dtype, seed=0)
    attn_in = randn(T, H, dtype=dtype, seed=1)
    qkv_in = randn(T, (HQ + 2 * hkv) * D, dtype=dtype, seed=2)
    gu_in = randn(T, 2 * I, dtype=dtype, seed=3)
    cos, sin = cos_sin(T, dtype, seed=4)
    slots = torch.randperm(rows, device=DEV)[:T].contiguous()
    kp = torch.zeros(rows, hkv, D, dtype=dtype, device=DEV)
    vp = torch.zeros_like(kp)

    def step():
        x = fo.rms_norm(h_in, w, EPS, impl="triton")
        q = qkv_in[:, : HQ * D].view(T, HQ, D)
        k = qkv_in[:, HQ * D:(HQ + hkv) * D].view(T, hkv, D)
        v = qkv_in[:, (HQ + hkv) * D:].view(T, hkv, D)
        q_rot = fo.rotary_and_cache(q, k, v, cos, sin, kp, vp, slots)
        normed, h = fo.add_rms_norm(attn_in, h_in, w, EPS, impl="triton")
        return x, q_rot, normed, h, fo.silu_mul(gu_in)

    def eager():
        q = qkv_in[:, : HQ * D].view(T, HQ, D)
        k = qkv_in[:, HQ * D:(HQ + hkv) * D].view(T, hkv, D)
        v = qkv_in[:, (HQ + hkv) * D:].view(T, hkv, D)
        kr, vr = torch.zeros_like(kp), torch.zeros_like(vp)
        q_rot = rotary_eager(q, k, v, cos, sin, kr, vr, slots)
        h = h_in + attn_in
        with torch.no_grad():
            return (norm(h_in), q_rot, norm(h), h, torch.nn.functional.silu(gu_in[:, :I]) * gu_in[:, I:]), kr, vr

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (10, 20, 30):
        h_in.copy_(randn(T, H, dtype=dtype, seed=seed))
        attn_in.copy_(randn(T, H, dtype=dtype, seed=seed + 1))
        qkv_in.copy_(randn(T, (HQ + 2 * hkv) * D, dtype=dtype, seed=seed + 2))
        gu_in.copy_(randn(T, 2 * I, dtype=dtype, seed=seed + 3))
        c, sn = cos_sin(T, dtype, seed=seed)
        cos.copy_(c)
        sin.copy_(sn)
        slots.copy_(torch.randperm(rows, device=DEV)[:T])
        kp.zero_()
        vp.zero_()
        graph.replay()
        torch.cuda.synchronize()
        wants, kr, vr = eager()
        for got, want in zip(outs, wants):
            assert torch.equal(got, want)
        assert torch.equal(kp, kr) and torch.equal(vp, vr)


# -- the Qwen2-VL vision tower's rotary and QuickGELU -------------------------------------------------------
VH, VD, VI = 16, 80, 5120  # Qwen2-VL-7B's vision blocks: 16 heads of 80, MLP 5,120
VISION_ROWS = [1, 576, 2304]  # one merge unit's row, a 336 px image, an 8-frame 336 px video


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("N", VISION_ROWS)
def test_vision_rotary_matches_transformers(dtype, N):
    """q and k as head views of one fused qkv output, cos/sin fp32 as the tower builds them: the same bits as
    transformers' apply_rotary_pos_emb_vision (fp32 within 1e-6)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    qkv = randn(N, 3 * VH * VD, dtype=dtype, seed=N, scale=3.0)
    q, k, _ = qkv.reshape(N, 3, VH, VD).permute(1, 0, 2, 3).unbind(0)
    ang = randn(N, VD // 2, dtype=torch.float32, seed=N + 1, scale=20.0)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    want_q, want_k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    got_q, got_k = fo.vision_rotary(q, k, cos, sin)
    check(got_q, want_q, dtype)
    check(got_k, want_k, dtype)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    empty = fo.vision_rotary(q[:0], k[:0], cos[:0], sin[:0])
    assert empty[0].shape == (0, VH, VD)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("N", VISION_ROWS)
def test_quick_gelu_matches_transformers(dtype, N):
    from transformers.activations import QuickGELUActivation

    x = randn(N, VI, dtype=dtype, seed=N + 7, scale=4.0)
    check(fo.quick_gelu(x), QuickGELUActivation()(x), dtype)
    check(fo.quick_gelu(x[:, : VI // 2]), QuickGELUActivation()(x[:, : VI // 2]), dtype)  # a strided view
    assert fo.quick_gelu(x[:0]).shape == (0, VI)
