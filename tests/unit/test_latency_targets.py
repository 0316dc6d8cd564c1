"""Latency targets per application: ``latency_target`` (seconds) on the wire as a sampling parameter, checked
before anything is queued, and per adapter in ``orchestrator.latency_targets``; the request's own wins, and
the scheduler's candidate carries it (the policy starves a request against it instead of ``theta_s``)."""
from __future__ import annotations

import json

import pytest

from fake_pb_utils import FakeRequest, fake_pb_utils
from vlora.config import ConfigError, EngineConfig, OrchestratorConfig
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.builder import build_engine
from vlora.errors import InvalidRequest
from vlora.server.wire import Wire


@pytest.mark.parametrize("value,want", [(0.5, 0.5), (2, 2.0), ("0.25", 0.25), (86400, 86400.0)])
def test_accepted_as_seconds(value, want):
    assert SamplingParams.from_dict({"latency_target": value}).latency_target == want


@pytest.mark.parametrize("value", [0, -1, 0.0, 86401, "abc", "nan", "inf", True, [1]])
def test_refused_with_a_clear_error(value):
    with pytest.raises(InvalidRequest, match="latency_target must be a (positive )?number"):
        SamplingParams.from_dict({"latency_target": value})


def test_json_nan_is_refused():
    from vlora.engine.api import parse_sampling_json

    with pytest.raises(InvalidRequest, match="latency_target"):
        SamplingParams.from_dict(parse_sampling_json('{"latency_target": NaN}'))


def test_on_the_wire_as_a_request_parameter_or_in_sampling_parameters():
    wire = Wire(fake_pb_utils())
    parsed = wire.parse(FakeRequest({"text_input": "hi"}, {"latency_target": 0.3}), "r1", fault_injection=False)
    assert parsed.gen.sampling.latency_target == 0.3
    parsed = wire.parse(FakeRequest({"text_input": "hi", "sampling_parameters": json.dumps({"latency_target": "1.5"})}),
                        "r2", fault_injection=False)
    assert parsed.gen.sampling.latency_target == 1.5
    with pytest.raises(InvalidRequest, match="latency_target"):
        wire.parse(FakeRequest({"text_input": "hi"}, {"latency_target": -2}), "r3", fault_injection=False)


def test_per_adapter_targets_are_checked():
    with pytest.raises(ConfigError, match="latency_targets"):
        OrchestratorConfig(latency_targets={"a": float("inf")})
    with pytest.raises(ConfigError, match="latency_targets"):
        OrchestratorConfig(latency_targets={"a": 0})
    assert OrchestratorConfig(latency_targets={"a": 0.5}).latency_targets == {"a": 0.5}


def test_the_scheduler_sees_the_request_target_else_the_adapters(tiny_model_dir, demo_adapter_root):
    cfg = EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "32", "lora.max_gpu_adapters": "2", "orchestrator.policy": "vlora",
        "orchestrator.cost_model": "default", "orchestrator.latency_targets": "{demo-r8-qv: 0.7}"})
    engine = build_engine(cfg)
    cases = [("own", "demo-r8-qv", 0.2, 0.2), ("adapter's", "demo-r8-qv", None, 0.7), ("theta", "demo-r32-mlp", None, None),
             ("base", None, None, None)]
    for rid, adapter, target, want in cases:
        prepared = engine.inputs.prepare(GenerationRequest(rid, "Count the circles.", lora_name=adapter,
                                                           sampling=SamplingParams(max_tokens=2, latency_target=target)))
        assert prepared.latency_target == target
        engine.add_request(prepared, lambda out: None)
        assert engine.waiting[-1].candidate.latency_target == want, rid
    while engine.has_work():
        engine.step()
