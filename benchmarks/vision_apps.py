"""V-LoRA's applications as a user of a vision application waits for them: the first token of a **new** image.

This is the first part of issue 35's benchmark; the part through the real server (visual retrieval and video
analytics under open-loop Poisson arrivals, adapters drawn from a Zipf distribution) is still to come, and
``--help`` says so. What it times now, in this process, per model (``--presets``; each in a child process of
its own so that one model's memory is gone before the next):

- ``image``: one request with one new image (every repetition its own pixels: no encoder-cache or prefix
  hit; JPEG, 640x480 for LLaVA, 448x448 for Qwen2-VL), one output token: ms of ``inputs.prepare`` (decode,
  preprocessing, tokens, M-RoPE positions) and of the engine step (vision tower, prefill, the token), p50;
- ``video16`` (families that take a video): 16 new 448x448 frames, the same;
- ``first``: the first such request after the engine is built (what the warm start is for);
- ``vision_ms``: the vision tower and projector/merger alone on the last request's pixels (the engine's own
  encode: the graphed tower where one is captured).
The floors of the same requests (vision + prefill FLOPs over the measured matmul rate) are
``benchmarks/engine_floor.py``'s media rows.

Usage (a GPU machine): ``python -m benchmarks.vision_apps`` (both 7B presets); ``--tiny`` on a CPU.
"""
from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import PRESETS, TINY, device_name, git_commit, model_folder, model_parser, sync_fn, write_result

REPS = 6


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


def measure(preset: str, work: Path, device: str, reps: int) -> dict:
    """One model's figures (run in a child process)."""
    import torch

    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    cuda = device.startswith("cuda")
    model_dir = model_folder(preset, work, cuda)
    t0 = time.perf_counter()
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(model_dir), "model.device": device, "model.dtype": "bfloat16" if cuda else "float32",
        "lora.adapter_root": None, "orchestrator.policy": "unmerge-only", "atmm.tune_at_load": "never",
        "limits.max_images": 16}))
    out: dict = {"preset": preset, "build_s": round(time.perf_counter() - t0, 2),
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
            rows.append(one_request(engine, text, [jpeg(1000 * seed + j, *side) for j in range(n)], sync))
        first, rest = rows[0], rows[1:]
        prepared = rest[-1][2]
        pv = prepared.pixel_values.to(runner.device, runner.dtype)
        times = []
        with torch.inference_mode():
            for _ in range(reps + 1):
                sync()
                t = time.perf_counter()
                runner.encode(pv, prepared.image_grid_thw, None, video=prepared.video)
                sync()
                times.append(1e3 * (time.perf_counter() - t))
        out[name] = {"images": n, "size": list(side), "prompt_tokens": len(prepared.prompt_ids),
                     "first_prepare_ms": round(first[0], 2), "first_step_ms": round(first[1], 2),
                     "prepare_ms_p50": round(statistics.median(r[0] for r in rest), 2),
                     "step_ms_p50": round(statistics.median(r[1] for r in rest), 2),
                     "ttft_ms_p50": round(statistics.median(r[0] + r[1] for r in rest), 2),
                     "vision_ms_p50": round(statistics.median(times[1:]), 2), "reps": reps}
        if prepared.image_grid_thw is not None:
            out[name]["grid"] = prepared.image_grid_thw.tolist()
    return out


def summary(result: dict) -> str:
    parts = []
    for m in result["models"]:
        name = Path(m["preset"]).stem
        for case in ("image", "video16"):
            if case in m:
                c = m[case]
                parts.append(f"{name} {case}: TTFT p50 {c['ttft_ms_p50']:.1f} ms (prepare {c['prepare_ms_p50']:.1f} + step "
                             f"{c['step_ms_p50']:.1f}; vision {c['vision_ms_p50']:.1f}), first after build "
                             f"{c['first_prepare_ms'] + c['first_step_ms']:.0f} ms")
        if m.get("warmup"):
            parts.append(f"{name} warm-up {m['warmup']['seconds']:.2f} s")
    return "; ".join(parts) + " (in process, new images; the server part of the benchmark is still to come)"


def main() -> None:
    p = model_parser(__doc__, f"comma-separated model presets (default {PRESETS})",
                     "where the random model folders are written", tiny_help=f"the tiny models ({TINY}) instead")
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--no-record", action="store_true", help="no line in RESULTS.md, no copy in benchmarks/results")
    p.add_argument("--child", help=argparse_hidden())
    args = p.parse_args()
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, Path(args.work), device, args.reps)), flush=True)
        return
    presets = [x for x in (args.presets or (TINY if args.tiny else PRESETS)).split(",") if x]
    models = []
    for preset in presets:
        cmd = [sys.executable, "-m", "benchmarks.vision_apps", "--child", preset, "--device", device,
               "--work", args.work, "--reps", str(args.reps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{preset}: the measurement failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        models.append(json.loads(line[len("RESULT "):]))
        print(json.dumps(models[-1], indent=1), flush=True)
    result = {"device": device_name() if device.startswith("cuda") else "cpu", "commit": git_commit(), "models": models}
    write_result("vision-apps", args.out, result, summary(result), record=not args.no_record and device != "cpu")


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
