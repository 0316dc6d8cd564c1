"""The model server protocol's metrics of vlora.server.metrics (fake pb_utils): the KV-cache utilization gauge,
and the LoRA info gauge as the Inference Extension's endpoint picker reads it (tests/gie_protocol.py): created at
start, its current label set always the newest, old label sets left with older values, and a fresh family once
too many label sets piled up. tests/e2e/test_model_server_protocol.py checks the same on a real tritonserver."""
from __future__ import annotations

import pytest

from gie_protocol import LORA_INFO, QUEUED, Family, lora_info, parse
from vlora.server.metrics import BASE_LABEL, TritonModelMetrics


def scrape(pb) -> dict[str, Family]:
    """The fake's families as the EPP's parser would see them."""
    out = {}
    for name, family in pb.families.items():
        out[name] = Family(name, family.kind, [(m.labels, m.value()) for m in family.metrics])
    return out


@pytest.fixture
def metrics(pb):
    m = TritonModelMetrics(pb, "vlora", "1", max_lora=4)
    yield m
    m.close()


def test_kv_cache_usage_is_the_fraction_of_blocks_held(pb, metrics):
    assert pb.families["vlora_kv_cache_usage_ratio"].find().value() == 0.0
    metrics.kv_cache_usage(30, 120)
    metrics.flush()
    assert pb.families["vlora_kv_cache_usage_ratio"].find().value() == 0.25
    assert pb.families["vlora_kv_cache_usage_ratio"].kind == "gauge"
    metrics.kv_cache_usage(0, 120)
    metrics.flush()
    assert pb.families["vlora_kv_cache_usage_ratio"].find().value() == 0.0


def test_lora_info_exists_at_start_with_max_lora_and_no_adapters(pb, metrics):
    family = pb.families[LORA_INFO]
    assert family.kind == "gauge"
    (series,) = family.metrics
    assert series.labels == {"model": "vlora", "version": "1", "running_lora_adapters": "",
                             "waiting_lora_adapters": "", "max_lora": "4"}
    assert series.value() > 1.6e9  # a Unix time
    assert lora_info(scrape(pb)) is None  # idle: the EPP keeps what it knew


def test_lora_info_names_running_and_waiting_adapters_and_the_newest_set_wins(pb, metrics):
    metrics.adapter_requests({None: 1, "b": 2, "a": 1}, {"c": 1})
    metrics.flush()
    seen = lora_info(scrape(pb))
    assert (seen.running, seen.waiting, seen.max_lora) == (["a", "b"], ["c"], 4)  # base requests are not adapters

    metrics.adapter_requests({"c": 1}, {})
    metrics.flush()
    second = lora_info(scrape(pb))
    assert (second.running, second.waiting) == (["c"], []) and second.stamp > seen.stamp
    assert len(pb.families[LORA_INFO].metrics) == 3  # the Python backend cannot drop a series: older values stay

    metrics.adapter_requests({}, {})  # idle: the EPP skips the empty set and keeps reading the last busy one
    metrics.flush()
    assert lora_info(scrape(pb)).running == ["c"]

    metrics.adapter_requests({"a": 1, "b": 1}, {"c": 2})  # an earlier set again: its value becomes the newest
    metrics.flush()
    again = lora_info(scrape(pb))
    assert (again.running, again.waiting) == (["a", "b"], ["c"]) and again.stamp > second.stamp
    assert len(pb.families[LORA_INFO].metrics) == 3


def test_counts_of_zero_and_the_base_label_are_not_adapters(pb, metrics):
    metrics.adapter_requests({BASE_LABEL: 3, "a": 0}, {None: 2})
    metrics.flush()
    assert lora_info(scrape(pb)) is None


def test_a_fresh_family_once_too_many_label_sets_piled_up(pb):
    m = TritonModelMetrics(pb, "vlora", "1", max_lora=8, lora_info_series=3)
    try:
        for i in range(7):
            m.adapter_requests({f"a{i}": 1}, {})
            m.flush()
            seen = lora_info(scrape(pb))
            assert seen.running == [f"a{i}"], (i, seen)
            assert len(pb.families[LORA_INFO].metrics) <= 3
        # 1 idle set + a0, a1 filled the first family; a2 started a fresh one, a3 and a4 filled it; a5, then a6
        assert [s.labels["running_lora_adapters"] for s in pb.families[LORA_INFO].metrics] == ["a5", "a6"]
    finally:
        m.close()


def test_no_lora_info_gauge_without_max_lora(pb):
    m = TritonModelMetrics(pb, "vlora", "1")
    m.adapter_requests({"a": 1}, {})
    m.close()
    assert LORA_INFO not in pb.families


def test_the_front_ends_metrics_fetch_serves_scrapes_that_come_together():
    """vlora.server.openai.metrics: concurrent scrapes share one fetch of Triton's metrics, a later one fetches
    again, and an unreachable endpoint is a 503."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from vlora.server.openai.metrics import CONTENT_TYPE, MetricsProxy

    hits = []

    class Triton(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            hits.append(self.path)
            body = f"# TYPE vlora_running_requests gauge\nvlora_running_requests {len(hits)}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Triton)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        proxy = MetricsProxy(f"http://127.0.0.1:{httpd.server_port}/metrics", max_age_s=0.3)

        async def scrapes():
            first = await asyncio.gather(*(proxy.text() for _ in range(8)))
            await asyncio.sleep(0.35)
            return first, await proxy.text()

        first, later = asyncio.run(scrapes())
        assert set(first) == {b"# TYPE vlora_running_requests gauge\nvlora_running_requests 1\n"}
        assert later.endswith(b"vlora_running_requests 2\n") and hits == ["/metrics", "/metrics"]

        response = asyncio.run(proxy.route().endpoint(None))
        assert response.status_code == 200 and response.media_type == CONTENT_TYPE
    finally:
        httpd.shutdown()
        httpd.server_close()
    gone = MetricsProxy(f"http://127.0.0.1:{httpd.server_port}/metrics", max_age_s=0)
    assert asyncio.run(gone.route().endpoint(None)).status_code == 503


def test_the_queued_gauge_adds_tritons_queue_to_the_engines():
    from vlora.server.openai.metrics import with_queued

    text = (b'nv_inference_pending_request_count{model="vlora",version="1"} 27\n'
            b'nv_inference_pending_request_count{model="other",version="1"} 5\n'
            b'vlora_waiting_requests{device="cuda:0",instance="vlora_0",model="vlora",version="1"} 3\n'
            b'vlora_waiting_requests{device="cuda:1",instance="vlora_1",model="vlora",version="1"} 2\n')
    families = parse(with_queued(text, "vlora").decode())
    assert families[QUEUED].kind == "gauge"
    assert families[QUEUED].samples == [({"model": "vlora", "version": "1"}, 32.0)]
    assert with_queued(b"nv_inference_pending_request_count{model=\"vlora\"} 1\n", "vlora").count(b"queued") == 0


def test_the_queued_gauge_sums_the_routed_engine_models():
    """With adapter-aware routing the engines are models vlora_gpu<i> behind the router vlora: the pod's queued
    requests are all of theirs, labelled model="vlora"; a model merely named alike is not counted."""
    from vlora.server.openai.metrics import with_queued

    text = (b'nv_inference_pending_request_count{model="vlora",version="1"} 1\n'
            b'nv_inference_pending_request_count{model="vlora_gpu0",version="1"} 2\n'
            b'vlora_waiting_requests{device="cuda:0",instance="vlora_gpu0_0",model="vlora_gpu0",version="1"} 3\n'
            b'vlora_waiting_requests{device="cuda:1",instance="vlora_gpu1_0",model="vlora_gpu1",version="1"} 4\n'
            b'vlora_waiting_requests{device="cuda:1",instance="x",model="vlora_gpux",version="1"} 100\n')
    families = parse(with_queued(text, "vlora").decode())
    assert families[QUEUED].samples == [({"model": "vlora", "version": "1"}, 10.0)]
