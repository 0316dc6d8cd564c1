"""The merge operator against its layer-by-layer reference, on the CPU."""
from __future__ import annotations

import pytest
import torch

from vlora.atmm import merge_lora, merge_lora_reference


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
