"""The server under test, for runs that check it beyond the load (``benchmarks/soak.py``, ``benchmarks/reliability.py``):
start ``vlora serve`` on free loopback ports with a fresh admin token, post to ``/generate``, list its adapters, check
that it is healthy, read the error lines of its log, and watch it through a run (:class:`ServerWatch`).
"""
from __future__ import annotations

import argparse
import json
import secrets
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence, TextIO

from vlora_load.runner import Target, wait_idle
from vlora_load.scrape import totals_by_label

FINISHED = "vlora_requests_finished_total"
HEALTH_PROMPT = "USER: Tell me a short story about a lighthouse. ASSISTANT:"


def start_server(workspace: Path, device: Optional[str], serve_args: Sequence[str], out: TextIO = sys.stdout):
    """`vlora serve` (the launcher, in this process) on free loopback ports, its workspace and a fresh admin token
    (``admin.token``, mode 600) under ``workspace``, with ``serve_args`` (each shell-split) added. Returns the
    started server and the token."""
    from vlora.server import launcher
    from vlora.server.ports import free_ports

    ws = Path(workspace).resolve()
    ws.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    token_file = ws / "admin.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    http_port, grpc_port, metrics_port = free_ports(3)
    argv = ["--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--metrics-port", str(metrics_port), "--openai-port", "0", "--workspace", str(ws / "ws"),
            "--admin-token-file", str(token_file)]
    if device:
        argv += ["--device", device]
    for extra in serve_args:
        argv += shlex.split(extra)
    parser = argparse.ArgumentParser(prog="vlora serve")
    launcher.add_arguments(parser)
    server = launcher.TritonServer(launcher.options_from_args(parser.parse_args(argv)), out=out)
    server.start()
    return server, token


def target_of(server) -> Target:
    """Where a started server (:func:`start_server`) listens."""
    return Target(server.http_url.replace("http://", ""), server.grpc_url, server.metrics_url)


def post_generate(target: Target, body: dict, timeout_s: float) -> tuple[int, dict]:
    """POST ``body`` to /generate; (status, JSON body). Raises OSError (e.g. socket.timeout) on no answer."""
    req = urllib.request.Request(f"http://{target.http_url}/v2/models/{target.model}/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read() or b"{}"
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, {"error": raw.decode(errors="replace")[:500]}


def served_adapters(target: Target) -> list[dict]:
    """The server's adapters (adapter_action list); [] when it does not answer."""
    try:
        status, payload = post_generate(target, {"text_input": "", "adapter_action": "list"}, timeout_s=60)
        text = payload.get("text_output")
        return json.loads(text[0] if isinstance(text, list) else text)["adapters"] if status == 200 else []
    except (OSError, KeyError, TypeError, ValueError):
        return []


def health_check(target: Target) -> tuple[bool, str]:
    """Ready is 200 and one normal request (4 tokens, greedy, EOS ignored) is answered in full."""
    try:
        with urllib.request.urlopen(f"http://{target.http_url}/v2/models/{target.model}/ready", timeout=10) as r:
            ready = r.status == 200
    except OSError as e:
        return False, f"ready: {e}"
    try:
        status, payload = post_generate(target, {"text_input": HEALTH_PROMPT, "sampling_parameters": json.dumps(
            {"max_tokens": 4, "temperature": 0, "ignore_eos": True})}, timeout_s=60)
    except OSError as e:
        return False, f"a normal request after the run: {e}"
    n = payload.get("num_output_tokens")
    n = n[0] if isinstance(n, list) else n
    return ready and status == 200 and n == 4, f"ready={ready}, normal request: HTTP {status}, {n} tokens"


def log_offset(log_path: Optional[Path]) -> int:
    return log_path.stat().st_size if log_path is not None and log_path.exists() else 0


def server_error_lines(log_path: Optional[Path], offset: int) -> tuple[int, list[str]]:
    """Error lines (E...) and tracebacks written to tritonserver's log since ``offset``: their number and the first 20."""
    if log_path is None or not log_path.exists():
        return 0, []
    with open(log_path, "rb") as fh:
        fh.seek(offset)
        text = fh.read().decode("utf-8", errors="replace")
    errors = [ln for ln in text.splitlines() if (ln[:1] == "E" and ln[1:5].isdigit()) or "Traceback" in ln]
    return len(errors), [e[:600] for e in errors[:20]]


class ServerWatch:
    """What a run checks on the server beside its answers. Made before the run: the log's size. :meth:`start`: the
    finished requests by reason, and a :class:`~vlora_load.procmem.MemorySampler` of the server's memory and gauges
    from ``t0`` (``procs`` None: gauges only). :meth:`finish`: waits up to ``drain_timeout_s`` for the server to
    drain, samples once more, then the requests it finished during the run by reason, a health check, and the error
    lines its log gained."""

    def __init__(self, target: Target, log_path: Optional[Path]) -> None:
        self.target, self.log_path, self.offset = target, log_path, log_offset(log_path)
        self.sampler = None
        self.finished_before: dict[str, float] = {}

    def start(self, procs, sample_every_s: float, t0: float):
        from vlora_load.procmem import MemorySampler

        self.finished_before = totals_by_label(self.target.metrics_url, FINISHED, "finish_reason")
        self.sampler = MemorySampler(procs, self.target.metrics_url, sample_every_s, t0)
        self.sampler.sample_now()
        return self.sampler.start()

    def finish(self, drain_timeout_s: float, out: TextIO = sys.stdout) -> dict:
        drained = wait_idle(self.target.metrics_url, drain_timeout_s, out)
        after = {}
        if self.sampler is not None:
            after = self.sampler.sample_now()
            self.sampler.stop()
        finished = totals_by_label(self.target.metrics_url, FINISHED, "finish_reason")
        healthy, health = health_check(self.target)
        n_errors, error_lines = server_error_lines(self.log_path, self.offset)
        return {"drained": drained, "memory_after_drain": after, "healthy_after": healthy, "health_after": health,
                "server_finished_by_reason": {k: int(v - self.finished_before.get(k, 0.0)) for k, v in sorted(finished.items())
                                              if v - self.finished_before.get(k, 0.0) > 0},
                "server_log_errors": n_errors, "server_log_error_examples": error_lines}
