"""Adapters listed, loaded and unloaded at run time through Triton, on the session's server: a folder
copied into the adapter root after start is loaded and served, unloaded and refused, loaded again
under the same id; a malformed adapter is refused with the reason while the server keeps serving;
an unload under traffic refuses new requests for the adapter at once and completes when those in flight
have finished."""
from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.request
import uuid

import pytest

from e2e_helpers import MODEL, post_json, start_server
from vlora_client import VloraClient, VloraClientError
from vlora_client.cli import main as client_main

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI

PROMPT = "USER: How many circles are there? ASSISTANT:"
SOURCE = "demo-r8-qv"


@pytest.fixture()
def add_adapter(server, demo_adapter_root):
    """Copy a demo adapter into the running server's adapter root under a fresh name (removed after)."""
    added = []

    def add(src: str = SOURCE, edit_config=None, drop_weights: bool = False) -> str:
        name = f"e2e-{uuid.uuid4().hex[:8]}"
        shutil.copytree(demo_adapter_root / src, demo_adapter_root / name)
        added.append(demo_adapter_root / name)
        if edit_config is not None:
            path = demo_adapter_root / name / "adapter_config.json"
            config = json.loads(path.read_text())
            edit_config(config)
            path.write_text(json.dumps(config))
        if drop_weights:
            (demo_adapter_root / name / "adapter_model.safetensors").unlink()
        return name

    yield add
    client = VloraClient(server.grpc_url, admin_token=server.admin_token)
    for path in added:
        try:  # leave nothing of it in the server's memory either
            client.unload_adapter(path.name)
        except VloraClientError:
            pass
        shutil.rmtree(path, ignore_errors=True)


def _by_name(client: VloraClient) -> dict[str, dict]:
    return {a["name"]: a for a in client.list_adapters()}


def test_load_request_unload_and_reload_keeps_the_id(server, add_adapter):
    client = VloraClient(server.grpc_url, admin_token=server.admin_token)
    http = VloraClient(server.http_url, protocol="http", admin_token=server.admin_token)
    before = _by_name(client)
    assert set(server.adapters) <= set(before)
    assert len({a["id"] for a in before.values()}) == len(before)
    assert all(a["tier"] in ("cpu-slot", "cpu", "disk") and a["loaded"] for a in before.values())  # a CPU server

    name = add_adapter()  # a folder the server has never seen
    loaded = client.load_adapter(name)
    assert loaded["name"] == name and loaded["rank"] == 8 and loaded["tier"] == "cpu" and loaded["loaded"]
    assert loaded["id"] > max(a["id"] for a in before.values())
    assert loaded["target_modules"] == ["q_proj", "v_proj"]

    answer = client.generate(PROMPT, lora_name=name, max_tokens=8, ignore_eos=True)
    same_weights = client.generate(PROMPT, lora_name=SOURCE, max_tokens=8, ignore_eos=True)
    assert answer.num_output_tokens == 8 and answer.text == same_weights.text
    assert _by_name(http)[name]["tier"] == "cpu-slot"  # a device slot, in host memory on this CPU server

    unloaded = http.unload_adapter(name)
    assert unloaded["name"] == name and unloaded["loaded"] is False and unloaded["id"] == loaded["id"]
    assert unloaded["tier"] == "disk"
    with pytest.raises(VloraClientError, match="unloaded"):
        client.generate(PROMPT, lora_name=name, max_tokens=3)

    again = http.load_adapter(name)
    assert again["id"] == loaded["id"] and again["loaded"]
    assert client.generate(PROMPT, lora_name=name, max_tokens=8, ignore_eos=True).text == answer.text
    after = _by_name(client)
    assert {n: a["id"] for n, a in before.items()} == {n: after[n]["id"] for n in before}


def test_malformed_adapters_are_refused_with_the_reason(server, add_adapter):
    client = VloraClient(server.grpc_url, admin_token=server.admin_token)
    dora = add_adapter(edit_config=lambda c: c.update(use_dora=True))
    no_weights = add_adapter(drop_weights=True)
    wrong_rank = add_adapter(edit_config=lambda c: c.update(r=4))
    for name, reason in ((dora, "DoRA"), (no_weights, "adapter_model.safetensors is missing"),
                         (wrong_rank, "r=4"), ("no-such-adapter", "unknown adapter"), ("../etc", "invalid adapter name")):
        with pytest.raises(VloraClientError, match=reason):
            client.load_adapter(name)
    listed = _by_name(client)
    assert listed[dora]["rank"] is None and listed[dora]["tier"] == "disk"
    # ...and the server keeps serving, adapters included.
    assert server.is_ready()
    assert client.generate(PROMPT, lora_name=SOURCE, max_tokens=3).num_output_tokens >= 1


def test_unload_waits_for_a_running_request_and_refuses_new_ones(server, add_adapter):
    """The unload stops new requests and loads of the adapter at once, shows "unloading" in list, and
    completes (answering "unloaded") when its running request ends."""
    client = VloraClient(server.grpc_url, timeout_s=120, admin_token=server.admin_token)
    name = add_adapter()
    stream = client.generate_stream(PROMPT, lora_name=name, max_tokens=800, ignore_eos=True)
    next(stream)  # the request is running
    answers: list = []
    unloader = threading.Thread(target=lambda: answers.append(client.unload_adapter(name)), daemon=True)
    unloader.start()
    deadline = time.monotonic() + 30
    while _by_name(client)[name]["state"] != "unloading":
        assert time.monotonic() < deadline and unloader.is_alive(), (answers, _by_name(client)[name])
        time.sleep(0.05)
    assert _by_name(client)[name]["running"] == 1
    with pytest.raises(VloraClientError, match=f"adapter '{name}' is being unloaded: it takes no new requests"):
        client.generate(PROMPT, lora_name=name, max_tokens=3)
    with pytest.raises(VloraClientError, match="is being unloaded: load it again once its unload has finished"):
        client.load_adapter(name)
    assert unloader.is_alive()  # still waiting for the running request
    stream.close()  # cancels it on the server: the last request of the adapter ends, the unload completes
    unloader.join(30)
    assert answers and answers[0]["state"] == "unloaded" and answers[0]["loaded"] is False, answers
    assert _by_name(client)[name]["state"] == "unloaded"
    with pytest.raises(VloraClientError, match="unloaded"):
        client.generate(PROMPT, lora_name=name, max_tokens=3)
    assert client.load_adapter(name)["state"] == "loaded"


def test_unload_under_steady_traffic_completes(server, add_adapter):
    """Requests for the adapter keep coming; the unload still completes: the requests in flight when it
    starts finish normally, and later ones are refused with a clear message."""
    admin = VloraClient(server.grpc_url, timeout_s=120, admin_token=server.admin_token)
    name = add_adapter()
    admin.load_adapter(name)
    stop = threading.Event()
    outcomes: list[tuple] = []  # ("ok", started, ended, result) or ("refused", started, ended, message)

    def send() -> None:
        client = VloraClient(server.grpc_url, timeout_s=120)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                result = client.generate(PROMPT, lora_name=name, max_tokens=16, ignore_eos=True)
                outcomes.append(("ok", t0, time.monotonic(), result))
            except VloraClientError as e:
                outcomes.append(("refused", t0, time.monotonic(), str(e)))
                time.sleep(0.02)

    senders = [threading.Thread(target=send, daemon=True) for _ in range(3)]
    for t in senders:
        t.start()
    deadline = time.monotonic() + 60
    while sum(1 for o in outcomes if o[0] == "ok") < 6:
        assert time.monotonic() < deadline, outcomes[-3:]
        time.sleep(0.05)
    began = time.monotonic()
    unloaded = admin.unload_adapter(name)
    took = time.monotonic() - began
    time.sleep(0.5)  # the senders keep sending after it
    stop.set()
    for t in senders:
        t.join(60)
    assert unloaded["state"] == "unloaded" and unloaded["loaded"] is False, unloaded
    assert took < 30, f"the unload took {took:.1f}s"
    ok = [o for o in outcomes if o[0] == "ok"]
    refused = [o for o in outcomes if o[0] == "refused"]
    assert all(o[3].num_output_tokens == 16 and o[3].finish_reason == "length" for o in ok)
    assert any(o[1] < began < o[2] for o in ok), "no request was in flight when the unload began"
    assert refused and all(re.search(f"adapter '{name}' is (being unloaded|unloaded)", o[3]) for o in refused), refused[:3]
    assert all(o[2] >= began for o in refused)  # nothing was refused before the unload
    assert _by_name(admin)[name]["state"] == "unloaded"


def test_admin_requests_are_checked(server):
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    for body, words in (({"text_input": "", "adapter_action": "reload"}, ["adapter_action", "reload"]),
                        ({"text_input": "", "adapter_action": "load"}, ["lora_name"]),
                        ({"text_input": "", "adapter_action": "list", "max_tokens": 3}, ["max_tokens"])):
        status, payload = post_json(url, body)
        assert status == 400 and all(w in payload.get("error", "") for w in words), (body, payload)
    status, payload = post_json(url, {"text_input": "", "adapter_action": "list"})  # what curl sends
    assert status == 200 and {a["name"] for a in json.loads(payload["text_output"])["adapters"]} >= set(server.adapters)


def test_load_and_unload_need_the_admin_token(server, add_adapter):
    """load/unload carry the server's token (sampling_parameters or a request parameter); list is open. A
    refusal is one log line without a traceback, and the token is never echoed."""
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    name = add_adapter()
    wrong = "not-the-token-0123456789"
    log_start = len(server.server_log(1_000_000).splitlines())
    for extra, words in (({}, "missing admin_token"), ({"admin_token": wrong}, "wrong admin_token"),
                         ({"admin_token": 12345}, "wrong admin_token")):
        for action in ("load", "unload"):
            status, payload = post_json(url, {"text_input": "", "adapter_action": action, "lora_name": name, **extra})
            assert status == 400 and words in payload.get("error", ""), (action, extra, payload)
            assert wrong not in payload["error"] and server.admin_token not in payload["error"]
    status, payload = post_json(url, {"text_input": "", "sampling_parameters": json.dumps(
        {"adapter_action": "load", "lora_name": name, "admin_token": server.admin_token})})
    assert status == 200 and json.loads(payload["text_output"])["loaded"]["name"] == name, payload
    status, payload = post_json(url, {"text_input": "", "adapter_action": "unload", "lora_name": name,
                                      "admin_token": server.admin_token})  # a request parameter
    assert status == 200 and json.loads(payload["text_output"])["unloaded"]["name"] == name, payload
    status, payload = post_json(url, {"text_input": "", "adapter_action": "list"})
    assert status == 200 and name in {a["name"] for a in json.loads(payload["text_output"])["adapters"]}
    deadline = time.monotonic() + 10
    while True:  # one log line per refused request, without a traceback, and no token in the log
        new = server.server_log(1_000_000).splitlines()[log_start:]
        refusals = [line for line in new if "refused:" in line and "admin_token" in line]
        if len(refusals) >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(refusals) == 6 and not any("Traceback" in line for line in new), new[-20:]
    log = server.server_log(1_000_000)
    assert wrong not in log and server.admin_token not in log
    # Clients can read the model's configuration: it names the token's file, never the token.
    with urllib.request.urlopen(f"{server.http_url}/v2/models/{MODEL}/config", timeout=10) as r:
        config = r.read().decode()
    assert "lora.admin_token_file" in config and server.admin_token not in config


def test_a_server_without_a_token_refuses_load_and_unload(tmp_path, vlora_cache, demo_adapter_root):
    del demo_adapter_root  # generated before the server starts
    srv = start_server(tmp_path, vlora_cache, admin_token=None)
    try:
        assert "load/unload are off (enable them with --admin-token-file FILE)" in srv.launcher_output()
        assert "listening on 127.0.0.1 (this machine only" in srv.launcher_output()
        client = VloraClient(srv.grpc_url, admin_token="any-token-0123456789")
        for call in (client.load_adapter, client.unload_adapter):
            with pytest.raises(VloraClientError, match="is off on this server.*--admin-token-file"):
                call(SOURCE)
        assert {a["name"] for a in client.list_adapters()} >= {SOURCE}
    finally:
        assert srv.stop() == 0, srv.launcher_output()[-3000:]


def test_cli_lists_loads_and_unloads(server, add_adapter, capsys, tmp_path):
    name = add_adapter()
    assert client_main(["adapters", "load", name, "--url", server.grpc_url]) == 1  # no token
    assert "admin_token" in capsys.readouterr().err
    token_file = tmp_path / "token"
    token_file.write_text(server.admin_token + "\n")
    token = ["--admin-token-file", str(token_file)]
    assert client_main(["adapters", "load", name, "--url", server.grpc_url, *token]) == 0
    assert f"loaded {name}" in capsys.readouterr().out
    assert client_main(["--url", server.grpc_url, "adapters", "list", "--json"]) == 0
    listed = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    assert listed[name]["loaded"] and listed[name]["rank"] == 8
    assert client_main(["adapters", "list", "--url", server.grpc_url]) == 0
    assert name in capsys.readouterr().out
    assert client_main(["adapters", "unload", name, "--url", server.grpc_url, "--protocol", "grpc", *token]) == 0
    assert client_main(["adapters", "load", "no-such-adapter", "--url", server.grpc_url, *token]) == 1
    assert "unknown adapter" in capsys.readouterr().err
