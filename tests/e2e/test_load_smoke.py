"""A short, bounded locust run against the real server: `vlora loadtest` end to end on the tiny model.

The smoke workload (configs/workloads/smoke.yaml) mixes visual retrieval over gRPC streaming, video
analytics over HTTP generate, and captions over HTTP generate_stream, for four seconds of Poisson and
camera-stream arrivals. Every scheduled request must be answered in full: no failure, none lost.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI


def test_smoke_load_run_answers_every_request_in_full(server, demo_adapter_root, tmp_path):
    from vlora.heads import has_heads

    out = tmp_path / "run"
    # Adapters with task heads (when the demo set has them) first: they are the most popular, so video
    # requests to them use their heads; the others generate labels.
    names = sorted(server.adapters, key=lambda n: (not has_heads(demo_adapter_root / n), n))
    cmd = [sys.executable, "-m", "vlora.cli", "loadtest", "--workload", "smoke", "--url", server.http_url,
           "--grpc-url", server.grpc_url, "--metrics-url", server.metrics_url,
           "--adapters", str(demo_adapter_root), "--adapter-names", ",".join(names), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "done 0/" in proc.stdout or "done " in proc.stdout  # progress was shown

    summary = json.loads((out / "summary.json").read_text())
    assert summary["scheduled"] >= 8, summary
    assert summary["lost"] == 0 and summary["requests"] == summary["scheduled"], summary
    assert summary["errors"] == 0, summary["error_messages"]
    assert summary["ok"] == summary["requests"]
    assert summary["avg_token_latency_s"] > 0 and summary["throughput_rps"] > 0

    with open(out / "requests.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == summary["requests"]
    assert {r["protocol"] for r in rows} == {"grpc", "http", "http-stream"}
    assert {r["application"] for r in rows} == {"visual_retrieval", "video_analytics", "captions"}
    for r in rows:  # every request got its full answer: max_tokens tokens (ignore_eos), or a head's label
        assert r["outcome"] == "ok", r
        assert int(r["num_output_tokens"]) == int(r["expected_output_tokens"]) >= 1, r
        assert r["finish_reason"] == ("stop" if r["head_task"] else "length") and r["text"], r
        assert int(r["num_input_tokens"]) > 0
        assert 0 < float(r["ttft_s"]) <= float(r["e2e_s"]), r

    with open(out / "locust_stats.csv", newline="") as fh:
        aggregated = [r for r in csv.DictReader(fh) if r["Name"] == "Aggregated"][0]
    assert int(aggregated["Request Count"]) == summary["requests"]
    assert int(aggregated["Failure Count"]) == 0

    report = (out / "report.md").read_text()
    for png in ("timeline.png", "latency_cdf.png"):
        assert (out / png).stat().st_size > 1000
        assert f"]({png})" in report
    with open(out / "server_timeline.csv", newline="") as fh:
        timeline = list(csv.DictReader(fh))
    assert any(float(r["batch_size_last"] or 0) >= 1 for r in timeline), "no batch size scraped from the server"
    # Each model instance's own series (the instance/device labels of the vlora_* samples) ran the requests.
    instances = json.loads((out / "server_instances.json").read_text())
    assert instances and sum(i["output_tokens"] or 0 for i in instances) > 0, instances
    assert all(i["device"] for i in instances), instances
    # The CPU of each role was sampled while the generator ran: the server, its model instance, the generator.
    roles = json.loads((out / "process_cpu.json").read_text())["roles"]
    assert {"tritonserver", "stub", "locust", "grpc_worker"} <= set(roles), roles
    assert roles["stub"]["cores"] > 0 and roles["stub"]["processes"] >= 1, roles
    assert "CPU cores used over" in report

    # The reports can be rebuilt from the raw files alone (what a GPU run without matplotlib needs).
    for name in ("report.md", "summary.json", "timeline.png"):
        (out / name).unlink()
    rebuilt = subprocess.run([sys.executable, "-m", "vlora.cli", "loadtest", "--report", str(out)],
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["ok"] == summary["ok"]
    assert (out / "timeline.png").is_file() and "](timeline.png)" in (out / "report.md").read_text()
