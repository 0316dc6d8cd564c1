"""AtmmKernels.run when the extension refuses a call: the PyTorch reference answers, a warning is
logged once, and forced configurations (the tuner's, the benchmarks') still see the error."""
from __future__ import annotations

import logging

import pytest
import torch

from vlora.atmm import AtmmKernels, atmm_reference
from vlora.atmm.dispatch import PHASE_SHRINK
from vlora.atmm.mapping import LoraBatchMapping

from helpers import FakeAtmmExt


REFUSAL = "atmm: shrink shrink_cfg: operation not supported: dtype=bf16 T=1185"


def _refusing() -> FakeAtmmExt:
    """The extension, with a forward that refuses every call as a kernel launch would."""
    return FakeAtmmExt(suffix="_cfg", refuse=REFUSAL)


def _case(tokens=(5, 7), slots=(0, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    d_in, d_out, r_max, n_slots = 32, 24, 8, 2
    T = sum(tokens)
    x = torch.randn(T, d_in, generator=g).to(torch.bfloat16)
    y = torch.randn(T, d_out, generator=g).to(torch.bfloat16)
    a = torch.randn(n_slots, r_max, d_in, generator=g).to(torch.bfloat16)
    b = torch.randn(n_slots, d_out, r_max, generator=g).to(torch.bfloat16)
    mapping = LoraBatchMapping.from_token_slots(list(tokens), list(slots))
    return y, x, a, b, (8, 8), (0.5, 2.0), mapping


def test_refused_call_is_served_by_the_reference_and_warned_once(caplog):
    ext = _refusing()
    kernels = AtmmKernels(ext=ext, load_table=False)
    y, x, a, b, ranks, scales, mapping = _case()
    expected = atmm_reference(y.clone(), x, a, b, ranks, scales, mapping)
    caplog.set_level(logging.WARNING, logger="vlora.atmm.dispatch")

    out = kernels.run(y, x, a, b, ranks, scales, mapping)
    assert out is y and torch.equal(y, expected)
    assert len(ext.calls) == 1
    assert "operation not supported" in caplog.text and "PyTorch reference" in caplog.text

    # The same signature again: straight to the reference, no second refusal, no second warning.
    caplog.clear()
    y2 = _case()[0]
    kernels.run(y2, x, a, b, ranks, scales, mapping)
    assert torch.equal(y2, expected) and len(ext.calls) == 1 and caplog.text == ""

    # Another token count with the same kernels: tried once more, answered, not warned again.
    y3, x3, a3, b3, _, _, m3 = _case(tokens=(4, 9), seed=1)
    expected3 = atmm_reference(y3.clone(), x3, a3, b3, ranks, scales, m3)
    kernels.run(y3, x3, a3, b3, ranks, scales, m3)
    assert torch.equal(y3, expected3) and len(ext.calls) == 2 and caplog.text == ""


@pytest.mark.parametrize("forced", [{"shrink": ("shrink_cfg", 1)}, {"expand": "expand_cfg"}, {"phases": PHASE_SHRINK}])
def test_forced_configurations_still_raise(forced):
    kernels = AtmmKernels(ext=_refusing(), load_table=False)
    y, x, a, b, ranks, scales, mapping = _case()
    before = y.clone()
    with pytest.raises(RuntimeError, match="operation not supported"):
        kernels.run(y, x, a, b, ranks, scales, mapping, **forced)
    assert torch.equal(y, before)


def test_plan_takes_each_direction_from_the_table():
    """The shrink (with its split) and the expand of a call come from the table's entry of each direction."""
    kernels = AtmmKernels(ext=FakeAtmmExt(suffix="_cfg", shrink_split=4, kind="stream", refuse=REFUSAL), load_table=False)
    _, _, _, _, ranks, _, mapping = _case()
    shrink_idx, split_k, expand_idx, _, _ = kernels.plan_call("bf16", 12, 32, 24, 8, ranks, mapping.num_segments, mapping.seg_slot_host)
    names = kernels.config_names
    assert (names[shrink_idx], split_k, names[expand_idx]) == ("shrink_cfg", 4, "expand_cfg")
