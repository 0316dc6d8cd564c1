"""What the OpenAI front end's extra hop costs (issue 39): time to first token and time per token through
``/v1/completions`` (streamed, server-sent events) against Triton's gRPC streaming endpoint, the same requests.

It starts ``vlora serve`` (the tiny model unless ``--model``; ``--device``) on free loopback ports with the OpenAI
API on, then sends ``--requests`` streamed requests of ``--max-tokens`` tokens (``ignore_eos``, greedy, the same
prompt) one at a time, alternating the two paths (after ``--warmup`` of each): the generate path through
tritonclient's gRPC stream (what ``vlora_client`` does), the OpenAI path through a plain HTTP/1.1 client reading
the events (no SDK parsing). TTFT: from sending to the first text; per token: (last text - first text) /
(tokens - 1). Then ``--concurrency`` clients at once on each path, ``--rounds`` requests each: output tokens per
second. The hop's cost is the difference of the p50s (and the throughput ratio).

    python -m benchmarks.openai_hop                  # the tiny model on this machine's CPU
    python -m benchmarks.openai_hop --device cuda --model /models/llava-1.5-7b-hf    # the GPU figure

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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.common import device_name, git_commit, write_result

PROMPT = "USER: Tell me a long story about the sea and the ships that sail on it. ASSISTANT:"


def start_server(args, work: Path):
    from vlora.server.ports import free_ports

    http, grpc, metrics, oa = free_ports(4)
    cmd = [sys.executable, "-m", "vlora.cli", "serve", "--host", "127.0.0.1", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(oa),
           "--workspace", str(work / "ws"), "--device", args.device]
    if args.model:
        cmd += ["--model", args.model]
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


def grpc_request(url: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft s, last text s, tokens) of one streamed request over Triton's gRPC stream."""
    import tritonclient.grpc as grpcclient
    from vlora_client.client import build_grpc_inputs

    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    inputs = build_grpc_inputs(PROMPT, [], params, True)
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
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
    client.close()
    return first - t0, last - t0, tokens


def openai_request(port: int, max_tokens: int) -> tuple[float, float, int]:
    """(ttft s, last text s, tokens) of one streamed /v1/completions request, read as raw server-sent events."""
    body = json.dumps({"model": "vlora", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
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
    conn.close()
    return first - t0, last - t0, tokens


def summarize(samples: list[tuple[float, float, int]]) -> dict:
    ttft = [s[0] * 1e3 for s in samples]
    per_token = [(s[1] - s[0]) * 1e3 / (s[2] - 1) for s in samples if s[2] > 1]
    return {"n": len(samples), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p90": float(np.percentile(ttft, 90)),
            "per_token_ms_p50": statistics.median(per_token), "per_token_ms_p90": float(np.percentile(per_token, 90)),
            "tokens": samples[0][2]}


def throughput(fn, concurrency: int, rounds: int) -> float:
    """Output tokens per second with ``concurrency`` clients sending ``rounds`` requests each."""
    def client(_):
        return sum(fn()[2] for _ in range(rounds))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(client, range(concurrency)))
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", help="a checkpoint folder (default: the tiny model)")
    ap.add_argument("--serve-arg", action="append", default=[], help="more `vlora serve` flags (repeatable)")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    os.environ["no_proxy"] = os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    work = Path(tempfile.mkdtemp(prefix="vlora-openai-hop-"))
    proc, grpc_url, oa_port = start_server(args, work)
    try:
        paths = {"generate_grpc": lambda: grpc_request(grpc_url, args.max_tokens),
                 "openai": lambda: openai_request(oa_port, args.max_tokens)}
        for _ in range(args.warmup):
            for fn in paths.values():
                fn()
        samples: dict[str, list] = {k: [] for k in paths}
        for _ in range(args.requests):  # alternating, so that drift hits both alike
            for name, fn in paths.items():
                samples[name].append(fn())
        result = {name: summarize(s) for name, s in samples.items()}
        for name, fn in paths.items():
            result[name]["concurrent_tok_per_s"] = throughput(fn, args.concurrency, args.rounds)
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
    model = args.model or "the embedded tiny model"
    full = {"device": device, "commit": git_commit(), "model": model, "settings": vars(args), "hop": hop, **result,
            "note": "CPU figure (tiny model, 2 shared cores): the GPU figure remains to be measured" if device == "cpu" else ""}
    summary = (f"{model}, {args.requests} streamed requests of {args.max_tokens} tokens per path, alternating; "
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
