"""Adapter-aware routing through a real `vlora serve`: the router model `vlora` in front of two engine models on the
CPU (the hidden --routing-cpu-engines 2 stands in for two GPUs). Requests for one adapter land on one engine model,
a cold adapter is read once, answers equal the single-model server's (the session's `server`), adapter actions
reach both engines, cancellations and errors pass through with their codes, and many requests at once leave the
server up."""
from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_helpers import MODEL, png_bytes, post_json, start_server
from vlora_client import VloraClient, VloraClientError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENGINES = ("vlora_gpu0", "vlora_gpu1")


@pytest.fixture(scope="module")
def routed(tmp_path_factory, demo_adapter_root, vlora_cache):
    del demo_adapter_root
    srv = start_server(tmp_path_factory.mktemp("e2e-routed"), vlora_cache, ["--routing-cpu-engines", "2"])
    assert "adapter-aware routing: 2 engine models" in srv.launcher_output()
    yield srv
    assert srv.stop() == 0, srv.launcher_output()[-3000:]


def per_model(text: str, name: str, adapter: str) -> dict[str, float]:
    """{engine model: value} of metric ``name`` for ``adapter``."""
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}}\s+(\S+)$", text, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("lora_name") == adapter:
            out[labels["model"]] = out.get(labels["model"], 0.0) + float(m.group(2))
    return out


def wait_for(check, timeout: float = 10.0):
    """``check()``'s value once it is truthy (the metrics lag the engine by up to 0.2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


CASES = [
    dict(prompt="USER: Tell me about the sea. ASSISTANT:", lora_name=None, max_tokens=10),
    dict(prompt="USER: <image>\nWhat is this? ASSISTANT:", images=[png_bytes(3)], lora_name="demo-r8-qv", max_tokens=8),
    dict(prompt="USER: Count to five. ASSISTANT:", lora_name="demo-r16-attn", max_tokens=12),
]


def test_answers_equal_the_single_model_server(routed, server):
    ref = VloraClient(server.grpc_url)
    for protocol, url in (("grpc", routed.grpc_url), ("http", routed.http_url)):
        client = VloraClient(url, protocol=protocol)
        for case in CASES:
            expected = ref.generate(**case)
            whole = client.generate(**case)
            assert (whole.text, whole.finish_reason, whole.num_output_tokens) == \
                (expected.text, expected.finish_reason, expected.num_output_tokens), (protocol, case)
            parts = list(client.generate_stream(**case))
            assert "".join(p.text for p in parts) == expected.text and parts[-1].finish_reason == expected.finish_reason
            assert len(parts) >= 2, "streaming sent a single response"


def test_float_request_parameters_reach_the_engine(routed, server):
    """Top-level request parameters of every JSON type, floats too (Triton 2.51's BLS takes none: the router moves
    them into sampling_parameters, beneath its own values), answer as on the single-model server."""
    for body in ({"text_input": "USER: hi ASSISTANT:", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3},
                 {"text_input": "USER: hi ASSISTANT:", "temperature": 0.7, "seed": 3,
                  "sampling_parameters": json.dumps({"max_tokens": 5, "temperature": 0.0})}):
        want = post_json(f"{server.http_url}/v2/models/{MODEL}/generate", body, timeout=60)
        got = post_json(f"{routed.http_url}/v2/models/{MODEL}/generate", body, timeout=60)
        assert want[0] == got[0] == 200, (want, got)
        assert got[1]["text_output"] == want[1]["text_output"] and got[1]["num_output_tokens"] == 5


def test_one_adapter_lands_on_one_engine(routed):
    client = VloraClient(routed.grpc_url)
    adapters = ["demo-count-circles", "demo-shapes"]
    for _ in range(3):
        for name in adapters:
            assert client.generate("USER: Which shape? ASSISTANT:", lora_name=name, max_tokens=2).num_output_tokens >= 1
    for name in adapters:
        counts = wait_for(lambda: (c := per_model(routed.metrics(), "vlora_requests_total", name)) and sum(c.values()) >= 3 and c)
        assert counts and len(counts) == 1 and sum(counts.values()) == 3, (name, counts)


def test_a_cold_adapter_is_read_once(routed):
    """A burst for an adapter no engine has read yet: it is read from disk and put in a slot on one engine only."""
    client = VloraClient(routed.grpc_url)
    name = "demo-r32-mlp"
    assert not per_model(routed.metrics(), "vlora_adapter_host_loads_total", name)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: client.generate(f"USER: Request {i}. ASSISTANT:", lora_name=name, max_tokens=3),
                                range(6)))
    assert all(r.num_output_tokens == 3 for r in results)
    reads = wait_for(lambda: per_model(routed.metrics(), "vlora_adapter_host_loads_total", name))
    assert reads and list(reads.values()) == [1.0], f"host reads per engine model: {reads}"
    requests = wait_for(lambda: (c := per_model(routed.metrics(), "vlora_requests_total", name)) and sum(c.values()) >= 6 and c)
    assert list(requests) == list(reads) and sum(requests.values()) == 6, requests


def test_adapter_load_and_unload_reach_every_engine(routed, demo_adapter_root):
    name = f"e2e-route-{uuid.uuid4().hex[:8]}"
    shutil.copytree(demo_adapter_root / "demo-r8-qv", demo_adapter_root / name)
    admin = VloraClient(routed.grpc_url, admin_token=routed.admin_token)
    try:
        status, body = post_json(f"{routed.http_url}/v2/models/{MODEL}/generate",
                                 {"text_input": "", "adapter_action": "load", "lora_name": name,
                                  "admin_token": routed.admin_token})
        assert status == 200, body
        answer = json.loads(body["text_output"])
        assert answer["loaded"]["name"] == name and set(answer["engines"]) == set(ENGINES), answer
        assert "partial" not in answer
        listed = {a["name"]: a for a in admin.list_adapters()}
        assert set(listed[name]["tiers"]) == set(ENGINES)
        assert admin.generate("USER: hi ASSISTANT:", lora_name=name, max_tokens=2).num_output_tokens == 2
        unloaded = admin.unload_adapter(name)
        assert unloaded["state"] == "unloaded" and unloaded["loaded"] is False
        listed = {a["name"]: a for a in admin.list_adapters()}
        assert listed[name]["state"] == "unloaded"
        with pytest.raises(VloraClientError) as refused:  # refused on whichever engine it goes to
            admin.generate("USER: hi ASSISTANT:", lora_name=name, max_tokens=2)
        assert refused.value.code == "INVALID_ARG"
        with pytest.raises(VloraClientError) as no_token:
            VloraClient(routed.grpc_url).load_adapter(name)
        assert no_token.value.code == "INVALID_ARG" and "admin_token" in str(no_token.value)
    finally:
        shutil.rmtree(demo_adapter_root / name, ignore_errors=True)


def test_errors_pass_through_with_their_codes(routed):
    status, body = post_json(f"{routed.http_url}/v2/models/{MODEL}/generate",
                             {"text_input": "x", "lora_name": "no-such-adapter"})
    assert status == 400 and body["error"].startswith("[INVALID_ARG] unknown adapter 'no-such-adapter'"), body
    for protocol, url in (("grpc", routed.grpc_url), ("http", routed.http_url)):
        with pytest.raises(VloraClientError) as bad:
            list(VloraClient(url, protocol=protocol).generate_stream("USER: x ASSISTANT:", lora_name="no-such-adapter",
                                                                     max_tokens=2))
        assert bad.value.code == "INVALID_ARG" and "no-such-adapter" in str(bad.value), protocol
    status, body = post_json(f"{routed.http_url}/v2/models/{MODEL}/generate",
                             {"text_input": "x", "sampling_parameters": "{\"temperature\": -1}"})
    assert status == 400 and body["error"].startswith("[INVALID_ARG]"), body


def test_a_cancelled_stream_is_cancelled_in_its_engine(routed):
    client = VloraClient(routed.grpc_url, timeout_s=60)
    stream = client.generate_stream("USER: A long answer please. ASSISTANT:", lora_name="demo-r4-pattern",
                                    max_tokens=2000, ignore_eos=True)
    next(stream)
    stream.close()  # cancels the router's request; the router cancels the engine's

    def cancelled() -> float:
        text = routed.metrics()
        return sum(v for k, v in _finished(text).items() if 'finish_reason="cancelled"' in k)

    assert wait_for(lambda: cancelled() >= 1, timeout=15), _finished(routed.metrics())
    assert wait_for(lambda: _depth(routed.metrics()) == 0, timeout=10), "requests still running after the cancellation"



def test_a_burst_for_a_resident_adapter_spreads_past_the_margin(routed):
    """40 requests at once for an adapter one engine holds: the router counts what it sent since the engines'
    records (policy.with_sent), so past the margin (8) the burst also goes to the other engine, which then loads
    the adapter too. With the records alone (published every 0.1 s) a burst went to the holder only. Each asks for
    24 tokens: requests that end within a record's 0.1 s are gone from the holder's load before the next ones are
    placed (on a busy machine the 40 client threads send over a longer time), and the holder rightly keeps them."""
    client = VloraClient(routed.grpc_url, timeout_s=120)
    name = "demo-r16-attn"
    time.sleep(0.5)  # the metrics of the tests before are applied (every 0.2 s)
    before = per_model(routed.metrics(), "vlora_requests_total", name)
    assert client.generate("USER: hi ASSISTANT:", lora_name=name, max_tokens=1).num_output_tokens == 1  # resident
    with ThreadPoolExecutor(40) as pool:
        done = list(pool.map(lambda i: client.generate(f"USER: Burst {i}. ASSISTANT:", lora_name=name, max_tokens=24,
                                                        ignore_eos=True).num_output_tokens, range(40)))
    assert done == [24] * 40
    total = sum(before.values()) + 41
    after = wait_for(lambda: (c := per_model(routed.metrics(), "vlora_requests_total", name)) and sum(c.values()) >= total and c)
    burst = {m: after.get(m, 0.0) - before.get(m, 0.0) for m in ENGINES}  # the first request and the burst
    assert min(burst.values()) >= 8, f"the burst's requests per engine model: {burst}"


def test_many_short_requests_at_once_leave_the_server_up(routed):
    """Requests that finish while the router's watcher polls its relays for cancellation: Triton 2.51 crashed
    (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled) when a poll reached a request its relay had just answered,
    within about 250 such requests (wire.Sender). Last in this module: it moves the per-adapter counts."""
    client = VloraClient(routed.grpc_url, timeout_s=60)
    adapters = [None, "demo-r4-pattern"]

    def work(i: int) -> int:
        return sum(client.generate("USER: hi ASSISTANT:", lora_name=adapters[(i + k) % 2], max_tokens=1).num_output_tokens
                   for k in range(75))

    with ThreadPoolExecutor(16) as pool:
        assert sum(pool.map(work, range(16))) == 16 * 75
    assert routed.proc.poll() is None, routed.launcher_output()[-3000:]

def _finished(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^vlora_requests_finished_total(\{[^}]*\})\s+(\S+)$", text, re.MULTILINE)}


def _depth(text: str) -> float:
    return sum(float(m.group(1)) for m in
               re.finditer(r"^vlora_(?:running|waiting)_requests\{[^}]*\}\s+(\S+)$", text, re.MULTILINE))
