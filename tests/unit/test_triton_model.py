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


def test_refused_requests_leave_no_reference_cycle(triton_model):
    """Issue 37 hole 6: a request refused inside execute() (by the image budget, the engine's checks or the
    wire's parse) is freed by reference counting as soon as it is answered. The answer once kept the error,
    whose traceback holds execute()'s frame, which holds the deferred answers: a cycle that kept each refused
    request's images until Python's cyclic collector ran (after a flood: 160 MiB of the stub, for minutes)."""
    import base64
    import gc
    import io
    import threading
    import types

    from PIL import Image

    from vlora.engine.preprocess import ImageBudget

    model, _ = triton_model
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, "PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    budget = ImageBudget(1 << 20)
    held = budget.take(1 << 20)  # another request's images in flight: the budget refuses the next one
    model._engine.image_budget = budget

    def refused() -> list:
        return [FakeRequest({"text_input": "USER: <image>\nWhat? ASSISTANT:", "image": [image]}),  # the budget
                FakeRequest({"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": "nope"})}),  # check
                FakeRequest({"text_input": "hi", "sampling_parameters": "{"})]  # the wire's parse

    gc.collect()
    gc.disable()
    try:
        batches = [refused(), refused()]  # the second: what the response thread last ran is not the first's
        for requests in batches:
            model.execute(requests)
            deadline = time.monotonic() + 30
            while not all(r.sender.sent for r in requests):
                assert time.monotonic() < deadline, "not every request was answered"
                time.sleep(0.02)
        flushed = threading.Event()  # the response thread has moved past the answers it ran
        model._post(("flushed", flushed))
        assert flushed.wait(30)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        frames = [f"{o.f_code.co_name} ({Path(o.f_code.co_filename).name})" for o in gc.garbage
                  if isinstance(o, types.FrameType)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        held.release()
    errors = [r.sender.final.error().message() for r in batches[0]]
    assert "limits.max_inflight_image_bytes" in errors[0] and "nope" in errors[1], errors
    assert not frames, f"a refusal left frames in a reference cycle: {frames}"


def test_a_final_answer_that_could_not_be_sent_is_sent_again(triton_model):
    """Triton counts a decoupled request in flight until its sender sends the final flag, and a stopping server
    waits for it (then exits 1 without finalize()). When every send of a request fails for a while (the answer
    and the error after it), the response thread sends a bare final flag again until it goes through."""
    model, _ = triton_model
    request = FakeRequest({"text_input": "USER: hello ASSISTANT:", "stream": True,
                           "sampling_parameters": json.dumps({"max_tokens": 4, "ignore_eos": True})})
    request.sender.fail = True
    model.execute([request])
    time.sleep(1.2)  # its outputs and the error after them failed; at least one retry failed too
    assert request.sender.sent == []
    request.sender.fail = False
    deadline = time.monotonic() + 10
    while not request.sender.sent:
        assert time.monotonic() < deadline, "the final flag was never sent again"
        time.sleep(0.02)
    assert request.sender.sent == [(None, COMPLETE_FINAL)]


def test_a_cancellation_is_repeated_until_the_request_ends(triton_model):
    """A client that leaves while its request is still on the image workers: the engine does not know the request
    yet and drops the first cancellation, so the response thread cancels it again at each poll until it ends."""
    model, pb = triton_model
    cancels = []
    model._engine.cancel = cancels.append
    sender = FakeRequest().sender
    sender.cancelled = True
    state = type(model)._poll_cancelled.__globals__["_InFlight"](request_id="r1", sender=sender, stream=True, prefix="")
    inflight = {"r1": state}
    model._poll_cancelled(inflight)
    model._poll_cancelled(inflight)
    assert cancels == ["r1", "r1"] and state.cancel_requested
    del inflight["r1"]  # its final event came: no more
    model._poll_cancelled(inflight)
    assert cancels == ["r1", "r1"]
