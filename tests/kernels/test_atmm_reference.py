"""ATMM on the CPU: the reference against a token-by-token float64 loop, and the dispatch fallback."""
from __future__ import annotations

import pytest
import torch

from vlora.atmm import AtmmKernels, atmm, atmm_reference
from vlora.atmm.cases import PATTERNS, RANK_CYCLE, lora_weights, loop_fp64, mapping_for
from vlora.atmm.mapping import LoraBatchMapping

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_case(pattern: str, T: int, dtype: torch.dtype, seed: int, d_in: int = 64, d_out: int = 48):
    g = torch.Generator().manual_seed(seed)
    n_slots = 5
    ranks = tuple(RANK_CYCLE[i % len(RANK_CYCLE)] // 4 for i in range(n_slots - 1)) + (0,)  # last slot: rank 0
    scales = tuple(0.5 + 0.25 * i for i in range(n_slots))
    a, b = lora_weights(n_slots, d_in, d_out, ranks, dtype, "cpu", g)
    x = torch.randn(T, d_in, generator=g).to(dtype)
    y0 = torch.randn(T, d_out, generator=g).to(dtype)
    mapping = mapping_for(pattern, T, n_slots)
    ref = loop_fp64(y0, x, a, b, ranks, scales, mapping)
    out = atmm_reference(y0.clone(), x, a, b, ranks, scales, mapping)
    return out, ref, y0, mapping


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_fp64_loop(pattern, T, dtype):
    out, ref, y0, mapping = run_case(pattern, T, dtype, seed=T * 31 + len(pattern))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("pattern", ["no_adapter", "empty"])
def test_rows_without_adapter_are_untouched(pattern):
    out, ref, y0, mapping = run_case(pattern, 40, torch.float32, seed=7)
    p = mapping.seg_indptr_host
    for i, slot in enumerate(mapping.seg_slot_host):
        if slot < 0 or slot == 4:  # slot 4 has rank 0
            assert torch.equal(out[p[i]:p[i + 1]], y0[p[i]:p[i + 1]])


def test_no_lora_early_exit_returns_y_unchanged():
    y = torch.randn(6, 8)
    before = y.clone()
    mapping = LoraBatchMapping.from_token_slots([3, 3], [-1, -1])
    a, b = torch.randn(1, 8, 8), torch.randn(1, 8, 8)
    assert atmm(y, torch.randn(6, 8), a, b, (8,), (1.0,), mapping) is y
    assert torch.equal(y, before)


def test_atmm_on_cpu_is_the_reference():
    mapping = mapping_for("3x3", 30, 5)
    g = torch.Generator().manual_seed(3)
    n_slots = 5
    ranks = tuple(RANK_CYCLE[i % len(RANK_CYCLE)] // 4 for i in range(n_slots - 1)) + (0,)
    scales = tuple(0.5 + 0.25 * i for i in range(n_slots))
    a, b = lora_weights(n_slots, 64, 48, ranks, torch.float32, "cpu", g)
    x = torch.randn(30, 64, generator=g)
    y = torch.randn(30, 48, generator=g)
    expect = atmm_reference(y.clone(), x, a, b, ranks, scales, mapping)
    got = atmm(y.clone(), x, a, b, ranks, scales, mapping)
    assert torch.equal(got, expect)


def test_dispatch_refuses_cpu_tensors_with_a_reason():
    kernels = AtmmKernels(load_table=False)
    mapping = LoraBatchMapping.from_token_slots([4], [0])
    reason = kernels.unsupported(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(1, 8, 8), torch.zeros(1, 8, 8),
                                 (8,), (1.0,), mapping)
    assert reason  # no extension, or CPU tensors: either way the reference serves


def test_dispatch_without_extension():
    kernels = AtmmKernels(load_table=False)
    if kernels.available:
        pytest.skip("extension importable here")
    assert kernels.config_names == []
    assert "vlora_atmm_ext" in kernels.unavailable_reason
