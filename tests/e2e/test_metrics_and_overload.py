"""Triton's metrics endpoint shows our metrics (adapter tiers and swaps included); a burst beyond
capacity is rejected explicitly, never hangs."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_helpers import png_bytes, start_server
from vlora_client import VloraClient, VloraClientError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI


def metric_values(text: str, name: str) -> dict[str, float]:
    """{label string: value} for every sample of ``name``."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", text, re.MULTILINE):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def test_metrics_show_requests_per_adapter_and_batch_size(server):
    client = VloraClient(server.grpc_url)
    adapter = server.adapters[0]
    before = metric_values(server.metrics(), "vlora_requests_total")
    before_count = sum(v for k, v in before.items() if f'lora_name="{adapter}"' in k)
    prompts = [f"USER: Count to {i}. ASSISTANT:" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: client.generate(p, lora_name=adapter, max_tokens=10), prompts))
    client.generate("USER: hello ASSISTANT:", max_tokens=4)

    def settled(text: str) -> None:
        requests = metric_values(text, "vlora_requests_total")
        count = sum(v for k, v in requests.items() if f'lora_name="{adapter}"' in k)
        assert count >= before_count + 6, requests
        assert any('lora_name="__base__"' in k for k in requests), requests

        steps = sum(metric_values(text, "vlora_batch_size_per_step_count").values())
        single = sum(v for k, v in metric_values(text, "vlora_batch_size_per_step_bucket").items() if 'le="1"' in k)
        assert steps > 0, "no batch size observations"
        assert single < steps, "every engine step ran a single request: the concurrent requests were not batched"
        assert metric_values(text, "vlora_batch_size"), "no batch size gauge"
        finished = metric_values(text, "vlora_requests_finished_total")
        assert any(f'lora_name="{adapter}"' in k and 'finish_reason="length"' in k for k in finished), finished
        assert "vlora_step_duration_seconds_count" in text
        assert "vlora_running_requests" in text and "vlora_waiting_requests" in text

        # Adapter tiers: the adapter was copied into a device slot (read into host memory first), and its
        # per-adapter request gauges are back to zero now that its requests finished.
        assert _labelled(text, "vlora_adapter_gpu_loads_total", adapter) >= 1
        assert _labelled(text, "vlora_adapter_host_loads_total", adapter) >= 1
        assert _labelled(text, "vlora_adapter_running_requests", adapter) == 0
        assert _labelled(text, "vlora_adapter_waiting_requests", adapter) == 0
        assert _tier(text, "gpu") >= 1 and _tier(text, "cpu") >= 1

    # Everything above was reported before the clients got their answers; the metrics thread applies the
    # reports every 0.2 s (vlora.server.metrics.FLUSH_INTERVAL_S), so the scrape is retried until it shows them.
    scrape_until(server, settled)

    # The prefix cache: a second request with the same long prompt reuses its full KV blocks.
    shared = "USER: " + "Look at the crossing and list what moves there, lane by lane. " * 6
    for question in ("Cars? ASSISTANT:", "Bikes? ASSISTANT:"):
        client.generate(shared + question, max_tokens=2)
    reused = total(scrape_until(server, total_at_least("vlora_prefix_cache_reused_tokens_total", 64)),
                   "vlora_prefix_cache_reused_tokens_total")
    assert total(server.metrics(), "vlora_prefix_cache_prompt_tokens_total") > reused

    # The encoder cache: the same frame twice is encoded once.
    frame = png_bytes(77)
    for question in ("Cars? ASSISTANT:", "Bikes? ASSISTANT:"):
        client.generate("USER: <image>\n" + question, images=[frame], max_tokens=2)
    scrape_until(server, total_at_least("vlora_encoder_cache_hits_total", 1))
    assert total(server.metrics(), "vlora_encoder_cache_bytes") > 0


def scrape_until(server, check, timeout: float = 10.0) -> str:
    """The first scrape of ``server``'s metrics that passes ``check`` (which asserts); its last failure
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        try:
            check(text)
            return text
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def total(text: str, name: str) -> float:
    """The sum of every sample of ``name``."""
    return sum(metric_values(text, name).values())


def total_at_least(name: str, least: float):
    """A scrape_until check: the samples of ``name`` sum to ``least`` or more."""
    def check(text: str) -> None:
        assert total(text, name) >= least, (name, total(text, name))
    return check


def _labelled(text: str, name: str, adapter: str) -> float:
    values = [v for k, v in metric_values(text, name).items() if f'lora_name="{adapter}"' in k]
    assert values, f"no {name} sample for {adapter}"
    return values[0]


def _tier(text: str, tier: str) -> float:
    values = [v for k, v in metric_values(text, "vlora_adapters_resident").items() if f'tier="{tier}"' in k]
    assert values, f"no vlora_adapters_resident sample for tier {tier}"
    return values[0]


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, demo_adapter_root, vlora_cache):
    """A server with tiny limits: one running request and one waiting in the engine (--max-queue-size is the
    engine's queue; Triton queues nothing); one adapter slot on the device and one adapter in host memory."""
    del demo_adapter_root
    srv = start_server(
        tmp_path_factory.mktemp("e2e-small"),
        vlora_cache,
        ["--max-batch-size", "1", "--max-queue-size", "1", "--set", "scheduler.admission_timeout_s=120",
         "--set", "lora.max_gpu_adapters=1", "--set", "lora.max_cpu_adapters=1"],
    )
    yield srv
    assert srv.stop() == 0, srv.launcher_output()[-3000:]


def test_burst_is_answered_or_rejected_explicitly(small_server):
    burst = 16
    client = VloraClient(small_server.grpc_url, timeout_s=120)

    def one(i: int):
        try:
            r = client.generate(f"USER: Burst request {i}. ASSISTANT:", max_tokens=24)
            return "answered", r
        except VloraClientError as e:
            return "rejected", str(e)

    t0 = time.monotonic()
    with ThreadPoolExecutor(burst) as pool:
        outcomes = list(pool.map(one, range(burst)))
    elapsed = time.monotonic() - t0
    answered = [r for kind, r in outcomes if kind == "answered"]
    rejected = [r for kind, r in outcomes if kind == "rejected"]
    assert len(answered) + len(rejected) == burst
    assert rejected, "a burst of 16 against capacity 2 was not rejected at all"
    assert all("overloaded" in r for r in rejected), rejected
    assert len(answered) >= 2, outcomes
    assert all(r.num_output_tokens >= 1 for r in answered)
    assert elapsed < 120
    # ...and the server is fine afterwards.
    assert client.generate("USER: after the burst ASSISTANT:", max_tokens=3).num_output_tokens >= 1


def test_cancelled_stream_frees_the_engine(small_server):
    """Closing a stream early cancels the request in the engine: the next request is served at once."""
    client = VloraClient(small_server.grpc_url, timeout_s=60)
    stream = client.generate_stream("USER: A long answer please. ASSISTANT:", max_tokens=800, ignore_eos=True)
    next(stream)
    stream.close()  # cancels on the server
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished = metric_values(small_server.metrics(), "vlora_requests_finished_total")
        if any('finish_reason="cancelled"' in k and v >= 1 for k, v in finished.items()):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the cancelled request did not finish as cancelled: {finished}")
    # The queue gauges drop with no further request (no engine step runs until the next one comes).
    deadline = time.monotonic() + 5
    while True:
        text = small_server.metrics()
        depth = [sum(metric_values(text, name).values()) for name in ("vlora_running_requests", "vlora_waiting_requests")]
        if depth == [0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert depth == [0, 0], f"running, waiting after the cancellation: {depth}"
    t0 = time.monotonic()
    assert client.generate("USER: next ASSISTANT:", max_tokens=3).num_output_tokens >= 1
    assert time.monotonic() - t0 < 20


def test_adapter_swaps_and_evictions_are_counted(small_server):
    """Three adapters through one device slot and a host tier of one: each request swaps its adapter in,
    and the first one is read from disk again after the host tier dropped it."""
    client = VloraClient(small_server.grpc_url, timeout_s=120)
    first, second, third = small_server.adapters[:3]
    for name in (first, second, third, first):
        assert client.generate("USER: Which shape? ASSISTANT:", lora_name=name, max_tokens=2).num_output_tokens >= 1
    deadline = time.monotonic() + 10
    while True:
        text = small_server.metrics()
        try:
            assert _labelled(text, "vlora_adapter_gpu_loads_total", first) >= 2
            assert _labelled(text, "vlora_adapter_gpu_evictions_total", first) >= 1
            assert _labelled(text, "vlora_adapter_gpu_loads_total", second) >= 1
            assert _labelled(text, "vlora_adapter_host_loads_total", first) >= 2
            assert _labelled(text, "vlora_adapter_host_evictions_total", first) >= 1
            # Retried with the counters: one CI run scraped the fourth load's counters beside a residency
            # gauge still at 0 (not reproduced in 9 runs here; the gauge is reported after the step, the
            # counters inside it).
            assert _tier(text, "gpu") == 1
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
