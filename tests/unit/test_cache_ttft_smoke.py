"""CPU smoke run of benchmarks/cache_ttft.py on the tiny LLaVA and Qwen2-VL models at the smallest sizes, so
that the GPU run cannot fail on something a CPU would have shown: both workloads run with the caches off
and on, the on rounds reuse encoder features and KV blocks, the off rounds touch no cache, and the answers
are the same (fp32)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_cache_ttft_runs_on_the_tiny_models(tiny_model_dir, vlora_cache, tmp_path, capsys):
    from vlora.models.tiny_qwen import ensure_tiny_qwen

    ensure_tiny_qwen(vlora_cache, variant="qwen2_vl")
    bench = importlib.import_module("benchmarks.cache_ttft")
    assert tiny_model_dir.parent == Path(vlora_cache)  # the benchmark finds the session's tiny models there
    rc = bench.main(["--tiny", "--no-record", "--work", str(vlora_cache), "--out", str(tmp_path),
                     "--rounds", "2", "--frames", "2", "--stride", "1", "--questions", "2", "--batch", "2",
                     "--system-tokens", "64", "--app-tokens", "16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "RESULTS cache-ttft cpu: TTFT caches off -> on" in out, out[-2000:]
    result = json.loads((tmp_path / "cache-ttft-cpu.json").read_text())
    assert [m["model_type"] for m in result["models"]] == ["llava", "qwen2_vl"]
    for m in result["models"]:
        assert sum(a["vision_side"] for a in m["apps"]) == 2
        for workload in ("video", "retrieval"):
            w = m[workload]
            assert w["same_answers"] == 1.0, (m["model_type"], workload)
            assert len(w["off"]["rounds"]) == len(w["on"]["rounds"]) == 2
            assert set(w["off"]["counters"].values()) == {0}, w["off"]["counters"]
            assert w["on"]["counters"]["prefix_reused_tokens"] > 0, w["on"]["counters"]
            assert w["off"]["steady_mean_ms"] > 0 and w["on"]["steady_mean_ms"] > 0
        # Two frames per chunk, one new a round: round 0 encodes both once per vision-side weights (3 of
        # them: two adapters and the plain encoder), round 1 the new one; the shared ones are hits.
        assert m["video"]["on"]["counters"]["encoder_misses"] == 3 * 2 + 3
        assert m["video"]["on"]["counters"]["encoder_hits"] > 0
        assert m["retrieval"]["system_tokens"] <= 64
