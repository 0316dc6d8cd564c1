"""The Gateway API Inference Extension's model server protocol against a real server: the endpoint picker's scrape
of the OpenAI front end's /metrics (the port an InferencePool targets) has the protocol's metrics under the names
deploy/kubernetes/ maps (tests/gie_protocol.py), as gauges with their labels, and their values move under load
sent as the picker routes it (OpenAI completions naming an adapter as the model): queued and running requests
rise while requests are in flight, the KV-cache utilization rises above 0 and returns to 0, and the LoRA info
gauge names the adapters that run and wait, its current label set always the newest.

The shared server runs without the OpenAI front end; this module starts one against it, as `vlora serve` does
(vlora.server.frontend), rather than a second server."""
from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_helpers import free_ports
from gie_protocol import KV_USAGE, LORA_INFO, LORA_LABELS, QUEUED, RUNNING, gauge, lora_info, parse
from vlora.config import EngineConfig
from vlora.server.frontend import OpenAIFrontendProcess
from vlora.server.options import ServeOptions

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_BATCH = EngineConfig().scheduler.max_batch_size  # the shared server's (defaults)
MAX_LORA = EngineConfig().lora.max_gpu_adapters


@pytest.fixture(scope="module")
def front(server, tmp_path_factory):
    """The OpenAI front end of the shared server's tritonserver; its URL."""
    port, = free_ports(1)
    options = ServeOptions(http_port=server.http_port, grpc_port=server.grpc_port, metrics_port=server.metrics_port,
                           openai_port=port, prepare_defaults=False)
    process = OpenAIFrontendProcess(options, tmp_path_factory.mktemp("e2e-front"), server.grpc_url, "vlora", None)
    try:
        process.start()
        yield f"http://127.0.0.1:{port}"
    finally:
        process.reap(timeout=30)


def scrape(front: str):
    """The endpoint picker's scrape: GET /metrics on the pool's target port."""
    with urllib.request.urlopen(f"{front}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(r.read().decode())


def idle(front: str, timeout: float = 20.0):
    """The first scrape with nothing queued, running or holding KV blocks."""
    deadline = time.monotonic() + timeout
    while True:
        families = scrape(front)
        if (gauge(families, QUEUED), gauge(families, RUNNING), gauge(families, KV_USAGE)) == (0, 0, 0):
            return families
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.1)


def test_the_protocols_metrics_are_gauges_with_their_labels(front, server):
    families = idle(front)
    for name in (QUEUED, RUNNING, KV_USAGE, LORA_INFO):
        assert families[name].kind == "gauge", name
        for labels, _ in families[name].samples:
            assert labels["model"] == "vlora", (name, labels)
    for labels, stamp in families[LORA_INFO].samples:
        assert set(LORA_LABELS) <= labels.keys() and labels["max_lora"] == str(MAX_LORA)
        assert 1.6e9 < stamp <= time.time() + 1  # a Unix time
    # The front end passes Triton's metrics through (its nv_* too) and adds the queue sum: Triton's queue and the
    # engine's, from the same fetch.
    direct = parse(server.metrics())
    assert {RUNNING, KV_USAGE, LORA_INFO, "nv_inference_request_success"} <= direct.keys() & families.keys()
    assert QUEUED not in direct
    assert gauge(families, QUEUED) == gauge(families, "vlora_waiting_requests") + gauge(
        families, "nv_inference_pending_request_count", model="vlora")


def complete(front: str, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "prompt": f"USER: Tell story {i} of the sea. ASSISTANT:", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"{front}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_values_move_under_load_and_return(front, server):
    first, second = server.adapters[:2]
    before = idle(front)
    # more requests than a batch takes: some wait, as long as the first batch decodes; 96 tokens keep them waiting
    # for a second or more, longer than the requests take to arrive on a busy 2-core machine (at 48, one run there
    # beside a CPU benchmark saw no request queued and 31 running at most: the requests arrived spread out)
    n, max_tokens = MAX_BATCH + 8, 96
    seen = {"queued": 0.0, "running": 0.0, "kv": 0.0, "running_adapters": set(), "waiting_adapters": set()}
    stamps = []
    with ThreadPoolExecutor(n) as pool:
        answers = [pool.submit(complete, front, (first, second)[i % 2], i, max_tokens) for i in range(n)]
        while not all(a.done() for a in answers):
            families = scrape(front)
            queued = gauge(families, QUEUED)
            assert queued == gauge(families, "vlora_waiting_requests") + gauge(
                families, "nv_inference_pending_request_count", model="vlora")
            seen["queued"] = max(seen["queued"], queued)
            seen["running"] = max(seen["running"], gauge(families, RUNNING))
            seen["kv"] = max(seen["kv"], gauge(families, KV_USAGE))
            picked = lora_info(families)
            if picked is not None:
                seen["running_adapters"].update(picked.running)
                seen["waiting_adapters"].update(picked.waiting)
                assert picked.max_lora == MAX_LORA
                stamps.append(picked.stamp)
            time.sleep(0.05)
        for a in answers:
            assert a.result()["usage"]["completion_tokens"] == max_tokens
    assert seen["running"] >= 2, seen  # batched
    assert seen["queued"] >= 1, seen  # beyond the batch, requests wait (in Triton's queue or the engine's)
    assert 0 < seen["kv"] <= 1, seen
    assert {first, second} <= seen["running_adapters"], seen  # the models the requests named, not the base model
    assert seen["waiting_adapters"] <= {first, second}, seen  # (the engine's waiting only: the unit tests see it)
    assert stamps == sorted(stamps), "the LoRA info the picker reads went back in time"

    after = idle(front)  # the queue empties and the KV blocks are freed
    # The idle label set is now the newest: the picker skips it and keeps the adapters it last saw running.
    newest, stamp = max(after[LORA_INFO].samples, key=lambda s: s[1])
    assert (newest["running_lora_adapters"], newest["waiting_lora_adapters"]) == ("", "")
    assert stamp > max(v for _, v in before[LORA_INFO].samples)
    assert set(lora_info(after).running) <= {first, second}
