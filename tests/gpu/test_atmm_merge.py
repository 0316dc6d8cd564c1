"""The streaming merge reading A and B in place (csrc/atmm/stream.cuh, stream_merge: per-matrix strides, a second
term) against an fp32 reference: the LoRA slot stacks as the model runner lays them out, a swap (+ new - old) in
one launch, weights as a row slice of a stack (GQA modules), and the swift switcher on the switchers' synthetic runner."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ext = pytest.importorskip("vlora_atmm_ext", reason="vlora_atmm_ext not built (pip install ./csrc)")

from vlora.atmm import merge_lora_terms  # noqa: E402
from vlora.atmm.dispatch import default_kernels  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


@pytest.fixture
def launches(monkeypatch):
    """The extension's merge launches of a test, (layers, rank, two terms) each: proves the kernel served."""
    seen = []
    mod = default_kernels().ext
    real = mod.merge

    def spy(*args, **kw):
        seen.append((args[3], args[6], bool(kw.get("lora_a2"))))
        return real(*args, **kw)

    monkeypatch.setattr(mod, "merge", spy)
    return seen


def _stacks(L, M, S, r, d_out, d_in, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(L, M, S, r, d_in, generator=g, device="cuda") / 8).to(dtype)
    b = (torch.randn(L, M, S, d_out, r, generator=g, device="cuda") / 8).to(dtype)
    w = torch.randn(L * M, d_out, d_in, generator=g, device="cuda").to(dtype)
    return a, b, w


def _rel_err(got, ref, base):
    return ((got.float() - ref).norm() / (ref - base.float()).norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("r", [8, 16, 64])
def test_merge_swap_unmerge_from_slot_stacks(launches, dtype, r):
    L, M, S, d_out, d_in = 4, 3, 5, 1000, 1032
    a, b, w = _stacks(L, M, S, r, d_out, d_in, dtype, seed=r)
    A = {s: a[:, :, s].view(L * M, r, d_in) for s in (1, 4)}  # views: a copy would raise
    B = {s: b[:, :, s].view(L * M, d_out, r) for s in (1, 4)}
    delta = {s: torch.bmm(B[s].float(), A[s].float()) for s in (1, 4)}
    w0 = w.float()
    merge_lora_terms(w, [(A[1], B[1], 1)])
    ref = w0 + delta[1]
    assert _rel_err(w, ref, w0) <= 4 * TOL[dtype]
    before = w.float()
    merge_lora_terms(w, [(A[4], B[4], 1), (A[1], B[1], -1)])  # a swap: one launch of rank 2r
    ref = before + delta[4] - delta[1]
    assert _rel_err(w, ref, before) <= 4 * TOL[dtype]
    before = w.float()
    merge_lora_terms(w, [(A[4], B[4], -1)])
    assert _rel_err(w, before - delta[4], before) <= 4 * TOL[dtype]
    assert launches == [(L * M, r, False), (L * M, r, True), (L * M, r, False)]
    assert ((w.float() - w0).norm() / w0.norm()).item() <= TOL[dtype]  # back where it started, up to rounding


def test_swap_with_both_terms_negated_and_added(launches):
    """Signs (-1, -1) and (-1, +1): alpha carries the first sign, the second term is negated when they differ."""
    L, M, S, r, d = 2, 1, 3, 32, 512
    a, b, w = _stacks(L, M, S, r, d, d, torch.bfloat16, seed=3)
    A = [a[:, :, s].view(L, r, d) for s in range(2)]
    B = [b[:, :, s].view(L, d, r) for s in range(2)]
    for s0, s1 in ((-1, -1), (-1, 1), (1, 1)):
        before = w.float()
        merge_lora_terms(w, [(A[0], B[0], s0), (A[1], B[1], s1)])
        ref = before + s0 * torch.bmm(B[0].float(), A[0].float()) + s1 * torch.bmm(B[1].float(), A[1].float())
        assert _rel_err(w, ref, before) <= 4e-2
    assert [x[2] for x in launches] == [True, True, True]


def test_row_slice_of_a_stack(launches):
    """GQA: a module's rows of a [L, sum d_out, d_in] stack (matrix stride larger than the matrix) take their
    merge in place; the rows around them stay bit-identical."""
    L, r, d_in = 3, 64, 1024
    g = torch.Generator(device="cuda").manual_seed(7)
    stack = torch.randn(L, 4096 + 2 * 1024, d_in, generator=g, device="cuda").to(torch.bfloat16)
    s0 = stack.clone()
    a = (torch.randn(L, 2, r, d_in, generator=g, device="cuda") / 8).to(torch.bfloat16)
    b = (torch.randn(L, 2, 1024, r, generator=g, device="cuda") / 8).to(torch.bfloat16)
    rows = stack[:, 4096:5120]
    merge_lora_terms(rows, [(a[:, 0], b[:, 0], 1), (a[:, 1], b[:, 1], -1)])
    ref = s0[:, 4096:5120].float() + torch.bmm(b[:, 0].float(), a[:, 0].float()) - torch.bmm(b[:, 1].float(), a[:, 1].float())
    assert _rel_err(rows, ref, s0[:, 4096:5120]) <= 4e-2
    assert torch.equal(stack[:, :4096], s0[:, :4096]) and torch.equal(stack[:, 5120:], s0[:, 5120:])
    assert launches == [(L, r, True)]


def test_rank_128_swap_takes_two_launches(launches):
    """Two terms of rank 128 exceed every config (256): each term runs on its own, still in place."""
    L, M, S, r, d = 2, 1, 2, 128, 512
    a, b, w = _stacks(L, M, S, r, d, d, torch.bfloat16, seed=9)
    A = [a[:, :, s].view(L, r, d) for s in range(2)]
    B = [b[:, :, s].view(L, d, r) for s in range(2)]
    before = w.float()
    merge_lora_terms(w, [(A[0], B[0], 1), (A[1], B[1], -1)])
    ref = before + torch.bmm(B[0].float(), A[0].float()) - torch.bmm(B[1].float(), A[1].float())
    assert _rel_err(w, ref, before) <= 4e-2
    assert launches == [(L, r, False), (L, r, False)]


def test_refusals():
    w = torch.zeros(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    a = torch.zeros(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(2, 64, 8, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match="strides smaller than a matrix"):
        ext.merge(w.data_ptr(), a.data_ptr(), b.data_ptr(), 2, 64, 64, 8, 1.0, "bf16", 0, stream, stride_a=64)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        ext.merge(w.data_ptr(), a.data_ptr(), b.data_ptr(), 2, 64, 64, 8, 1.0, "bf16", 0, stream, stride_b=64 * 8 + 4)
    with pytest.raises(RuntimeError, match="needs both A and B"):
        ext.merge(w.data_ptr(), a.data_ptr(), b.data_ptr(), 2, 64, 64, 8, 1.0, "bf16", 0, stream, lora_a2=a.data_ptr())
    with pytest.raises(RuntimeError, match="serves ranks up to 64"):
        ext.merge(w.data_ptr(), a.data_ptr(), b.data_ptr(), 2, 64, 64, 40, 1.0, "bf16", 0, stream,
                  stride_a=40 * 64, stride_b=64 * 40, lora_a2=a.data_ptr(), lora_b2=b.data_ptr())
    assert not w.any()


def test_swift_switcher_reads_the_slot_stacks(launches):
    """The switchers' synthetic runner (tests/helpers.py: q/k/v and o stacks, slot stacks) at a small width: merge,
    swap, unmerge with the swift switcher, each checked against fp32, one launch per group and switch."""
    from helpers import synthetic_runner
    from vlora.orchestrator.switcher import SwiftSwitcher

    L, d, r, S = 3, 512, 64, 6
    runner = synthetic_runner(L, d, r, S, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for slot in (2, 5):
        for w in runner.lora_layers.values():
            w.set_slot(slot, torch.randn(r, d, generator=g, device="cuda").to(torch.bfloat16) * 0.05,
                       torch.randn(d, r, generator=g, device="cuda").to(torch.bfloat16) * 0.05, 1.0)
    sw = SwiftSwitcher(runner)
    w0 = {k: w.base.weight.float() for k, w in runner.lora_layers.items()}
    delta = {s: {k: w.lora_b[s].float() @ w.lora_a[s].float() for k, w in runner.lora_layers.items()} for s in (2, 5)}
    for target in (2, 5, None):
        sw.switch(target)
        for key, w in runner.lora_layers.items():
            want = w0[key] + (delta[target][key] if target is not None else 0)
            err = ((w.base.weight.float() - want).norm() / want.norm()).item()
            assert err <= 1e-2, (target, key, err)
    assert launches == [(3 * L, r, False), (L, r, False), (3 * L, r, True), (L, r, True), (3 * L, r, False), (L, r, False)]
