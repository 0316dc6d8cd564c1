"""The merge operator against its layer-by-layer reference, on the CPU."""
from __future__ import annotations

import pytest
import torch

from vlora.atmm import merge_lora, merge_lora_reference, merge_lora_terms
from vlora.atmm.merge import MERGE_CONFIGS, stream_config


@pytest.mark.parametrize("per_layer_scale", [False, True])
def test_merge_matches_reference_and_unmerge_restores(per_layer_scale):
    g = torch.Generator().manual_seed(0)
    L, d_out, d_in, r = 6, 40, 24, 8
    w = torch.randn(L, d_out, d_in, generator=g)
    a = torch.randn(L, r, d_in, generator=g)
    b = torch.randn(L, d_out, r, generator=g)
    scale = torch.linspace(0.5, 2.0, L) if per_layer_scale else 0.75
    got = merge_lora(w.clone(), a, b, scale, +1)
    ref = merge_lora_reference(w.clone(), a, b, scale, +1)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4)
    back = merge_lora(got, a, b, scale, -1)
    assert torch.allclose(back, w, rtol=1e-5, atol=1e-4)


def test_merge_is_in_place():
    w = torch.zeros(2, 4, 4)
    out = merge_lora(w, torch.ones(2, 1, 4), torch.ones(2, 4, 1), 2.0)
    assert out is w and torch.equal(w, torch.full((2, 4, 4), 2.0))


def test_merge_refuses_bad_shapes_and_sign():
    with pytest.raises(ValueError, match="sign"):
        merge_lora(torch.zeros(1, 4, 4), torch.zeros(1, 1, 4), torch.zeros(1, 4, 1), 1.0, sign=2)
    with pytest.raises(ValueError, match="disagree"):
        merge_lora(torch.zeros(1, 4, 4), torch.zeros(1, 1, 5), torch.zeros(1, 4, 1), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        merge_lora(torch.zeros(1, 4, 4).transpose(1, 2), torch.zeros(1, 1, 4), torch.zeros(1, 4, 1), 1.0)


def _slot_stacks(g, L=3, M=2, S=4, r=8, d_out=16, d_in=24):
    """Slot stacks laid out as the model runner keeps them: A [L, M, S, r, d_in], B [L, M, S, d_out, r]."""
    return (torch.randn(L, M, S, r, d_in, generator=g, dtype=torch.float64),
            torch.randn(L, M, S, d_out, r, generator=g, dtype=torch.float64))


def test_merge_terms_read_strided_slots_and_swap_in_one_call():
    """A slot's A and B of every layer and module are strided views of the stacks; merge_lora_terms takes them
    as they are: a merge, then a swap (+ new, - old) equal to the fp64 layer-by-layer sum, then an unmerge
    back to the start."""
    g = torch.Generator().manual_seed(1)
    L, M, S, r, d_out, d_in = 3, 2, 4, 8, 16, 24
    a, b = _slot_stacks(g, L, M, S, r, d_out, d_in)
    w = torch.randn(L * M, d_out, d_in, generator=g, dtype=torch.float64)
    w0 = w.clone()
    view = lambda t, slot, *shape: t[:, :, slot].view(*shape)  # noqa: E731  (no copy: it would raise)
    A = {s: view(a, s, L * M, r, d_in) for s in (1, 3)}
    B = {s: view(b, s, L * M, d_out, r) for s in (1, 3)}
    assert A[1].data_ptr() == a[0, 0, 1].data_ptr() and not A[1].is_contiguous()
    delta = {s: torch.stack([B[s][i] @ A[s][i] for i in range(L * M)]) for s in (1, 3)}
    merge_lora_terms(w, [(A[1], B[1], 1)])
    torch.testing.assert_close(w, w0 + delta[1])
    merge_lora_terms(w, [(A[3], B[3], 1), (A[1], B[1], -1)])
    torch.testing.assert_close(w, w0 + delta[3])
    merge_lora_terms(w, [(A[3], B[3], -1)])
    torch.testing.assert_close(w, w0)


def test_merge_terms_into_row_slices_of_a_stack():
    """GQA modules: each module's rows of a [L, sum d_out, d_in] stack take their own merge (weights as a row
    slice, not contiguous)."""
    g = torch.Generator().manual_seed(2)
    L, r, d_in = 2, 8, 16
    stack = torch.randn(L, 40, d_in, generator=g, dtype=torch.float64)
    s0 = stack.clone()
    a = torch.randn(L, r, d_in, generator=g, dtype=torch.float64)
    b = torch.randn(L, 8, r, generator=g, dtype=torch.float64)
    merge_lora_terms(stack[:, 24:32], [(a, b, -1)])
    torch.testing.assert_close(stack[:, 24:32], s0[:, 24:32] - b @ a)
    torch.testing.assert_close(stack[:, :24], s0[:, :24], rtol=0, atol=0)
    torch.testing.assert_close(stack[:, 32:], s0[:, 32:], rtol=0, atol=0)


def test_merge_terms_refuse_bad_input():
    w = torch.zeros(2, 8, 8)
    a, b = torch.zeros(2, 8, 8), torch.zeros(2, 8, 8)
    with pytest.raises(ValueError, match="one or two"):
        merge_lora_terms(w, [(a, b, 1)] * 3)
    with pytest.raises(ValueError, match="sign"):
        merge_lora_terms(w, [(a, b, 1), (a, b, 0)])
    with pytest.raises(ValueError, match="backend"):
        merge_lora(w, a, b, 1.0, backend="cutlass")


def test_stream_config_picks_the_smallest_that_covers_the_rank():
    class Ext:
        @staticmethod
        def merge_configs():
            return list(MERGE_CONFIGS)

        @staticmethod
        def merge_config_max_ranks():
            return [64, 128]

    assert stream_config(Ext, 64) == "mg_m128n128_r64"
    assert stream_config(Ext, 128) == "mg_m128n128_r128"  # a swap at rank 64
    assert stream_config(Ext, 136) is None and stream_config(None, 8) is None
