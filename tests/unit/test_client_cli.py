"""``vlora-client`` with no server at its address prints one clear line and exits non-zero (no traceback),
over gRPC and HTTP; the admin token is read from a file and sent with load/unload only."""
from __future__ import annotations

import pytest

from vlora.server.ports import free_ports
from vlora_client import VloraClient, VloraConnectionError
from vlora_client.cli import main


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("command", [["--prompt", "hi"], ["--prompt", "hi", "--stream"], ["adapters", "list"]])
def test_no_server_is_one_line_and_a_failure(protocol, command, capsys):
    pytest.importorskip("tritonclient.grpc")
    (port,) = free_ports(1)  # closed again: nothing listens there
    code = main([*command, "--url", f"127.0.0.1:{port}", "--protocol", protocol, "--timeout", "20"])
    captured = capsys.readouterr()
    assert code != 0
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("vlora-client: cannot reach a vlora server at 127.0.0.1:") and protocol in lines[0].lower()


def test_library_raises_a_connection_error():
    (port,) = free_ports(1)
    with pytest.raises(VloraConnectionError, match="cannot reach"):
        VloraClient(f"127.0.0.1:{port}", protocol="http").list_adapters()


def test_admin_token_goes_with_load_and_unload_only(tmp_path, monkeypatch, capsys):
    sent = []

    def fake_generate(self, prompt, images, params):
        sent.append(dict(params))
        action = params["adapter_action"]
        from vlora_client.client import GenerationResult
        body = {"list": '{"adapters": []}', "load": '{"loaded": {"name": "a", "id": 1, "tier": "cpu"}}',
                "unload": '{"unloaded": {"name": "a", "id": 1, "tier": "disk"}}'}[action]
        return GenerationResult(body, "stop", 0, 0)

    monkeypatch.setattr(VloraClient, "_http_generate", fake_generate)
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret-token-0123456789\n")
    for command in (["adapters", "list"], ["adapters", "load", "a"], ["adapters", "unload", "a"]):
        assert main([*command, "--protocol", "http", "--admin-token-file", str(token_file)]) == 0
    assert [p.get("admin_token") for p in sent] == [None, "s3cret-token-0123456789", "s3cret-token-0123456789"]
    assert "s3cret" not in capsys.readouterr().out
    assert main(["adapters", "list", "--protocol", "http", "--admin-token-file", str(tmp_path / "missing")]) == 2
    assert "cannot be read" in capsys.readouterr().err
