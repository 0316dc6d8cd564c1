"""Decode throughput of the real server: tokens/s at batch 1 and 32, base model and mixed LoRA batch.

Starts ``vlora serve`` (the real tritonserver) on a model folder, streams requests through Triton's
HTTP ``/generate_stream`` endpoint from client processes, and measures decode throughput in the window
where every request of the batch is decoding (after the last first token, before the first finish).

    python -m benchmarks.serve_decode --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-bench

With ``--preset`` it first writes a random-weight model of that size and ``--num-adapters`` random
rank-``--rank`` adapters (q/k/v/o). Without it, it serves the tiny default model (a smoke run).
Writes ``benchmarks/results/serve-decode-<device>.json`` and a line in ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from benchmarks.common import device_name, git_commit, record_result


def stream_request(url: str, body: dict, out: dict) -> None:
    """POST to /generate_stream and record the arrival time of every token event."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    times, error = [], None
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                ev = json.loads(line[5:])
                if "error" in ev:
                    error = ev["error"]
                    break
                # An event carries the tokens generated since the previous one (several when some
                # decode to no text yet); count tokens, not events.
                times.extend([time.perf_counter()] * int(ev.get("num_output_tokens", 1) or 0))
                out["final"] = ev
    except urllib.error.HTTPError as e:  # the server's JSON error names the problem
        error = f"{e}: {e.read().decode(errors='replace')[:500]}"
    except Exception as e:  # recorded, and the run fails loudly below
        error = str(e)
    out["times"], out["error"] = times, error


ENGINE_SERIES = ("vlora_engine_steps_total", "vlora_decode_tokens_total", "vlora_step_duration_seconds_sum")


def scrape(metrics_url: Optional[str]) -> dict:
    """The engine's own counters from Triton's metrics endpoint, summed over their labels (empty: no URL)."""
    if not metrics_url:
        return {}
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    totals = dict.fromkeys(ENGINE_SERIES, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _stream(job: tuple[str, dict]) -> dict:
    out: dict = {}
    stream_request(job[0], job[1], out)
    return out


def run_batch(base_url: str, model: str, n: int, max_tokens: int, adapters: list[str | None], measure: bool = True,
              metrics_url: Optional[str] = None) -> dict:
    """``n`` concurrent streams, each read by its own client process: Python threads would share one GIL,
    and at thousands of token events a second their turns, not the server, would set the arrival times
    (perf_counter is the system's monotonic clock, the same in every process)."""
    prompt = "Describe the scene in detail, listing every object you can see and where it is."
    jobs = []
    for i in range(n):
        sp = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        body = {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sp)}
        if adapters[i % len(adapters)] is not None:
            body["lora_name"] = adapters[i % len(adapters)]
        jobs.append((f"{base_url}/v2/models/{model}/generate_stream", body))
    with multiprocessing.get_context("fork").Pool(n) as pool:  # the workers exist before t0
        before = scrape(metrics_url) if measure else {}
        t0 = time.perf_counter()
        results = pool.map(_stream, jobs, chunksize=1)
        after = scrape(metrics_url) if measure else {}
    errors = [r["error"] for r in results if r.get("error")]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    if not measure:
        return {}
    firsts = [r["times"][0] for r in results]
    lasts = [r["times"][-1] for r in results]
    lo, hi = max(firsts), min(lasts)  # every request is decoding inside [lo, hi]
    tokens = sum(sum(1 for t in r["times"] if lo < t <= hi) for r in results)
    if hi <= lo or tokens == 0:
        raise RuntimeError("no window where the whole batch decodes; raise --max-tokens")
    row = {"batch": n, "decode_tokens_per_s": tokens / (hi - lo), "window_s": hi - lo,
           "ttft_s_median": sorted(f - t0 for f in firsts)[n // 2], "wall_s": max(lasts) - t0,
           "first_token_spread_s": max(firsts) - min(firsts), "tokens_in_window": tokens,
           "tokens_per_s_overall": sum(len(r["times"]) for r in results) / (max(lasts) - t0)}
    if before and after:  # what the engine itself did meanwhile: its decode tokens per second of step time
        d = {k: after[k] - before[k] for k in ENGINE_SERIES}
        row["engine_steps"] = d["vlora_engine_steps_total"]
        row["engine_step_ms_mean"] = 1e3 * d["vlora_step_duration_seconds_sum"] / max(d["vlora_engine_steps_total"], 1)
        row["engine_decode_tokens_per_step_s"] = d["vlora_decode_tokens_total"] / max(d["vlora_step_duration_seconds_sum"], 1e-9)
    return row


def image_ttft(base_url: str, model: str, n: int) -> dict:
    """Time to the first token of a one-image request at idle (``<image>`` prompt, 336x336 PNG, greedy),
    ``n`` requests one after another, each with a new image (the same image again would be answered by the
    encoder and prefix caches); the first is a warm-up and is not counted."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    sp = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    ttfts = []
    for i in range(n + 1):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (336, 336, 3), dtype=np.uint8)).save(buf, format="PNG")
        body = {"text_input": "<image>\nWhat is in the picture?", "image": [base64.b64encode(buf.getvalue()).decode()],
                "stream": True, "sampling_parameters": json.dumps(sp)}
        out: dict = {}
        t0 = time.perf_counter()
        stream_request(f"{base_url}/v2/models/{model}/generate_stream", body, out)
        if out.get("error"):
            raise RuntimeError(f"image request failed: {out['error']}")
        if i:
            ttfts.append(out["times"][0] - t0)
    ttfts.sort()
    return {"workload": "image-ttft", "requests": n, "ttft_s_p50": ttfts[n // 2], "ttft_s_min": ttfts[0],
            "ttft_s_max": ttfts[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", help="configs/models/*.yaml; omit to serve the tiny default model")
    ap.add_argument("--work", default="/tmp/vlora-bench")
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--name", default="serve-decode")
    ap.add_argument("--prepare-only", action="store_true", help="write the model and adapters, then stop")
    ap.add_argument("--image-ttft", type=int, default=10, help="one-image requests timed to their first token at idle (0: none)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    serve = [sys.executable, "-m", "vlora.cli", "serve"]
    overrides = {"scheduler": {"max_batch_size": max(batches), "max_waiting": 4 * max(batches)},
                 "lora": {"max_gpu_adapters": max(args.num_adapters, 1), "max_cpu_adapters": max(args.num_adapters, 1) * 2,
                          "max_rank": args.rank, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}
    if args.preset:
        import torch
        from transformers import AutoConfig

        from vlora.lora.demo import DemoAdapter, write_adapter
        from vlora.models.random_init import make_random_model

        t = time.perf_counter()
        model_dir = make_random_model(args.preset, work / Path(args.preset).stem,
                                      device="cuda" if torch.cuda.is_available() else "cpu")
        print(f"model ready in {time.perf_counter() - t:.0f}s: {model_dir}", flush=True)
        # the decoder's settings with transformers' defaults filled in, whatever the family's config.json layout
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True).text_config.to_dict()
        adapters_dir = work / f"adapters-r{args.rank}"
        for i in range(args.num_adapters):  # random PEFT adapters in the demo adapters' format
            spec = DemoAdapter(f"r{args.rank}-{i:03d}", r=args.rank, alpha=2 * args.rank, seed=1000 + i,
                               modules=("q_proj", "k_proj", "v_proj", "o_proj"))
            out = adapters_dir / spec.name
            if not (out / "adapter_config.json").is_file():
                out.mkdir(parents=True, exist_ok=True)
                write_adapter(spec, model_dir, cfg, out)
        adapter_names = [f"r{args.rank}-{i:03d}" for i in range(args.num_adapters)]
        if args.prepare_only:
            return
        serve += ["--model", str(model_dir), "--adapters", str(adapters_dir), "--dtype", "bfloat16"]
        del torch
    else:
        adapter_names = ["demo-r8-qv", "demo-r16-attn", "demo-r32-mlp"]
        overrides["lora"] = {"max_gpu_adapters": 4}
    cfg_path = work / "serve.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump(overrides))
    from vlora.server.ports import free_ports

    http, grpc, metrics = free_ports(3)
    serve += ["--config", str(cfg_path), "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
              "--openai-port", "0",
              "--workspace", str(work / "triton-ws")]
    log = open(work / "server.log", "w")
    print("starting:", " ".join(serve), flush=True)
    proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{http}"
    try:
        deadline = time.time() + 900
        while True:
            try:
                if urllib.request.urlopen(f"{base}/v2/models/vlora/ready", timeout=2).status == 200:
                    break
            except Exception:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not become ready; see {work / 'server.log'}:\n" + (work / "server.log").read_text()[-4000:])
            time.sleep(2)
        run_batch(base, "vlora", 2, 8, [None], measure=False)  # warm-up
        # Load every adapter once (from disk into the host tier), so that a measured batch is not
        # admitted over the seconds that first loads take.
        run_batch(base, "vlora", len(adapter_names), 2, adapter_names, measure=False)
        rows = []
        for n in batches:
            for label, names in (("base", [None]), ("lora", adapter_names)):
                use = names if label == "base" else names[:n] if n > 1 else names[:1]
                r = run_batch(base, "vlora", n, args.max_tokens, use, metrics_url=f"http://127.0.0.1:{metrics}/metrics")
                r |= {"workload": label, "distinct_adapters": 0 if label == "base" else len(set(use[:n]))}
                print(json.dumps(r), flush=True)
                rows.append(r)
        if args.image_ttft:
            ttft = image_ttft(base, "vlora", args.image_ttft)
            print(json.dumps(ttft), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    dev = device_name()
    result = {"benchmark": args.name, "device": dev, "commit": git_commit(), "preset": args.preset or "tiny",
              "rank": args.rank, "max_tokens": args.max_tokens, "rows": rows}
    summary = "; ".join(f"bs{r['batch']} {r['workload']}: {r['decode_tokens_per_s']:.0f} tok/s" for r in rows)
    if args.image_ttft:
        result["image_ttft"] = ttft
        summary += f"; one-image request at idle (a new image each): first token p50 {1e3 * ttft['ttft_s_p50']:.0f} ms"
    record_result(args.name, dev, result, summary)


if __name__ == "__main__":
    main()
