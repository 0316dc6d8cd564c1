"""Issue 36's table through the real server: requests arriving at once, each with a new prompt length, many with
their own adapter, some with an adapter never requested before, and new images.

One ``vlora serve`` (the real tritonserver) on a model folder (``--preset``: a random-weight model of that size,
bf16 on a GPU; default and ``--tiny``: the tiny LLaVA on this machine's CPU, every row scaled down), and these rows
(``--rows``, comma-separated; all by default), each one burst of gRPC streams sent at the same instant:

``text32``
    ``--requests`` (32) short text requests of the base model, each a different new prompt length (20-80 tokens
    of random words: no prefix-cache hit, no length the server has seen), 16 output tokens, ``ignore_eos``: TTFT
    p50/p99/max, and from the server's metrics (read before and after) the engine steps their prefills took
    (``vlora_stage_seconds{stage="prefill_step"}`` observations: steps that carried a prefill), the prompt tokens
    those steps processed, the model's ``execute()`` calls (Triton's ``nv_inference_exec_count``: the batches
    Triton handed the Python backend) and the mean queue time. Floor: the FLOPs of one prefill of all the
    prompts' tokens (each prompt's attention within itself) at the matmul rate measured in the run.
``lora32``
    ``--requests`` concurrent x ``--max-tokens`` (256) tokens, base model, then one distinct resident adapter
    each (rank ``--rank`` 64, q/k/v/o; each warmed with one request first): output tokens/s through the server
    (all output tokens over first send to last answer), the engine's own decode tokens per second of step time
    (its counters: what the in-process engine reaches on the same steps), the ratio lora/base, and the decode
    floor (weights, KV and the adapters' bytes at the measured copy rate).
``cold32``
    the same with ``--requests`` adapters never requested before (new names, so new to every tier; their files
    are in the page cache): TTFT p50/p99, tokens/s, and the adapter read rate from the server's log (the
    manager logs every read from disk: bytes staged and seconds); the floor the issue states: the adapters'
    bytes at 5 GB/s.
``image64``
    ``--images`` (64) one-image requests at once over ``--image-adapters`` (8) resident adapters, 16 tokens each,
    every image a new random JPEG: requests/s for the burst, TTFT p50/p99, the engine's stage means, and the
    roofline requests/s (vision and prefill FLOPs plus decode bytes: ``benchmarks.vision_apps.roofline``).

The clients: ``--client-procs`` processes (half the cores, at most 8), each sending its share of a burst on
threads of its own, one tritonclient gRPC stream per request (one channel per thread, kept between bursts).
Every stream is opened first; then one message starts them all and each thread sends at once. A request's first
token is the first response that carries an output token (``num_output_tokens`` > 0; with random weights the text
of a token is often held back as incomplete UTF-8); its TTFT is counted from its own send.

    python -m benchmarks.serve_burst --preset configs/models/llava-1.5-7b.yaml   # a GPU (about 3 minutes on an H200)
    python -m benchmarks.serve_burst --no-record                                   # the tiny model on this CPU

Writes ``<--out>/serve-burst-<device>.json`` and, unless ``--no-record``, its copy and a line in
``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import faulthandler
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks.common import RESULTS, device_name, git_commit, model_folder, write_result

ROWS = ("text32", "lora32", "cold32", "image64")
TARGETS = {"text32": "TTFT p50 <= 60 ms (floor: one prefill of the prompts' tokens, ~25 ms on an H100)",
           "lora32": "lora/base >= 0.8, >= 85% of the in-process rate",
           "cold32": "TTFT p50 <= 1.5 s (reading at >= 5 GB/s: < 1 s)",
           "image64": ">= 45 req/s (~70 req/s from prefill FLOPs + decode bytes)"}
ISSUE_READ_GBS = 5.0  # the read rate issue 36 asks of cold adapters


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big each row is."""

    requests: int = 32  # text32, lora32, cold32
    text_lengths: tuple[int, int] = (20, 80)  # text32's new prompt lengths (tokens of random words)
    text_tokens: int = 16
    long_lengths: tuple[int, int] = (100, 200)  # lora32 / cold32's prompts
    max_tokens: int = 256  # lora32 / cold32
    rank: int = 64
    distinct_weights: int = 4  # adapter files written; the other names are hard links of them (see adapter_root)
    images: int = 64
    image_adapters: int = 8
    image_tokens: int = 16
    image_size: tuple[int, int] = (640, 480)  # the JPEGs' width and height


GPU = Scale()
# The tiny LLaVA on a 2-core CPU: every row in a few seconds.
TINY = Scale(requests=8, text_lengths=(20, 60), long_lengths=(30, 60), max_tokens=32, rank=8, distinct_weights=2,
             images=8, image_adapters=4, image_size=(64, 64))


# -- the requests ---------------------------------------------------------------------------------------------

def spread(lo: int, hi: int, n: int) -> list[int]:
    """``n`` distinct integers from ``lo`` to ``hi`` (inclusive), evenly spaced (wider than the range if it must)."""
    if n <= 1:
        return [lo][:n]
    out: list[int] = []
    for i in range(n):
        v = round(lo + i * (hi - lo) / (n - 1))
        out.append(max(v, out[-1] + 1) if out else v)
    return out


def new_prompts(count_tokens: Callable[[str], int], lengths: Sequence[int], seed: int) -> list[tuple[str, int]]:
    """One prompt of random words per length in ``lengths``: (text, its tokens by ``count_tokens``), at least the
    length asked and no two of the same length. Every prompt starts with words of its own, so none shares a
    prefix-cache block with another or with any earlier prompt of another seed."""
    import random

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    used: set[int] = set()
    out = []
    for want in lengths:
        words: list[str] = []
        n = 0
        while n < want or n in used:
            words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))))
            n = count_tokens(" ".join(words))
        used.add(n)
        out.append((" ".join(words), n))
    return out


def job(prompt: str, max_tokens: int, adapter: Optional[str] = None, image: Optional[bytes] = None) -> dict:
    """One streamed request: greedy, ``ignore_eos`` (every request generates ``max_tokens``)."""
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if adapter:
        params["lora_name"] = adapter
    return {"prompt": prompt, "params": params, "images": [base64.b64encode(image).decode()] if image else []}


# -- the clients: processes of threads, one gRPC stream per request ---------------------------------------------

def _send(client, j: dict, armed: threading.Barrier, go: threading.Event, out: dict) -> None:
    """Open a stream, wait for the start, send ``j`` and read its answers (run on a thread of a client process)."""
    import queue

    from vlora_client.client import build_grpc_inputs

    events: queue.Queue = queue.Queue()
    inputs = build_grpc_inputs(j["prompt"], j["images"], j["params"], True)
    out.update(t_send=None, t_first=None, t_end=None, n_in=0, n_out=0, finish_reason="", error="")
    finished = False
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
    except Exception as e:
        out["error"] = f"start_stream: {type(e).__name__}: {e}"
        armed.abort()
        return
    try:
        armed.wait()
        go.wait()
        out["t_send"] = time.perf_counter()
        client.async_stream_infer("vlora", inputs, enable_empty_final_response=True)
        while True:
            result, error, t = events.get(timeout=600)
            if error is not None:
                out["error"] = str(error)
                finished = True
                break
            response = result.get_response()
            if response.outputs:
                n = result.as_numpy("num_output_tokens")
                n = int(n.reshape(-1)[0]) if n is not None and n.size else 0
                if n > 0:
                    out["t_first"] = out["t_first"] or t
                    out["n_out"] += n
                n_in = result.as_numpy("num_input_tokens")
                if n_in is not None and n_in.size:
                    out["n_in"] = int(n_in.reshape(-1)[0]) or out["n_in"]
                reason = result.as_numpy("finish_reason")
                if reason is not None and reason.size and reason.reshape(-1)[0]:
                    out["finish_reason"] = reason.reshape(-1)[0].decode()
            if response.parameters["triton_final_response"].bool_param:
                finished = True
                break
    except Exception as e:
        out["error"] = out["error"] or f"{type(e).__name__}: {e}"
    finally:
        out["t_end"] = time.perf_counter()
        try:
            client.stop_stream(cancel_requests=not finished)
        except Exception:
            pass


def _client_loop(conn, url: str) -> None:
    """A client process: for each list of jobs it receives, arms one stream per job (a thread each), says so,
    sends them all on the next message, and sends back their results."""
    import tritonclient.grpc as grpcclient

    clients: list = []
    conn.send("ready")
    while True:
        jobs = conn.recv()
        if jobs is None:
            break
        while len(clients) < len(jobs):
            clients.append(grpcclient.InferenceServerClient(url))
        armed, go = threading.Barrier(len(jobs) + 1), threading.Event()
        results: list[dict] = [{} for _ in jobs]
        threads = [threading.Thread(target=_send, args=(clients[i], j, armed, go, results[i]), daemon=True)
                   for i, j in enumerate(jobs)]
        for t in threads:
            t.start()
        try:
            armed.wait(timeout=120)
            conn.send("armed")
        except threading.BrokenBarrierError:
            conn.send("broken")
        conn.recv()  # the start
        go.set()
        for t in threads:
            t.join()
        conn.send(results)
    for c in clients:
        c.close()


def _recv(conn, timeout_s: float):
    """The next message from a client process; RuntimeError when none comes within ``timeout_s``."""
    if not conn.poll(timeout_s):
        raise RuntimeError(f"a client process sent nothing for {timeout_s:g} s")
    return conn.recv()


class Clients:
    """``procs`` client processes (spawned: no state of this process, no gRPC of this process, crosses a fork)."""

    def __init__(self, grpc_url: str, procs: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(max(1, procs)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_loop, args=(child, grpc_url), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            if _recv(c, 120) != "ready":
                raise RuntimeError("a client process did not start")

    def burst(self, jobs: list[dict], refusals: bool = False) -> list[dict]:
        """Send ``jobs`` at once; their results in order. A failure raises RuntimeError naming the first, except
        explicit refusals (UNAVAILABLE: the server's queues are full) with ``refusals``: those come back with
        their ``error``, counted by :func:`burst_figures`."""
        shards = [list(range(i, len(jobs), len(self.conns))) for i in range(min(len(self.conns), len(jobs)))]
        conns = self.conns[:len(shards)]
        for c, idx in zip(conns, shards):
            c.send([jobs[i] for i in idx])
        states = [_recv(c, 180) for c in conns]
        for c in conns:  # every stream is open: start them all
            c.send("go")
        results: list[dict] = [{} for _ in jobs]
        for c, idx in zip(conns, shards):
            for i, r in zip(idx, _recv(c, 900)):
                results[i] = r
        if "broken" in states:
            raise RuntimeError(f"a client process could not open its streams: {[r.get('error') for r in results]}")
        errors = [r["error"] for r in results if r.get("error") and not (refusals and "[UNAVAILABLE]" in r["error"])]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(jobs)} requests failed, first: {errors[0]}")
        return results

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# -- figures --------------------------------------------------------------------------------------------------

def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation, as numpy's default)."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def burst_figures(results: list[dict]) -> dict:
    """TTFT (each request from its own send), the sends' spread, output tokens/s and requests/s of a burst, over
    the requests answered; ``refused``: those refused explicitly (the server's queues full)."""
    refused = [r for r in results if r.get("error")]
    results = [r for r in results if not r.get("error")]
    if not results:
        return {"requests": 0, "refused": len(refused), "refusal": refused[0]["error"][:200] if refused else None}
    ttft = [r["t_first"] - r["t_send"] for r in results]
    firsts = [r["t_first"] for r in results]
    t0 = min(r["t_send"] for r in results)
    wall = max(r["t_end"] for r in results) - t0
    tokens = sum(r["n_out"] for r in results)
    return {"requests": len(results), "ttft_ms_p50": round(1e3 * pct(ttft, 50), 2),
            "ttft_ms_p99": round(1e3 * pct(ttft, 99), 2), "ttft_ms_max": round(1e3 * max(ttft), 2),
            "send_spread_ms": round(1e3 * (max(r["t_send"] for r in results) - t0), 3),
            "first_token_spread_ms": round(1e3 * (max(firsts) - min(firsts)), 2),
            "wall_s": round(wall, 3), "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1),
            "requests_per_s": round(len(results) / wall, 2),
            "ttft_ms_sorted": [round(1e3 * t, 1) for t in sorted(ttft)],  # the order the burst was served in
            "input_tokens": [r["n_in"] for r in results],
            "finish_reasons": sorted({r["finish_reason"] for r in results}),
            "refused": len(refused), **({"refusal": refused[0]["error"][:200]} if refused else {})}


COUNTERS = ("vlora_engine_steps_total", "vlora_prefill_tokens_total", "vlora_decode_tokens_total",
            "vlora_step_duration_seconds_sum", "vlora_batch_size_per_step_sum", "vlora_batch_size_per_step_count",
            "vlora_adapter_host_loads_total", "vlora_adapter_gpu_loads_total", "nv_inference_exec_count",
            "nv_inference_count", "nv_inference_request_success", "nv_inference_queue_duration_us",
            "nv_inference_compute_infer_duration_us")


PER_DEVICE = {"vlora_adapter_host_loads_total": "host_loads", "vlora_adapter_gpu_loads_total": "gpu_loads",
              "vlora_decode_tokens_total": "decode_tokens", "vlora_prefill_tokens_total": "prefill_tokens"}


def counters(metrics_url: str) -> dict[str, float]:
    """The server's counters of :data:`COUNTERS` summed over their labels, each engine stage's
    ``stage:<name>:sum`` / ``stage:<name>:count`` (``vlora_stage_seconds``), the counters of :data:`PER_DEVICE`
    per engine (``device|<engine>|<figure>``, an engine named by its model and device labels), and the adapters
    resident in device slots per engine (``resident|<engine>``)."""
    import urllib.request

    from vlora_load.scrape import parse_prometheus

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        samples = parse_prometheus(r.read().decode())
    out = dict.fromkeys(COUNTERS, 0.0)
    for name, labels, value in samples:
        if name in out and (not name.startswith("nv_") or labels.get("model") == "vlora"):
            out[name] += value
        elif name.startswith("vlora_stage_seconds_") and "stage" in labels:
            key = f"stage:{labels['stage']}:{name.rsplit('_', 1)[1]}"
            out[key] = out.get(key, 0.0) + value
        engine = " ".join(labels[k] for k in ("model", "device") if labels.get(k))  # routed: vlora_gpu<i>
        if name in PER_DEVICE and engine:
            key = f"device|{engine}|{PER_DEVICE[name]}"  # a device label holds a colon (cuda:0)
            out[key] = out.get(key, 0.0) + value
        elif name == "vlora_adapters_resident" and labels.get("tier") == "gpu" and engine:
            out[f"resident|{engine}"] = value
    return out


def settle(metrics_url: str) -> None:
    """Wait for the server to be idle, and for its metrics to show everything done so far (they are applied
    every 0.2 s)."""
    from vlora_load.runner import wait_idle

    wait_idle(metrics_url, 120, sys.stdout)
    time.sleep(0.5)


def engine_figures(before: dict, after: dict) -> dict:
    """What the engine did between two :func:`counters`: steps, steps with a prefill, tokens, and Triton's
    execute() calls and queue time."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    steps = d["vlora_engine_steps_total"]
    out = {"engine_steps": int(steps), "prefill_steps": int(d.get("stage:prefill_step:count", 0)),
           "prefill_tokens": int(d["vlora_prefill_tokens_total"]), "decode_tokens": int(d["vlora_decode_tokens_total"]),
           "step_ms_mean": round(1e3 * d["vlora_step_duration_seconds_sum"] / max(steps, 1), 3),
           "batch_mean": round(d["vlora_batch_size_per_step_sum"] / max(d["vlora_batch_size_per_step_count"], 1), 2),
           "execute_calls": int(d["nv_inference_exec_count"]), "triton_requests": int(d["nv_inference_count"]),
           # Triton's side of an arrival: the time in its scheduler's queue before execute(), and execute()'s own
           "triton_queue_ms_mean": round(d["nv_inference_queue_duration_us"] / 1e3 / max(d["nv_inference_count"], 1), 3),
           "execute_ms_mean": round(d["nv_inference_compute_infer_duration_us"] / 1e3 / max(d["nv_inference_exec_count"], 1), 3),
           "host_loads": int(d["vlora_adapter_host_loads_total"]), "gpu_loads": int(d["vlora_adapter_gpu_loads_total"])}
    if d["vlora_step_duration_seconds_sum"] > 0:
        out["engine_decode_tok_per_s"] = round(d["vlora_decode_tokens_total"] / d["vlora_step_duration_seconds_sum"], 1)
    for stage in ("queue", "prefill_step", "decode_step", "image_decode", "preprocess", "vision", "adapter_read",
                  "adapter_copy", "adapter_copy_queue", "adapter_copy_work", "adapter_copy_host", "adapter_copy_wait",
                  "adapter_copy_h2d"):
        n = d.get(f"stage:{stage}:count", 0)
        if n:
            out[f"{stage}_ms_mean"] = round(1e3 * d[f"stage:{stage}:sum"] / n, 3)
    if d.get("stage:adapter_read:count"):
        out["adapter_read_count"] = int(d["stage:adapter_read:count"])
    devices = sorted({k.split("|")[1] for k in d if k.startswith("device|")})
    if len(devices) > 1:  # several engines (adapter-aware routing): what each did, and its adapters in slots after
        out["per_device"] = {dev: {**{f: int(d.get(f"device|{dev}|{f}", 0)) for f in PER_DEVICE.values()},
                                   "resident_gpu_adapters": int(after.get(f"resident|{dev}", 0))} for dev in devices}
    return out


READ_LINE = re.compile(r"loaded adapter (\S+) from .*?\(rank \d+, ([0-9.]+) MB\) in ([0-9.]+) ms")
NO_READ_LOG = ("the server logged no adapter reads: LoraManager._read logs each (MB, ms, GB/s) through Python's logging "
               "at INFO, which the Python backend's stub does not hand to Triton's log, and the metrics count reads "
               "(vlora_adapter_host_loads_total) without their bytes or seconds; gb_per_s_lower_bound is the adapters' "
               "bytes over the time to the last first token")


def adapter_reads(log_text: str, names: set[str]) -> Optional[dict]:
    """The reads of ``names`` from disk that the server logged (``LoraManager._read``: MB staged, ms): their
    count, GB, the summed read time and the mean rate of one read (what the manager's ``read_bytes /
    read_seconds`` gives), and the longest read; None when none was logged."""
    reads = [(float(m.group(2)), float(m.group(3))) for m in READ_LINE.finditer(log_text) if m.group(1) in names]
    if not reads:
        return None
    mb, ms = sum(r[0] for r in reads), sum(r[1] for r in reads)
    return {"reads": len(reads), "gb": round(mb / 1e3, 3), "read_s_sum": round(ms / 1e3, 3),
            "gb_per_s_per_read": round(mb / ms, 2) if ms else None,  # MB/ms = GB/s
            "read_ms_max": max(r[1] for r in reads)}


# -- the server and its adapters ------------------------------------------------------------------------------

def adapter_root(model_dir: Path, root: Path, names: int, scale: Scale, bf16: bool) -> list[str]:
    """``names`` rank-``scale.rank`` q/k/v/o adapters under ``root``: ``scale.distinct_weights`` written with
    ``vlora_load.adapters.ensure_load_adapters`` (in bf16 when ``bf16``, as a checkpoint's adapters are: its
    writer draws them in fp32), the others hard links of their files under names of their own. The server keys
    an adapter on its name and the hash of its bytes, so every name is an adapter of its own in every tier, and
    its cost to compute does not depend on its values. Returns the names."""
    import shutil

    from vlora_load.adapters import ensure_load_adapters

    src = ensure_load_adapters(model_dir, root / "src", scale.distinct_weights, rank=scale.rank,
                               modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    if bf16:
        import torch
        from safetensors.torch import load_file, save_file

        for name in src:
            f = root / "src" / name / "adapter_model.safetensors"
            tensors = load_file(str(f))
            if any(t.dtype != torch.bfloat16 for t in tensors.values()):
                tmp = f.with_suffix(".tmp")
                save_file({k: t.to(torch.bfloat16) for k, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
                tmp.replace(f)
    out = []
    for i in range(names):
        name = f"burst-r{scale.rank}-{i:03d}"
        folder, origin = root / "served" / name, root / "src" / src[i % len(src)]
        if not (folder / "adapter_config.json").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            for f in origin.iterdir():
                try:
                    os.link(f, folder / f.name)
                except OSError:
                    shutil.copyfile(f, folder / f.name)
        out.append(name)
    return out


def start(model_dir: Path, adapters: Path, work: Path, device: str, scale: Scale, cuda: bool, extra: Sequence[str] = ()):
    """``vlora serve`` on the model with room for every adapter of the run in device slots and host memory, with the
    arguments ``extra`` added (``--serve-arg``)."""
    import yaml

    from vlora_load.server import start_server

    n = 2 * scale.requests
    cfg = {"scheduler": {"max_waiting": max(64, 2 * scale.images)},
           "lora": {"max_gpu_adapters": n, "max_cpu_adapters": n, "max_rank": scale.rank,
                    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
           "limits": {"max_images": 1}}
    path = work / "serve-burst.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = [f"--model {model_dir}", f"--adapters {adapters}", f"--config {path}"] + (["--dtype bfloat16"] if cuda else []) + list(extra)
    server, _token = start_server(work / "burst-server", device, args)  # its log: burst-server/ws/tritonserver.log
    return server


# -- the rows -------------------------------------------------------------------------------------------------

class Run:
    """What the rows share: the server, its clients, the model's dimensions and rates, and the adapters."""

    def __init__(self, server, clients: Clients, model_dir: Path, adapters: Path, scale: Scale, rates: dict,
                 cuda: bool, warm: list[str], cold: list[str]) -> None:
        from transformers import AutoTokenizer

        from benchmarks.engine_floor import read_config
        from benchmarks.floors import ModelDims

        self.server, self.clients, self.model_dir, self.scale, self.rates = server, clients, model_dir, scale, rates
        self.metrics_url, self.adapters = server.metrics_url, adapters
        self.warm, self.cold = warm, cold
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.count_tokens = lambda text: len(tok(text, add_special_tokens=False).input_ids)
        cfg = read_config(model_dir)
        self.dims = ModelDims.from_config(cfg.get("text_config") or cfg, elt=2 if cuda else 4)
        self.seed = 0

    def prompts(self, lo: int, hi: int, n: int) -> list[tuple[str, int]]:
        self.seed += 1
        return new_prompts(self.count_tokens, spread(lo, hi, n), seed=1000 * self.seed + 17)

    def measured(self, jobs: list[dict]) -> tuple[dict, dict]:
        """(burst figures, engine figures) of one burst, the server idle before and after."""
        settle(self.metrics_url)
        before = counters(self.metrics_url)
        results = self.clients.burst(jobs, refusals=True)
        settle(self.metrics_url)
        return burst_figures(results), engine_figures(before, counters(self.metrics_url))

    def warm_up(self) -> None:
        """The first requests after start (text and one image), outside every row: their lengths (8-12 tokens)
        and image are used by no row."""
        jobs = [job(p, 2) for p, _ in self.prompts(8, 12, 4)]
        jobs.append(job(self.image_mark() + "What is in this picture?", 2, image=self.jpeg(1)))
        self.clients.burst(jobs)

    def image_mark(self) -> str:
        from vlora.models.family import family_for

        return family_for(self.model_dir).image_placeholder

    def jpeg(self, seed: int) -> bytes:
        from benchmarks.vision_apps import jpeg

        return jpeg(seed, *self.scale.image_size)

    def text32(self) -> dict:
        s = self.scale
        prompts = self.prompts(*s.text_lengths, s.requests)
        burst, engine = self.measured([job(p, s.text_tokens) for p, _ in prompts])
        from benchmarks.floors import prefill_floor

        tflops = self.rates["matmul_tflops"]
        floor_ms = sum(prefill_floor(self.dims, n, tflops)["floor_ms"] for n in burst["input_tokens"])
        return {**burst, **engine, "prompt_words_tokens": [n for _, n in prompts], "max_tokens": s.text_tokens,
                "floor_ms": round(floor_ms, 3), "ttft_p50_over_floor": round(burst["ttft_ms_p50"] / floor_ms, 2),
                "target": TARGETS["text32"]}

    def decode_burst(self, adapters: Sequence[Optional[str]]) -> dict:
        s = self.scale
        prompts = self.prompts(*s.long_lengths, s.requests)
        burst, engine = self.measured([job(p, s.max_tokens, adapters[i % len(adapters)])
                                       for i, (p, _) in enumerate(prompts)])
        from benchmarks.floors import decode_floor

        distinct = len({a for a in adapters if a})
        context = statistics.mean(burst["input_tokens"]) + s.max_tokens / 2
        floor = decode_floor(self.dims, s.requests, int(context), self.rates["copy_gbs"], adapters=distinct, rank=s.rank)
        row = {**burst, **engine, "distinct_adapters": distinct, "max_tokens": s.max_tokens,
               "decode_floor_tok_per_s": round(s.requests / (floor["floor_ms"] / 1e3), 1)}
        if engine.get("engine_decode_tok_per_s"):
            row["server_over_engine"] = round(burst["output_tok_per_s"] / engine["engine_decode_tok_per_s"], 3)
        return row

    def lora32(self) -> dict:
        base = self.decode_burst([None])
        lora = self.decode_burst(self.warm[:self.scale.requests])
        return {"base": base, "lora": lora, "lora_over_base": round(lora["output_tok_per_s"] / base["output_tok_per_s"], 3),
                "target": TARGETS["lora32"]}

    def cold32(self) -> dict:
        from vlora_load.server import log_offset

        log = self.server.log_path
        offset = log_offset(log)
        row = self.decode_burst(self.cold[:self.scale.requests])
        text = ""
        if log_offset(log) > offset:
            with open(log, "rb") as fh:
                fh.seek(offset)
                text = fh.read().decode(errors="replace")
        files = sum(f.stat().st_size for name in self.cold[:self.scale.requests]
                    for f in (self.adapters / name).glob("*.safetensors"))
        row["adapter_file_bytes"] = files
        row["adapter_file_gb"] = round(files / 1e9, 3)
        row["adapter_reads"] = adapter_reads(text, set(self.cold))
        if row.get("adapter_read_ms_mean"):  # vlora_stage_seconds{stage="adapter_read"}: every read, timed
            row["adapter_reads_timed"] = row["adapter_read_count"]
            row["gb_per_read_s"] = round(files / row["adapter_read_count"] / 1e9 / (row["adapter_read_ms_mean"] / 1e3), 3)
        elif row["adapter_reads"] is None:
            row["adapter_reads_note"] = NO_READ_LOG
        # Every read ended before the last request's first token: the burst read at least this fast.
        row["gb_per_s_lower_bound"] = round(files / 1e9 / (row["ttft_ms_max"] / 1e3), 4)
        row["read_floor_s"] = round(files / 1e9 / ISSUE_READ_GBS, 3)
        row["target"] = TARGETS["cold32"]
        return row

    def image64(self) -> dict:
        s = self.scale
        mark = self.image_mark()
        adapters = self.warm[:s.image_adapters]
        words = self.prompts(4, 4 + s.images, s.images)  # a few new words each: no two prompts alike
        jobs = [job(f"{mark}{p}\nWhat is in this picture?", s.image_tokens, adapters[i % len(adapters)],
                    image=self.jpeg(10_000 + self.seed * 1000 + i)) for i, (p, _) in enumerate(words)]
        burst, engine = self.measured(jobs)
        from benchmarks.vision_apps import roofline

        point = {"mean_input_tokens": statistics.mean(burst["input_tokens"]), "mean_output_tokens": s.image_tokens}
        roof = roofline(self.model_dir, self.rates, point, 1.0, s.image_size[0], batch=32)
        return {**burst, **engine, "adapters": len(adapters), "image_size": list(s.image_size),
                "roofline": roof, "fraction_of_roofline": round(burst["requests_per_s"] / roof["roofline_rps"], 3)
                if roof.get("roofline_rps") else None, "target": TARGETS["image64"]}


def _refused(r: dict) -> str:
    return f" ({r['refused']} refused: {r.get('refusal')})" if r.get("refused") else ""


def _per_gpu(r: dict) -> str:
    """With several engines: the decode tokens, adapter reads (host loads) and adapters in slots of each."""
    per = r.get("per_device")
    if not per:
        return ""
    col = lambda f: "/".join(str(v[f]) for v in per.values())  # noqa: E731
    return (f" [per GPU {', '.join(per)}: decode tokens {col('decode_tokens')}, adapter reads {col('host_loads')}, "
            f"adapters in slots {col('resident_gpu_adapters')}]")


def summary(result: dict) -> str:
    rows, parts = result["rows"], []
    name = Path(result["preset"]).stem
    for row, r in list(rows.items()):
        if isinstance(r, dict) and r.get("requests") == 0:  # every request refused: nothing to time
            parts.append(f"{row}: all {r['refused']} requests refused ({r.get('refusal')})")
            rows = {k: v for k, v in rows.items() if k != row}
    if "text32" in rows:
        r = rows["text32"]
        parts.append(f"{r['requests']} short text requests at once: TTFT p50 {r['ttft_ms_p50']:.1f} / p99 "
                     f"{r['ttft_ms_p99']:.1f} / max {r['ttft_ms_max']:.1f} ms (floor {r['floor_ms']:.1f} ms), prefills in "
                     f"{r['prefill_steps']} steps, {r['execute_calls']} execute() calls{_refused(r)}")
    if "lora32" in rows:
        r = rows["lora32"]
        parts.append(f"{r['base']['requests']} x {r['base']['max_tokens']} tokens: base {r['base']['output_tok_per_s']:.0f} "
                     f"tok/s, {r['lora']['distinct_adapters']} resident adapters {r['lora']['output_tok_per_s']:.0f} "
                     f"(lora/base {r['lora_over_base']:.2f}; server/engine steps "
                     f"{r['lora'].get('server_over_engine', 0):.2f}){_per_gpu(r['lora'])}")
    if "cold32" in rows:
        r = rows["cold32"]
        reads = r["adapter_reads"]
        if r.get("adapter_read_ms_mean"):  # the engine's own timers (vlora_stage_seconds)
            rate = (f"one read {r['adapter_read_ms_mean']:.0f} ms ({r['gb_per_read_s']:.2f} GB/s per read, "
                    f"{r['adapter_reads_timed']} reads), one slot copy {r.get('adapter_copy_ms_mean', 0):.0f} ms "
                    f"({r.get('adapter_copy_queue_ms_mean', 0):.0f} queued, {r.get('adapter_copy_work_ms_mean', 0):.0f} "
                    f"enqueueing: {r.get('adapter_copy_host_ms_mean', 0):.0f} CPU copies, "
                    f"{r.get('adapter_copy_wait_ms_mean', 0):.0f} buffer waits, "
                    f"{r.get('adapter_copy_h2d_ms_mean', 0):.0f} enqueueing the device copies)")
        elif reads:
            rate = f"read {reads['gb_per_s_per_read']} GB/s per read (server log)"
        else:
            rate = f"read >= {r['gb_per_s_lower_bound']:.2f} GB/s (bytes / last TTFT; the server reports no read rate)"
        parts.append(f"{r['distinct_adapters']} cold adapters ({r['adapter_file_gb']:.2f} GB): TTFT p50 "
                     f"{r['ttft_ms_p50']:.0f} ms, {r['output_tok_per_s']:.0f} tok/s, {rate}{_refused(r)}{_per_gpu(r)}")
    if "image64" in rows:
        r = rows["image64"]
        roof = r["roofline"].get("roofline_rps")
        parts.append(f"{r['requests']} one-image requests at once ({r['adapters']} adapters): "
                     f"{r['requests_per_s']:.1f} req/s, TTFT p50 {r['ttft_ms_p50']:.0f} / p99 {r['ttft_ms_p99']:.0f} ms "
                     f"(roofline {roof} req/s){_refused(r)}{_per_gpu(r)}")
    given = f"; served with {' '.join(result['serve_args'])}" if result.get("serve_args") else ""
    return f"{name}: " + "; ".join(parts) + f" (new prompts, images and adapters{given})"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", help="configs/models/*.yaml: a random-weight model of that size; omit for the tiny model")
    ap.add_argument("--model", help="a model folder to serve instead (a checkpoint, or the tiny model's folder)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny LLaVA, every row scaled down (the default without --preset or --model)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--requests", type=int, help="requests of text32, lora32 and cold32 (default 32; tiny 8)")
    ap.add_argument("--images", type=int, help="requests of image64 (default 64; tiny 8)")
    ap.add_argument("--max-tokens", type=int, help="output tokens of lora32 and cold32 (default 256; tiny 32)")
    ap.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    ap.add_argument("--work", default="/tmp/vlora-bench", help="where the model and adapters are written (and reused)")
    ap.add_argument("--out", default=str(RESULTS), help="folder for the JSON (default benchmarks/results)")
    ap.add_argument("--no-record", action="store_true", help="no line in RESULTS.md, no copy in benchmarks/results")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="more vlora serve arguments (repeatable), e.g. --serve-arg='--routing off'; "
                         "named in the results")
    args = ap.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack, if a run hangs
    rows = [r for r in args.rows.split(",") if r]
    if bad := [r for r in rows if r not in ROWS]:
        ap.error(f"unknown rows {bad}; choose from {list(ROWS)}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    tiny = args.tiny or not (args.preset or args.model)
    scale = TINY if tiny else GPU
    given = {"requests": args.requests, "images": args.images, "max_tokens": args.max_tokens}
    scale = dataclasses.replace(scale, **{k: v for k, v in given.items() if v})
    os.environ["no_proxy"] = os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = Path(args.model) if args.model else model_folder("tiny-llava" if tiny else args.preset, work, cuda)
    names = adapter_root(model_dir, work / f"burst-adapters-r{scale.rank}", 2 * scale.requests, scale, bf16=cuda)
    warm, cold = names[:scale.requests], names[scale.requests:]
    print(f"model and {len(names)} adapters ready in {time.perf_counter() - t0:.0f} s: {model_dir}", flush=True)
    import torch

    from benchmarks.floors import measure_rates

    rates = measure_rates(torch.device(device))  # before the server holds the device
    t1 = time.perf_counter()
    served = work / f"burst-adapters-r{scale.rank}" / "served"
    server = start(model_dir, served, work, device, scale, cuda, args.serve_arg)
    ready_s = time.perf_counter() - t1
    from vlora_load.server import log_offset, server_error_lines

    started = log_offset(server.log_path)  # error lines are counted from here (a CPU start logs a CUDA one)
    clients = None
    result: dict = {"benchmark": "serve-burst", "device": device_name() if cuda else "cpu", "commit": git_commit(),
                    "preset": args.preset or args.model or "tiny-llava", "scale": dataclasses.asdict(scale), "rates": rates,
                    "ready_s": round(ready_s, 1), "client_procs": args.client_procs, "serve_args": args.serve_arg,
                    "rows": {}}
    try:
        clients = Clients(server.grpc_url, args.client_procs)
        run = Run(server, clients, model_dir, served, scale, rates, cuda, warm, cold)
        print("warm-up: 4 text requests and an image", flush=True)
        run.warm_up()
        if any(r in rows for r in ("lora32", "image64")):  # every resident adapter read and in a slot, once
            use = warm if "lora32" in rows else warm[:scale.image_adapters]
            print(f"reading {len(use)} adapters into slots, one request each", flush=True)
            run.clients.burst([job(p, 1, a) for (p, _), a in zip(run.prompts(13, 13 + len(use), len(use)), use)])
        for row in rows:
            t = time.perf_counter()
            result["rows"][row] = getattr(run, row)()
            shown = {k: v for k, v in result["rows"][row].items() if k != "input_tokens"}
            print(f"== {row} ({time.perf_counter() - t:.1f} s)\n{json.dumps(shown, default=str)}", flush=True)
    finally:
        result["server_log_errors"], first = server_error_lines(server.log_path, started)
        if first:
            result["server_log_error_lines"] = first
        if clients is not None:
            clients.close()
        code = server.stop()
        if code:
            print(f"warning: vlora serve exited with {code}", flush=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    line = summary(result)
    write_result("serve-burst", args.out, result, line, record=not args.no_record)
    print("RESULTS", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
