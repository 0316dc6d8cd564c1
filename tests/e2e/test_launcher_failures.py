"""`vlora serve` fails fast and says why: a busy port, a model that cannot load."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from e2e_helpers import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI


def serve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "vlora.cli", "serve", "--host", "127.0.0.1", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_busy_port_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        result = serve("--http-port", str(port))
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "not free" in result.stderr


def test_model_that_cannot_load_shows_the_reason(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    result = serve("--model", str(empty), "--workspace", str(tmp_path / "ws"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the model failed to load" in result.stderr and "config.json" in result.stderr, result.stderr
