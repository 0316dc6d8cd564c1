"""What the OpenAI front end's extra hop costs (issue 39): time to first token and time per token through
``/v1/completions`` (streamed, server-sent events) against Triton's gRPC streaming endpoint, the same requests.

It starts ``vlora serve`` (the tiny model unless ``--model`` or ``--preset``; ``--device``) on free loopback ports
with the OpenAI API on, then sends ``--requests`` streamed requests of ``--max-tokens`` tokens (``ignore_eos``,
greedy, the same prompt) one at a time, alternating the two paths (after ``--warmup`` of each): the generate path
through tritonclient's gRPC stream (what ``vlora_client`` does: a stream per request), the OpenAI path through a
plain HTTP/1.1 client reading the events (no SDK parsing). Each client holds its connection as real ones do (one
gRPC channel; one keep-alive HTTP connection, as the ``openai`` SDK's pool), and the clock starts before the
request's stream is opened (``--new-connections``: a new channel and a new TCP connection per request, and the
gRPC clock started after the stream is opened, as the first version of this benchmark measured). TTFT: from
sending to the first text; per token: (last text - first text) / (tokens - 1). Then ``--concurrency`` clients at
once on each path, ``--rounds`` requests each, the two paths alternating ``--throughput-repeats`` times: output
tokens per second. The hop's cost is the difference of the p50s (and the throughput ratio).

    python -m benchmarks.openai_hop                  # the tiny model on this machine's CPU
    python -m benchmarks.openai_hop --device cuda --preset configs/models/llava-1.5-7b.yaml   # the GPU figure
    python -m benchmarks.openai_hop --device cuda --model /models/llava-1.5-7b-hf

Writes ``results/openai-hop-<device>.json`` and one line in ``RESULTS.md`` (``--no-record``: only ``--out``).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.common import device_name, git_commit, write_result

PROMPT = "USER: Tell me a long story about the sea and the ships that sail on it. ASSISTANT:"
SAMPLING = {"temperature": 0, "ignore_eos": True}  # greedy: the same tokens, the same work on both paths


def start_server(args, work: Path):
    from vlora.server.ports import free_ports

    http, grpc, metrics, oa = free_ports(4)
    cmd = [sys.executable, "-m", "vlora.cli", "serve", "--host", "127.0.0.1", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(oa),
           "--workspace", str(work / "ws"), "--device", args.device]
    model = getattr(args, "model", None)
    if getattr(args, "preset", None):  # a random-weight model of the preset's size (cached under --work)
        from vlora.models.random_init import make_random_model

        model = str(make_random_model(args.preset, Path(args.work) / Path(args.preset).stem,
                                      device="cuda" if args.device.startswith("cuda") else "cpu"))
        cmd += ["--dtype", "bfloat16"]
    if model:
        cmd += ["--model", model]
    cmd += [a for arg in args.serve_arg for a in arg.split()]
    out = open(work / "serve.out", "wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while "Press Ctrl-C" not in (work / "serve.out").read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"vlora serve did not start:\n{(work / 'serve.out').read_text(errors='replace')[-3000:]}")
        time.sleep(0.25)
    return proc, f"127.0.0.1:{grpc}", oa


def _timed(first, last, t0: float, tokens: int) -> tuple[float, float, int]:
    if first is None:
        raise RuntimeError(f"{tokens} tokens came back and none had text: nothing to time")
    return first - t0, last - t0, tokens


class GrpcClient:
    """One client of the generate path: a tritonclient gRPC channel it keeps (``new``: a new one per request), a
    stream per request."""

    def __init__(self, url: str, new: bool = False) -> None:
        self.url, self.new, self.client = url, new, None

    def request(self, max_tokens: int) -> tuple[float, float, int]:
        """(ttft s, last text s, tokens) of one streamed request."""
        import tritonclient.grpc as grpcclient
        from vlora_client.client import build_grpc_inputs

        params = {"max_tokens": max_tokens, **SAMPLING}
        inputs = build_grpc_inputs(PROMPT, [], params, True)
        events: queue.Queue = queue.Queue()
        if self.client is None or self.new:
            self.client = grpcclient.InferenceServerClient(self.url)
        client = self.client
        t0 = time.perf_counter()
        client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
        if self.new:  # the first version's clock: the stream already open
            t0 = time.perf_counter()
        client.async_stream_infer("vlora", inputs, enable_empty_final_response=True)
        first = last = None
        tokens = 0
        while True:
            result, error, t = events.get(timeout=300)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                text = result.as_numpy("text_output")
                if text is not None and text.size and text.reshape(-1)[0]:
                    first = first or t
                    last = t
                n = result.as_numpy("num_output_tokens")
                tokens += int(n.reshape(-1)[0]) if n is not None else 0
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        if self.new:
            client.close()
        return _timed(first, last, t0, tokens)

    def close(self) -> None:
        if self.client is not None and not self.new:
            self.client.close()


class OpenAIClient:
    """One client of the OpenAI path: a keep-alive HTTP/1.1 connection (``new``: a new one per request), the
    events read as raw server-sent events."""

    def __init__(self, port: int, new: bool = False) -> None:
        self.port, self.new, self.conn = port, new, None

    def request(self, max_tokens: int) -> tuple[float, float, int]:
        """(ttft s, last text s, tokens) of one streamed /v1/completions request."""
        body = json.dumps({"model": "vlora", "prompt": PROMPT, "max_tokens": max_tokens, **SAMPLING, "stream": True,
                           "stream_options": {"include_usage": True}})
        if self.conn is None or self.new:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        conn = self.conn
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        first = last = None
        tokens = 0
        for raw in resp:
            t = time.perf_counter()
            if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                continue
            event = json.loads(raw[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                first = first or t
                last = t
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        resp.read()  # the end of the chunked body: the connection is free for the next request
        if self.new:
            conn.close()
        return _timed(first, last, t0, tokens)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def summarize(samples: list[tuple[float, float, int]]) -> dict:
    ttft = [s[0] * 1e3 for s in samples]
    per_token = [(s[1] - s[0]) * 1e3 / (s[2] - 1) for s in samples if s[2] > 1]
    return {"n": len(samples), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p90": float(np.percentile(ttft, 90)),
            "per_token_ms_p50": statistics.median(per_token), "per_token_ms_p90": float(np.percentile(per_token, 90)),
            "tokens": samples[0][2]}


def throughput(make_client, concurrency: int, rounds: int, max_tokens: int) -> tuple[int, float]:
    """(output tokens, seconds) with ``concurrency`` clients (each its own, made by ``make_client``) sending
    ``rounds`` requests each, after one request each outside the clock (their connections made)."""
    clients = [make_client() for _ in range(concurrency)]
    start = threading.Barrier(concurrency + 1)

    def run(client):
        client.request(max_tokens)
        start.wait()
        return sum(client.request(max_tokens)[2] for _ in range(rounds))

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(run, c) for c in clients]
        start.wait()
        t0 = time.perf_counter()
        tokens = sum(f.result() for f in futures)
        seconds = time.perf_counter() - t0
    for c in clients:
        c.close()
    return tokens, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", help="a checkpoint folder (default: the tiny model)")
    ap.add_argument("--preset", help="configs/models/*.yaml: serve a random-weight model of that size (bfloat16)")
    ap.add_argument("--work", default="/tmp/vlora-bench", help="where --preset's model is written (and reused)")
    ap.add_argument("--serve-arg", action="append", default=[], help="more `vlora serve` flags (repeatable)")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--throughput-repeats", type=int, default=2, help="throughput runs per path, alternating")
    ap.add_argument("--new-connections", action="store_true",
                    help="a new gRPC channel and TCP connection per request (the first version's method)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    os.environ["no_proxy"] = os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    work = Path(tempfile.mkdtemp(prefix="vlora-openai-hop-"))
    proc, grpc_url, oa_port = start_server(args, work)
    new = args.new_connections
    makers = {"generate_grpc": lambda: GrpcClient(grpc_url, new), "openai": lambda: OpenAIClient(oa_port, new)}
    try:
        clients = {name: make() for name, make in makers.items()}
        for _ in range(args.warmup):
            for c in clients.values():
                c.request(args.max_tokens)
        samples: dict[str, list] = {k: [] for k in clients}
        for _ in range(args.requests):  # alternating, so that drift hits both alike
            for name, c in clients.items():
                samples[name].append(c.request(args.max_tokens))
        for c in clients.values():
            c.close()
        result = {name: summarize(s) for name, s in samples.items()}
        totals = {name: [0, 0.0] for name in makers}
        for _ in range(args.throughput_repeats):  # alternating too
            for name, make in makers.items():
                tokens, seconds = throughput(make, args.concurrency, args.rounds, args.max_tokens)
                totals[name][0] += tokens
                totals[name][1] += seconds
        for name, (tokens, seconds) in totals.items():
            result[name]["concurrent_tok_per_s"] = tokens / seconds
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    g, o = result["generate_grpc"], result["openai"]
    hop = {"ttft_ms_p50": o["ttft_ms_p50"] - g["ttft_ms_p50"],
           "per_token_ms_p50": o["per_token_ms_p50"] - g["per_token_ms_p50"],
           "throughput_ratio": o["concurrent_tok_per_s"] / g["concurrent_tok_per_s"]}
    device = device_name() if args.device != "cpu" else "cpu"
    model = args.model or (f"{Path(args.preset).stem} (random weights)" if args.preset else "the embedded tiny model")
    connections = "new connections per request" if new else "kept connections"
    full = {"device": device, "commit": git_commit(), "model": model, "settings": vars(args), "hop": hop, **result,
            "target": "hop <= 1 ms p50 TTFT, throughput ratio >= 0.97",
            "note": "CPU figure (tiny model, 2 shared cores): the GPU figure remains to be measured" if device == "cpu" else ""}
    summary = (f"{model}, {args.requests} streamed requests of {args.max_tokens} tokens per path, alternating, "
               f"{connections}; "
               f"TTFT p50 generate(gRPC) {g['ttft_ms_p50']:.2f} ms / OpenAI {o['ttft_ms_p50']:.2f} ms "
               f"(hop {hop['ttft_ms_p50']:+.2f} ms); per token p50 {g['per_token_ms_p50']:.2f} / {o['per_token_ms_p50']:.2f} ms "
               f"(hop {hop['per_token_ms_p50']:+.3f} ms); {args.concurrency} clients: {g['concurrent_tok_per_s']:.0f} / "
               f"{o['concurrent_tok_per_s']:.0f} tok/s (OpenAI/generate {hop['throughput_ratio']:.3f})"
               + ("; a CPU figure: the GPU figure remains to be measured" if device == "cpu" else ""))
    print(json.dumps(full, indent=2))
    write_result("openai-hop", args.out, full, summary, record=not args.no_record)
    print("RESULTS", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
