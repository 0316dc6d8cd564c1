"""The steady-state window of a closed-loop load test (benchmarks/load_sweep.py --warmup-s)."""
from __future__ import annotations

import pytest

from vlora_load.summary import window_stats
from vlora_load.transport import RequestRecord


def rec(start, ttft, e2e, tokens, outcome="ok"):
    return RequestRecord(index=0, application="a", task="t", adapter="", protocol="grpc", start_s=start,
                         ttft_s=ttft, e2e_s=e2e, num_output_tokens=tokens, outcome=outcome)


def test_window_counts_answers_ending_inside_and_tokens_generated_inside():
    records = [
        rec(0.0, 2.0, 12.0, 11),    # first token at 2, ten more over 2..12: 2 of them in 10..20
        rec(11.0, 1.0, 5.0, 5),     # wholly inside: answered, 5 tokens
        rec(15.0, 1.0, 15.0, 15),   # first at 16, 14 more over 16..30: 4/14 of them before 20
        rec(12.0, float("nan"), 3.0, 1),  # no TTFT (one token): counted at its end, 15
        rec(13.0, 0.5, 1.0, 0, outcome="error"),
    ]
    w = window_stats(records, 10.0, 20.0)
    assert w["answered"] == 3  # ends at 12, 16 and 15; the third request ends at 30
    assert w["failed_sent_in_window"] == 1
    expected_tokens = 10 * 2 / 10 + 5 + (1 + 14 * 4 / 14) + 1
    assert w["output_tokens_per_s"] == pytest.approx(expected_tokens / 10)
    assert w["throughput_rps"] == pytest.approx(0.3)


def test_window_must_not_be_empty():
    with pytest.raises(ValueError):
        window_stats([], 5.0, 5.0)
