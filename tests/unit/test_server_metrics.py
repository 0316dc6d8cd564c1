"""vlora.server.metrics with a fake pb_utils: the engine's reports become Triton metric families with the
right kinds and labels, applied on the metrics thread (tests/e2e/test_metrics_and_overload.py scrapes the
same families from a real tritonserver). The reports accumulate on the engine's side and the metrics
thread applies them every FLUSH_INTERVAL_S; close() and flush() apply what is pending."""
from __future__ import annotations

import threading
import time

import pytest

from fake_pb_utils import MetricFamily
from vlora.server.metrics import BASE_LABEL, TritonModelMetrics

LABELS = {"model": "vlora", "version": "1", "instance": "vlora_0", "device": "cuda:1"}


@pytest.fixture
def metrics(pb):
    m = TritonModelMetrics(pb, "vlora", "1", "vlora_0", "cuda:1")
    yield m
    m.close()


def test_families_have_their_kinds_and_every_series_its_instance_labels(pb, metrics):
    kinds = {name: f.kind for name, f in pb.families.items()}
    assert kinds["vlora_requests_total"] == MetricFamily.COUNTER
    assert kinds["vlora_batch_size"] == MetricFamily.GAUGE
    assert kinds["vlora_step_duration_seconds"] == MetricFamily.HISTOGRAM
    assert all(name.startswith("vlora_") for name in kinds)
    for family in pb.families.values():
        for metric in family.metrics:
            assert LABELS.items() <= metric.labels.items()


def test_cpu_instances_have_no_instance_label(pb):
    m = TritonModelMetrics(pb, "vlora", "1")
    m.close()
    assert pb.families["vlora_engine_steps_total"].find().labels == {"model": "vlora", "version": "1"}


def test_requests_and_tokens_per_adapter(pb, metrics):
    metrics.request_admitted(None)
    metrics.request_admitted("a")
    metrics.request_admitted("a")
    metrics.request_finished("a", "length", 5)
    metrics.request_finished(None, "", 0)
    metrics.close()  # applies everything queued, then ends the metrics thread
    f = pb.families
    assert f["vlora_requests_total"].find(lora_name="a").value() == 2
    assert f["vlora_requests_total"].find(lora_name=BASE_LABEL).value() == 1
    assert f["vlora_requests_finished_total"].find(lora_name="a", finish_reason="length").value() == 1
    assert f["vlora_requests_finished_total"].find(lora_name=BASE_LABEL, finish_reason="unknown").value() == 1
    assert f["vlora_output_tokens_total"].find(lora_name="a").value() == 5
    assert [m.labels["lora_name"] for m in f["vlora_output_tokens_total"].metrics] == ["a"]  # 0 tokens: no series


def test_steps_modes_and_caches(pb, metrics):
    metrics.step(4, 100, 3, 0.02)
    metrics.step(2, 0, 2, 0.01)
    metrics.queue_depth(3, 7)
    metrics.mode_step("merge", "a", 0.5)
    metrics.mode_step("unmerge", None, 0.25)
    metrics.mode_switch("merge", "unmerge", 0.004)
    metrics.adapters_resident(2, 5)
    metrics.prefix_cache(10, 4, 1)
    metrics.encoder_cache(1, 2, 0, 4096)
    metrics.adapter_swap("gpu_load", "a")
    metrics.close()  # applies everything queued, then ends the metrics thread
    f = pb.families
    value = lambda name, **labels: f[name].find(**labels).value()  # noqa: E731
    assert (value("vlora_engine_steps_total"), value("vlora_prefill_tokens_total"), value("vlora_decode_tokens_total")) == (2, 100, 5)
    assert value("vlora_batch_size") == 2 and f["vlora_batch_size_per_step"].find().observations == [4, 2]
    assert f["vlora_step_duration_seconds"].find().observations == [0.02, 0.01]
    assert (value("vlora_running_requests"), value("vlora_waiting_requests")) == (3, 7)
    assert value("vlora_mode_seconds_total", mode="merge") == 0.5 and value("vlora_mode_steps_total", mode="unmerge") == 1
    assert [value("vlora_mode_active", mode=m) for m in ("merge", "unmerge", "mixture")] == [0, 1, 0]
    assert value("vlora_mode_switches_total") == 1 and f["vlora_mode_switch_seconds"].find().observations == [0.004]
    assert (value("vlora_adapters_resident", tier="gpu"), value("vlora_adapters_resident", tier="cpu")) == (2, 5)
    assert (value("vlora_prefix_cache_prompt_tokens_total"), value("vlora_prefix_cache_reused_tokens_total"),
            value("vlora_prefix_cache_evictions_total")) == (10, 4, 1)
    assert (value("vlora_encoder_cache_hits_total"), value("vlora_encoder_cache_misses_total"),
            value("vlora_encoder_cache_bytes")) == (1, 2, 4096)
    assert value("vlora_adapter_gpu_loads_total", lora_name="a") == 1


def test_stage_times_are_one_histogram_per_stage(pb, metrics):
    """vlora_stage_seconds{stage=...}: one series per stage of vlora.metrics.STAGES and of the adapter stages (the
    LoRA manager's read and slot copy), an observation per report; a stage name not in the list is dropped rather
    than creating a series."""
    from vlora.metrics import ADAPTER_STAGES, STAGES

    metrics.stage("adapter_read", 0.05)
    metrics.stage("vision", 0.004)
    metrics.stage("queue", 0.02)
    metrics.stage("vision", 0.006)
    metrics.stage("no-such-stage", 1.0)
    metrics.close()
    family = pb.families["vlora_stage_seconds"]
    assert family.kind == MetricFamily.HISTOGRAM
    assert sorted(m.labels["stage"] for m in family.metrics) == sorted(STAGES + ADAPTER_STAGES)
    assert family.find(stage="vision").observations == [0.004, 0.006]
    assert family.find(stage="adapter_read").observations == [0.05]
    assert family.find(stage="queue").observations == [0.02]
    assert family.find(stage="decode_step").observations == []


def test_per_adapter_gauges_go_back_to_zero(pb, metrics):
    metrics.adapter_requests({"a": 2, None: 1}, {"b": 4})
    metrics.adapter_requests({}, {"b": 1})
    metrics.close()  # applies everything queued, then ends the metrics thread
    f = pb.families
    running, waiting = f["vlora_adapter_running_requests"], f["vlora_adapter_waiting_requests"]
    assert (running.find(lora_name="a").value(), running.find(lora_name=BASE_LABEL).value()) == (0, 0)
    assert waiting.find(lora_name="b").value() == 1


def test_a_failing_update_is_logged_and_the_thread_goes_on(pb, metrics):
    metrics.mode_step("no-such-mode", None, 0.1)  # a KeyError on the metrics thread
    metrics.step(1, 1, 0, 0.001)
    metrics.close()
    assert "metrics update failed" in pb.Logger.said("warn")[0]
    assert pb.families["vlora_engine_steps_total"].find().value() == 1


def test_reports_accumulate_and_a_flush_applies_them_in_few_calls(pb):
    """The engine's reports touch no pb_utils metric until a flush; a flush makes one increment per counter
    that moved, one set per gauge that changed and one observe per histogram observation."""
    m = TritonModelMetrics(pb, "vlora", "1", flush_interval_s=3600)  # only explicit flushes
    try:
        f = pb.families
        for _ in range(50):  # 50 decode steps of a batch of 32, as engine/core.py reports them
            m.step(32, 0, 32, 0.0075)
            m.mode_step("unmerge", None, 0.0075)
            m.queue_depth(32, 0)
        assert f["vlora_engine_steps_total"].find().value() == 0
        assert f["vlora_step_duration_seconds"].find().observations == []
        assert m.ipc_calls == 0
        m.flush()
        assert (f["vlora_engine_steps_total"].find().value(), f["vlora_decode_tokens_total"].find().value()) == (50, 1600)
        assert f["vlora_batch_size_per_step"].find().observations == [32] * 50
        assert f["vlora_mode_steps_total"].find(mode="unmerge").value() == 50
        assert f["vlora_mode_seconds_total"].find(mode="unmerge").value() == pytest.approx(50 * 0.0075)
        assert (f["vlora_running_requests"].find().value(), f["vlora_batch_size"].find().value()) == (32, 32)
        # increments: steps, decode, mode seconds, mode steps; sets: batch size, running, waiting, 3 mode gauges
        assert m.ipc_calls == 4 + 6 + 2 * 50
        for _ in range(10):
            m.step(32, 0, 32, 0.0075)
            m.mode_step("unmerge", None, 0.0075)
            m.queue_depth(32, 0)
        m.flush()
        assert m.ipc_calls == 4 + 6 + 2 * 50 + 4 + 2 * 10  # the gauges did not change: no set
        assert f["vlora_engine_steps_total"].find().value() == 60
        flushes = m.flushes
        m.flush()  # nothing new: nothing sent
        assert m.flushes == flushes
    finally:
        m.close()


def test_the_metrics_thread_flushes_on_its_own_and_alone_calls_pb_utils(pb):
    m = TritonModelMetrics(pb, "vlora", "1", flush_interval_s=0.01)
    callers: set[str] = set()
    steps = pb.families["vlora_engine_steps_total"].find()
    increment = steps.increment

    def recording_increment(value):
        callers.add(threading.current_thread().name)
        increment(value)

    steps.increment = recording_increment
    try:
        m.step(2, 10, 1, 0.01)
        deadline = time.monotonic() + 10
        while steps.value() < 1:
            assert time.monotonic() < deadline, "the metrics thread never flushed"
            time.sleep(0.005)
        assert callers == {"vlora-metrics"}
    finally:
        m.close()


def test_an_adapter_that_came_and_went_between_flushes_shows_zero(pb):
    m = TritonModelMetrics(pb, "vlora", "1", flush_interval_s=3600)
    try:
        m.adapter_requests({"a": 1}, {})
        m.adapter_requests({}, {"b": 2})
        m.flush()
        running = pb.families["vlora_adapter_running_requests"]
        assert running.find(lora_name="a").value() == 0
        assert pb.families["vlora_adapter_waiting_requests"].find(lora_name="b").value() == 2
    finally:
        m.close()


def test_reports_from_several_threads_are_all_counted(pb):
    """adapter_swap also comes from loader threads: concurrent reports lose nothing."""
    m = TritonModelMetrics(pb, "vlora", "1", flush_interval_s=0.001)
    threads = [threading.Thread(target=lambda: [m.adapter_swap("host_load", "a") for _ in range(2000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(2000):
        m.step(1, 0, 1, 0.001)
    for t in threads:
        t.join()
    m.close()  # the last flush
    assert pb.families["vlora_adapter_host_loads_total"].find(lora_name="a").value() == 8000
    assert pb.families["vlora_engine_steps_total"].find().value() == 2000
