"""engine.host_threads: PyTorch's intra-op CPU threads, set once the model's weights are loaded (auto: 1 on CUDA, unchanged on a
CPU, where the model computes on them), and engine.switch_interval_ms, the GIL switch interval; a bad value of either is refused
with the key's name."""
from __future__ import annotations

import pytest
import torch

from vlora.config import ConfigError, EngineConfig
from vlora.engine.builder import build_engine


import sys

# setting, value set, how to read the process's figure and put it back, what the value gives
SETTINGS = [("engine.host_threads", "1", torch.get_num_threads, torch.set_num_threads, 1),
            ("engine.switch_interval_ms", "0.5", sys.getswitchinterval, sys.setswitchinterval, pytest.approx(0.0005))]


def _build_cpu_engine(tiny_model_dir, **over):
    build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "64",
        **over}))


@pytest.mark.parametrize("key,value,read,restore,want", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_the_setting_is_applied_when_the_engine_is_built(tiny_model_dir, key, value, read, restore, want):
    before = read()
    try:
        _build_cpu_engine(tiny_model_dir, **{key: value})
        assert read() == want
        restore(before)
        _build_cpu_engine(tiny_model_dir)  # auto on a CPU: the process's own setting stays
        assert read() == before
    finally:
        restore(before)


@pytest.mark.parametrize("key,value", [("engine.host_threads", v) for v in ("0", "many", "true", "2.5")]
                         + [("engine.switch_interval_ms", v) for v in ("0", "1000", "true", "fast")])
def test_a_bad_value_is_refused(key, value):
    with pytest.raises(ConfigError, match=key):
        EngineConfig().with_overrides({key: value})
