"""AtmmKernels.run when the extension refuses a call: the PyTorch reference answers, a warning is
logged once, and forced configurations (the tuner's, the benchmarks') still see the error."""
from __future__ import annotations

import logging

import pytest
import torch

from vlora.atmm import AtmmKernels, atmm_reference
from vlora.atmm.dispatch import PHASE_SHRINK
from vlora.atmm.mapping import LoraBatchMapping


class _Table:
    def add(self, *args) -> None:
        pass

    def lookup(self, direction, dtype, tokens, width, rank, segments) -> dict:
        config = "shrink_cfg" if direction == "shrink" else "expand_cfg"
        return {"config": config, "split_k": 1, "exact": True, "default": False, "matched": config}


class _RefusingExt:
    """The extension's Python surface, with a forward that refuses every call as a kernel launch would."""

    MAX_SLOTS = 64

    def __init__(self) -> None:
        self.calls = 0

    TilingTable = _Table

    @staticmethod
    def configs() -> list[dict]:
        return [{"name": "shrink_cfg"}, {"name": "expand_cfg"}]

    @staticmethod
    def workspace_size(segments, split_k, tokens, r_max, dtype) -> int:
        return 1024

    def forward(self, *args) -> None:
        self.calls += 1
        raise RuntimeError("atmm: shrink shrink_cfg: operation not supported: dtype=bf16 T=1185")


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
    ext = _RefusingExt()
    kernels = AtmmKernels(ext=ext, load_table=False)
    y, x, a, b, ranks, scales, mapping = _case()
    expected = atmm_reference(y.clone(), x, a, b, ranks, scales, mapping)
    caplog.set_level(logging.WARNING, logger="vlora.atmm.dispatch")

    out = kernels.run(y, x, a, b, ranks, scales, mapping)
    assert out is y and torch.equal(y, expected)
    assert ext.calls == 1
    assert "operation not supported" in caplog.text and "PyTorch reference" in caplog.text

    # The same signature again: straight to the reference, no second refusal, no second warning.
    caplog.clear()
    y2 = _case()[0]
    kernels.run(y2, x, a, b, ranks, scales, mapping)
    assert torch.equal(y2, expected) and ext.calls == 1 and caplog.text == ""

    # Another token count with the same kernels: tried once more, answered, not warned again.
    y3, x3, a3, b3, _, _, m3 = _case(tokens=(4, 9), seed=1)
    expected3 = atmm_reference(y3.clone(), x3, a3, b3, ranks, scales, m3)
    kernels.run(y3, x3, a3, b3, ranks, scales, m3)
    assert torch.equal(y3, expected3) and ext.calls == 2 and caplog.text == ""


@pytest.mark.parametrize("forced", [{"shrink": ("shrink_cfg", 1)}, {"expand": "expand_cfg"}, {"phases": PHASE_SHRINK}])
def test_forced_configurations_still_raise(forced):
    kernels = AtmmKernels(ext=_RefusingExt(), load_table=False)
    y, x, a, b, ranks, scales, mapping = _case()
    before = y.clone()
    with pytest.raises(RuntimeError, match="operation not supported"):
        kernels.run(y, x, a, b, ranks, scales, mapping, **forced)
    assert torch.equal(y, before)


class _CallExt(_RefusingExt):
    """An extension whose table answers with a fused call (kind "call") for one direction."""

    def __init__(self, shrink_hit: str, expand_hit: str) -> None:
        super().__init__()
        hits = {"shrink": shrink_hit, "expand": expand_hit}

        class Table(_Table):
            def lookup(self, direction, dtype, tokens, width, rank, segments) -> dict:
                config = hits[direction] if self.loaded else ("default_" + direction)
                return {"config": config, "split_k": 4 if config == "fc" else 1, "exact": self.loaded,
                        "default": not self.loaded, "matched": config}

        self.made = 0
        ext = self

        def table():  # the first table is the kernels' own (the loaded one); later ones are fresh
            t = Table()
            t.loaded = ext.made == 0
            ext.made += 1
            return t

        self.TilingTable = table

    @staticmethod
    def configs() -> list[dict]:
        return [{"name": n, "kind": k} for n, k in (("shrink_cfg", "stream"), ("expand_cfg", "stream"), ("fc", "call"),
                                                  ("default_shrink", "stream"), ("default_expand", "stream"))]


@pytest.mark.parametrize("hits, plan", [
    (("fc", "fc"), ("fc", 4, "fc")),                        # the table names the fused call for both
    (("fc", "expand_cfg"), ("fc", 4, "fc")),                # shrink's key is a fused call: it runs the call
    (("shrink_cfg", "fc"), ("shrink_cfg", 1, "default_expand")),  # expand's alone: the default rule's expand
    (("shrink_cfg", "expand_cfg"), ("shrink_cfg", 1, "expand_cfg")),
])
def test_plan_keeps_a_fused_call_whole(hits, plan):
    """A fused call (one launch for shrink and expand) is never paired with another kernel, even when
    the nearest keys of the two directions disagree."""
    ext = _CallExt(*hits)
    kernels = AtmmKernels(ext=ext, load_table=False)
    _, _, _, _, ranks, _, mapping = _case()
    shrink_idx, split_k, expand_idx, _, _ = kernels._plan("bf16", 12, 32, 24, 8, ranks, mapping, None, None)
    names = kernels.config_names
    assert (names[shrink_idx], split_k, names[expand_idx]) == plan
