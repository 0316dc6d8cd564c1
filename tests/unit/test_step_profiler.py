"""engine.profile_dir: the serving loop writes a torch.profiler trace of a window of its steps."""
from __future__ import annotations

import json
import threading

import pytest

from vlora.config import ConfigError, EngineConfig
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.timeout(120)


def test_the_serving_loop_profiles_its_steps(tiny_model_dir, tmp_path):
    out = tmp_path / "prof"
    aeng = AsyncEngine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu",
        "engine.profile_dir": str(out), "engine.profile_steps": "[2, 3]"}))
    try:
        done = threading.Event()
        aeng.generate(GenerationRequest("p", "Hello there", sampling=SamplingParams(max_tokens=8, ignore_eos=True)),
                      lambda o: done.set() if o.finished else None, lambda e: pytest.fail(str(e)))
        assert done.wait(60)
    finally:
        aeng.shutdown()
    traces = list(out.glob("engine-steps-*.json"))
    assert len(traces) == 1, list(out.iterdir()) if out.exists() else "no folder"
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the steps' CPU ops
    assert "Self CPU" in traces[0].with_suffix(".txt").read_text()


def test_profile_steps_is_checked():
    with pytest.raises(ConfigError, match="engine.profile_steps"):
        EngineConfig().with_overrides({"engine.profile_steps": "[5, 0]"})
