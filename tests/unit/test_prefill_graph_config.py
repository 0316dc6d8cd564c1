"""engine.prefill_graph_tokens and its token buckets, without a GPU (the graphs themselves: tests/gpu/test_engine_graphs.py)."""
from __future__ import annotations

import pytest

from vlora.config import ConfigError, EngineConfig
from vlora.engine.graphs import PREFILL_BUCKET, prefill_buckets


def test_buckets_are_multiples_of_64_up_to_the_limit():
    assert PREFILL_BUCKET == 64
    assert prefill_buckets(1024) == tuple(range(64, 1025, 64))
    assert prefill_buckets(600)[-1] == 576  # a limit between buckets keeps the one below it
    assert prefill_buckets(63) == () and prefill_buckets(0) == ()


def test_off_by_default_and_checked():
    assert EngineConfig().engine.prefill_graph_tokens == 0
    assert EngineConfig().with_overrides({"engine.prefill_graph_tokens": "1024"}).engine.prefill_graph_tokens == 1024
    for bad in ("-64", "100000"):
        with pytest.raises(ConfigError, match="prefill_graph_tokens"):
            EngineConfig().with_overrides({"engine.prefill_graph_tokens": bad})
