"""vlora.server.metrics with a fake pb_utils: the engine's reports become Triton metric families with the
right kinds and labels, applied on the metrics thread (tests/e2e/test_metrics_and_overload.py scrapes the
same families from a real tritonserver)."""
from __future__ import annotations

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
