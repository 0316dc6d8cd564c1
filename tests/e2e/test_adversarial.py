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
from vlora.server.processes import child_processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI

HEALTHY_WITHIN_S = 1.0  # a normal request after a hostile one is answered within this
# ... and one sent while heavy images are being decoded on the image workers: those share the 2 cores
# of a CI machine (and the GIL, in short holds) with the engine; unbounded decoding on Triton's thread
# took 4.5 s here.
BESIDE_HEAVY_WITHIN_S = 2.0
SOURCE = "demo-r8-qv"


def _urls(server) -> tuple[str, str]:
    base = f"{server.http_url}/v2/models/{MODEL}"
    return f"{base}/generate", f"{base}/generate_stream"


def assert_healthy(server, within_s: float = HEALTHY_WITHIN_S) -> None:
    """The server reports ready and answers a normal request, correctly and within ``within_s``."""
    assert http_status(f"{server.http_url}/v2/health/ready") == 200
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
    ({"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": "\u0000" + SOURCE})}, ["lora_name", "NUL"]),
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
        assert http_status(f"{srv.http_url}/v2/health/ready") != 200
        assert http_status(f"{srv.http_url}/v2/models/{MODEL}/ready") != 200
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


# --- issue 37 holes 1-2: Triton's restricted APIs, private shared memory ---
# Triton's shared-memory, logging, trace and model-repository APIs are restricted by `vlora serve`: they
# answer only requests carrying the header `vlora-admin-key` (gRPC: `triton-grpc-protocol-vlora-admin-key`)
# whose value is the key derived from the admin token (launcher.triton_admin_key); without an admin
# token no request can carry the value they expect. Health, metadata, inference, model configuration and
# statistics stay open. The Python backend's shared-memory regions are created 0600.
_R37_REGION = "vlora-r37-test"
_R37_HTTP_RESTRICTED = [  # (method, path, JSON body) of each restricted HTTP endpoint
    ("GET", "/v2/systemsharedmemory/status", None),
    ("GET", f"/v2/systemsharedmemory/region/{_R37_REGION}/status", None),
    ("POST", f"/v2/systemsharedmemory/region/{_R37_REGION}/register", {"key": "/vlora_r37_none", "offset": 0, "byte_size": 64}),
    ("POST", f"/v2/systemsharedmemory/region/{_R37_REGION}/unregister", None),
    ("POST", "/v2/systemsharedmemory/unregister", None),
    ("GET", "/v2/cudasharedmemory/status", None),
    ("POST", "/v2/cudasharedmemory/unregister", None),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", {"log_verbose_level": 10, "log_error": False, "log_warning": False, "log_info": False}),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}),
    ("GET", f"/v2/models/{MODEL}/trace/setting", None),
    ("POST", "/v2/repository/index", {}),
    ("POST", f"/v2/repository/models/{MODEL}/unload", {}),
    ("POST", f"/v2/repository/models/{MODEL}/load", {}),
]
_R37_HTTP_OPEN = ["/v2/health/live", "/v2/health/ready", "/v2", f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/ready",
                  f"/v2/models/{MODEL}/config", f"/v2/models/{MODEL}/stats", "/v2/models/stats"]


def _r37_http(server, method: str, path: str, body=None, headers: dict = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(f"{server.http_url}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _r37_grpc_restricted(client, headers) -> dict:
    """Each restricted gRPC call of tritonclient, ready to run with ``headers``."""
    return {
        "system shm status": lambda: client.get_system_shared_memory_status(headers=headers),
        "system shm register": lambda: client.register_system_shared_memory(_R37_REGION, "/vlora_r37_none", 64, headers=headers),
        "system shm unregister": lambda: client.unregister_system_shared_memory(_R37_REGION, headers=headers),
        "cuda shm status": lambda: client.get_cuda_shared_memory_status(headers=headers),
        "log settings": lambda: client.get_log_settings(headers=headers),
        "update log settings": lambda: client.update_log_settings({"log_verbose_level": 10, "log_error": False}, headers=headers),
        "trace settings": lambda: client.get_trace_settings(headers=headers),
        "update trace settings": lambda: client.update_trace_settings(settings={"trace_rate": "1"}, headers=headers),
        "repository index": lambda: client.get_model_repository_index(headers=headers),
        "unload model": lambda: client.unload_model(MODEL, headers=headers),
        "load model": lambda: client.load_model(MODEL, headers=headers),
    }


def _r37_assert_restricted(server, headers: dict) -> None:
    """Every restricted API refuses a request with ``headers``, on HTTP (403) and gRPC (UNAVAILABLE)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    for method, path, body in _R37_HTTP_RESTRICTED:
        status, text = _r37_http(server, method, path, body, headers)
        assert status == 403 and "restricted" in text, (method, path, status, text)
    grpc_headers = {f"triton-grpc-protocol-{k}": v for k, v in headers.items()} | headers
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for name, call in _r37_grpc_restricted(client, grpc_headers).items():
            with pytest.raises(InferenceServerException) as err:
                call()
            assert "restricted" in err.value.message(), (name, err.value)
            assert err.value.status() == "StatusCode.UNAVAILABLE", (name, err.value.status())


def _r37_assert_open(server) -> None:
    """Health, metadata, model configuration and statistics answer without any header."""
    import tritonclient.grpc as grpcclient

    for path in _R37_HTTP_OPEN:
        status, text = _r37_http(server, "GET", path)
        assert status == 200, (path, status, text)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        assert client.get_server_metadata().name == "triton"
        assert client.get_model_metadata(MODEL).name == MODEL
        assert client.get_model_config(MODEL).config.name == MODEL
        assert client.get_inference_statistics(MODEL).model_stats


def _r37_cmdline(server) -> list[str]:
    triton, _, _ = _server_processes(server.proc.pid)
    return Path(f"/proc/{triton}/cmdline").read_bytes().decode(errors="replace").split("\0")


def test_tritons_restricted_apis_refuse_requests_without_the_admin_key(server):
    """Hole 1: without the key (or with a wrong one, or with the admin token itself), the shared-memory,
    logging, trace and model-repository APIs are refused on HTTP and gRPC; the rest stays open."""
    from vlora.server.lockdown import triton_admin_key

    _r37_assert_restricted(server, {})
    _r37_assert_restricted(server, {"vlora-admin-key": "wrong-" + "x" * 58})
    _r37_assert_restricted(server, {"vlora-admin-key": server.admin_token})  # the token is not the key
    _r37_assert_restricted(server, {"vlora-admin-token": triton_admin_key(server.admin_token)})  # another header
    _r37_assert_open(server)
    # The refused POST /v2/logging changed nothing: error logs are on, verbosity is what the server started with.
    status, text = _r37_http(server, "GET", "/v2/logging", headers={"vlora-admin-key": triton_admin_key(server.admin_token)})
    assert status == 200, text
    settings = json.loads(text)
    assert settings["log_error"] is True and settings["log_verbose_level"] == 0, settings
    assert_healthy(server)


def test_tritons_restricted_apis_answer_the_admin_key(server):
    """Hole 1: with the key derived from the admin token they work, on HTTP and gRPC (a region of the test's
    own is registered, listed and unregistered); the key and the token are not on tritonserver's command line."""
    import tritonclient.grpc as grpcclient
    from multiprocessing import shared_memory

    from vlora.server.lockdown import ADMIN_KEY_HEADER, triton_admin_key

    assert ADMIN_KEY_HEADER == "vlora-admin-key"
    key = triton_admin_key(server.admin_token)
    assert len(key) == 64 and key != server.admin_token
    headers = {ADMIN_KEY_HEADER: key}
    for method, path in (("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/cudasharedmemory/status"),
                         ("GET", "/v2/logging"), ("GET", "/v2/trace/setting"), ("POST", "/v2/repository/index")):
        status, text = _r37_http(server, method, path, headers=headers)
        assert status == 200, (path, status, text)
    status, text = _r37_http(server, "POST", "/v2/repository/index", {}, headers)
    assert MODEL in text
    region = shared_memory.SharedMemory(name=f"vlora_r37_{uuid.uuid4().hex[:8]}", create=True, size=4096)
    try:
        status, text = _r37_http(server, "POST", f"/v2/systemsharedmemory/region/{_R37_REGION}/register",
                                 {"key": f"/{region.name}", "offset": 0, "byte_size": 4096}, headers)
        assert status == 200, text
        status, text = _r37_http(server, "GET", "/v2/systemsharedmemory/status", headers=headers)
        assert status == 200 and _R37_REGION in text, text
        status, text = _r37_http(server, "POST", f"/v2/systemsharedmemory/region/{_R37_REGION}/unregister", headers=headers)
        assert status == 200, text
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            grpc_headers = {f"triton-grpc-protocol-{ADMIN_KEY_HEADER}": key}
            client.register_system_shared_memory(_R37_REGION, f"/{region.name}", 4096, headers=grpc_headers)
            assert _R37_REGION in str(client.get_system_shared_memory_status(headers=grpc_headers))
            client.unregister_system_shared_memory(_R37_REGION, headers=grpc_headers)
            assert "log_error" in str(client.get_log_settings(headers=grpc_headers))
            client.get_trace_settings(headers=grpc_headers)
            assert MODEL in str(client.get_model_repository_index(headers=grpc_headers))
    finally:
        region.close()
        region.unlink()
    cmdline = "\0".join(_r37_cmdline(server))
    assert "--http-restricted-api=" in cmdline and "--grpc-restricted-protocol=" in cmdline, cmdline
    assert key not in cmdline and server.admin_token not in cmdline
    assert_healthy(server)


def test_shared_memory_regions_workspace_and_log_are_private(server):
    """Hole 2: every region of the running server is 0600 and the server's user's; the workspace and the log
    (which may hold prompts at a high verbosity) are not readable by other users."""
    triton, stubs, prefix = _server_processes(server.proc.pid)
    assert prefix.startswith("vlora_") and len(prefix) >= len("vlora_") + 12, prefix  # 48 random bits at least
    regions = sorted(Path("/dev/shm").glob(f"{prefix}*"))
    assert regions, f"no /dev/shm/{prefix}* region"
    owner = Path(f"/proc/{triton}").stat().st_uid
    modes = {r.name: oct(r.stat().st_mode & 0o777) for r in regions}
    assert all(m == "0o600" for m in modes.values()), modes
    assert all(r.stat().st_uid == owner for r in regions)
    for path in (server.workspace, server.workspace / "tritonserver.log"):
        assert path.stat().st_mode & 0o077 == 0, (path.name, oct(path.stat().st_mode))


def _r37_attack(server, region_key: str, byte_size: int) -> list:
    """Register the backend's own region (refused), then ask for the output in it over a gRPC stream.
    Returns the stream's (result, error) answers."""
    import queue as queue_module

    import numpy as np
    import tritonclient.grpc as grpcclient

    status, text = _r37_http(server, "POST", f"/v2/systemsharedmemory/region/{_R37_REGION}/register",
                             {"key": region_key, "offset": 0, "byte_size": byte_size})
    assert status == 403, (status, text)
    inputs = []
    for name, array, dtype in (("text_input", np.array([b"USER: hi ASSISTANT:"], dtype=np.object_), "BYTES"),
                               ("stream", np.array([False]), "BOOL"),
                               ("sampling_parameters", np.array([json.dumps({"max_tokens": 4}).encode()], dtype=np.object_), "BYTES")):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    output = grpcclient.InferRequestedOutput("text_output")
    output.set_shared_memory(_R37_REGION, min(byte_size, 4096))
    answers: "queue_module.Queue" = queue_module.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(Exception):
            client.register_system_shared_memory(_R37_REGION, region_key, byte_size)
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(MODEL, inputs, outputs=[output])
        got = [answers.get(timeout=60)]
        client.stop_stream()
    return got


def test_without_an_admin_token_the_restricted_apis_are_off_and_the_shm_attack_fails(tmp_path, vlora_cache, demo_adapter_root):
    """Hole 1, the attack of the issue: a server without an admin token; no header opens the restricted APIs
    (no secret on the command line either); registering the backend's own region and directing an output
    into it is refused, and the server stays up and healthy."""
    srv = start_server(tmp_path, vlora_cache, admin_token=None)
    try:
        triton, _, prefix = _server_processes(srv.proc.pid)
        _r37_assert_restricted(srv, {})
        _r37_assert_restricted(srv, {"vlora-admin-key": ""})
        restricted = [a for a in _r37_cmdline(srv) if a.startswith("--http-restricted-api=")]
        assert len(restricted) == 1 and restricted[0].startswith(
            "--http-restricted-api=shared-memory,logging,trace,model-repository:vlora-admin-key="), restricted
        shown = restricted[0].split("vlora-admin-key=", 1)[1]
        if shown.isprintable():  # what /proc shows opens nothing ...
            _r37_assert_restricted(srv, {"vlora-admin-key": shown})
        else:  # ... and cannot even be sent: no HTTP header or gRPC metadata value holds a line break
            assert "\n" in shown, repr(shown)
        _r37_assert_open(srv)
        region = sorted(Path("/dev/shm").glob(f"{prefix}*"))[0]
        answers = _r37_attack(srv, f"/{region.name}", region.stat().st_size)
        assert answers and answers[0][1] is not None, answers  # the output region is unknown: an error answer
        time.sleep(1.0)
        assert Path(f"/proc/{triton}").exists() and srv.proc.poll() is None, srv.server_log()
        assert "lock_exception" not in srv.server_log(400)
        assert_healthy(srv)
    finally:
        code = srv.stop(timeout=60)
    assert code == 0, srv.launcher_output()[-2000:]


# --- issue 37 holes 3 and 5: every request answered, status codes ---
# Hole 3: every request is answered. A string field (text_input, sampling_parameters and each key in it,
# request parameters) holding invalid UTF-8, a lone UTF-16 surrogate or a NUL is refused naming the field,
# or, where Triton's own parser sees it first (a lone surrogate in /generate's JSON body), refused by
# Triton; never left unanswered. Hole 5: what Triton 2.51 (the nvidia-pytriton 0.7.0 binary) does with
# the codes the model sends: /generate and /generate_stream answer ANY error the model sends first with
# 400 (later Triton releases map UNAVAILABLE to 503); Triton's own queue-full rejection is a real 503; a
# gRPC stream's error has no status (status() is None; the header `triton_grpc_error: true` would carry
# it, but with it Triton 2.51 crashes, SIGSEGV, after a few streams end in errors, so no test sends it);
# gRPC ModelInfer refuses a decoupled model (UNIMPLEMENTED). So every error vlora sends starts with its
# code, "[INVALID_ARG] ...", "[UNAVAILABLE] ...", and the client library exposes it as VloraClientError.code.
import re as _h35_re  # noqa: E402
import socket as _h35_socket  # noqa: E402

_H35_CODE = _h35_re.compile(r"^\[([A-Z_]+)\] ")
_H35_NO_ANSWER = "NO ANSWER"


def _h35_code(message: str):
    m = _H35_CODE.match(message or "")
    return m.group(1) if m else None


def _at_once(call, n: int, join_s: float) -> list:
    """``call()`` on ``n`` threads started together; the results that came within ``join_s`` each."""
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(call()), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return results


def _h35_post(url: str, raw: bytes, timeout: float = 15.0):
    """(HTTP status, JSON body) of a raw POST, or (NO ANSWER, reason) when none came within ``timeout``."""
    req = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (_h35_socket.timeout, TimeoutError, urllib.error.URLError) as e:
        return _H35_NO_ANSWER, {"error": str(e)}


def _h35_sse(url: str, body: dict, timeout: float = 30.0):
    """(HTTP status, the events) of /generate_stream."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, [json.loads(line[5:]) for line in (raw.decode().strip() for raw in r) if line.startswith("data:")]
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(line[5:]) for line in e.read().decode().splitlines() if line.startswith("data:")]
    except (_h35_socket.timeout, TimeoutError, urllib.error.URLError) as e:
        return _H35_NO_ANSWER, [{"error": str(e)}]


def _h35_grpc(server, text: bytes, sampling=None, params=None, stream=False, timeout: float = 15.0):
    """One request on its own tritonclient gRPC stream: ("ok", None, text) or ("error", status, message),
    or (NO ANSWER, None, "") when nothing came within ``timeout``."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool))
        return t

    inputs = [tensor("text_input", text, "BYTES"), tensor("stream", stream, "BOOL")]
    if sampling is not None:
        inputs.append(tensor("sampling_parameters", sampling, "BYTES"))
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer(MODEL, inputs, parameters=params, enable_empty_final_response=True)
        text_out = ""
        while True:
            try:
                result, error = events.get(timeout=timeout)
            except queue.Empty:
                return _H35_NO_ANSWER, None, text_out
            if error is not None:
                return "error", error.status(), error.message()
            response = result.get_response()
            if response.outputs:
                text_out += result.as_numpy("text_output")[0].decode()
            if response.parameters["triton_final_response"].bool_param:
                return "ok", None, text_out
    finally:
        try:
            client.stop_stream(cancel_requests=False)
        finally:
            client.close()


def _h35_traceback_count(server) -> int:
    return server.server_log(100_000).count("Traceback")


def _h35_assert_refused(outcome, field: str, what: str) -> None:
    """A refusal naming ``field``, with the INVALID_ARG code (never an internal error); ``status`` is the
    HTTP status, or None for a gRPC stream's error."""
    status, error = outcome
    assert status != _H35_NO_ANSWER, f"{what}: no answer"
    assert status in (400, None), (what, status, error)
    assert _h35_code(error) == "INVALID_ARG" and field in error and "internal error" not in error, (what, error)


# (field, where, value bytes) -> how the answer must look. ``where``: "top" a top-level key of /generate's
# body (text_input is an input tensor; the others are request parameters), "sp" a key inside sampling_parameters.
_H35_BAD = {"utf8": b"x\xff\xfey", "surrogate": b"x\\ud800y", "nul": b"x\\u0000y"}
_H35_FIELDS = ("text_input", "lora_name", "task", "stop", "admin_token", "adapter_action")


def _h35_http_body(field: str, where: str, value: bytes) -> bytes:
    """A /generate body with ``value`` (JSON string content, escapes as given) in ``field``."""
    admin = field in ("admin_token", "adapter_action")
    base = {"adapter_action": "load", "lora_name": SOURCE} if field == "admin_token" else {}
    if where == "top":
        parts = [] if field == "text_input" else [b'"text_input": "hi"']
        parts += [json.dumps(k).encode() + b": " + json.dumps(v).encode() for k, v in base.items()]
        parts.append(json.dumps(field).encode() + b': "' + value + b'"')
        return b"{" + b", ".join(parts) + b"}"
    # Inside sampling_parameters: the inner JSON string is itself a JSON string of the body, so its quotes
    # and escapes are escaped once more (raw bytes stay raw).
    inner_value = value.replace(b"\\", b"\\\\")
    inner = [json.dumps(json.dumps(k))[1:-1].encode() + b": " + json.dumps(json.dumps(v))[1:-1].encode()
             for k, v in base.items()]
    quoted = b'\\"' + inner_value + b'\\"'
    inner.append(b'\\"' + field.encode() + b'\\": ' + (b"[" + quoted + b"]" if field == "stop" else quoted))
    text = b'""' if admin else b'"hi"'
    return b'{"text_input": ' + text + b', "sampling_parameters": "{' + b", ".join(inner) + b'}"}'


def test_h35_every_string_field_with_bad_text_is_answered_on_http(server):
    """Hole 3 on HTTP /generate: each field with invalid UTF-8, a lone surrogate and a NUL gets an answer
    within seconds; what reaches vlora is refused naming the field; no traceback in the log."""
    generate, _ = _urls(server)
    tracebacks = _h35_traceback_count(server)
    for field in _H35_FIELDS:
        for where in ("top", "sp"):
            if field == "text_input" and where == "sp":
                continue
            for kind, value in _H35_BAD.items():
                what = f"{field} ({where}, {kind})"
                status, payload = _h35_post(generate, _h35_http_body(field, where, value))
                error = payload.get("error", "")
                assert status != _H35_NO_ANSWER, f"{what}: no answer ({error})"
                if where == "top" and kind == "surrogate":  # Triton's JSON parser refuses the body itself
                    assert status == 500 and "surrogate" in error, (what, status, payload)
                elif where == "top" and kind == "nul" and field != "text_input":
                    # Triton passes request parameters as C strings: the value reaches vlora cut at the NUL
                    # (issue 37's hole 7); whatever it is, it is answered.
                    assert status in (200, 400), (what, status, payload)
                elif where == "sp" and kind == "utf8":  # the JSON text itself is not UTF-8
                    _h35_assert_refused((status, error), "sampling_parameters", what)
                else:
                    _h35_assert_refused((status, error), field, what)
                if field == "admin_token":
                    assert "x" + "y" not in error and "\\ud800" not in error, (what, error)  # never echoed
    assert _h35_traceback_count(server) == tracebacks, server.server_log(60)
    assert_healthy(server)


def test_h35_every_string_field_with_bad_text_is_answered_on_grpc(server):
    """Hole 3 on gRPC streams (tritonclient): bad bytes in the text_input and sampling_parameters tensors,
    lone surrogates and NULs in each sampling_parameters key: refused naming the field, with the
    INVALID_ARG code; a NUL in a gRPC string parameter is cut by Triton but answered. ModelInfer (unary)
    is refused by Triton for this decoupled model, and answered."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    tracebacks = _h35_traceback_count(server)
    cases = [("text_input", b"hi \xff\xfe", None), ("text_input", b"hi \xed\xa0\x80", None),  # bad, surrogate (CESU)
             ("text_input", b"hi \x00 there", None),
             ("sampling_parameters", b"hi", b'{"lora_name": "x\xffy"}'),
             ("sampling_parameters", b"hi", b'{"lora_name": "x\xed\xa0\x80y"}')]
    for field in _H35_FIELDS[1:]:
        for escape in ("\\ud800", "\\udfff", "\\u0000"):
            value = f'"x{escape}y"'
            value = f"[{value}]" if field == "stop" else value
            extra = f', "adapter_action": "load", "lora_name": "{SOURCE}"' if field == "admin_token" else ""
            cases.append((field, b"" if field in ("admin_token", "adapter_action") else b"hi",
                          f'{{"{field}": {value}{extra}}}'.encode()))
    for field, text, sampling in cases:
        for stream in (False, True):
            kind, status, message = _h35_grpc(server, text, sampling, stream=stream)
            what = f"{field} {text!r} {sampling!r} stream={stream}"
            assert kind == "error", (what, kind, status, message)
            _h35_assert_refused((status, message), field, what)  # no gRPC status: the message's code tells
    # A NUL in a gRPC string parameter: Triton cuts it (hole 7); answered either way.
    for field in ("lora_name", "task", "adapter_action"):
        kind, status, message = _h35_grpc(server, b"hi", None, params={field: "x\x00y"})
        assert kind != _H35_NO_ANSWER, field
    # ModelInfer (unary): Triton's own refusal for a decoupled model.
    client = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi \xff"], dtype=object))
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [text], client_timeout=15)
    assert err.value.status() == "StatusCode.UNIMPLEMENTED" and "decoupled" in err.value.message()
    client.close()
    assert _h35_traceback_count(server) == tracebacks, server.server_log(60)
    assert_healthy(server)


def test_h35_hostile_admin_requests_are_answered_and_the_server_stops_quickly(tmp_path, vlora_cache, demo_adapter_root):
    """Hole 3 as reported: admin requests whose admin_token holds a lone surrogate (in
    sampling_parameters) are each answered, and with them sent the server stops cleanly and quickly."""
    srv = start_server(tmp_path, vlora_cache)
    try:
        generate, _ = _urls(srv)
        body = {"text_input": "", "sampling_parameters": json.dumps(
            {"adapter_action": "load", "lora_name": SOURCE, "admin_token": "\ud800"})}
        outcomes = _at_once(lambda: _h35_post(generate, json.dumps(body).encode(), timeout=20), 3, 30)
        assert len(outcomes) == 3 and all(status == 400 for status, _ in outcomes), outcomes
        assert all("admin_token" in p["error"] and "\\ud800" not in p["error"] for _, p in outcomes), outcomes
        assert_healthy(srv)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        srv.stop(timeout=30)
    assert code == 0, srv.launcher_output()[-2000:]
    assert took < 15, f"stopping took {took:.1f}s"


def _h35_assert_unavailable_http(status, error: str, what: str) -> None:
    """UNAVAILABLE on HTTP: Triton 2.51 answers a model's error with 400 whatever its code (later releases:
    503), so the code is the message's prefix; 503 is Triton's own (queue full) or a later release's."""
    assert status != _H35_NO_ANSWER, f"{what}: no answer"
    assert status == 503 or (status == 400 and _h35_code(error) == "UNAVAILABLE"), (what, status, error)


def _h35_assert_codes(srv, body: dict, sampling: dict, code: str, words: str) -> None:
    """``body`` (a /generate body) on every transport carries ``code`` and ``words``: HTTP /generate and
    /generate_stream; a gRPC stream, streaming and not; the client library over gRPC and HTTP
    (VloraClientError.code)."""
    from vlora_client import VloraClient, VloraClientError

    generate, stream = _urls(srv)
    raw = json.dumps({**body, "sampling_parameters": json.dumps(sampling)}).encode()
    status, payload = _h35_post(generate, raw)
    sse_status, events = _h35_sse(stream, {**body, "sampling_parameters": json.dumps(sampling)})
    for what, (st, error) in {"generate": (status, payload.get("error", "")),
                              "generate_stream": (sse_status, (events or [{}])[-1].get("error", ""))}.items():
        assert words in error and _h35_code(error) == code, (what, st, error)
        if code == "UNAVAILABLE":
            _h35_assert_unavailable_http(st, error, what)
        else:
            assert st == 400, (what, st, error)
    for streaming in (False, True):
        kind, st, message = _h35_grpc(srv, body["text_input"].encode(), json.dumps(sampling).encode(),
                                      stream=streaming, timeout=30)
        what = f"grpc stream={streaming}"
        assert kind == "error" and words in message and _h35_code(message) == code, (what, kind, st, message)
    for protocol, url in (("grpc", srv.grpc_url), ("http", srv.http_url)):
        client = VloraClient(url, protocol=protocol, timeout_s=60)
        with pytest.raises(VloraClientError) as err:
            client.generate(body["text_input"], **{k: v for k, v in sampling.items() if k in ("lora_name", "max_tokens")})
        assert err.value.code == code and err.value.retryable == (code == "UNAVAILABLE"), (protocol, err.value.code, str(err.value))
        assert words in str(err.value) and not str(err.value).startswith("["), str(err.value)


def test_h35_bad_input_overload_and_a_dead_engine_carry_their_codes_on_every_transport(tmp_path, vlora_cache, demo_adapter_root):
    """Hole 5: bad input is INVALID_ARG (HTTP 400); a full engine queue, a full image queue and a failed
    engine are UNAVAILABLE (on HTTP the [UNAVAILABLE] code or 503), on HTTP, the gRPC stream and the client
    library; a burst against a full engine is refused at once (Triton queues nothing for the model)."""
    stall = 40.0
    # admission_timeout_s=1.0: an image job holds the one image worker for that long (it waits for room in the
    # wedged engine), longer than Triton's 0.5 s wake-up between deliveries, so the image queue fills; at 0.3 s
    # a fast preprocess let the worker drain it and every image request met the full engine queue instead.
    srv = start_server(tmp_path, vlora_cache, [
        "--max-batch-size", "1", "--max-queue-size", "1", "--set", "scheduler.admission_timeout_s=1.0",
        "--set", "scheduler.fault_injection=true", "--set", f"scheduler.stall_timeout_s={stall}",
        "--set", "limits.inline_image_pixels=0", "--set", "limits.image_workers=1", "--set", "limits.image_queue_size=1"])
    try:
        generate, stream = _urls(srv)
        # Bad input.
        _h35_assert_codes(srv, {"text_input": "hi"}, {"lora_name": "nope", "max_tokens": 2}, "INVALID_ARG", "unknown adapter 'nope'")
        # A full engine queue: the engine is wedged (the test-only fault) with one request waiting behind it;
        # each further request is refused at once (execute() never waits).
        wedged: list = []
        threading.Thread(target=lambda: wedged.append(_h35_grpc(srv, b"hi", json.dumps({"max_tokens": 4}).encode(),
                                                                params={"vlora_test_fault": "wedge"}, timeout=stall + 30)),
                         daemon=True).start()
        time.sleep(1.0)
        waiting: list = []
        threading.Thread(target=lambda: waiting.append(_h35_sse(stream, {"text_input": "hi", "sampling_parameters": json.dumps(
            {"max_tokens": 4})}, timeout=stall + 30)), daemon=True).start()
        time.sleep(1.0)
        t0 = time.monotonic()
        _h35_assert_codes(srv, {"text_input": "hi"}, {"max_tokens": 2}, "UNAVAILABLE", "server overloaded")
        # A full image queue: one image request on the (one) image worker, one in its queue, the rest refused.
        from e2e_helpers import b64, png_bytes

        image_body = json.dumps({"text_input": "USER: <image>\nWhat? ASSISTANT:", "image": [b64(png_bytes(5))],
                                 "sampling_parameters": json.dumps({"max_tokens": 2})}).encode()
        images = _at_once(lambda: _h35_post(generate, image_body), 4, 30)
        assert len(images) == 4, images
        for status, payload in images:
            _h35_assert_unavailable_http(status, payload.get("error", ""), "image request")
        assert any("image requests already wait" in p.get("error", "") for _, p in images), images
        # A burst against the full engine: every request refused at once, none held in a queue.
        t_burst = time.monotonic()
        burst = _at_once(lambda: _h35_post(generate, json.dumps(
            {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 2})}).encode()), 10, 30)
        assert len(burst) == 10, burst
        for status, payload in burst:
            _h35_assert_unavailable_http(status, payload.get("error", ""), "burst")
            assert "server overloaded" in payload.get("error", ""), payload
        assert time.monotonic() - t_burst < 5.0, "a refused burst waited"
        assert time.monotonic() - t0 < stall - 5, "the overload checks outlasted the watchdog's stall timeout"
        # The engine fails (the watchdog sees the wedge): the requests in flight get UNAVAILABLE.
        deadline = time.monotonic() + stall + 30
        while (not wedged or not waiting) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert wedged and wedged[0][0] == "error", wedged
        assert _h35_code(wedged[0][2]) == "UNAVAILABLE" and "no progress" in wedged[0][2], wedged
        status, events = waiting[0]
        assert events and _h35_code(events[-1].get("error", "")) == "UNAVAILABLE", (status, events)
        _h35_assert_unavailable_http(status, events[-1]["error"], "generate_stream in flight")
        assert srv.proc.wait(timeout=60) == 3, srv.launcher_output()[-2000:]
    finally:
        srv.stop(timeout=30)


# --- issue 37 hole 4: caches keyed by adapter content ---
# An adapter's version named its files' size, mtime and inode: weights overwritten in place with the same size
# and the mtime restored (what `cp -p` or a sync tool leaves) kept it, and a reload was served the old weights'
# keys and values from the prefix cache. The version is now the hash of the bytes loaded.

H4_SOURCE = "demo-r8-qv"
H4_PROMPT = ("USER: You answer questions about the city's traffic reports. Reports: the north bridge is closed "
             "for repairs until Friday; buses take the east road; the tram runs every ten minutes. "
             "Is the bridge open? ASSISTANT:")  # several full KV blocks: the prefix cache keeps them


def _h4_admin(server, action: str, name: str) -> dict:
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    status, payload = post_json(url, {"text_input": "", "adapter_action": action, "lora_name": name,
                                      "admin_token": server.admin_token}, timeout=60)
    assert status == 200, (action, name, status, payload)
    return json.loads(payload["text_output"])


def _h4_generate(server, name: str) -> str:
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    status, payload = post_json(url, {"text_input": H4_PROMPT, "lora_name": name, "sampling_parameters": json.dumps(
        {"max_tokens": 6, "ignore_eos": True, "temperature": 0.0})}, timeout=60)
    assert status == 200 and payload.get("num_output_tokens") == 6, (status, payload)
    return payload["text_output"]


def _h4_fresh_answer(tiny_model_dir, folder: Path, root: Path) -> str:
    """The prompt through an engine in this process, both caches off, on a copy of ``folder``."""
    from vlora.config import EngineConfig
    from vlora.engine.api import GenerationRequest, SamplingParams
    from vlora.engine.builder import build_engine

    shutil.copytree(folder, root / folder.name)
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
        "model.dtype": "float32", "cache.prefix_caching": "off", "cache.encoder_cache_mb": "0"}))
    outs: list = []
    req = GenerationRequest("h4", H4_PROMPT, lora_name=folder.name,
                            sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request(engine.inputs.prepare(req), outs.append)
    while engine.has_work():
        engine.step()
    assert outs and outs[-1].finish_reason == "length", outs
    return outs[-1].text


def _h4_same_size_other_weights(data: bytes) -> bytes:
    """The safetensors file ``data`` with every lora_B times -2: same keys, shapes and metadata, same size."""
    from safetensors.torch import load, save

    n = int.from_bytes(data[:8], "little")
    out = save({k: (v * -2.0 if "lora_B" in k else v).contiguous() for k, v in load(data).items()},
               metadata=json.loads(data[8:8 + n]).get("__metadata__"))
    assert len(out) == len(data) and out != data
    return out


def test_h4_a_reload_after_an_in_place_overwrite_is_not_served_from_stale_caches(server, demo_adapter_root,
                                                                                  tiny_model_dir, tmp_path):
    """Serve adapter X (its prompt's KV blocks go into the prefix cache), overwrite X's weights in place with
    other weights of the same size and restore the mtime, unload and load X through the admin API: the
    answer is a fresh engine's on the new weights, not one made from the old weights' cached KV."""
    name = f"h4-{uuid.uuid4().hex[:8]}"
    folder = demo_adapter_root / name
    shutil.copytree(demo_adapter_root / H4_SOURCE, folder)
    try:
        first = _h4_admin(server, "load", name)["loaded"]
        old = _h4_generate(server, name)
        assert _h4_generate(server, name) == old  # served again, its prompt's blocks from the prefix cache

        weights = folder / "adapter_model.safetensors"
        st = os.stat(weights)
        new_bytes = _h4_same_size_other_weights(weights.read_bytes())
        assert _h4_admin(server, "unload", name)["unloaded"]["state"] == "unloaded"
        with open(weights, "r+b") as f:  # in place: the same inode
            f.write(new_bytes)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = os.stat(weights)
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
        again = _h4_admin(server, "load", name)["loaded"]
        served = _h4_generate(server, name)

        fresh = _h4_fresh_answer(tiny_model_dir, folder, tmp_path / "adapters")
        assert fresh != old, "the new weights do not change the answer: stale caches would not show"
        assert served == fresh, f"served {served!r} after the reload; a fresh engine on the new weights says {fresh!r}"
        # the admin answer names what was loaded: the version changed with the content
        assert again.get("version") and again["version"] != first.get("version"), (first, again)
        assert _h4_generate(server, name) == fresh  # and the new version's own cache entries serve it again
    finally:
        try:
            _h4_admin(server, "unload", name)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    assert_healthy(server)


# --- issue 37 holes 6-7 ---
# Hole 6: limits.max_inflight_image_bytes bounds the image bytes of the requests in flight (encoded as sent,
# decoded from base64, and 4 bytes per pixel), from admission to the final answer; beyond it a request is
# refused as overloaded, and after a flood the stub's own memory comes back within 10% of its idle value (a
# refusal keeps no reference cycle, and once nothing is in flight the garbage collector runs and glibc's arenas
# are trimmed). Hole 7: cheap refusals answered without Triton's 500 ms scheduler wait, and a flood of `list`
# requests leaves normal requests their latency.
def _h67_noise_png_b64(seed: int, side: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _h67_stub_rss_mb(server, field: str = "RssAnon:", process: bytes = b"triton_python_backend_stub") -> float:
    """The resident memory of the server's Python backend stub (the engine's process; ``process``: another of the
    server's, by its command's first word), in MiB: its own heap (RssAnon) by default; VmRSS adds the pages of
    Triton's shared-memory pool it has touched (RssShmem), which the Python backend grows with the inputs it
    passes and does not give back."""
    ws = str(server.workspace).encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if process in cmd.split(b"\0")[0] and ws in cmd:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(field):
                        return int(line.split()[1]) / 1024
        except OSError:
            continue
    raise AssertionError("no backend stub found for the server")


H67_BUDGET = 60_000_000  # bytes: one of the flood's requests (about 43 MB each) at a time
# After the flood the stub's own memory (RssAnon) comes back within 10% of its warm idle value, within 10 s.
# Measured on a 2-core CPU machine with the tiny model: 430 MiB idle, 510 at the peak, 428-431 three seconds
# after. Before the fix it stayed at 612-640 (457 idle): the refused requests' errors held their images in
# reference cycles (traceback -> execute()'s frame -> the deferred answers -> the error) that only the cyclic
# garbage collector frees, and nothing trimmed the heap after it did (a gc.collect() and malloc_trim(0) by hand
# brought it back to 457); and an idle image worker held its last request's images (28 MB).
H67_RSS_MARGIN = 0.10
H67_RSS_WITHIN_S = 10.0


def test_h67_image_bytes_in_flight_are_bounded_and_memory_comes_back(tmp_path, vlora_cache, demo_adapter_root):
    srv = start_server(tmp_path, vlora_cache, ["--set", f"limits.max_inflight_image_bytes={H67_BUDGET}"])
    try:
        generate, _ = _urls(srv)
        images = [_h67_noise_png_b64(i, 700) for i in range(8)]  # 1.5 MB each, 8 per request: 43 MB charged
        body = {"text_input": "USER: " + "<image>" * 8 + "\nWhat? ASSISTANT:", "image": images,
                "sampling_parameters": json.dumps({"max_tokens": 2})}
        assert post_json(generate, body, timeout=120)[0] == 200  # warm: caches, the vision tower's buffers
        time.sleep(3.0)  # past the heap trims that follow it (0.2 s and 2 s after)
        idle = _h67_stub_rss_mb(srv)
        server_idle = _h67_stub_rss_mb(srv, process=b"tritonserver")
        results = _at_once(lambda: post_json(generate, body, timeout=120), 12, 180)
        assert len(results) == 12, results
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] != 200]
        assert ok, results
        assert refused, "12 concurrent requests of 43 MB each against a 60 MB budget: some must be refused"
        for status, payload in refused:
            error = payload.get("error", "")
            assert _h35_code(error) == "UNAVAILABLE" and "server overloaded" in error, (status, error)
            assert f"limits.max_inflight_image_bytes={H67_BUDGET}" in error, error
        # Every charge was given back: each request alone is taken again (a leak would refuse them), also
        # after requests refused in preprocessing (a prompt over the context once the images are counted).
        too_long = dict(body, text_input="USER: " + "<image>" * 8 + " word" * 3000 + " ASSISTANT:")
        assert post_json(generate, too_long, timeout=120)[0] == 400
        for _ in range(2):
            status, payload = post_json(generate, body, timeout=120)
            assert status == 200, payload
        # RssAnon is the stub's own memory (heap, Python, torch); VmRSS adds the pages it has touched of the
        # Python backend's shared-memory region (RssShmem), which Triton grows with the inputs it passes at once
        # and never shrinks: the region's /dev/shm pages stay allocated whether the stub maps them or not.
        bound = idle * (1 + H67_RSS_MARGIN)
        deadline = time.monotonic() + H67_RSS_WITHIN_S
        while (after := _h67_stub_rss_mb(srv)) > bound and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"stub RssAnon {idle:.0f} -> {after:.0f} MiB; VmRSS {_h67_stub_rss_mb(srv, 'VmRSS:'):.0f}, "
              f"RssShmem {_h67_stub_rss_mb(srv, 'RssShmem:'):.0f}")
        assert _h35_traceback_count(srv) == 0
        assert after <= bound, (f"the stub's RssAnon stayed at {after:.0f} MiB {H67_RSS_WITHIN_S:g} s after the "
                                f"flood ({idle:.0f} MiB idle, bound {bound:.0f})")
        # tritonserver's own heap too (the requests' HTTP bodies): 5 -> 225 MiB before glibc's mmap threshold was
        # fixed for it (launcher.MMAP_THRESHOLD), 5.6 MiB after.
        server_after = _h67_stub_rss_mb(srv, process=b"tritonserver")
        assert server_after <= server_idle + 32, (f"tritonserver's RssAnon went from {server_idle:.0f} to "
                                                  f"{server_after:.0f} MiB after the flood")
    finally:
        srv.stop(timeout=30)


def _h67_timed(url: str, body: dict) -> tuple[int, float]:
    t0 = time.monotonic()
    status, _ = post_json(url, body, timeout=30)
    return status, time.monotonic() - t0


def test_h67_cheap_refusals_on_an_idle_server_never_wait_half_a_second(server):
    """Refusals sent while execute() still ran let the client's next request reach Triton's dynamic batcher
    before the model instance was free again; it then waited for the batcher's 500 ms default wake-up (19 of
    100 took exactly 0.5 s). Answers decided in execute() now go out after it returns."""
    generate, _ = _urls(server)
    bad_image = {"text_input": "hi", "image": ["aGVsbG8="]}
    unknown = {"text_input": "hi", "lora_name": "nope"}
    bad_param = _sampling(top_p=5)
    no_token = {"text_input": "", "adapter_action": "load", "lora_name": SOURCE}
    times = []
    for i in range(100):
        status, elapsed = _h67_timed(generate, (bad_image, unknown, bad_param, no_token)[i % 4])
        assert status == 400
        times.append(elapsed)
    slow = [round(t, 3) for t in times if t > 0.25]
    assert not slow, f"{len(slow)} of 100 refusals took over 0.25 s: {slow}"
    assert_healthy(server)


def test_h67_a_flood_of_list_requests_leaves_normal_requests_their_latency(server):
    """`list` answers from a snapshot at most 0.25 s old (one engine round trip for all the list requests
    meanwhile), so open list requests cannot queue up on the engine thread ahead of normal ones.

    The flood is paced (each of 6 clients sends one list request per 16 ms, up to 375 a second, about 90 per
    snapshot): on a 2-core machine an unpaced flood takes CPU in proportion to how fast `list` is answered, and
    that, not a queue, is what the normal median then measures. With Triton's dynamic batcher gone, whose stalls
    throttled the flood to 640-820 answers, the same unpaced clients got 1,300-1,800 and the normal median moved
    from 58-72 to 80-102 ms with the CPU they took."""
    generate, _ = _urls(server)
    normal = {"text_input": "USER: How many circles? ASSISTANT:",
              "sampling_parameters": json.dumps({"max_tokens": 2, "ignore_eos": True})}

    def median_latency(n: int = 15) -> float:
        times = sorted(_h67_timed(generate, normal)[1] for _ in range(n))
        return times[n // 2]

    idle = median_latency()
    stop = threading.Event()
    answered = []

    def flood():
        while not stop.is_set():
            t0 = time.monotonic()
            status, payload = post_json(generate, {"text_input": "", "adapter_action": "list"}, timeout=30)
            answered.append(status == 200 and "adapters" in json.loads(payload["text_output"]))
            stop.wait(max(0.0, 0.016 - (time.monotonic() - t0)))

    floods = [threading.Thread(target=flood, daemon=True) for _ in range(6)]
    for t in floods:
        t.start()
    try:
        time.sleep(0.5)
        busy = median_latency()
    finally:
        stop.set()
        for t in floods:
            t.join(30)
    assert answered and all(answered), "every list request is answered"
    # The issue measured 17 -> 155 ms. Six clients listing as fast as they can share the 2 cores with the
    # server: the bound allows the CPU they take, not a queue on the engine thread.
    assert busy < max(3 * idle, idle + 0.06), f"normal median {idle * 1e3:.0f} ms idle, {busy * 1e3:.0f} ms beside {len(answered)} list requests"
