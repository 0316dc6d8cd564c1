"""vlora.server.admin with a fake pb_utils and a fake engine: which requests are adapter actions, the token
check, and how each outcome is answered (tests/e2e/test_adapter_admin.py runs them in a real tritonserver)."""
from __future__ import annotations

import json

import pytest

from fake_pb_utils import FakeRequest, FakeSender, TritonError
from vlora.errors import EngineOverloaded, InvalidRequest
from vlora.server.admin import AdminActions, admin_request

TOKEN = "s3cret-token"


class FakeEngine:
    def __init__(self, fail: Exception | None = None, unloaded=None) -> None:
        self.fail, self.unloaded, self.calls = fail, unloaded, []

    def _call(self, what, value):
        self.calls.append(what)
        if self.fail is not None:
            raise self.fail
        return value

    def adapters(self):
        return self._call(("list",), [{"name": "a"}])

    def load_adapter(self, name):
        return self._call(("load", name), {"name": name, "rank": 8})

    def unload_adapter(self, name):
        return self._call(("unload", name), self.unloaded if self.unloaded is not None else {"name": name})


def ask(wire, parameters=None, sampling=None):
    inputs = {"text_input": ""}
    if sampling is not None:
        inputs["sampling_parameters"] = json.dumps(sampling)
    return admin_request(wire, FakeRequest(inputs, parameters))


def test_which_requests_are_adapter_actions(wire):
    assert ask(wire, {"lora_name": "a", "max_tokens": 3}) is None
    assert ask(wire, {"adapter_action": "list"}) == ("list", None, None)
    assert ask(wire, {"adapter_action": "load", "lora_name": "a", "admin_token": TOKEN}) == ("load", "a", TOKEN)
    assert ask(wire, sampling={"adapter_action": "unload", "lora_name": "b"}) == ("unload", "b", None)


@pytest.mark.parametrize("parameters,words", [
    ({"adapter_action": "drop"}, "adapter_action must be one of ['list', 'load', 'unload'], got 'drop'"),
    ({"adapter_action": "load", "lora_name": "a", "max_tokens": 3}, "takes only lora_name and admin_token, not ['max_tokens']"),
    ({"adapter_action": "list", "lora_name": "a"}, 'adapter_action "list" takes no lora_name'),
    ({"adapter_action": "load"}, "adapter_action 'load' needs lora_name"),
    ({"adapter_action": "unload", "lora_name": ""}, "adapter_action 'unload' needs lora_name"),
    ({"adapter_action": "list", "nope": 1}, "unknown request parameter(s) ['nope']"),
])
def test_bad_adapter_actions_are_refused(wire, parameters, words):
    with pytest.raises(InvalidRequest) as e:
        ask(wire, parameters)
    assert words in str(e.value)


def test_load_and_unload_need_the_token_and_list_does_not(wire):
    off = AdminActions(wire, FakeEngine(), admin_token=None)
    off.check_token("list", None)
    with pytest.raises(InvalidRequest, match="is off on this server: start it with `vlora serve --admin-token-file FILE`"):
        off.check_token("load", TOKEN)
    on = AdminActions(wire, FakeEngine(), admin_token=TOKEN.encode())
    on.check_token("unload", TOKEN)
    with pytest.raises(InvalidRequest, match="refused: missing admin_token"):
        on.check_token("load", None)
    for wrong in ("nope", 42, TOKEN + "x"):
        with pytest.raises(InvalidRequest, match="refused: wrong admin_token") as e:
            on.check_token("unload", wrong)
        assert str(wrong) not in str(e.value)


def final_json(sender):
    response = sender.final
    assert not response.has_error(), response.error().message()
    assert (response.text("finish_reason"), response.text("num_input_tokens"), response.text("num_output_tokens")) == ("stop", 0, 0)
    return json.loads(response.text("text_output"))


def test_each_action_is_answered_with_json_and_logged(wire, pb):
    engine = FakeEngine()
    actions = AdminActions(wire, engine, admin_token=TOKEN.encode())
    for action, name, expected in [("list", None, {"adapters": [{"name": "a"}]}),
                                   ("load", "a", {"loaded": {"name": "a", "rank": 8}}),
                                   ("unload", "a", {"unloaded": {"name": "a"}})]:
        sender = FakeSender()
        actions.run(sender, action, name, TOKEN)
        assert final_json(sender) == expected
    assert engine.calls == [("list",), ("load", "a"), ("unload", "a")]
    assert pb.Logger.said("info") == ["vlora: adapter a loaded", "vlora: adapter a unloaded"]

    slow = AdminActions(wire, FakeEngine(unloaded={"name": "a", "state": "unloading"}), admin_token=TOKEN.encode())
    slow.run(FakeSender(), "unload", "a", TOKEN)
    assert pb.Logger.said("info")[-1] == "vlora: adapter a unloading"


def test_a_refused_token_is_answered_and_logged_once_without_the_token(wire, pb):
    engine = FakeEngine()
    sender = FakeSender()
    AdminActions(wire, engine, admin_token=TOKEN.encode()).run(sender, "load", "a", "guess-" + TOKEN)
    assert sender.final.error().code() == TritonError.INVALID_ARG and engine.calls == []
    (line,) = pb.Logger.said("warn")
    assert "wrong admin_token" in line and TOKEN not in line


@pytest.mark.parametrize("fail,code,words,logged", [
    (InvalidRequest("unknown adapter 'x'"), TritonError.INVALID_ARG, "[INVALID_ARG] unknown adapter 'x'", False),
    (EngineOverloaded("server shutting down"), TritonError.UNAVAILABLE, "[UNAVAILABLE] server shutting down", False),
    (RuntimeError("disk on fire"), TritonError.INTERNAL, "[INTERNAL] internal error: RuntimeError: disk on fire", True),
])
def test_engine_failures_reach_the_client(wire, pb, fail, code, words, logged):
    sender = FakeSender()
    AdminActions(wire, FakeEngine(fail=fail), admin_token=TOKEN.encode()).run(sender, "load", "x", TOKEN)
    error = sender.final.error()
    assert (error.code(), error.message()) == (code, words)
    assert bool(pb.Logger.said("error")) == logged


def test_a_failed_send_is_logged(wire, pb):
    AdminActions(wire, FakeEngine(), admin_token=None).run(FakeSender(fail=True), "list", None)
    assert "sending an adapter_action answer failed" in pb.Logger.said("error")[0]


# --- issue 37 hole 3: every admin request is answered ---
@pytest.mark.parametrize("token", ["\ud800", TOKEN + "\udfff", "\x00" + TOKEN, 42, ["x"]])
def test_a_token_that_is_not_clean_text_is_answered(wire, pb, token):
    """A lone surrogate once raised UnicodeEncodeError on the admin thread: no answer, no log line."""
    engine, sender = FakeEngine(), FakeSender()
    AdminActions(wire, engine, admin_token=TOKEN.encode()).run(sender, "load", "a", token)
    error = sender.final.error()
    assert error.code() == TritonError.INVALID_ARG and "admin_token" in error.message() and engine.calls == []


@pytest.mark.parametrize("sampling", [
    {"adapter_action": "load", "lora_name": "a", "admin_token": "\ud800"},
    {"adapter_action": "load", "lora_name": "a\x00", "admin_token": TOKEN},
    {"adapter_action": "\ud800"},
])
def test_admin_requests_with_unclean_text_are_refused_naming_the_field(wire, sampling):
    with pytest.raises(InvalidRequest) as e:
        ask(wire, sampling=sampling)
    assert any(f in str(e.value) for f in ("admin_token", "lora_name", "adapter_action")), str(e.value)


def test_a_fault_anywhere_in_an_action_is_answered(wire, pb):
    """Even an answer that cannot be built (here: not JSON-serializable) ends in a response."""

    class OddEngine(FakeEngine):
        def adapters(self):
            return [object()]

    sender = FakeSender()
    AdminActions(wire, OddEngine(), admin_token=None).run(sender, "list", None)
    assert sender.final.error().code() == TritonError.INTERNAL
    assert len(pb.Logger.said("error")) == 1 and "Traceback" not in pb.Logger.said("error")[0]
