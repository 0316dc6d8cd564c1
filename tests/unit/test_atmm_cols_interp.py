"""The column-stationary ATMM expand (csrc/atmm/triton_lora.py: lora_expand_cols, compiled ahead of time into the
extension on GPU machines) under Triton's interpreter on CPU tensors, against a plain PyTorch reference: one
prompt, a prefill graph's layout (one sequence among empty segments), a mixed step (one-row decode segments first,
then prompts) and empty and slot-less segments among them; v written by the shrink, one fp32 partial, and two
partials; one to seven programs along the rows. Every output row must be updated exactly once. The kernel's
programmatic-dependent-launch waits are off here (PDL=False): the interpreter has no such instruction."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.interpreter

ATMM = Path(__file__).resolve().parents[2] / "csrc" / "atmm"
T, D_OUT, R, N_SLOTS, BM, BN = 70, 96, 16, 4, 16, 64
RANKS, SCALES = [16, 8, 16, 8], [0.5, 2.0, 1.0, 0.25]
LAYOUTS = {
    "one-prompt": ([0, T], [0]),
    "prefill-graph": ([0, T] + [T] * 5, [1] + [-1] * 5),
    "mixed": (list(range(11)) + [40, T], [i % N_SLOTS for i in range(12)]),
    "mixed-with-empty": (list(range(11)) + [40, 40, T] + [T] * 3, [i % N_SLOTS for i in range(11)] + [2, -1, 3, -1, -1]),
}


def reference(y, v, b, indptr, slots):
    out = y.clone()
    for s, slot in enumerate(slots):
        lo, hi = indptr[s], indptr[s + 1]
        if slot >= 0 and hi > lo:
            r = RANKS[slot]
            out[lo:hi] += SCALES[slot] * (v[lo:hi, :r] @ b[slot, :, :r].T)
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("splits", [0, 1, 2])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_expand_cols_updates_every_row_once(layout, splits, programs):
    import triton

    sys.path.insert(0, str(ATMM))
    try:
        import triton_lora
    finally:
        sys.path.remove(str(ATMM))
    indptr, slots = LAYOUTS[layout]
    g = torch.Generator().manual_seed(len(indptr) * 10 + splits)
    y = torch.randn(T, D_OUT, generator=g)
    v = torch.randn(T, R, generator=g)
    b = torch.randn(N_SLOTS, D_OUT, R, generator=g)
    partial = torch.randn(max(splits, 1), T, R, generator=g)
    want = reference(y, partial.sum(0) if splits else v, b, indptr, slots)
    got = y.clone()
    triton_lora.lora_expand_cols[(triton.cdiv(D_OUT, BN), programs)](
        got, v, partial, b, torch.tensor(SCALES), torch.tensor(RANKS, dtype=torch.int32),
        torch.tensor(indptr, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32), len(slots), T, D_OUT, R, D_OUT,
        splits, BM=BM, BN=BN, R=R, NS=2, SEGS=8, PDL=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
