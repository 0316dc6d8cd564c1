"""A response sender that fell behind merges a request's queued events (engine.api.coalesce): the same
text reaches the client in fewer pieces, finals and errors are never merged away, control items keep
their place."""
from __future__ import annotations

from vlora.engine.api import GenerationOutput, coalesce


def ev(rid: str, delta: str, n: int, finished: bool = False, reason=None, error=None) -> GenerationOutput:
    return GenerationOutput(rid, delta, "", finished, reason, num_input_tokens=3, num_output_tokens=n, error=error)


def test_backlog_of_two_streams_merges_per_request_in_order():
    events = [ev("a", "He", 1), ev("b", "x", 1), ev("a", "llo", 2), ev("b", "y", 2), ev("a", "!", 3, True, "length")]
    out = coalesce(events)
    assert [(o.request_id, o.text_delta, o.num_output_tokens, o.finished) for o in out] == [
        ("a", "Hello!", 3, True), ("b", "xy", 2, False)]
    assert out[0].finish_reason == "length"


def test_nothing_merges_after_a_final_and_errors_stay_alone():
    out = coalesce([ev("a", "x", 1), ev("a", "", 1, True, "error", error="boom")])
    assert [(o.text_delta, o.error) for o in out] == [("x", None), ("", "boom")]
    out = coalesce([ev("a", "x", 1), ev("a", "", 1, True, "cancelled")])
    assert len(out) == 2
    out = coalesce([ev("a", "x", 1, True, "stop"), ev("a", "y", 2)])
    assert len(out) == 2


def test_control_items_keep_what_was_queued_before_them_ahead():
    marker = ("flushed", object())
    out = coalesce([ev("a", "x", 1), marker, ev("a", "y", 2)])
    assert out[0].text_delta == "x" and out[1] is marker and out[2].text_delta == "y"


def test_the_joined_text_equals_the_pieces():
    pieces = ["The", " cat", " sat", " on", " the", " mat", "."]
    events = [ev("r", p, i + 1, i == len(pieces) - 1, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    for cut in range(1, len(pieces)):
        sent = coalesce(events[:cut]) + coalesce(events[cut:])
        assert "".join(o.text_delta for o in sent) == "".join(pieces)
        assert sent[-1].finished and sent[-1].num_output_tokens == len(pieces)
