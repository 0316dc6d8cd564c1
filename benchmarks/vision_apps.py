"""V-LoRA's two applications as a user of a vision application waits for them: new images, through the server.

Two parts, per model (``--presets``; each in a child process of its own so that one model's memory is gone
before the next):

**In process** (``--part engine``): one request with one new image (every repetition its own pixels: no
encoder-cache or prefix hit; JPEG, 640x480 for LLaVA, 448x448 for Qwen2-VL) asking for one token: ms of
``inputs.prepare`` (decode, preprocessing, tokens, M-RoPE positions) and of the engine step (vision tower,
prefill, the token), p50; ``video16`` (families that take a video): 16 new 448x448 frames; ``first``: the first
such request after the engine is built (what the warm start is for); ``vision_ms``: the vision tower and
projector/merger alone (the engine's own encode: the graphed tower where one is captured); ``async_ms``: the same
request handed to the ``AsyncEngine`` as the Triton model hands it (checks, image workers, the engine thread's loop
and its step overlap) to its final event: the server's figure less Triton's transport.

**Through the real server** (``--part server``): ``vlora serve`` on the model with ``--adapters N`` random
rank-``--rank`` adapters, then
- the time to ready and the first request after it, and the idle time to the whole one-token answer of a new
  image over HTTP ``/generate``, with and without an adapter (p50 of ``--reps``), with the engine's stage timers
  over those requests and what they leave untimed (Triton's HTTP and the stub's transport, the response thread);
  the applications' images are uniform-noise JPEGs (the worst case to decode), so the idle time is also taken
  for a photo-like JPEG of the same size and, on LLaVA, for a 336x336 one (the size its CLIP takes);
- visual retrieval (one new image per request, the trace-shaped question and answer lengths of
  ``configs/workloads/visual_retrieval.yaml``, adapters drawn from Zipf(1) over the N) and video analytics
  (``--frames`` new frames per chunk, one chunk per stream per second, 5-10 output tokens or a task head;
  Qwen2-VL takes them as one video; LLaVA-1.5 takes them as images, as many as fit its context: 6 of 576 tokens
  in 4,096) under open-loop Poisson arrivals at each of ``--rates`` (``--video-rates`` for the video), through
  the load harness (``load/vlora_load``): requests/s, TTFT p50/p99, V-LoRA's average token latency (end-to-end
  latency over output tokens) and the SLO attainment of the workload's SLO. Each application's figure is its
  rate at the SLO: the arrivals per second of the highest rate point at which every request was answered and
  90% within the SLO (the goodput of DistServe); the answered requests/s of a point (over the window to its
  last answer) is reported beside it. Every rate point draws new images and clips (the harness gives point i
  its own seed), and each says what its answers took from the server's encoder and prefix caches (its
  ``server_caches``; near 0 for new content). Before 2026-11-29 every point re-sent the first point's
  content, and the caches answered most requests of every point after the first.
Before the sweeps every adapter answers one video chunk of new frames, so that the sweeps measure the steady
state: an adapter's first use (its cold read and slot copy) is serve_burst's cold rows, and a video grid's graph
is captured at its second sighting. Per application over its whole sweep: the mean time per stage from the
engine's own timers (``vlora_stage_seconds``: queue, image_decode, preprocess, vision, prefill_step, decode_step).
Each rate point carries its workload's roofline: requests/s at the floor (the images' vision FLOPs and the
prompt's prefill FLOPs at the measured matmul rate, plus the output tokens' decode bytes (their share of the
weights at 32 rows a step, and their context's keys and values) at the measured copy rate, from the lengths the
harness saw) and the rate at the SLO as a fraction of it.
The floors of the in-process requests (vision + prefill FLOPs over the measured matmul rate) are
``benchmarks/engine_floor.py``'s media rows.

Usage (a GPU machine): ``python -m benchmarks.vision_apps`` (both 7B presets, both parts); ``--tiny`` on a CPU.
"""
from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.common import PRESETS, TINY, device_name, git_commit, model_folder, model_parser, sync_fn, write_result

REPS = 6


PHOTO_SIDE = 336  # LLaVA-1.5's CLIP input: an image of this size needs no resize


def photo_jpeg(seed: int, w: int, h: int) -> bytes:
    """A photo-like JPEG (smooth 8x8 blocks with a little noise, quality 90): about a third of the bytes of
    :func:`jpeg`'s uniform noise at 640x480, as camera frames are (benchmarks/image_prep.py uses the same)."""
    from benchmarks.image_prep import jpeg as photo

    return photo(seed, w, h)


def jpeg(seed: int, w: int, h: int) -> bytes:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def one_request(engine, text: str, images: list[bytes], sync) -> tuple[float, float, object]:
    """(prepare ms, step ms, the prepared request) of one request asking for one token, run alone."""
    from vlora.engine.api import GenerationRequest, SamplingParams

    req = GenerationRequest(f"vision-apps-{time.monotonic_ns()}", text, images=images, sampling=SamplingParams(max_tokens=1))
    sync()
    t0 = time.perf_counter()
    prepared = engine.inputs.prepare(req)
    t1 = time.perf_counter()
    errors: list = []
    engine.add_request(prepared, lambda out: errors.append(out.error) if out.finished and out.error else None)
    engine.step()
    engine.flush()
    sync()
    t2 = time.perf_counter()
    if errors:
        raise RuntimeError(f"the request failed: {errors[0]}")
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), prepared


def async_request(aeng, text: str, images: list[bytes]) -> float:
    """ms from handing one request (one token) to the AsyncEngine, as the Triton model does, to its final event:
    the checks, the image workers, the engine thread's loop and its step overlap, without Triton's transport."""
    import threading

    from vlora.engine.api import GenerationRequest, SamplingParams

    done, got = threading.Event(), []

    def callback(out) -> None:
        if out.finished:
            got.append(out.error)
            done.set()

    req = GenerationRequest(f"vision-apps-async-{time.monotonic_ns()}", text, images=images,
                            sampling=SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    aeng.generate(req, callback, lambda e: (got.append(str(e)), done.set()))
    if not done.wait(300):
        raise RuntimeError("no answer from the engine in 300 s")
    ms = 1e3 * (time.perf_counter() - t0)
    if got[0]:
        raise RuntimeError(f"the request failed: {got[0]}")
    return ms


def measure(preset: str, work: Path, device: str, reps: int) -> dict:
    """One model's figures (run in a child process). The engine runs behind its AsyncEngine, as in the server;
    the direct timings (prepare, step) run on its engine thread between two iterations of its loop."""
    from vlora.config import EngineConfig
    from vlora.engine.async_engine import AsyncEngine

    cuda = device.startswith("cuda")
    model_dir = model_folder(preset, work, cuda)
    t0 = time.perf_counter()
    aeng = AsyncEngine(EngineConfig().with_overrides({
        "model.path": str(model_dir), "model.device": device, "model.dtype": "bfloat16" if cuda else "float32",
        "lora.adapter_root": None, "orchestrator.policy": "unmerge-only", "atmm.tune_at_load": "never",
        "limits.max_images": 16}))
    try:
        return _measure(aeng, preset, cuda, reps, time.perf_counter() - t0)
    finally:
        aeng.shutdown()


def _measure(aeng, preset: str, cuda: bool, reps: int, build_s: float) -> dict:
    import torch

    engine = aeng.engine
    out: dict = {"preset": preset, "build_s": round(build_s, 2),
                 "warmup": engine.model_info.get("warmup"), "cuda_graphs": engine.model_info.get("cuda_graphs")}
    runner = engine.runner
    family = runner.loaded.family
    sync = sync_fn(runner.device)
    qwen = bool(family.video_placeholder)
    side = (448, 448) if qwen else (640, 480)
    if not cuda:  # the tiny models on a CPU: small images
        side = (112, 112)
    cases = [("image", family.image_placeholder + "What is in this picture?", 1)]
    if qwen:
        cases.append(("video16", family.video_placeholder + "What happens in this video?", 16))
    seed = 0
    for name, text, n in cases:
        rows = []
        for _ in range(reps + 1):
            seed += 1
            images = [jpeg(1000 * seed + j, *side) for j in range(n)]
            rows.append(aeng.call(lambda eng, images=images: one_request(eng, text, images, sync)))
        first, rest = rows[0], rows[1:]
        prepared = rest[-1][2]

        def encode_times(eng) -> list[float]:
            pv = prepared.pixel_values.to(runner.device, runner.dtype)
            times = []
            with torch.inference_mode():
                for _ in range(reps + 1):
                    sync()
                    t = time.perf_counter()
                    runner.encode(pv, prepared.image_grid_thw, None, video=prepared.video)
                    sync()
                    times.append(1e3 * (time.perf_counter() - t))
            return times

        times = aeng.call(encode_times)
        through = []
        for _ in range(reps):
            seed += 1
            through.append(async_request(aeng, text, [jpeg(1000 * seed + j, *side) for j in range(n)]))
        out[name] = {"images": n, "size": list(side), "prompt_tokens": len(prepared.prompt_ids),
                     "first_prepare_ms": round(first[0], 2), "first_step_ms": round(first[1], 2),
                     "prepare_ms_p50": round(statistics.median(r[0] for r in rest), 2),
                     "step_ms_p50": round(statistics.median(r[1] for r in rest), 2),
                     "ttft_ms_p50": round(statistics.median(r[0] + r[1] for r in rest), 2),
                     "async_ms_p50": round(statistics.median(through), 2),
                     "vision_ms_p50": round(statistics.median(times[1:]), 2), "reps": reps}
        if prepared.image_grid_thw is not None:
            out[name]["grid"] = prepared.image_grid_thw.tolist()
    return out


# -- through the server ----------------------------------------------------------------------------------------

def _marks(model_dir: Path) -> tuple[str, str]:
    """(image placeholder, video placeholder or "") of the model folder's family."""
    from vlora.models.family import family_for

    family = family_for(model_dir)
    return family.image_placeholder, family.video_placeholder


def _generate(http_url: str, prompt: str, images: list[str], params: dict) -> float:
    """Seconds to the whole answer of one ``/generate`` request; RuntimeError with the server's message."""
    import urllib.error
    import urllib.request

    body = json.dumps({"text_input": prompt, "image": images, "sampling_parameters": json.dumps(params)}).encode()
    req = urllib.request.Request(f"{http_url}/v2/models/vlora/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"/generate answered {e.code}: {e.read()[:300]!r}") from None
    return time.perf_counter() - t0


def stage_totals(metrics_url: str) -> dict[str, tuple[float, float]]:
    """stage -> (sum of seconds, count) of the engine's stage timers (``vlora_stage_seconds``), summed over
    the server's instances (:func:`vlora_load.scrape.stage_totals` of one scrape; OSError when the server does
    not answer)."""
    from vlora_load.scrape import MetricsScraper
    from vlora_load.scrape import stage_totals as totals

    samples = MetricsScraper(metrics_url).scrape_once()
    if samples is None:
        raise OSError(f"{metrics_url} did not answer")
    return totals(samples)


def roofline(model_dir: Path, rates: dict, point: dict, images: float, image_side: int, batch: int) -> dict:
    """Requests/s this workload could reach at its floor: per request, the FLOPs of its images' vision tower
    and of its prompt's prefill at the measured matmul rate, plus the bytes of its output tokens' decode
    (each token's share of the weights at ``batch`` rows a step, and its context's keys and values) at the
    measured copy rate; ``point`` gives the mean prompt and output lengths the harness saw."""
    from benchmarks.floors import ModelDims, QwenVisionDims, prefill_floor, vision_dims
    from benchmarks.engine_floor import read_config

    cfg = read_config(model_dir)
    text = cfg.get("text_config") or cfg
    dims = ModelDims.from_config(text, elt=2)
    vdims = vision_dims(cfg)
    prompt = float(point.get("mean_input_tokens") or 0)
    out = float(point.get("mean_output_tokens") or 0)
    per_image = vdims.flops_per_image(image_side) if isinstance(vdims, QwenVisionDims) else vdims.flops_per_image()
    tflops, gbs = rates["matmul_tflops"], rates["copy_gbs"]
    compute_s = (images * per_image + prefill_floor(dims, int(prompt), tflops)["flops"]) / (tflops * 1e12)
    per_token = (dims.decoder_bytes + dims.head_bytes) / batch + (prompt + out / 2) * dims.kv_bytes_per_token
    decode_s = out * per_token / (gbs * 1e9)
    floor_s = compute_s + decode_s
    return {"floor_ms_per_request": round(1e3 * floor_s, 3), "compute_ms": round(1e3 * compute_s, 3),
            "decode_ms": round(1e3 * decode_s, 3), "roofline_rps": round(1 / floor_s, 2) if floor_s > 0 else None,
            "images_per_request": images, "batch": batch}


def frames_that_fit(model_dir: Path, frames: int, reserve: int = 160) -> int:
    """The frames of a video chunk sent to a family that takes them as separate images (LLaVA-1.5): at most
    ``frames``, as many as fit the model's context with ``reserve`` tokens left for the question and the answer
    (LLaVA-1.5-7B: 576 tokens a frame in 4,096, so 6). A family that takes a video (Qwen2-VL) gets ``frames``."""
    from benchmarks.engine_floor import read_config

    cfg = read_config(model_dir)
    vc, text = cfg.get("vision_config") or {}, cfg.get("text_config") or cfg
    if "image_size" not in vc or "patch_size" not in vc:
        return frames
    per_frame = (int(vc["image_size"]) // int(vc["patch_size"])) ** 2
    context = int(text.get("max_position_embeddings") or 4096)
    return max(1, min(frames, (context - reserve) // per_frame))


def at_slo(points: list[dict], attainment: float = 0.9) -> Optional[dict]:
    """The highest rate point that every request answered and at least ``attainment`` of them within the
    workload's SLO (DistServe's goodput: the highest rate served at a 90% attainment goal); None: no point did."""
    good = [p for p in points if p.get("slo_attainment") and not (p.get("error") or p.get("rejected") or p.get("timeout"))
            and all((v or 0) >= attainment for v in p["slo_attainment"].values())]
    return max(good, key=lambda p: p["offered_rate_rps"], default=None)


def serve_apps(preset: str, work: Path, device: str, args) -> dict:
    """The server part for one model (see the module docstring)."""
    import argparse
    import base64
    import dataclasses

    from vlora_load import cli
    from vlora_load.heads import HeadPolicy
    from vlora_load.runner import Target, run_sweep, sweep_points, wait_idle
    from vlora_load.scrape import stage_means

    cuda = device.startswith("cuda")
    model_dir = model_folder(preset, work, cuda)
    image_mark, video_mark = _marks(model_dir)
    side = (448, 448) if video_mark else (640, 480)
    extra = [] if cuda else ["--length-scale", "0.05", "--image-size", "64",
                             "--serve-arg=--max-batch-size 8 --set scheduler.max_waiting=64"]
    extra += [f"--serve-arg={a}" for a in args.serve_arg]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    common = ["--model", str(model_dir), "--device", device, "--num-adapters", str(args.adapters),
              "--adapter-rank", str(args.rank), "--zipf", "1.0", "--duration", str(args.duration), *extra]
    lt = parser.parse_args(["--workload", "visual_retrieval", *common])
    new_images = {"image_pool": 1 << 20, "image_placeholder": image_mark, "video_placeholder": video_mark}
    retrieval = dataclasses.replace(cli.workload_from_args(lt), **new_images)
    frames = args.frames if video_mark else frames_that_fit(model_dir, args.frames)
    video = dataclasses.replace(cli.workload_from_args(parser.parse_args(
        ["--workload", "video", "--frames-per-chunk", str(frames), *common])), **new_images)
    out_dir = work / f"serve-{Path(preset).stem}"
    import torch

    from benchmarks.floors import measure_rates

    rates = measure_rates(torch.device(device))  # before the server holds the GPU
    t0 = time.perf_counter()
    server, root, names = cli.start_server(lt, retrieval, out_dir, sys.stdout)
    result: dict = {"preset": preset, "ready_s": round(time.perf_counter() - t0, 2), "adapters": len(names),
                    "rates": rates, "video_frames": frames}
    try:
        http = server.http_url if server.http_url.startswith("http") else f"http://{server.http_url}"
        seed = 0

        def new_image(kind: str = "noise") -> str:
            nonlocal seed
            seed += 1
            data = (jpeg(7_000_003 + seed, *side) if kind == "noise" else
                    photo_jpeg(7_000_003 + seed, *((PHOTO_SIDE, PHOTO_SIDE) if kind == "photo-square" else side)))
            return base64.b64encode(data).decode()

        prompt = f"{image_mark}What is in this picture?"
        result["first_request_ms"] = round(1e3 * _generate(http, prompt, [new_image()], {"max_tokens": 1}), 1)
        # base and adapter: the 640x480 (Qwen 448x448) noise JPEGs of the applications; photo: a photo-like JPEG of
        # that size (a third of the bytes); photo336 (LLaVA): a 336x336 one, the row (no resize needed).
        idle = [("base", None, "noise"), ("adapter", names[0], "noise"), ("photo", None, "photo")]
        if not video_mark:
            idle.append(("photo336", None, "photo-square"))
        for label, adapter, kind in idle:
            params = {"max_tokens": 1, **({"lora_name": adapter} if adapter else {})}
            _generate(http, prompt, [new_image(kind)], params)  # the adapter's first use: its load
            time.sleep(0.5)  # the model applies its metrics every 0.2 s
            before = stage_totals(server.metrics_url)
            times = [1e3 * _generate(http, prompt, [new_image(kind)], params) for _ in range(args.reps)]
            time.sleep(0.5)
            stages = stage_means(before, stage_totals(server.metrics_url))
            timed = sum(v["mean_ms"] for k, v in stages.items() if k != "vision")  # vision runs inside the step
            result[f"idle_image_ms_{label}"] = {
                "p50": round(statistics.median(times), 1), "min": round(min(times), 1), "max": round(max(times), 1),
                "reps": len(times), "stages": stages,
                # what the engine's timers do not see: Triton's HTTP and the stub's transport both ways, the
                # response thread, and the gaps between the timed stages
                "untimed_ms": round(statistics.mean(times) - timed, 1)}
        # Before the sweeps, every adapter answers one request of a video chunk of new frames: an adapter's first
        # use (a cold read and slot copy: serve_burst's cold rows measure it) and a video grid's graph (captured at
        # its second sighting) would otherwise land in the first rate point, whose backlog near the capacity
        # outlasts its 15-20 s (at 44/s on Qwen2-VL: TTFT p50 1.6-2.0 s against 0.14-0.30 s at 48/s after it).
        t_warm = time.perf_counter()
        marks = video_mark or image_mark * frames
        for adapter in names if args.rates or args.video_rates else ():
            _generate(http, f"{marks}Which action happens in this clip?", [new_image() for _ in range(frames)],
                      {"max_tokens": 1, "lora_name": adapter})
        result["warm_s"] = round(time.perf_counter() - t_warm, 2)
        target = Target(http.replace("http://", ""), server.grpc_url, server.metrics_url)
        heads = HeadPolicy.from_adapter_root(root, tuple(names))
        settings = {"benchmark": "python -m benchmarks.vision_apps", "device": device_name(), "commit": git_commit()}
        sweeps = (("visual_retrieval", retrieval, args.rates), ("video_analytics", video, args.video_rates))
        for name, workload, app_rates in ((n, w, r) for n, w, r in sweeps if r):
            wait_idle(target.metrics_url, 120, sys.stdout)
            before = stage_totals(target.metrics_url)
            points = run_sweep(workload, sweep_points(app_rates, []), target, out_dir / name, names, heads,
                               out=sys.stdout, settings=settings, title=f"vision-apps {name} ({Path(preset).stem})")
            time.sleep(0.5)  # the model applies its metrics every 0.2 s
            result[name] = [_point(p) for p in points]
            result[f"{name}_stages"] = stage_means(before, stage_totals(target.metrics_url))
            # images per request: one (retrieval; a detection chunk's newest frame), or a chunk's frames (action)
            images = 1.0 if name == "visual_retrieval" else 0.5 * (1 + frames)
            batch = 32  # scheduler.max_batch_size's default
            for p, row in zip(points, result[name]):
                roof = roofline(model_dir, rates, p, images, workload.image_size, batch)
                row["roofline"] = roof
                # the arrivals the open-loop schedule drew (Poisson: near the offered rate), which a point that
                # keeps up answers; throughput_rps divides by the window to the last answer, whose tail of long
                # answers a short point counts in full
                row["arrival_rps"] = round(row["requests"] / args.duration, 3)
                if roof["roofline_rps"]:
                    row["fraction_of_roofline"] = round(row["throughput_rps"] / roof["roofline_rps"], 3)
                    row["arrivals_fraction_of_roofline"] = round(row["arrival_rps"] / roof["roofline_rps"], 3)
            # printed now as well: a run cut short later (a device call's time limit) still shows this sweep
            print(f"vision-apps: {app_line(result, name)}", flush=True)
    finally:
        server.stop()
    return result


def _point(s: dict) -> dict:
    """One rate point's figures from the harness's summary."""
    keep = ("offered_rate_rps", "requests", "ok", "rejected", "error", "timeout", "throughput_rps",
            "output_tokens_per_s", "avg_token_latency_s", "error_messages", "server_caches", "server_stages")
    out = {k: s.get(k) for k in keep}
    for k in ("ttft", "e2e"):
        out[f"{k}_s"] = {q: s.get(f"{k}_{q}_s") for q in ("p50", "p99")}
    apps = s.get("applications") or {}
    out["slo_attainment"] = {a: v.get("slo_attainment") for a, v in apps.items()} if isinstance(apps, dict) else None
    return out


def summary(result: dict) -> str:
    parts = []
    for m in result["models"]:
        name = Path(m["preset"]).stem
        for case in ("image", "video16"):
            if case in m:
                c = m[case]
                parts.append(f"{name} {case}: TTFT p50 {c['ttft_ms_p50']:.1f} ms (prepare {c['prepare_ms_p50']:.1f} + step "
                             f"{c['step_ms_p50']:.1f}; vision {c['vision_ms_p50']:.1f}; through the AsyncEngine "
                             f"{c.get('async_ms_p50', float('nan')):.1f}), first after build "
                             f"{c['first_prepare_ms'] + c['first_step_ms']:.0f} ms")
        if m.get("warmup"):
            parts.append(f"{name} warm-up {m['warmup']['seconds']:.2f} s")
    for m in result.get("served", []):
        name = Path(m["preset"]).stem
        base = m['idle_image_ms_base']
        stages = " + ".join(f"{k} {v['mean_ms']:.1f}" for k, v in base.get("stages", {}).items())
        photo = "".join(f", {label} {m[key]['p50']:.1f} ms" for key, label in
                        (("idle_image_ms_photo", "a photo-like JPEG"), ("idle_image_ms_photo336", "a 336x336 one"))
                        if key in m)
        parts.append(f"{name} through the server: ready in {m['ready_s']:.0f} s, first request {m['first_request_ms']:.0f} ms, "
                     f"idle new image {base['p50']:.1f} ms ({m['idle_image_ms_adapter']['p50']:.1f} "
                     f"with an adapter{photo}; engine timers {stages}, untimed {base.get('untimed_ms', float('nan')):.1f})")
        for app in (a for a in ("visual_retrieval", "video_analytics") if m.get(a) is not None):
            parts.append(app_line(m, app))
    return "; ".join(parts) + " (new images)"


def app_line(m: dict, app: str) -> str:
    """One application's rate points on one served model, and its rate at the SLO against its roofline."""
    pts = ", ".join(f"{p['offered_rate_rps']:g}/s -> answered {p['throughput_rps']:.2f}/s, TTFT p50 "
                    f"{1e3 * (p['ttft_s'].get('p50') or float('nan')):.0f} ms, SLO met "
                    f"{_attained(p)}{_steps(p)}{_cache_hits(p)}" for p in m.get(app, []))
    good = at_slo(m.get(app, []))
    if good is not None and good.get("roofline", {}).get("roofline_rps"):
        pts += (f"; at its SLO (90% met, none failed) {good['arrival_rps']:.2f} req/s arriving = "
                f"{good.get('arrivals_fraction_of_roofline', 0):.2f} of its roofline "
                f"{good['roofline']['roofline_rps']:.1f} req/s")
    elif m.get(app):
        pts += "; no rate point met its SLO"
    frames = f" ({m['video_frames']} frames a chunk)" if app == "video_analytics" and "video_frames" in m else ""
    return f"{Path(m['preset']).stem} {app}{frames}: {pts}"


def _steps(p: dict) -> str:
    """A point's mean queue wait and step times from the engine's timers over that point."""
    st = p.get("server_stages") or {}
    parts = [f"{label} {st[k]['mean_ms']:.0f}" for k, label in (("queue", "queue"), ("prefill_step", "prefill step"),
                                                               ("decode_step", "decode step")) if k in st]
    return f" ({', '.join(parts)} ms)" if parts else ""


def _cache_hits(p: dict) -> str:
    """What a point's answers took from the server's caches (its images are new: both should be near 0)."""
    c = p.get("server_caches") or {}
    parts = [f"{label} {c[k]:.0%}" for k, label in (("encoder_hit_rate", "images"), ("prefix_reused_share", "prompt tokens"))
             if c.get(k) is not None]
    return f" (from the caches: {', '.join(parts)})" if parts else ""


def _attained(p: dict) -> str:
    vals = [v for v in (p.get("slo_attainment") or {}).values() if v is not None]
    return f"{min(vals):.0%}" if vals else "-"


def main() -> None:
    p = model_parser(__doc__, f"comma-separated model presets (default {PRESETS})",
                     "where the random model folders are written", tiny_help=f"the tiny models ({TINY}) instead")
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--part", choices=("engine", "server", "both"), default="both")
    p.add_argument("--adapters", type=int, default=8, help="server part: random adapters (Zipf(1) popularity)")
    p.add_argument("--rank", type=int, default=64, help="server part: their rank")
    p.add_argument("--rates", default="1,2,4,8", help="server part: offered requests/s of the applications (empty: "
                   "the retrieval is not run; with no --video-rates, the idle figures only)")
    p.add_argument("--video-rates", help="server part: the video application's rates (default: --rates; its short "
                   "answers take higher ones; empty: the video application is not run)")
    p.add_argument("--duration", type=float, default=20.0, help="server part: seconds per rate point")
    p.add_argument("--frames", type=int, default=8, help="server part: frames per video chunk")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARGS",
                   help="server part: more `vlora serve` arguments, e.g. --serve-arg='--set engine.profile_dir=/tmp/prof'")
    p.add_argument("--no-record", action="store_true", help="no line in RESULTS.md, no copy in benchmarks/results")
    p.add_argument("--child", help=argparse_hidden())
    p.add_argument("--result-file", help=argparse_hidden())
    args = p.parse_args()
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    args.rates, args.video_rates = parse_rates(args.rates, args.video_rates)
    if args.child:
        part, _, preset = args.child.partition(":")
        work = Path(args.work)
        got = measure(preset, work, device, args.reps) if part == "engine" else serve_apps(preset, work, device, args)
        Path(args.result_file).write_text(json.dumps(got))
        return
    presets = [x for x in (args.presets or (TINY if args.tiny else PRESETS)).split(",") if x]
    parts = ("engine", "server") if args.part == "both" else (args.part,)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    result_file = Path(args.work) / f"vision-apps-child-{os.getpid()}.json"
    found: dict[str, list] = {"engine": [], "server": []}
    for part in parts:
        for preset in presets:
            cmd = [sys.executable, "-m", "benchmarks.vision_apps", "--child", f"{part}:{preset}", "--device", device,
                   "--work", args.work, "--reps", str(args.reps), "--adapters", str(args.adapters), "--rank",
                   str(args.rank), "--rates", ",".join(f"{r:g}" for r in args.rates),
                   "--video-rates", ",".join(f"{r:g}" for r in args.video_rates), "--duration", str(args.duration),
                   "--frames", str(args.frames), "--result-file", str(result_file),
                   *(f"--serve-arg={a}" for a in args.serve_arg)]
            result_file.unlink(missing_ok=True)
            proc = subprocess.run(cmd)
            if proc.returncode or not result_file.is_file():
                raise SystemExit(f"{part} {preset}: the measurement failed (exit {proc.returncode}); its log is above")
            found[part].append(json.loads(result_file.read_text()))
            print(json.dumps(found[part][-1], indent=1), flush=True)
    result = {"device": device_name() if device.startswith("cuda") else "cpu", "commit": git_commit(),
              "models": found["engine"], "served": found["server"]}
    write_result("vision-apps", args.out, result, summary(result), record=not args.no_record and device != "cpu")


def parse_rates(rates: str, video_rates: str | None) -> tuple[list[float], list[float]]:
    """(retrieval rates, video rates) of ``--rates`` and ``--video-rates``: the video's default to the retrieval's;
    an empty string is no rate point, so that application is not run (and with neither, only the idle figures)."""
    retrieval = [float(x) for x in str(rates).split(",") if x.strip()]
    return retrieval, (list(retrieval) if video_rates is None else [float(x) for x in video_rates.split(",") if x.strip()])


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
