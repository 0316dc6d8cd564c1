"""Adversarial requests and adapters against a real server, and the engine's fail-safe.

Each hostile input is refused with a clear 400 (never an internal error), and after each one the
server still answers a normal request correctly within a second and reports ready. Then, on servers
of their own: an engine wedged by the test-only fault is detected by the watchdog, its requests in
flight are failed, and `vlora serve` prints the cause and stops (readiness goes false); SIGTERM stops
the server with no stub process and no shared-memory region left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from e2e_helpers import MODEL, http_status, post_json, start_server
from vlora.server.launcher import child_processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI

HEALTHY_WITHIN_S = 1.0  # a normal request after a hostile one is answered within this
# ... and one sent while heavy images are being decoded on the image workers: those share the 2 cores
# of a CI machine (and the GIL, in short holds) with the engine; unbounded decoding on Triton's thread
# took 4.5 s here.
BESIDE_HEAVY_WITHIN_S = 2.0
SOURCE = "demo-r8-qv"


def _urls(server) -> tuple[str, str]:
    base = f"http://{server.http_url}/v2/models/{MODEL}"
    return f"{base}/generate", f"{base}/generate_stream"


def assert_healthy(server, within_s: float = HEALTHY_WITHIN_S) -> None:
    """The server reports ready and answers a normal request, correctly and within ``within_s``."""
    assert http_status(f"http://{server.http_url}/v2/health/ready") == 200
    generate, _ = _urls(server)
    t0 = time.monotonic()
    status, payload = post_json(generate, {"text_input": "USER: How many circles? ASSISTANT:",
                                           "sampling_parameters": json.dumps({"max_tokens": 2, "ignore_eos": True})},
                                timeout=30)
    elapsed = time.monotonic() - t0
    assert status == 200 and isinstance(payload.get("text_output"), str), payload
    assert payload.get("finish_reason") == "length" and payload.get("num_output_tokens") == 2, payload
    assert elapsed < within_s, f"a normal request took {elapsed:.2f}s after a hostile one"


def assert_refused(status: int, payload: dict, *words: str) -> None:
    error = payload.get("error", "")
    assert status == 400, (status, payload)
    assert "internal error" not in error.lower(), error
    assert all(w.lower() in error.lower() for w in words), (words, error)


def _sampling(**sp) -> dict:
    return {"text_input": "hi", "sampling_parameters": json.dumps(sp)}


@pytest.mark.parametrize("body,words", [
    # 1. a seed beyond 64 bits (it once crashed the engine thread)
    ({"text_input": "hi", "sampling_parameters": "{\"seed\": 18446744073709551616, \"temperature\": 0.7}"}, ["seed"]),
    # 2. probabilities below what the sampler can represent
    (_sampling(top_p=1e-46), ["top_p"]),
    (_sampling(temperature=1e-40), ["temperature"]),
    # max_tokens as a 5,000-digit string
    (_sampling(max_tokens="9" * 5000), ["max_tokens"]),
    # a NUL in lora_name is not another adapter's name
    pytest.param({"text_input": "hi", "lora_name": SOURCE + "\u0000"}, ["lora_name"], marks=pytest.mark.xfail(
        strict=True, reason="Triton's HTTP frontend passes string request parameters as C strings: the name "
                            "reaches the model already cut at the NUL (the JSON sampling_parameters keep it)")),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": "\u0000" + SOURCE})}, ["adapter name"]),
], ids=["seed-2**64", "top_p-1e-46", "temperature-1e-40", "max_tokens-5000-digits", "lora_name-nul",
        "lora_name-nul-in-sampling"])
def test_hostile_parameters_are_refused(server, body, words):
    generate, _ = _urls(server)
    assert_refused(*post_json(generate, body), *words)
    assert_healthy(server)


def test_deeply_nested_sampling_parameters_are_refused(server):
    generate, _ = _urls(server)
    depth = 100_000
    nested = '{"a":' * depth + "1" + "}" * depth
    assert_refused(*post_json(generate, {"text_input": "hi", "sampling_parameters": nested}), "sampling_parameters")
    assert_healthy(server)


def _stream_in_background(server, results: list, max_tokens: int = 300) -> threading.Thread:
    """A long normal request, running while the hostile ones arrive; its outcome goes to ``results``."""
    _, stream = _urls(server)
    body = {"text_input": "USER: Describe the picture. ASSISTANT:",
            "sampling_parameters": json.dumps({"max_tokens": max_tokens, "ignore_eos": True}), "stream": True}

    def run():
        req = urllib.request.Request(stream, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        events = []
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if line.startswith("data:"):
                        events.append(json.loads(line[5:].strip()))
        except urllib.error.HTTPError as e:  # the error body is JSON, or empty when the server went down
            raw_body = e.read()
            try:
                events.append(json.loads(raw_body) if raw_body else {"error": str(e)})
            except ValueError:
                events.append({"error": f"{e}: {raw_body[:200]!r}"})
        except Exception as e:
            events.append({"error": f"{type(e).__name__}: {e}"})
        results.append(events)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _assert_stream_completed(results: list, max_tokens: int) -> None:
    assert results, "the concurrent request did not finish"
    events = results[0]
    assert events and not any("error" in e for e in events), events[-3:]
    assert events[-1].get("finish_reason") == "length"
    assert sum(e.get("num_output_tokens", 0) for e in events) == max_tokens


def test_a_bad_request_next_to_a_running_one_leaves_it_alone(server):
    """2. The bad request is refused at validation; the request already decoding finishes normally."""
    generate, _ = _urls(server)
    results: list = []
    runner = _stream_in_background(server, results)
    time.sleep(0.3)
    for body in (_sampling(top_p=1e-46), _sampling(temperature=1e-40, seed=2 ** 64)):
        status, payload = post_json(generate, body)
        assert status == 400, payload
    runner.join(120)
    _assert_stream_completed(results, 300)
    assert_healthy(server)


@pytest.fixture()
def hostile_adapter(server, demo_adapter_root):
    """Copy a demo adapter into the server's adapter root with its config edited (removed after)."""
    added = []

    def add(edit_config) -> str:
        name = f"adv-{uuid.uuid4().hex[:8]}"
        shutil.copytree(demo_adapter_root / SOURCE, demo_adapter_root / name)
        added.append(demo_adapter_root / name)
        path = demo_adapter_root / name / "adapter_config.json"
        config = json.loads(path.read_text())
        edit_config(config)
        path.write_text(json.dumps(config))
        return name

    yield add
    for path in added:
        shutil.rmtree(path, ignore_errors=True)


def _load(server, name: str, timeout: float = 60) -> tuple[int, dict, float]:
    generate, _ = _urls(server)
    t0 = time.monotonic()
    status, payload = post_json(generate, {"text_input": "", "adapter_action": "load", "lora_name": name,
                                           "admin_token": server.admin_token}, timeout=timeout)
    return status, payload, time.monotonic() - t0


def test_an_adapter_with_a_huge_alpha_is_refused_while_others_run(server, hostile_adapter):
    """2. lora_alpha 1e308 is refused at load with the reason; a concurrent request is unaffected."""
    name = hostile_adapter(lambda c: c.update(lora_alpha=1e308))
    results: list = []
    runner = _stream_in_background(server, results)
    time.sleep(0.3)
    status, payload, _ = _load(server, name)
    assert_refused(status, payload, name)
    assert any(w in payload["error"] for w in ("scale", "lora_alpha", "alpha")), payload
    # ...and a request naming it is refused the same way, not served.
    generate, _ = _urls(server)
    assert_refused(*post_json(generate, {"text_input": "hi", "lora_name": name}), name)
    runner.join(120)
    _assert_stream_completed(results, 300)
    assert_healthy(server)


def test_a_catastrophic_rank_pattern_is_refused_quickly_while_inference_goes_on(server, hostile_adapter):
    """3. A rank_pattern regex with catastrophic backtracking: the load answers within seconds with a
    refusal, and inference keeps answering meanwhile."""
    name = hostile_adapter(lambda c: c.update(rank_pattern={"(.+)+X": 8}))
    outcome: list = []
    loader = threading.Thread(target=lambda: outcome.append(_load(server, name)), daemon=True)
    loader.start()
    time.sleep(0.2)
    assert_healthy(server)  # while the load is being refused
    loader.join(60)
    assert outcome, "the load did not answer"
    status, payload, elapsed = outcome[0]
    assert_refused(status, payload, name)
    assert elapsed < 10, f"the refusal took {elapsed:.1f}s"
    assert_healthy(server)


def _solid_png_b64(size: int, colour: tuple[int, int, int]) -> str:
    """A one-colour PNG: a few dozen KB to send, size x size pixels to decode."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def test_heavy_image_requests_delay_only_themselves(server):
    """5. Images cheap to send but costly to decode (solid-colour 4096x4096 PNGs, ~60 KB each, most of a
    second each to decode and preprocess) are decoded on the image workers, not on Triton's request
    thread: normal requests sent while four such requests are being decoded are answered within a second,
    and a request over the per-request pixel budget is refused from its headers at once."""
    from e2e_helpers import b64, png_bytes

    generate, _ = _urls(server)
    heavy_images = [_solid_png_b64(4096, (200, 30, 30)), _solid_png_b64(4096, (30, 30, 200))]  # 32 M pixels: the limit
    heavy = {"text_input": "USER: <image>\n<image>\nWhat colours are these? ASSISTANT:", "image": heavy_images,
             "sampling_parameters": json.dumps({"max_tokens": 2, "ignore_eos": True})}
    outcomes: list[tuple[int, dict, float]] = []

    def send_heavy() -> None:
        t0 = time.monotonic()
        status, payload = post_json(generate, heavy, timeout=120)
        outcomes.append((status, payload, time.monotonic() - t0))

    t0 = time.monotonic()
    senders = [threading.Thread(target=send_heavy, daemon=True) for _ in range(4)]
    for t in senders:
        t.start()
    time.sleep(0.5)  # the heavy requests have arrived and are being decoded
    assert_healthy(server, BESIDE_HEAVY_WITHIN_S)  # a text request
    small = {"text_input": "USER: <image>\nWhat is this? ASSISTANT:", "image": [b64(png_bytes(3))],
             "sampling_parameters": json.dumps({"max_tokens": 2, "ignore_eos": True})}
    t1 = time.monotonic()
    status, payload = post_json(generate, small, timeout=30)
    small_took = time.monotonic() - t1
    assert status == 200 and payload.get("num_output_tokens") == 2, payload
    assert small_took < BESIDE_HEAVY_WITHIN_S, f"a request with a small image took {small_took:.2f}s next to heavy ones"
    # Over the pixel budget (8 such images, 134 M pixels): refused from the headers, without decoding.
    t2 = time.monotonic()
    status, payload = post_json(generate, {**heavy, "image": heavy_images * 4})
    assert_refused(status, payload, "limits.max_total_pixels")
    assert time.monotonic() - t2 < HEALTHY_WITHIN_S
    still_decoding = sum(t.is_alive() for t in senders)
    for t in senders:
        t.join(120)
    assert len(outcomes) == 4 and all(status == 200 for status, _, _ in outcomes), [o[:2] for o in outcomes]
    assert all(p.get("num_output_tokens") == 2 for _, p, _ in outcomes)
    slowest = max(took for _, _, took in outcomes)
    assert still_decoding >= 1 and slowest > small_took, (still_decoding, slowest, small_took)
    assert time.monotonic() - t0 < 60
    assert_healthy(server)


# -- the fail-safe engine: servers of their own (destructive) ----------------------------------------
def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, name) of ``pid``'s living (not zombie) children."""
    return [(child, name) for child, name, state in child_processes(pid) if state != "Z"]


def _server_processes(launcher_pid: int) -> tuple[int, list[int], str]:
    """(tritonserver's pid, its stubs' pids, its shared-memory prefix)."""
    triton = next(pid for pid, name in _children(launcher_pid) if name == "tritonserver")
    stubs = [pid for pid, name in _children(triton) if name.startswith("triton_python")]
    cmdline = Path(f"/proc/{triton}/cmdline").read_bytes().decode().split("\0")
    prefix = next(a.split("shm-region-prefix-name=", 1)[1] for a in cmdline if "shm-region-prefix-name=" in a)
    return triton, stubs, prefix


def _assert_nothing_left(pids: list[int], prefix: str) -> None:
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if Path(f"/proc/{p}/stat").exists()
            and Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()[0] != "Z"]
    assert not left, f"processes left running: {left}"
    assert prefix.startswith("vlora_") and not list(Path("/dev/shm").glob(f"{prefix}*")), "shared memory left behind"


def test_a_wedged_engine_fails_its_requests_and_takes_the_server_down(tmp_path, vlora_cache, demo_adapter_root):
    stall = 3.0
    srv = start_server(tmp_path, vlora_cache, ["--set", "scheduler.fault_injection=true",
                                               "--set", f"scheduler.stall_timeout_s={stall}"])
    try:
        triton, stubs, prefix = _server_processes(srv.proc.pid)
        assert stubs and list(Path("/dev/shm").glob(f"{prefix}*"))
        generate, _ = _urls(srv)
        assert_refused(*post_json(generate, {"text_input": "hi", "vlora_test_fault": "nope"}), "vlora_test_fault")
        results: list[list] = [[] for _ in range(3)]
        runners = [_stream_in_background(srv, results[i], max_tokens=800) for i in range(3)]
        time.sleep(0.5)
        faulted: list = []
        t0 = time.monotonic()
        fault = threading.Thread(target=lambda: faulted.append(post_json(
            generate, {"text_input": "hi", "vlora_test_fault": "wedge"}, timeout=60)), daemon=True)
        fault.start()
        for r in runners + [fault]:
            r.join(stall + 15)
        failed_in = time.monotonic() - t0
        for events in results:  # each in-flight request ends with the cause, not a hang
            assert events and events[0] and "error" in events[0][-1], events
            assert "engine" in events[0][-1]["error"], events[0][-1]
        status, payload = faulted[0]
        assert status >= 400 and "no progress" in payload.get("error", ""), payload
        assert failed_in < stall + 10, f"requests were failed after {failed_in:.1f}s"
        code = srv.proc.wait(timeout=60)
        out = srv.launcher_output()
        assert code == 3 and "ENGINE FAILED" in out and "no progress" in out, out[-2000:]
        assert http_status(f"http://{srv.http_url}/v2/health/ready") != 200
        assert http_status(f"http://{srv.http_url}/v2/models/{MODEL}/ready") != 200
        _assert_nothing_left([triton] + stubs, prefix)
    finally:
        srv.stop(timeout=30)


def test_sigterm_leaves_no_stub_and_no_shared_memory(tmp_path, vlora_cache, demo_adapter_root):
    srv = start_server(tmp_path, vlora_cache)
    try:
        triton, stubs, prefix = _server_processes(srv.proc.pid)
        assert stubs and list(Path("/dev/shm").glob(f"{prefix}*"))
        os.kill(srv.proc.pid, signal.SIGTERM)
        code = srv.proc.wait(timeout=90)
        assert code == 0, srv.launcher_output()[-2000:]
        _assert_nothing_left([triton] + stubs, prefix)
    finally:
        srv.stop(timeout=30)
