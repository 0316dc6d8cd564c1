"""Shared fixtures: the generated tiny model and its demo adapters, built once per test session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # shared test helpers (engine_parity) import from here


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
