"""Helpers of the end-to-end tests: start `vlora serve` on free loopback ports, build and send requests."""
from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

MODEL = "vlora"
STARTUP_TIMEOUT_S = 300
ADMIN_TOKEN = "e2e-admin-token-0123456789"  # what start_server's servers require for adapter load/unload


from vlora.server.ports import ServerUrls, free_ports  # noqa: E402,F401  (the e2e tests import free_ports from here)


@dataclass
class RunningServer(ServerUrls):
    """A `vlora serve` process on loopback; its URLs as the launcher's (ServerUrls: http_url with its scheme)."""

    proc: subprocess.Popen
    workspace: Path
    output: Path  # the launcher's stdout and stderr
    http_port: int
    grpc_port: int
    metrics_port: int
    adapters: list[str]
    admin_token: Optional[str] = None  # None: the server refuses adapter load/unload
    openai_port: int = 0  # the OpenAI API's port (start_server(openai=True)); 0: off
    url_host = "127.0.0.1"

    def launcher_output(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def server_log(self, tail: int = 60) -> str:
        log = self.workspace / "tritonserver.log"
        if not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-tail:])

    def is_ready(self) -> bool:
        return http_status(f"{self.http_url}/v2/models/{MODEL}/ready") == 200

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def http_status(url: str) -> Optional[int]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def start_server(workspace: Path, cache_dir: Path, extra_args: list[str] = (),
                 admin_token: Optional[str] = ADMIN_TOKEN, openai: bool = False) -> RunningServer:
    """`vlora serve` on free loopback ports; ``admin_token`` (None: none) enables adapter load/unload;
    ``openai`` starts the OpenAI API on a free port too (else it is off: --openai-port 0)."""
    http_port, grpc_port, metrics_port, openai_port = free_ports(4)
    openai_port = openai_port if openai else 0
    output = workspace / "launcher.out"
    token_args = []
    if admin_token is not None:
        token_file = workspace / "admin.token"
        token_file.write_text(admin_token + "\n")
        token_args = ["--admin-token-file", str(token_file)]
    cmd = [
        sys.executable, "-m", "vlora.cli", "serve",
        "--host", "127.0.0.1",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
        "--workspace", str(workspace / "ws"),
        "--device", "cpu",
        "--set", f"model.cache_dir={cache_dir}",
        "--openai-port", str(openai_port),
        *token_args,
        *extra_args,
    ]
    with open(output, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = RunningServer(proc, workspace / "ws", output, http_port, grpc_port, metrics_port, [], admin_token,
                           openai_port)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.is_ready():
        if proc.poll() is not None:
            pytest.fail(f"`vlora serve` exited with {proc.returncode}:\n{server.launcher_output()}\n--- server log ---\n{server.server_log()}")
        if time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"server not ready in {STARTUP_TIMEOUT_S}s:\n{server.launcher_output()}\n{server.server_log()}")
        time.sleep(0.25)
    # The launcher prints its banner right after readiness; it lists the adapters.
    deadline = time.monotonic() + 30
    while "Press Ctrl-C" not in server.launcher_output() and time.monotonic() < deadline:
        time.sleep(0.1)
    m = re.search(r"^  adapters: (.*)$", server.launcher_output(), re.MULTILINE)
    server.adapters = [a.strip() for a in m.group(1).split(",")] if m and "(none" not in m.group(1) else []
    return server


def png_bytes(seed: int, size: int = 48) -> bytes:
    """A small deterministic RGB PNG."""
    from PIL import Image

    img = Image.new("RGB", (size, size))
    img.putdata([((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x * y + seed) % 256)
                 for y in range(size) for x in range(size)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def assert_refused(server, body: dict, words) -> str:
    """POST ``body`` to ``server``'s /generate: a 400 whose error mentions each of ``words`` (any case).
    Returns the error message."""
    status, payload = post_json(f"{server.http_url}/v2/models/{MODEL}/generate", body)
    assert status == 400, (status, payload)
    message = payload.get("error", "")
    for word in words:
        assert word.lower() in message.lower(), f"error {message!r} does not mention {word!r}"
    return message


def post_sse(url: str, body: dict, timeout: float = 120.0) -> list[dict]:
    """POST to /generate_stream and return the decoded server-sent events."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[5:].strip()))
    return events


# urllib and gRPC honour *_proxy variables; requests to loopback must not go through a proxy.
for _var in ("no_proxy", "NO_PROXY"):
    os.environ[_var] = ",".join(filter(None, [os.environ.get(_var, ""), "127.0.0.1", "localhost"]))
