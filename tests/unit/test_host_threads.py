"""engine.host_threads: PyTorch's intra-op CPU threads, set once the model's weights are loaded (auto: 1 on CUDA, unchanged on a
CPU, where the model computes on them), and engine.switch_interval_ms, the GIL switch interval; a bad value of either is refused
with the key's name."""
from __future__ import annotations

import pytest
import torch

from vlora.config import ConfigError, EngineConfig
from vlora.engine.builder import build_engine


def test_host_threads_is_set_when_the_engine_is_built(tiny_model_dir):
    before = torch.get_num_threads()
    try:
        build_engine(EngineConfig().with_overrides({
            "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "64",
            "engine.host_threads": "1"}))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        build_engine(EngineConfig().with_overrides({  # auto on a CPU: PyTorch's own setting stays
            "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "64"}))
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["0", "many", "true", "2.5"])
def test_a_bad_host_threads_is_refused(value):
    with pytest.raises(ConfigError, match="engine.host_threads"):
        EngineConfig().with_overrides({"engine.host_threads": value})


def test_switch_interval_is_set_when_the_engine_is_built(tiny_model_dir):
    import sys

    before = sys.getswitchinterval()
    try:
        build_engine(EngineConfig().with_overrides({
            "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "64",
            "engine.switch_interval_ms": "0.5"}))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        sys.setswitchinterval(before)
        build_engine(EngineConfig().with_overrides({  # auto on a CPU: Python's own setting stays
            "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "64"}))
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("value", ["0", "1000", "true", "fast"])
def test_a_bad_switch_interval_is_refused(value):
    with pytest.raises(ConfigError, match="engine.switch_interval_ms"):
        EngineConfig().with_overrides({"engine.switch_interval_ms": value})
