"""What the router of adapter-aware routing adds per response (issue 40): the same streamed requests to one engine
model served directly (`vlora serve`, one `vlora` model) and through the router (the router model `vlora` in front
of one engine model, `--routing-cpu-engines 1`), interleaved request by request so that the machine's noise falls
on both alike. Every request has a prompt of its own (no cache serves a repeat).

    python -m benchmarks.routing_relay --requests 40 --max-tokens 32          # the tiny model on the CPU

Prints and writes (``--json-out``) per server: TTFT and the gap between streamed responses (median, p90), and the
difference, routed minus direct: the relay's cost per first response and per later response.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vlora.config import EngineConfig
from vlora.server.launcher import TritonServer
from vlora.server.options import ServeOptions
from vlora.server.ports import free_ports
from vlora_client import VloraClient


def start(workspace: Path, routed: bool, cache_dir: str | None) -> TritonServer:
    overrides = {"model.device": "cpu"}
    if cache_dir:
        overrides["model.cache_dir"] = cache_dir
    http, grpc, metrics = free_ports(3)
    options = ServeOptions(engine=EngineConfig().with_overrides(overrides), http_port=http, grpc_port=grpc,
                           metrics_port=metrics, workspace=workspace, routing_cpu_engines=1 if routed else 0)
    server = TritonServer(options, out=io.StringIO())
    server.start()
    return server


def one(client: VloraClient, prompt: str, max_tokens: int, lora: str | None) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    times = [time.perf_counter() for _ in client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True,
                                                                 lora_name=lora)]
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lora", default="demo-r8-qv", help="adapter of every request ('' for the base model)")
    p.add_argument("--cache-dir", help="model.cache_dir (default: ~/.cache/vlora)")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vlora-relay-") as tmp:
        servers = {"direct": start(Path(tmp) / "direct", False, args.cache_dir),
                   "routed": start(Path(tmp) / "routed", True, args.cache_dir)}
        try:
            clients = {name: VloraClient(s.grpc_url) for name, s in servers.items()}
            for client in clients.values():  # warm: the adapter read, first-call costs
                one(client, "USER: warm up ASSISTANT:", 4, args.lora or None)
            ttft = {name: [] for name in servers}
            gaps = {name: [] for name in servers}
            for k in range(args.requests):
                order = list(servers) if k % 2 == 0 else list(reversed(servers))
                for name in order:
                    first, between = one(clients[name], f"USER: Tell me about number {k} and {name}. ASSISTANT:",
                                         args.max_tokens, args.lora or None)
                    ttft[name].append(first)
                    gaps[name].extend(between)
        finally:
            for s in servers.values():
                s.stop()
    for name in servers:
        results[name] = {"ttft_p50_ms": 1e3 * statistics.median(ttft[name]), "ttft_p90_ms": 1e3 * quantile(ttft[name], 0.9),
                         "gap_p50_ms": 1e3 * statistics.median(gaps[name]), "gap_p90_ms": 1e3 * quantile(gaps[name], 0.9),
                         "gap_mean_ms": 1e3 * statistics.fmean(gaps[name]), "responses": len(gaps[name]) + len(ttft[name])}
    results["relay"] = {k: results["routed"][k] - results["direct"][k] for k in results["direct"] if k.endswith("_ms")}
    results["settings"] = {"requests": args.requests, "max_tokens": args.max_tokens, "lora": args.lora}
    text = json.dumps(results, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
