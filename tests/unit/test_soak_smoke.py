"""benchmarks/soak.py end to end for about 10 s: it starts a real server on loopback, sends every kind of
request of its mix (bad ones, disconnects and adapter unload/load included), and passes with 0 unexpected
and 0 lost, memory measured for tritonserver and its stub."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(180)]


def _soak_module():
    return importlib.import_module("benchmarks.soak")


def test_soak_runs_every_kind_and_passes(tmp_path, vlora_cache, demo_adapter_root):
    soak = _soak_module()
    code = soak.main(["--minutes", "0.13", "--rate", "8", "--seed", "1", "--report-every", "5", "--no-record",
                      "--device", "cpu", "--out", str(tmp_path), "--serve-arg", f"--set model.cache_dir={vlora_cache}"])
    result = json.loads((tmp_path / "soak-cpu.json").read_text())
    assert code == 0, (result["failures"], result["probe_failures"], result["health_after"])
    outcomes = result["outcomes"]
    assert outcomes["all"]["requests"] >= 30
    assert outcomes["all"]["unexpected"] == 0 and outcomes["all"]["lost"] == 0
    assert outcomes["all"]["ok"] > 0
    assert result["drained"] and result["healthy_after"]
    mem = result["memory"]
    assert mem["server_rss_mb"]["end_mb"] > 0 and mem["stub_rss_mb"]["end_mb"] > 100  # the stub holds the model
    assert result["server_finished_by_reason"].get("length", 0) > 0


def test_outcomes_and_flatness_are_computed_as_documented():
    soak = _soak_module()
    from vlora_load.transport import RequestRecord

    refused = RequestRecord(index=1, application="soak", task="text", adapter="demo-r4-pattern", protocol="http",
                            outcome="error", error="adapter 'demo-r4-pattern' is being unloaded: it takes no new requests")
    assert soak.soak_outcome(refused, "demo-r4-pattern") == "expected"
    assert soak.soak_outcome(refused, None) == "unexpected"  # no adapter was being cycled: a real failure
    assert soak.soak_outcome(RequestRecord(index=2, application="soak", task="text", adapter="", protocol="http",
                                           outcome="timeout"), None) == "lost"
    samples = [{"t_s": t, "stub_rss_mb": 500.0 + (10.0 if t >= 95 else 0.0)} for t in range(0, 101, 5)]
    flat = soak.flatness(samples, 100.0, 0.2, "stub_rss_mb")
    assert flat["warmup_mb"] == 500.0 and flat["end_mb"] == 510.0 and flat["growth_pct"] == 2.0
