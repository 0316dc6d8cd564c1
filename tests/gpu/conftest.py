"""Fixtures shared by the GPU tests (tests/gpu): each module skips itself where CUDA or the extension is missing."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kernels():
    """The extension's kernels with no tiling table: every test names its configurations or takes the built-in rule."""
    from vlora.atmm import AtmmKernels

    return AtmmKernels(load_table=False)


@pytest.fixture(autouse=True)
def _no_tuner_sidecar(request, monkeypatch):
    """Engines built by the GPU tests start no ATMM tuner sidecar, except in the sidecar's own tests.

    On a GPU without a committed tiling table (an H200) every engine built with ``atmm.tune_at_load: auto``
    starts one, which profiles for up to ``atmm.tune_budget_s``: a dozen of them ran at once under the
    later tests of one device call and slowed them past its time limit."""
    if "tuner" in request.node.path.name:
        return
    from vlora.engine import builder

    monkeypatch.setattr(builder, "start_tuner", lambda *args, **kwargs: None)
