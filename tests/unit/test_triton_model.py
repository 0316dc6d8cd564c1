"""model_repository/vlora/1/model.py on the tiny model with a fake pb_utils (tests/fake_pb_utils.py): streamed
requests through the outbox and the response thread (woken once per engine step), and the metrics, which the
engine accumulates and finalize() flushes, count every request and token."""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from fake_pb_utils import COMPLETE_FINAL, FakeRequest, fake_pb_utils

pytestmark = pytest.mark.timeout(300)

MODEL_PY = Path(__file__).resolve().parents[2] / "model_repository" / "vlora" / "1" / "model.py"


@pytest.fixture
def triton_model(tiny_model_dir, demo_adapter_root, monkeypatch):
    pb = fake_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location("vlora_triton_model_under_test", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    params = {"model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cpu",
              "model.dtype": "float32", "lora.max_rank": "32"}
    config = {"model_transaction_policy": {"decoupled": True},
              "parameters": {k: {"string_value": v} for k, v in params.items()}}
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_name": "vlora", "model_version": "1"})
    yield model, pb
    model.finalize()


def test_streams_and_metrics_through_the_model(triton_model):
    model, pb = triton_model
    max_tokens = 12
    sp = json.dumps({"max_tokens": max_tokens, "ignore_eos": True})
    streams = [FakeRequest({"text_input": f"USER: Count to {i}. ASSISTANT:", "stream": True, "sampling_parameters": sp})
               for i in range(4)]
    single = FakeRequest({"text_input": "USER: hello ASSISTANT:", "sampling_parameters": sp})
    model.execute(streams + [single])
    deadline = time.monotonic() + 120
    while not all(any(flags for _, flags in r.sender.sent) for r in streams + [single]):
        assert time.monotonic() < deadline, "not every request got its final response"
        time.sleep(0.02)
    model.finalize()  # drains the engine, joins the response thread, flushes the metrics

    for r in streams:
        sent = r.sender.sent
        assert [flags for _, flags in sent] == [0] * (len(sent) - 1) + [COMPLETE_FINAL]
        assert not any(resp.has_error() for resp, _ in sent)
        assert sum(resp.text("num_output_tokens") for resp, _ in sent) == max_tokens
        assert 1 < len(sent) <= max_tokens  # streamed, at most one response per token
        assert sent[-1][0].text("finish_reason") == "length"
    final = single.sender.final
    assert final.text("num_output_tokens") == max_tokens and final.text("text_output")

    f = pb.families
    assert f["vlora_requests_total"].find(lora_name="__base__").value() == 5
    assert f["vlora_output_tokens_total"].find(lora_name="__base__").value() == 5 * max_tokens
    assert f["vlora_requests_finished_total"].find(lora_name="__base__", finish_reason="length").value() == 5
    steps = f["vlora_engine_steps_total"].find().value()
    assert steps >= max_tokens and len(f["vlora_step_duration_seconds"].find().observations) == steps
    assert f["vlora_decode_tokens_total"].find().value() == 5 * (max_tokens - 1)
    assert (f["vlora_running_requests"].find().value(), f["vlora_waiting_requests"].find().value()) == (0, 0)
