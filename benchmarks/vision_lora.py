"""The cost of a vision-side adapter over a language-only one, per image.

A language-only adapter (or none) encodes its images with the plain vision tower and projector; a
vision-side adapter adds LoRA on every projection of the tower's blocks and of the projector (or merger).
This times the real engine's encoder, ``ModelRunner.encode``, on a batch of N images (random pixels through
the family's own processor) in three variants:

- ``plain``: the plain encoder (what every language-only request gets);
- ``one``: every image through one vision-side adapter (one LoRA segment);
- ``mixed``: the images spread over ``--adapters`` vision-side adapters, in one forward (one segment each).

Each time is the median of 5 rounds in which the variants take turns (``--reps`` forwards each, between
device synchronisations). Per image: (variant ms - plain ms) / N. The check: the ``mixed`` forward's
features against each image encoded alone through the PyTorch reference LoRA backend (largest difference
over the largest value).

Models: a preset's vision tower and projector at real width with random weights (bf16; the decoder cut to
2 layers, which nothing here runs), written under ``--work`` on first use; on a CPU, the tiny models.

    python -m benchmarks.vision_lora --out $OUT                  # LLaVA-1.5-7B and Qwen2-VL-7B widths (CUDA)
    python -m benchmarks.vision_lora --device cpu --no-record     # the tiny models on a CPU (a smoke run)

Writes ``<out>/vision-lora-<device>.json`` and, unless ``--no-record``, results/vision-lora-<device>.json and
one line in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import (PRESETS, TINY, build_model_engine, device_name, git_commit, model_folder,
                               model_parser, sync_fn, write_result)

NAME = "vision-lora"
IMAGE_PX = 448  # square test images: LLaVA resizes them to its 336; Qwen2-VL keeps 448 (256 tokens each)
DELTA = 0.2  # typical size of one LoRA delta entry for a unit-RMS input


def build(model_dir: Path, device, rank: int, slots: int):
    return build_model_engine(model_dir, device, {
        "lora.max_rank": str(rank), "lora.max_gpu_adapters": str(slots), "lora.max_cpu_adapters": str(slots),
        "cache.num_blocks": "64", "cache.encoder_cache_mb": "0"})


def register_vision_adapters(engine, count: int, rank: int, seed: int) -> list[int]:
    """``count`` random rank-``rank`` adapters on every vision-side projection, registered in memory and
    pinned in their slots; returns the slots."""
    import torch

    from vlora.lora.adapter import AdapterWeights, LoraPair

    runner = engine.runner
    dims = runner.module_dims()
    gen = torch.Generator().manual_seed(seed)
    slots = []
    for i in range(count):
        pairs = {}
        for layer, target in runner.vision_lora.layers:
            d_in, d_out = dims[target]
            a = torch.randn(rank, d_in, generator=gen) / math.sqrt(d_in)
            b = torch.randn(d_out, rank, generator=gen) * (DELTA / math.sqrt(rank))
            pairs[(layer, target)] = LoraPair(a=a, b=b, scale=1.0)
        targets = tuple(sorted({t for _, t in pairs}))
        name = f"vision-{i}"
        engine.loras.register(name, AdapterWeights(name=name, dir=Path("<in-memory>"), pairs=pairs,
                                                   ranks={t: rank for t in targets}, max_rank=rank, version=str(seed + i),
                                                   target_modules=targets, vision_targets=targets))
        slots.append(engine.loras.acquire(name))
    return slots


def images(engine, n: int, px: int, seed: int):
    """(per-image pixel inputs, per-image grids or None) of ``n`` random images, as the family's processor makes them."""
    import numpy as np
    from PIL import Image

    from vlora.engine.api import GenerationRequest

    family = engine.runner.loaded.family
    rng = np.random.default_rng(seed)
    per_item, grids = [], []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (px, px, 3), dtype=np.uint8)).save(buf, format="PNG")
        p = engine.inputs.prepare(GenerationRequest(f"img{i}", "Describe it.", images=[buf.getvalue()]))
        per_item += family.patches(p.pixel_values, p.image_grid_thw)
        grids += [] if p.image_grid_thw is None else list(p.image_grid_thw)
    return per_item, grids or None


def timed(fns: dict[str, Any], sync, reps: int, rounds: int = 5, warmup: int = 3) -> dict[str, float]:
    """ms of each of ``fns``: the median over ``rounds`` of the mean of ``reps`` runs between device
    synchronisations, the functions taking turns in every round (so drifting clocks or host load touch
    them alike), after ``warmup`` runs of each."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            samples[name].append(1e3 * (time.perf_counter() - t0) / reps)
    return {name: statistics.median(v) for name, v in samples.items()}


def measure(engine, n_images: int, slots: list[int], reps: int, px: int = IMAGE_PX) -> dict[str, Any]:
    """The three variants on ``n_images`` images (``slots``: the vision-side adapters' slots), and the check."""
    import torch

    from vlora.lora.backends import get_lora_backend

    runner = engine.runner
    family = runner.loaded.family
    per_item, grids = images(engine, n_images, px, seed=n_images)
    per_item = [x.to(runner.device, runner.dtype) for x in per_item]  # on the device already, as engine_floor's vision point
    pv = family.join(per_item)
    grid = torch.stack(grids) if grids is not None else None
    sync = sync_fn(runner.device)
    one = [slots[0]] * n_images
    mixed = sorted(slots[i * len(slots) // n_images] for i in range(n_images))  # contiguous runs: one segment each
    out: dict[str, Any] = {"images": n_images, "adapters": len(slots), "rows": family.vision_lora_rows(runner.loaded, pv, grid)}
    with torch.inference_mode():
        variants = {"plain": None, "one": one, "mixed": mixed}
        ms = timed({v: (lambda slots=slots: runner.encode(pv, grid, slots)) for v, slots in variants.items()}, sync, reps)
        out.update({f"{v}_ms": t for v, t in ms.items()})
        batched = runner.encode(pv, grid, mixed)
        keep = runner.lora_ctx.backend
        runner.lora_ctx.backend = get_lora_backend("reference")
        try:
            alone = [runner.encode(family.join([x]), None if grid is None else grid[i:i + 1], [mixed[i]])[0]
                     for i, x in enumerate(per_item)]
        finally:
            runner.lora_ctx.backend = keep
    out["mixed_vs_alone_rel"] = max(float((b - a).abs().max() / a.abs().max()) for b, a in zip(batched, alone))
    for variant in ("one", "mixed"):
        out[f"{variant}_extra_ms_per_image"] = (out[f"{variant}_ms"] - out["plain_ms"]) / n_images
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = model_parser(__doc__, f"comma-separated model presets (default {PRESETS} on CUDA, {TINY} on a CPU)",
                     "where the random model folders are written")
    p.add_argument("--images", default="1,8,32", help="images per forward")
    p.add_argument("--adapters", type=int, default=4, help="vision-side adapters in the mixed forward")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=4, help="runs per variant in each of 5 rounds")
    p.add_argument("--no-record", action="store_true", help="no line in RESULTS.md, no copy in benchmarks/results")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    from vlora.atmm.dispatch import default_kernels
    from vlora.engine.builder import resolve_device

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    kernels = default_kernels()
    result: dict[str, Any] = {
        "benchmark": NAME, "device": device_name(), "commit": git_commit(), "dtype": "bfloat16" if cuda else "float32",
        "atmm_extension": kernels.available if cuda else False,
        "settings": {"images": args.images, "adapters": args.adapters, "rank": args.rank, "reps": args.reps,
                     "image_px": IMAGE_PX},
        "models": []}
    for preset in (args.presets or (PRESETS if cuda else TINY)).split(","):
        model_dir = model_folder(preset, Path(args.work), cuda, suffix="-vision", overrides={"text": {"num_hidden_layers": 2}})
        engine = build(model_dir, device, args.rank, args.adapters + 1)
        slots = register_vision_adapters(engine, args.adapters, args.rank, seed=7)
        config = json.loads((model_dir / "config.json").read_text())
        entry = {"preset": preset, "model_type": config.get("model_type"), "points": []}
        for n in (int(x) for x in args.images.split(",") if x):
            point = measure(engine, n, slots, args.reps)
            entry["points"].append(point)
            print(f"{preset}: {n} image(s): plain {point['plain_ms']:.2f} ms, one adapter +{point['one_extra_ms_per_image']:.3f} "
                  f"ms/image, {len(slots)} adapters +{point['mixed_extra_ms_per_image']:.3f} ms/image "
                  f"(mixed vs alone {point['mixed_vs_alone_rel']:.1e})", flush=True)
        result["models"].append(entry)
        del engine
        if cuda:
            torch.cuda.empty_cache()
    write_result(NAME, args.out, result, summary_line(result), record=not args.no_record)
    return 0


def summary_line(result: dict[str, Any]) -> str:
    """The RESULTS.md figures: per image at each model's largest batch."""
    return f"rank {result['settings']['rank']}, per image at the largest batch: " + "; ".join(
        f"{m['model_type']} x{p['images']}: plain {p['plain_ms'] / p['images']:.2f} ms/image, "
        f"+{p['one_extra_ms_per_image']:.2f} (1 adapter), +{p['mixed_extra_ms_per_image']:.2f} ({p['adapters']} adapters)"
        for m in result["models"] for p in m["points"][-1:])


if __name__ == "__main__":
    sys.exit(main())
