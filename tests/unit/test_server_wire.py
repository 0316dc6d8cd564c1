"""vlora.server.wire with a fake pb_utils: the Triton vLLM backend's wire format, as the Triton model reads
requests and writes responses (the e2e tests run the same code inside a real tritonserver)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fake_pb_utils import COMPLETE_FINAL, FakeRequest, FakeSender, TritonError
from vlora.engine.api import GenerationOutput, SamplingParams
from vlora.errors import InvalidRequest
from vlora.server.wire import FAULT_KEY, SAMPLING_KEYS, Wire


def parse(wire, inputs, parameters=None, fault_injection=False):
    return wire.parse(FakeRequest(inputs, parameters), "rid", fault_injection=fault_injection)


def test_a_full_request(wire):
    parsed = parse(wire, {
        "text_input": "USER: <image>\nWhat? ASSISTANT:",
        "image": ["aGVsbG8=", "d29ybGQ="],
        "stream": True,
        "exclude_input_in_output": False,
        "sampling_parameters": json.dumps({"max_tokens": 5, "temperature": 0.5, "seed": 3, "task": "color",
                                           "apply_chat_template": True}),
    }, parameters={"lora_name": "demo-r8-qv", "stop": ["\n"]})
    gen = parsed.gen
    assert (gen.request_id, gen.prompt, gen.images) == ("rid", "USER: <image>\nWhat? ASSISTANT:", [b"aGVsbG8=", b"d29ybGQ="])
    assert (gen.lora_name, gen.stream, gen.apply_chat_template, gen.task) == ("demo-r8-qv", True, True, "color")
    assert gen.sampling == SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop=("\n",))
    assert parsed.exclude_input is False and parsed.fault is None


def test_defaults_and_the_json_input_over_the_parameters(wire):
    parsed = parse(wire, {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 7})},
                   parameters={"max_tokens": 3, "stream": True})  # "stream" as a parameter: accepted, ignored
    assert parsed.gen.sampling.max_tokens == 7 and parsed.gen.stream is False and parsed.gen.images == []
    assert parsed.exclude_input is True and parsed.gen.lora_name is None
    assert parse(wire, {"text_input": "hi"}, parameters={"lora_name": ""}).gen.lora_name is None


@pytest.mark.parametrize("inputs,parameters,words", [
    ({}, None, "text_input is required"),
    ({"text_input": np.array([], dtype=np.object_)}, None, "text_input is required"),
    ({"text_input": b"\xff\xfe"}, None, "not valid UTF-8"),
    ({"text_input": "hi"}, {"nope": 1}, "unknown request parameter(s) ['nope']"),
    ({"text_input": "hi"}, {FAULT_KEY: "kill"}, f"unknown request parameter(s) ['{FAULT_KEY}']"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({FAULT_KEY: "kill"})}, None, FAULT_KEY),
    ({"text_input": "hi", "sampling_parameters": "[1]"}, None, "must be a JSON object"),
    ({"text_input": "hi"}, {"lora_name": 3}, "lora_name must be a string"),
    ({"text_input": "hi"}, {"apply_chat_template": "yes"}, "apply_chat_template must be true or false"),
    ({"text_input": "hi"}, {"task": 1}, "task must be a string"),
    ({"text_input": "hi"}, {"max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"top_k": 3})}, None, "top_k"),
])
def test_bad_requests_are_refused_naming_the_problem(wire, inputs, parameters, words):
    with pytest.raises(InvalidRequest) as e:
        parse(wire, inputs, parameters)
    assert words in str(e.value)


def test_the_unknown_parameter_message_lists_what_is_accepted(wire):
    with pytest.raises(InvalidRequest) as e:
        parse(wire, {"text_input": "hi"}, {"nope": 1})
    for key in SAMPLING_KEYS + ("adapter_action",):
        assert key in str(e.value)


def test_the_fault_parameter_passes_only_where_fault_injection_is_on(wire):
    parsed = parse(wire, {"text_input": "hi"}, {FAULT_KEY: "wedge"}, fault_injection=True)
    assert parsed.fault == "wedge"


def out(**kw):
    base = dict(request_id="rid", text_delta="", text="", finished=False)
    return GenerationOutput(**{**base, **kw})


def values(pb_tensors):
    got = {}
    for t in pb_tensors:
        a = t.as_numpy()
        got[t.name()] = [x.decode() if isinstance(x, bytes) else x.item() for x in a.reshape(-1)]
    return got


def test_streamed_responses_count_the_new_tokens(wire):
    assert wire.output_tensors(out(text_delta=""), stream=True, prefix="", sent_output_tokens=0) is None
    first = wire.output_tensors(out(text_delta="Hel", num_input_tokens=9, num_output_tokens=2), stream=True,
                                prefix="ignored", sent_output_tokens=0)
    assert values(first) == {"text_output": ["Hel"], "num_input_tokens": [9], "num_output_tokens": [2]}
    last = wire.output_tensors(out(text_delta="lo", finished=True, finish_reason="length", num_input_tokens=9,
                                   num_output_tokens=3), stream=True, prefix="", sent_output_tokens=2)
    assert values(last) == {"text_output": ["lo"], "num_input_tokens": [9], "num_output_tokens": [1],
                            "finish_reason": ["length"]}
    assert last[1].as_numpy().dtype == np.uint32


def test_a_whole_response_carries_the_prefix_and_a_head_answer(wire):
    assert wire.output_tensors(out(text_delta="x"), stream=False, prefix="", sent_output_tokens=0) is None
    answer = {"label": "red", "scores": [0.9, 0.1], "labels": ["red", "blue"]}
    tensors = wire.output_tensors(out(text="red", finished=True, num_input_tokens=4, num_output_tokens=1, extra=answer),
                                  stream=False, prefix="PROMPT ", sent_output_tokens=0)
    got = values(tensors)
    assert got["text_output"] == ["PROMPT red"] and got["finish_reason"] == ["stop"]  # no reason given: stop
    assert got["label"] == ["red"] and got["label_names"] == ["red", "blue"]
    assert np.allclose(got["scores"], [0.9, 0.1]) and tensors[-2].as_numpy().dtype == np.float32


def test_errors_carry_the_code_and_a_failed_send_is_logged(wire, pb):
    sender = FakeSender()
    wire.send_error(sender, "bad")
    wire.send_error(sender, "busy", unavailable=True)
    wire.send_cancelled(sender)
    got = [(r.error().message(), r.error().code(), flags) for r, flags in sender.sent]
    assert got == [("[INVALID_ARG] bad", TritonError.INVALID_ARG, COMPLETE_FINAL),
                   ("[UNAVAILABLE] busy", TritonError.UNAVAILABLE, COMPLETE_FINAL),
                   ("[CANCELLED] request cancelled", TritonError.CANCELLED, COMPLETE_FINAL)]
    wire.send_error(FakeSender(fail=True), "bad")
    wire.send_cancelled(FakeSender(fail=True))
    assert "sending an error failed" in pb.Logger.said("error")[0]
    assert "sending a cancellation failed" in pb.Logger.said("warn")[0]


def test_a_triton_without_the_cancelled_code_sends_its_default_code(pb):
    """Older Triton releases have no TritonError.CANCELLED: the error still goes out, with the default code."""

    class OlderTritonError:
        def __init__(self, message, code=TritonError.UNKNOWN):
            self._message, self._code = message, code

        message, code = TritonError.message, TritonError.code

    pb.TritonError = OlderTritonError
    sender = FakeSender()
    Wire(pb).send_cancelled(sender)
    assert (sender.final.error().message(), sender.final.error().code()) == ("[CANCELLED] request cancelled", TritonError.UNKNOWN)


# --- issue 37 holes 3 and 5: clean text in every string field, the code in every error message ---
@pytest.mark.parametrize("inputs,parameters,words", [
    ({"text_input": b"hi \xed\xa0\x80"}, None, "text_input is not valid UTF-8"),  # an encoded surrogate
    ({"text_input": "hi \x00 there"}, None, "text_input holds a NUL"),
    ({"text_input": "hi", "sampling_parameters": b'{"lora_name": "\xff"}'}, None, "sampling_parameters is not valid UTF-8"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": "a\ud800"})}, None, "lora_name holds a lone UTF-16 surrogate"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": "a\x00"})}, None, "lora_name holds a NUL"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"task": "\udfff"})}, None, "task holds a lone"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"stop": ["ok", "\ud800"]})}, None, "stop holds a lone"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"stop": ["\x00"]})}, None, "stop holds a NUL"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"\ud800": 1})}, None, "sampling_parameters holds a lone"),
    ({"text_input": "hi"}, {"lora_name": "a\ud800"}, "lora_name holds a lone"),
    ({"text_input": "hi"}, {"task": "a\x00"}, "task holds a NUL"),
])
def test_text_that_is_not_clean_is_refused_naming_the_field(wire, inputs, parameters, words):
    with pytest.raises(InvalidRequest) as e:
        parse(wire, inputs, parameters)
    assert words in str(e.value)
    assert "\ud800" not in str(e.value) and "\x00" not in str(e.value)  # never quoted (it may be a token)


def test_parameters_the_stub_cannot_decode_are_refused_naming_the_key(wire):
    """Triton hands the stub a request parameter's bytes as they came: the stub's parameters() raises."""

    class Undecodable(FakeRequest):
        def parameters(self) -> str:
            return b'{"max_tokens": 2, "lora_name": "a\xffb"}'.decode("utf-8")

    with pytest.raises(InvalidRequest, match=r"request parameter 'lora_name' is not valid UTF-8"):
        wire.parse(Undecodable({"text_input": "hi"}), "rid", fault_injection=False)


def test_an_error_message_quoting_a_clients_bad_text_is_still_sent(wire):
    """A message quoting a lone surrogate or a NUL (which pybind11 and Triton's C strings cannot carry) goes
    out escaped, with its code prefix; INTERNAL has its own code."""
    sender = FakeSender()
    assert wire.send_error(sender, "unknown adapter 'a\ud800\x00b'") is True
    assert sender.final.error().message() == "[INVALID_ARG] unknown adapter 'a\\ud800\\x00b'"
    internal = FakeSender()
    wire.send_error(internal, "internal error: boom", internal=True)
    assert (internal.final.error().code(), internal.final.error().message()) == (TritonError.INTERNAL, "[INTERNAL] internal error: boom")
    assert wire.send_error(FakeSender(fail=True), "x") is False


class _BackendSender:
    """The Python backend's sender as far as Sender relies on it: a final flag frees the request's response
    factory in the server process (so is_cancelled() after it would read freed memory), and its own closed flag
    refuses any send after a final one, before it reaches the server."""

    def __init__(self) -> None:
        self.freed = self.closed = False
        self.polls_after_final = 0
        self.sent = 0

    def send(self, response=None, flags=0) -> None:
        if self.closed:
            raise RuntimeError("Unable to send response. Response sender has been closed.")
        if flags & COMPLETE_FINAL:
            self.closed = True
        time.sleep(0.0002)  # the round trip to the server, during which it frees the factory
        self.sent += 1
        if flags & COMPLETE_FINAL:
            self.freed = True

    def is_cancelled(self) -> bool:
        if self.freed or self.closed:
            self.polls_after_final += 1
        time.sleep(0.0001)
        return False


def test_a_sender_is_never_asked_about_cancellation_after_its_final_flag(wire):
    """The crash of Triton 2.51 the router hit: a watcher thread polls is_cancelled() while another thread sends
    the final answer. Through Sender the poll either comes before the send or answers False without asking."""
    backend = [_BackendSender() for _ in range(200)]
    senders = [wire.sender(_request_with(b)) for b in backend]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for s in senders:
                assert s.is_cancelled() is False

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for s in senders:
            s.send("a token")
            s.send("the rest", flags=COMPLETE_FINAL)
    finally:
        done.set()
        watcher.join()
    assert all(b.sent == 2 for b in backend)
    assert sum(b.polls_after_final for b in backend) == 0
    with pytest.raises(RuntimeError, match="closed"):  # a second final flag is the backend's to refuse
        senders[0].send(None, flags=COMPLETE_FINAL)


def test_a_final_flag_whose_send_failed_can_be_sent_again(wire):
    """A send that fails before it reaches the server (here: the backend refuses its arguments) leaves the sender
    open in the backend: the model's retry of the final flag goes through, and polling stays off meanwhile."""

    class Refusing(_BackendSender):
        refuse = True

        def send(self, response=None, flags=0) -> None:
            if self.refuse:
                self.refuse = False
                raise RuntimeError("Inference Response object must be provided")
            super().send(response, flags)

    backend = Refusing()
    sender = wire.sender(_request_with(backend))
    with pytest.raises(RuntimeError):
        sender.send(None, flags=COMPLETE_FINAL)
    assert sender.is_cancelled() is False and backend.polls_after_final == 0
    sender.send(None, flags=COMPLETE_FINAL)
    assert backend.sent == 1 and backend.freed


def test_every_response_sender_is_taken_through_wire():
    """A sender taken straight from a request (request.get_response_sender()) has no such guard."""
    root = Path(__file__).resolve().parents[2]
    offenders = [str(p.relative_to(root)) for base in ("backend", "model_repository") for p in (root / base).rglob("*.py")
                 if "get_response_sender()" in p.read_text() and p.name != "wire.py"]
    assert offenders == []




def test_open_senders_name_the_requests_left_without_a_final_flag(wire, pb):
    """Triton holds a request (and the model, at shutdown) until its final flag: a sender dropped without one, and
    one with nothing sent for long, are logged with what the request is; a final flag takes a sender off the list."""
    import gc

    answered, dropped, waiting = (wire.sender(FakeRequest()) for _ in range(3))
    for s, note in ((answered, "request a"), (dropped, "request b"), (waiting, "request c")):
        s.note = note
    assert len(wire.senders) == 3
    answered.send(None, flags=COMPLETE_FINAL)
    answered.send(None, flags=COMPLETE_FINAL)  # a second try of the same final flag changes nothing
    assert len(wire.senders) == 2
    del answered, dropped
    gc.collect()
    assert len(wire.senders) == 1
    said = pb.Logger.said("warn")
    assert len(said) == 1 and "request b ended without a final answer" in said[0]
    assert wire.senders.report_stale(3600) == 0
    assert wire.senders.report_stale(0) == 1 and wire.senders.report_stale(0) == 1  # listed each time, logged once
    said = pb.Logger.said("warn")
    assert len(said) == 2 and "request c has had no answer for" in said[1]
    waiting.send(None, flags=COMPLETE_FINAL)
    assert len(wire.senders) == 0 and wire.senders.report_stale(0) == 0


def _request_with(sender) -> FakeRequest:
    request = FakeRequest()
    request.sender = sender
    return request
