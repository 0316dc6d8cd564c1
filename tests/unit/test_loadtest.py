"""The load-test harness without a server: workloads, generators, popularity, heads, summary, metrics parsing."""
from __future__ import annotations

import io
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from vlora.config import ConfigError
from vlora_load.generators import WorkloadGenerator
from vlora_load import report
from vlora_load.heads import HeadPolicy
from vlora_load.scrape import build_timeline, current_mode, parse_prometheus, Snapshot
from vlora_load.summary import percentile, queue_built, summarize
from vlora_load.transport import RequestRecord, classify_error
from vlora_load.workload import LengthDistribution, Popularity, Workload, resolve_workload, workloads_dir

ADAPTERS = tuple(f"a{i}" for i in range(1000))


def small(name: str = "visual_retrieval", **overrides) -> Workload:
    wl = Workload.from_yaml(resolve_workload(name))
    return wl.with_overrides(image_size=32, **overrides)


@pytest.mark.parametrize("path", sorted(workloads_dir().glob("*.yaml")), ids=lambda p: p.stem)
def test_every_workload_file_loads_and_survives_its_json_round_trip(path: Path):
    wl = Workload.from_yaml(path)
    assert Workload.from_dict(wl.to_dict()) == wl
    assert wl.describe()


def test_bad_workloads_are_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="arrivals.mode"):
        small(mode="sometimes")
    with pytest.raises(ConfigError, match="skewness 0.1 is below 1/num_adapters"):
        Popularity(kind="skewness", num_adapters=4, skewness=0.1)
    with pytest.raises(ConfigError, match=r"num_adapters must be in \[1, 1000\]"):
        Popularity(num_adapters=1001)
    with pytest.raises(ConfigError, match="unknown key"):
        Workload.from_dict({"name": "x", "applications": [{"name": "a", "kind": "video_analytics", "fps": 3}]})
    with pytest.raises(ConfigError, match="kind must be one of"):
        Workload.from_dict({"name": "x", "applications": [{"name": "a", "kind": "audio"}]})


def test_skewness_gives_the_most_popular_adapter_its_share():
    probs = Popularity(kind="skewness", num_adapters=8, skewness=0.6).probabilities()
    assert probs[0] == pytest.approx(0.6) and sum(probs) == pytest.approx(1.0)
    assert probs[1:] == pytest.approx([0.4 / 7] * 7)
    wl = small(skewness=0.6, num_adapters=8, rate=50.0, duration_s=60.0, length_scale=0.02)
    specs = WorkloadGenerator(wl, ADAPTERS).schedule()
    share = Counter(s.adapter for s in specs)["a0"] / len(specs)
    assert abs(share - 0.6) < 0.03, share


def test_zipf_over_a_thousand_adapters():
    probs = Popularity(kind="zipf", num_adapters=1000, zipf_alpha=1.0).probabilities()
    assert probs[0] / probs[9] == pytest.approx(10.0)
    assert sum(probs) == pytest.approx(1.0)
    wl = small(zipf_alpha=1.2, num_adapters=1000, rate=100.0, duration_s=20.0, length_scale=0.02)
    specs = WorkloadGenerator(wl, ADAPTERS).schedule()
    counts = Counter(s.adapter for s in specs)
    assert counts["a0"] > counts["a1"] > counts["a5"]
    assert len(counts) > 100  # the long tail is reached


def test_base_share_sends_requests_without_adapter():
    wl = Workload.from_yaml(resolve_workload("smoke")).with_overrides(rate=40.0, duration_s=20.0)
    specs = WorkloadGenerator(wl, ADAPTERS).schedule()
    share = sum(1 for s in specs if s.adapter is None) / len(specs)
    assert 0.05 < share < 0.2
    assert all("lora_name" not in s.sampling_parameters() for s in specs if s.adapter is None)


def test_the_schedule_is_seeded():
    wl = small(rate=5.0, duration_s=10.0)
    a = WorkloadGenerator(wl, ADAPTERS).schedule()
    b = WorkloadGenerator(wl, ADAPTERS).schedule()
    c = WorkloadGenerator(wl.with_overrides(seed=1), ADAPTERS).schedule()
    assert a == b
    assert [s.send_at for s in a] != [s.send_at for s in c]


def test_poisson_arrivals_have_the_set_rate_and_exponential_gaps():
    wl = small(rate=20.0, duration_s=200.0, length_scale=0.02)
    times = [s.send_at for s in WorkloadGenerator(wl, ADAPTERS).schedule()]
    assert abs(len(times) / 200.0 - 20.0) < 1.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert sd / mean == pytest.approx(1.0, abs=0.1)  # exponential: coefficient of variation 1


def test_video_streams_send_one_chunk_per_period():
    wl = small("video", rate=4.0, duration_s=30.0)
    gen = WorkloadGenerator(wl, ADAPTERS)
    assert gen.num_streams() == {"video_analytics": 4}
    specs = gen.schedule()
    assert len(specs) == 4 * 30
    per_stream = Counter(s.stream_id for s in specs)
    assert set(per_stream.values()) == {30}
    times = sorted(s.send_at for s in specs if s.stream_id == 0)
    assert all(b - a == pytest.approx(1.0) for a, b in zip(times, times[1:]))
    for s in specs:
        if s.task == "action":
            assert len(s.images) == 8 and s.prompt.count("<image>") == 8
        else:
            assert s.task == "detection" and len(s.images) == 1
        assert s.max_tokens == {"action": 8, "detection": 24}[s.task] and s.head_task is None
    six = WorkloadGenerator(small("video", rate=8.0, duration_s=3.0, frames_per_chunk=6), ADAPTERS).schedule()
    assert {len(s.images) for s in six if s.task == "action"} == {6}
    with pytest.raises(ConfigError, match="frames_per_chunk"):
        small("video", frames_per_chunk=0)
    frac = WorkloadGenerator(small("video", rate=2.5, duration_s=40.0), ADAPTERS)
    assert frac.num_streams() == {"video_analytics": 3}
    assert len(frac.schedule()) == pytest.approx(100, abs=3)


def test_task_heads_are_used_only_where_an_adapter_declares_them():
    wl = small("video", rate=8.0, duration_s=5.0, skewness=0.25)
    heads = HeadPolicy({"a0": {"action": "action"}, "a1": {"detection": "count_cars", "action": "moves"}})
    specs = WorkloadGenerator(wl, ADAPTERS, heads).schedule()
    assert any(s.head_task for s in specs) and any(not s.head_task for s in specs)
    for s in specs:
        head = heads.heads.get(s.adapter, {}).get(s.task)
        assert s.head_task == head
        assert s.sampling_parameters().get("task") == head
        if head:
            assert s.max_tokens == 1 and s.expected_output_tokens == 1
    assert HeadPolicy.from_adapter_root(None, ("a0",)).heads == {}


def test_heads_are_read_from_the_adapter_folder(tmp_path):
    import json

    from vlora.heads import HEADS_CONFIG

    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    (tmp_path / "with" / HEADS_CONFIG).write_text(json.dumps({"format": "vlora-task-heads", "version": 1, "heads": [
        {"task": "count_cars", "task_type": "counting", "labels": ["0", "1"]},
        {"task": "motion", "task_type": "action", "labels": ["left", "right"]}]}))
    policy = HeadPolicy.from_adapter_root(tmp_path, ("with", "without"))
    assert policy.heads == {"with": {"detection": "count_cars", "action": "motion"}}
    assert policy.head_task("with", "action") == "motion" and policy.head_task("without", "action") is None


def test_lengths_follow_the_azure_shape_and_scale():
    dist = LengthDistribution(median=129, mean=211, max=100_000)
    rng = random.Random(0)
    draws = sorted(dist.sample(rng) for _ in range(20_000))
    assert abs(draws[len(draws) // 2] - 129) < 6
    assert abs(sum(draws) / len(draws) - 211) < 15
    tiny = small(length_scale=0.05, rate=20.0, duration_s=30.0)
    specs = WorkloadGenerator(tiny, ADAPTERS).schedule()
    median = sorted(s.max_tokens for s in specs)[len(specs) // 2]
    assert 4 <= median <= 9  # 129 * 0.05


def record(app="app", outcome="ok", e2e=1.0, ttft=0.1, n_out=10, start=0.0) -> RequestRecord:
    return RequestRecord(index=0, application=app, task="t", adapter="a", protocol="grpc", start_s=start,
                         e2e_s=e2e, ttft_s=ttft, num_output_tokens=n_out if outcome == "ok" else 0, outcome=outcome,
                         expected_output_tokens=n_out, error="" if outcome == "ok" else "Exceeds maximum queue size")


def test_summary_average_token_latency_and_slo_attainment():
    wl = Workload.from_dict({"name": "x", "applications": [
        {"name": "app", "kind": "visual_retrieval", "slo": {"e2e_s": 1.5}}]})
    records = [record(e2e=1.0, n_out=10), record(e2e=2.0, n_out=30, start=1.0), record(outcome="rejected", e2e=0.01)]
    s = summarize(records, wl, scheduled=4)
    assert s["avg_token_latency_s"] == pytest.approx(3.0 / 40)  # sum of e2e / total output tokens
    assert s["ok"] == 2 and s["rejected"] == 1 and s["errors"] == 1 and s["lost"] == 1
    assert s["applications"]["app"]["slo_attainment"] == pytest.approx(1 / 3)  # a rejection misses its SLO
    assert s["throughput_rps"] == pytest.approx(2 / 3.0)
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5) and percentile([], 50) is None


def test_queue_built_by_waiting_requests_or_missing_throughput():
    base = {"offered_actual_rps": 10.0, "throughput_rps": 9.8, "server": {"mean_triton_queue": 0.1, "mean_waiting": 0.0}}
    assert not queue_built(base)
    assert queue_built({**base, "server": {"mean_triton_queue": 0.4, "mean_waiting": 0.2}})
    assert queue_built({**base, "throughput_rps": 8.5})


def test_errors_are_classified():
    assert classify_error("Exceeds maximum queue size") == "rejected"
    assert classify_error("server overloaded: no room within 30s") == "rejected"
    assert classify_error("anything", status=503) == "rejected"
    assert classify_error("unknown adapter 'x'") == "error"
    assert classify_error("no response within 60s") == "timeout"


METRICS = """# HELP vlora_batch_size x
vlora_batch_size{model="vlora",version="1"} 3
vlora_batch_size_per_step_sum{model="vlora",version="1"} %s
vlora_batch_size_per_step_count{model="vlora",version="1"} %s
vlora_engine_steps_total{model="vlora",version="1"} %s
nv_inference_pending_request_count{model="vlora",version="1"} 5
vlora_mode_seconds_total{mode="merge"} %s
vlora_mode_seconds_total{mode="unmerge"} %s
"""


def test_metrics_timeline_and_mode():
    s0 = parse_prometheus(METRICS % (10, 5, 5, 1.0, 1.0))
    s1 = parse_prometheus(METRICS % (22, 9, 9, 1.1, 1.4))
    rows = build_timeline([Snapshot(100.0, s0), Snapshot(101.0, s1)], t0=100.0)
    assert rows[1]["batch_size_mean"] == pytest.approx(3.0)
    assert rows[1]["steps_per_s"] == pytest.approx(4.0)
    assert rows[1]["triton_queue"] == 5 and rows[1]["batch_size_last"] == 3
    assert rows[1]["mode"] == "unmerge"
    gauge = parse_prometheus('vlora_inference_mode{mode="merge"} 0\nvlora_inference_mode{mode="mixture"} 1\n')
    assert current_mode(gauge, None) == "mixture"
    assert current_mode(parse_prometheus("vlora_batch_size 2\n"), None) == ""


def test_instance_series_per_device_label():
    """Two model instances on two GPUs: each (instance, device) gets its own steps and tokens over the run,
    and the report lists both (the timeline itself sums them)."""
    from vlora_load.scrape import instance_series

    text = ('vlora_engine_steps_total{model="vlora",instance="vlora_0",device="cuda:0"} %d\n'
            'vlora_engine_steps_total{model="vlora",instance="vlora_0",device="cuda:1"} %d\n'
            'vlora_output_tokens_total{model="vlora",instance="vlora_0",device="cuda:0"} %d\n'
            'vlora_output_tokens_total{model="vlora",instance="vlora_0",device="cuda:1"} %d\n'
            'nv_inference_pending_request_count{model="vlora"} 0\n')
    snaps = [Snapshot(0.0, parse_prometheus(text % (0, 0, 0, 0))), Snapshot(1.0, parse_prometheus(text % (3, 5, 90, 150))),
             Snapshot(2.0, parse_prometheus(text % (10, 12, 300, 360)))]
    series = instance_series(snaps)
    assert series == [{"instance": "vlora_0", "device": "cuda:0", "steps": 10.0, "output_tokens": 300.0},
                      {"instance": "vlora_0", "device": "cuda:1", "steps": 12.0, "output_tokens": 360.0}]
    assert build_timeline(snaps, t0=0.0)[2]["tokens_per_s"] == pytest.approx(420.0)  # both instances summed
    # One unlabelled instance: one entry with empty names.
    one = [Snapshot(0.0, parse_prometheus("vlora_output_tokens_total 5\n")),
           Snapshot(1.0, parse_prometheus("vlora_output_tokens_total 25\n"))]
    assert instance_series(one) == [{"instance": "", "device": "", "steps": None, "output_tokens": 20.0}]
    wl = Workload.from_dict({"name": "x", "applications": [{"name": "app", "kind": "visual_retrieval"}]})
    summary = summarize([record()], wl, scheduled=1, extra={"server": {"scrapes": 3, "instances": series}})
    page = report.run_markdown(summary, {}, {})
    assert "| vlora_0 | cuda:0 | 10 | 300 |" in page and "| vlora_0 | cuda:1 | 12 | 360 |" in page


def test_cache_counters_per_run():
    """What a run took from the server's caches: the counters' growth over the run, summed over instances,
    with the image hit rate and the prompt tokens' reused share (None where a server has no such counters)."""
    from vlora_load.scrape import cache_deltas

    text = ('vlora_encoder_cache_hits_total{instance="vlora_0",device="cuda:0"} %d\n'
            'vlora_encoder_cache_hits_total{instance="vlora_0",device="cuda:1"} %d\n'
            'vlora_encoder_cache_misses_total{instance="vlora_0",device="cuda:0"} %d\n'
            'vlora_prefix_cache_prompt_tokens_total %d\nvlora_prefix_cache_reused_tokens_total %d\n')
    snaps = [Snapshot(0.0, parse_prometheus(text % (5, 1, 10, 1000, 100))),
             Snapshot(1.0, parse_prometheus(text % (6, 2, 40, 4000, 400))),
             Snapshot(2.0, parse_prometheus(text % (8, 4, 110, 11000, 600)))]
    got = cache_deltas(snaps)
    assert got == {"encoder_hits": 6, "encoder_misses": 100, "prefix_prompt_tokens": 10000, "prefix_reused_tokens": 500,
                   "encoder_hit_rate": round(6 / 106, 4), "prefix_reused_share": 0.05}
    assert cache_deltas(snaps[:1]) is None
    assert cache_deltas([Snapshot(0.0, parse_prometheus("vlora_batch_size 2\n"))] * 2) is None


def test_stage_timers_per_run():
    """The engine's stage timers over a run (the sum and count series of vlora_stage_seconds), summed over
    instances: each stage's mean over what was timed between the first snapshot and the last."""
    from vlora_load.scrape import stage_deltas

    text = ('vlora_stage_seconds_sum{stage="queue",device="cuda:0"} %g\nvlora_stage_seconds_count{stage="queue",device="cuda:0"} %d\n'
            'vlora_stage_seconds_sum{stage="queue",device="cuda:1"} %g\nvlora_stage_seconds_count{stage="queue",device="cuda:1"} %d\n'
            'vlora_stage_seconds_sum{stage="decode_step"} %g\nvlora_stage_seconds_count{stage="decode_step"} %d\n'
            'vlora_stage_seconds_bucket{stage="queue",le="0.1"} 3\n')
    snaps = [Snapshot(0.0, parse_prometheus(text % (1.0, 10, 0.5, 5, 2.0, 100))),
             Snapshot(1.0, parse_prometheus(text % (1.3, 13, 0.6, 7, 2.0, 100)))]
    assert stage_deltas(snaps) == {"queue": {"mean_ms": 80.0, "count": 5}}  # no decode step between them
    assert stage_deltas(snaps[:1]) is None


def test_each_sweep_point_sends_new_content(monkeypatch, tmp_path):
    """run_sweep gives point i the seed workload.seed + i: a video stream's k-th chunk is another clip at the next
    rate, and retrieval images differ too, so that no point is answered from the caches the point before filled."""
    from vlora_load import runner

    seen = []
    monkeypatch.setattr(runner, "run_point", lambda wl, *a, **k: seen.append(wl) or {"offered_rate_rps": wl.arrivals.rate})
    monkeypatch.setattr(runner, "write_sweep_page", lambda *a, **k: tmp_path / "report.md")
    monkeypatch.setattr(runner, "wait_idle", lambda *a, **k: True)
    target = runner.Target("127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:3/metrics")
    for name in ("video", "visual_retrieval"):
        seen.clear()
        wl = small(name, duration_s=3.0)
        points = [runner.Point(rate=r, skewness=None) for r in (4.0, 5.0, 6.0)]
        runner.run_sweep(wl, points, target, tmp_path / name, ADAPTERS[:4], HeadPolicy.none(), out=io.StringIO())
        assert [w.seed for w in seen] == [wl.seed, wl.seed + 1, wl.seed + 2]
        images = [{img for spec in WorkloadGenerator(w, ADAPTERS[:4]).schedule() for img in spec.images} for w in seen]
        assert not images[0] & images[1] and not images[1] & images[2]


def test_cpu_sampler_keeps_a_process_that_exits_before_the_last_sample(monkeypatch):
    """The generator's processes end (or turn zombie, their command line gone) before the run's last
    sample: each keeps the CPU it used while it was seen; a process that started later counts from 0."""
    from types import SimpleNamespace

    from vlora_load import proccpu

    procs = {1: (["python", "-m", "vlora_load.grpc_worker"], 1.0), 2: (["tritonserver", "--x"], 5.0)}

    class FakePsutil:
        Error = RuntimeError

        @staticmethod
        def process_iter(attrs):
            for pid, (cmd, cpu) in procs.items():
                yield SimpleNamespace(info={"pid": pid, "cmdline": cmd, "cpu_times": SimpleNamespace(user=cpu, system=0.0)})

    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr(proccpu.time, "monotonic", lambda: next(clock))
    s = proccpu.CpuSampler()
    s._psutil = FakePsutil
    s.sample()
    procs[1] = (["python", "-m", "vlora_load.grpc_worker"], 1.5)
    procs[2] = (["tritonserver", "--x"], 5.2)
    procs[3] = (["triton_python_backend_stub", "m"], 0.8)  # started after the first sample
    s.sample()
    procs[1] = ([], 1.5)  # a zombie: no command line
    procs[2] = (["tritonserver", "--x"], 5.4)
    procs[3] = (["triton_python_backend_stub", "m"], 1.6)
    s.sample()
    got = s.cores()
    assert got["window_s"] == 2.0
    assert got["roles"]["grpc_worker"]["cores"] == pytest.approx(0.25)
    assert got["roles"]["tritonserver"]["cores"] == pytest.approx(0.2)
    assert got["roles"]["stub"] == {"cores": pytest.approx(0.8), "max_process_cores": pytest.approx(0.8), "processes": 1}
