"""Fixtures shared by the GPU tests (tests/gpu): each module skips itself where CUDA or the extension is missing."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kernels():
    """The extension's kernels with no tiling table: every test names its configurations or takes the built-in rule."""
    from vlora.atmm import AtmmKernels

    return AtmmKernels(load_table=False)
