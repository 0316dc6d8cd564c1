"""The engine against transformers + PEFT on the same weights, fp32 on the CPU: logits within 1e-4
relative error in one mixed step (three adapters of different ranks and targets, a base request,
prefill and decode together, images), and token-identical greedy generations."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from engine_parity import check_adapters_matter, check_mixed_batch, make_engine, make_reference  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_model_dir, demo_adapter_root):
    return make_engine(tiny_model_dir, demo_adapter_root, "cpu", "float32")


@pytest.fixture(scope="module")
def reference(tiny_model_dir, demo_adapter_root):
    return make_reference(tiny_model_dir, demo_adapter_root, "cpu", torch.float32)


def test_mixed_batch_matches_transformers_peft(engine, reference):
    check_mixed_batch(engine, reference, rtol=1e-4)


def test_adapters_change_the_output(engine, reference):
    check_adapters_matter(engine, reference)
