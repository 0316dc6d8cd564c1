"""Shared fixtures: the generated tiny model and its demo adapters, built once per test session."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # shared test helpers (helpers, engine_parity) import from here


@pytest.fixture(scope="session")
def vlora_cache(tmp_path_factory):
    """A cache folder private to this test session (the tiny model and demo adapters are generated into it)."""
    return tmp_path_factory.mktemp("vlora-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(vlora_cache):
    from vlora.models.tiny import ensure_tiny_model

    return ensure_tiny_model(vlora_cache)


@pytest.fixture(scope="session")
def demo_adapter_root(tiny_model_dir, vlora_cache):
    from vlora.lora.demo import ensure_demo_adapters

    return ensure_demo_adapters(tiny_model_dir, vlora_cache / "demo-adapters")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``interpreter`` run the Triton-language kernels on CPU tensors under Triton's interpreter.

    The kernel modules read TRITON_INTERPRET when they are imported (and make every CPU tensor take the
    interpreted kernels), so these tests need a pytest process of their own with TRITON_INTERPRET=1: `make
    test` runs the suite with ``-m "not interpreter"``, then these with ``-m interpreter`` under the
    interpreter. Elsewhere they are skipped, saying why."""
    if importlib.util.find_spec("triton") is None:
        reason = "needs triton (the dev extra installs it) to run the Triton kernels under its interpreter"
    elif os.environ.get("TRITON_INTERPRET") != "1":
        reason = "runs under Triton's interpreter only: TRITON_INTERPRET=1 pytest -m interpreter (make test does)"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)
