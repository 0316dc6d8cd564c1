"""What the Triton Python backend path adds to a request and to a token (issue 36): the same streamed requests
in process through ``AsyncEngine`` and through a real ``vlora serve`` over HTTP (``/generate_stream``) and gRPC
(tritonclient's stream), at 1, 32 and 128 concurrent streams.

    python -m benchmarks.server_overhead                        # the tiny model on this machine's CPU
    python -m benchmarks.server_overhead --device cuda --preset configs/models/llava-1.5-7b.yaml

Each point: ``--concurrency`` clients at once (threads spread over ``--client-procs`` processes, so that the
clients' own Python does not bound 128 streams), each sending ``--rounds`` requests of ``--max-tokens`` tokens
(greedy, ``ignore_eos``, a prompt of new words per request: no prefix-cache hit). Per request: TTFT (to the first
event with a token) and time per token ((last - first) / (tokens - 1)); per point: their p50/p90 and output
tokens/s. In process, the same requests go to ``AsyncEngine.generate`` from threads of a process of its own (its
device memory free again before the server starts). The
overhead is the server's figure minus the in-process one at the same concurrency; the server's own step time
(``vlora_step_duration_seconds``) over the same window says how much of a token's time the engine spent.

Writes ``results/server-overhead-<device>.json`` and one line in ``RESULTS.md`` (``--no-record``: only ``--out``).
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import queue
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks.common import RESULTS, device_name, git_commit, write_result

WORDS = ("sea ship harbor wind sail rope deck storm tide gull lantern anchor wave reef island compass chart mast "
         "keel hull").split()


def prompt(i: int) -> str:
    """A prompt of new words for request ``i`` (no two alike: the prefix cache answers none)."""
    rng = np.random.default_rng(i)
    return "USER: Tell a story about " + " ".join(rng.choice(WORDS, 12)) + f" number {i}. ASSISTANT:"


def _figures(samples: list[tuple[float, float, int]], seconds: float) -> dict:
    """p50/p90 of TTFT and time per token (ms), and output tokens/s, of (ttft s, last token s, tokens) samples."""
    ttft = [1e3 * s[0] for s in samples]
    per_token = [1e3 * (s[1] - s[0]) / (s[2] - 1) for s in samples if s[2] > 1]
    tokens = sum(s[2] for s in samples)
    return {"requests": len(samples), "ttft_ms_p50": round(statistics.median(ttft), 3),
            "ttft_ms_p90": round(float(np.percentile(ttft, 90)), 3),
            "per_token_ms_p50": round(statistics.median(per_token), 3) if per_token else None,
            "per_token_ms_p90": round(float(np.percentile(per_token, 90)), 3) if per_token else None,
            "output_tok_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 3)}


# -- clients -------------------------------------------------------------------------------------------------

def _http_request(conn: http.client.HTTPConnection, text: str, max_tokens: int) -> tuple[float, float, int]:
    body = json.dumps({"text_input": text, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0})
    t0 = time.perf_counter()
    conn.request("POST", "/v2/models/vlora/generate_stream", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    tokens = 0
    for raw in resp:
        if not raw.startswith(b"data:"):
            continue
        event = json.loads(raw[5:])
        if "error" in event:
            raise RuntimeError(event["error"])
        n = int(event.get("num_output_tokens") or 0)
        if n:
            t = time.perf_counter()
            first = first or t
            last = t
            tokens += n
    resp.read()
    if first is None:
        raise RuntimeError("no token came back")
    return first - t0, last - t0, tokens


def _grpc_request(client, text: str, max_tokens: int) -> tuple[float, float, int]:
    from vlora_client.client import build_grpc_inputs

    events: queue.Queue = queue.Queue()
    inputs = build_grpc_inputs(text, [], {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}, True)
    t0 = time.perf_counter()
    client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
    client.async_stream_infer("vlora", inputs, enable_empty_final_response=True)
    first = last = None
    tokens = 0
    try:
        while True:
            result, error, t = events.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                n = result.as_numpy("num_output_tokens")
                n = int(n.reshape(-1)[0]) if n is not None else 0
                if n:
                    first = first or t
                    last = t
                    tokens += n
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    if first is None:
        raise RuntimeError("no token came back")
    return first - t0, last - t0, tokens


def client_proc(transport: str, address: str, ids: list[list[int]], max_tokens: int, start_at: float) -> list:
    """In a client process: one thread per entry of ``ids`` (that client's request numbers), each with its own
    connection, all starting at ``start_at`` (time.time()); returns every (ttft, last, tokens)."""
    out: list = []
    lock = threading.Lock()

    def run(numbers: list[int]) -> None:
        if transport == "http":
            host, port = address.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            one = lambda i: _http_request(conn, prompt(i), max_tokens)  # noqa: E731
        else:
            import tritonclient.grpc as grpcclient

            conn = grpcclient.InferenceServerClient(address)
            one = lambda i: _grpc_request(conn, prompt(i), max_tokens)  # noqa: E731
        time.sleep(max(0.0, start_at - time.time()))
        mine = [one(i) for i in numbers]
        conn.close()
        with lock:
            out.extend(mine)

    threads = [threading.Thread(target=run, args=(numbers,)) for numbers in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def server_point(pool: ProcessPoolExecutor, procs: int, transport: str, address: str, concurrency: int, rounds: int,
                 max_tokens: int, first_id: int) -> tuple[list, float]:
    clients = [[first_id + c * rounds + r for r in range(rounds)] for c in range(concurrency)]
    shares = [clients[p::procs] for p in range(procs) if clients[p::procs]]
    start_at = time.time() + 2.0  # every process has its connections open by then
    futures = [pool.submit(client_proc, transport, address, share, max_tokens, start_at) for share in shares]
    samples = [s for f in futures for s in f.result()]
    return samples, time.time() - start_at


# -- in process ----------------------------------------------------------------------------------------------

def engine_point(aeng, concurrency: int, rounds: int, max_tokens: int, first_id: int) -> tuple[list, float]:
    from vlora.engine.api import GenerationRequest, SamplingParams

    samples: list = []
    lock = threading.Lock()
    go = threading.Barrier(concurrency + 1)

    def one(i: int) -> tuple[float, float, int]:
        done = threading.Event()
        marks: dict = {"first": None, "last": None, "tokens": 0, "error": None}

        def on_output(out) -> None:
            t = time.perf_counter()
            if out.error:
                marks["error"] = out.error
            n = out.num_output_tokens - marks["tokens"]
            if n > 0:
                marks["first"] = marks["first"] or t
                marks["last"] = t
                marks["tokens"] = out.num_output_tokens
            if out.finished:
                done.set()

        def refuse(error: Exception) -> None:
            marks["error"] = str(error)
            done.set()

        req = GenerationRequest(f"overhead-{i}", prompt(i), stream=True,
                                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        t0 = time.perf_counter()
        aeng.generate(req, on_output, refuse)
        done.wait(600)
        if marks["error"] or marks["first"] is None:
            raise RuntimeError(f"request {i}: {marks['error'] or 'no token'}")
        return marks["first"] - t0, marks["last"] - t0, marks["tokens"]

    def run(c: int) -> None:
        go.wait()
        mine = [one(first_id + c * rounds + r) for r in range(rounds)]
        with lock:
            samples.extend(mine)

    threads = [threading.Thread(target=run, args=(c,)) for c in range(concurrency)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return samples, time.perf_counter() - t0


def in_process_points(cfg: dict, levels: list[int], rounds: int, max_tokens: int, first_id: int) -> dict:
    """{concurrency: figures} of the in-process engine built from the dotted settings ``cfg`` (a warm request
    first). Runs in a process of its own (:func:`main`)."""
    from vlora.config import EngineConfig
    from vlora.engine.async_engine import AsyncEngine

    aeng = AsyncEngine(EngineConfig().with_overrides(cfg))
    out: dict = {}
    try:
        engine_point(aeng, 1, 1, max_tokens, first_id)  # warm
        first_id += 10
        for c in levels:
            samples, seconds = engine_point(aeng, c, rounds, max_tokens, first_id)
            first_id += c * rounds
            out[c] = _figures(samples, seconds)
            print(f"in process, {c} streams: {out[c]}", flush=True)
    finally:
        aeng.shutdown()
    return out


def banner_urls(text: str) -> dict[str, str]:
    """``{"HTTP": host:port, "metrics": url}`` from the banner ``vlora serve`` prints (vlora.server.banner)."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in ("HTTP", "metrics"):
            url = words[1]
            out[words[0]] = url.split("://", 1)[1].split("/", 1)[0] if words[0] == "HTTP" else url
    if set(out) != {"HTTP", "metrics"}:
        raise RuntimeError(f"no HTTP and metrics URLs in vlora serve's banner:\n{text[-2000:]}")
    return out


def step_seconds(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the server's vlora_step_duration_seconds."""
    import urllib.request

    from vlora_load.scrape import parse_prometheus

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        samples = parse_prometheus(r.read().decode())
    total = count = 0.0
    for name, _, value in samples:
        if name == "vlora_step_duration_seconds_sum":
            total += value
        elif name == "vlora_step_duration_seconds_count":
            count += value
    return total, count


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--preset", help="configs/models/*.yaml: a random-weight model of that size; omit for the tiny model")
    ap.add_argument("--model", help="a model folder to serve instead")
    ap.add_argument("--work", default="/tmp/vlora-bench")
    ap.add_argument("--concurrency", default="1,32,128")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each point")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--transports", default="http,grpc")
    ap.add_argument("--client-procs", type=int, default=max(1, min(8, (multiprocessing.cpu_count() or 2) // 2)))
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARGS")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    transports = [t for t in args.transports.split(",") if t]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "python -m benchmarks.server_overhead", "device": device_name() if args.device != "cpu" else "cpu",
                    "commit": git_commit(), "max_tokens": args.max_tokens, "rounds": args.rounds, "points": {}}
    next_id = 1_000_000

    # In process first (the engine alone on the device), then the server on the same model.
    from benchmarks.openai_hop import start_server

    model = args.model
    if args.preset:
        from vlora.models.random_init import make_random_model

        model = str(make_random_model(args.preset, work / Path(args.preset).stem,
                                      device="cuda" if args.device.startswith("cuda") else "cpu"))
    if model is None:
        from vlora.models.tiny import ensure_tiny_model

        model = str(ensure_tiny_model())
    cfg = {"model.path": model, "model.device": args.device, "lora.adapter_root": None,
           **({"model.dtype": "bfloat16"} if args.device.startswith("cuda") else {})}
    # In a process of its own, so that the device's memory is free again (its allocator's cache, its graphs' pools)
    # when the server's engine is built.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as one:
        points = one.submit(in_process_points, cfg, levels, args.rounds, args.max_tokens, next_id).result()
    next_id += 10 + sum(c * args.rounds for c in levels)
    for c, fig in points.items():
        result["points"].setdefault(str(c), {})["in_process"] = fig

    args.model, args.preset = model, None
    proc, grpc_url, _ = start_server(args, work)
    try:
        banner = banner_urls((work / "serve.out").read_text(errors="replace"))
        addresses = {"http": banner["HTTP"], "grpc": grpc_url}
        metrics_url = banner["metrics"]
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.client_procs, mp_context=ctx) as pool:
            for transport in transports:
                server_point(pool, 1, transport, addresses[transport], 1, 1, args.max_tokens, next_id)  # warm
                next_id += 10
                for c in levels:
                    before = step_seconds(metrics_url)
                    samples, seconds = server_point(pool, min(args.client_procs, c), transport, addresses[transport], c,
                                                    args.rounds, args.max_tokens, next_id)
                    after = step_seconds(metrics_url)
                    next_id += c * args.rounds
                    fig = _figures(samples, seconds)
                    steps = after[1] - before[1]
                    fig["engine_step_ms_mean"] = round(1e3 * (after[0] - before[0]) / steps, 3) if steps else None
                    point = result["points"].setdefault(str(c), {})
                    point[transport] = fig
                    ref = point.get("in_process")
                    if ref:
                        fig["ttft_ms_over_in_process"] = round(fig["ttft_ms_p50"] - ref["ttft_ms_p50"], 3)
                        if fig["per_token_ms_p50"] is not None and ref["per_token_ms_p50"] is not None:
                            fig["per_token_ms_over_in_process"] = round(fig["per_token_ms_p50"] - ref["per_token_ms_p50"], 3)
                        fig["throughput_over_in_process"] = round(fig["output_tok_per_s"] / ref["output_tok_per_s"], 3)
                    print(f"{transport}, {c} streams: {fig}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    write_result("server-overhead", args.out, result, summary(result), record=not args.no_record and args.device != "cpu")
    return 0


def summary(result: dict) -> str:
    parts = []
    for c, point in result["points"].items():
        ref = point.get("in_process", {})
        for t in ("http", "grpc"):
            f = point.get(t)
            if f and ref:
                parts.append(f"{c} streams {t}: TTFT p50 {f['ttft_ms_p50']:.2f} ms ({f.get('ttft_ms_over_in_process', 0):+.2f} "
                             f"over in process), per token {f['per_token_ms_p50']:.3f} ms "
                             f"({f.get('per_token_ms_over_in_process', 0):+.3f}), {f['output_tok_per_s']:.0f} tok/s "
                             f"({f.get('throughput_over_in_process', 0):.2f} of in process)")
    return f"{result['max_tokens']} tokens per request, greedy: " + "; ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
