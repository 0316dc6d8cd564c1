"""Adapters listed, loaded and unloaded at run time through Triton, on the session's server: a folder
copied into the adapter root after start is loaded and served, unloaded and refused, loaded again
under the same id; a malformed adapter is refused with the reason while the server keeps serving;
an adapter with a running request is not unloaded."""
from __future__ import annotations

import json
import shutil
import time
import uuid

import pytest

from e2e_helpers import MODEL, post_json
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
    client = VloraClient(server.grpc_url)
    for path in added:
        try:  # leave nothing of it in the server's memory either
            client.unload_adapter(path.name)
        except VloraClientError:
            pass
        shutil.rmtree(path, ignore_errors=True)


def _by_name(client: VloraClient) -> dict[str, dict]:
    return {a["name"]: a for a in client.list_adapters()}


def test_load_request_unload_and_reload_keeps_the_id(server, add_adapter):
    client = VloraClient(server.grpc_url)
    http = VloraClient(server.http_url, protocol="http")
    before = _by_name(client)
    assert set(server.adapters) <= set(before)
    assert len({a["id"] for a in before.values()}) == len(before)
    assert all(a["tier"] in ("gpu", "cpu", "disk") and a["loaded"] for a in before.values())

    name = add_adapter()  # a folder the server has never seen
    loaded = client.load_adapter(name)
    assert loaded["name"] == name and loaded["rank"] == 8 and loaded["tier"] == "cpu" and loaded["loaded"]
    assert loaded["id"] > max(a["id"] for a in before.values())
    assert loaded["target_modules"] == ["q_proj", "v_proj"]

    answer = client.generate(PROMPT, lora_name=name, max_tokens=8, ignore_eos=True)
    same_weights = client.generate(PROMPT, lora_name=SOURCE, max_tokens=8, ignore_eos=True)
    assert answer.num_output_tokens == 8 and answer.text == same_weights.text
    assert _by_name(http)[name]["tier"] == "gpu"

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
    client = VloraClient(server.grpc_url)
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


def test_unload_is_refused_while_a_request_runs(server, add_adapter):
    client = VloraClient(server.grpc_url, timeout_s=120)
    name = add_adapter()
    stream = client.generate_stream(PROMPT, lora_name=name, max_tokens=800, ignore_eos=True)
    next(stream)  # the request is running
    with pytest.raises(VloraClientError, match=r"running .*unload refused"):
        client.unload_adapter(name)
    stream.close()  # cancels it on the server
    deadline = time.monotonic() + 30
    while True:
        try:
            assert client.unload_adapter(name)["loaded"] is False
            break
        except VloraClientError as e:
            assert "refused" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.2)


def test_admin_requests_are_checked(server):
    url = f"http://{server.http_url}/v2/models/{MODEL}/generate"
    for body, words in (({"text_input": "", "adapter_action": "reload"}, ["adapter_action", "reload"]),
                        ({"text_input": "", "adapter_action": "load"}, ["lora_name"]),
                        ({"text_input": "", "adapter_action": "list", "max_tokens": 3}, ["max_tokens"])):
        status, payload = post_json(url, body)
        assert status == 400 and all(w in payload.get("error", "") for w in words), (body, payload)
    status, payload = post_json(url, {"text_input": "", "adapter_action": "list"})  # what curl sends
    assert status == 200 and {a["name"] for a in json.loads(payload["text_output"])["adapters"]} >= set(server.adapters)


def test_cli_lists_loads_and_unloads(server, add_adapter, capsys):
    name = add_adapter()
    assert client_main(["adapters", "load", name, "--url", server.grpc_url]) == 0
    assert f"loaded {name}" in capsys.readouterr().out
    assert client_main(["--url", server.grpc_url, "adapters", "list", "--json"]) == 0
    listed = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    assert listed[name]["loaded"] and listed[name]["rank"] == 8
    assert client_main(["adapters", "list", "--url", server.grpc_url]) == 0
    assert name in capsys.readouterr().out
    assert client_main(["adapters", "unload", name, "--url", server.grpc_url, "--protocol", "grpc"]) == 0
    assert client_main(["adapters", "load", "no-such-adapter", "--url", server.grpc_url]) == 1
    assert "unknown adapter" in capsys.readouterr().err
