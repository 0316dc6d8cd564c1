"""Where a new image's host time goes before the vision tower: the engine's own functions, stage by stage, for
new JPEGs of one size (LLaVA-1.5's CLIP layout: shortest edge 336, 336 x 336 crop; Qwen2-VL's patches at
its default pixel bounds), on the device the engine would use.

    python -m benchmarks.image_prep [--size 640x480] [--reps 20] [--device cuda]

Stages (ms, median over ``--reps`` new images): base64 decode, probe (header checks), JPEG decode to RGB,
the pixels to the device, resize, crop and normalise (LLaVA), Qwen's resize + patches, and the whole of
``InputProcessor``'s image part as the engine runs it. Prints JSON; writes nothing.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time

import numpy as np
import torch

from benchmarks.common import device_name

CLIP = (336, (336, 336), 1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
QWEN = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280, "patch": 14, "merge": 2, "temporal": 2,
        "rescale": 1 / 255, "mean": CLIP[3], "std": CLIP[4]}


def jpeg(seed: int, w: int, h: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)  # photo-like: smooth blocks
    arr = np.kron(base, np.ones((8, 8, 1), dtype=np.uint8))[:h, :w] + rng.integers(0, 8, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def main() -> None:
    from vlora.config import InputLimits
    from vlora.models import images as imgs
    from vlora.models import pixels

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="640x480")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    w, h = map(int, args.size.split("x"))
    dev = torch.device(args.device)
    limits = InputLimits()
    stages: dict[str, list[float]] = {}

    def timed(name, fn):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        stages.setdefault(name, []).append(1e3 * (time.perf_counter() - t0))
        return out

    for rep in range(args.reps + 2):  # the first two warm the caches up and are dropped
        b64 = base64.b64encode(jpeg(1000 + rep, w, h)).decode()
        raw = timed("base64", lambda: imgs.image_bytes_from_input(b64, limits, 0))
        probed = timed("probe", lambda: imgs.probe_image(raw, limits, 0))
        image = timed("jpeg_decode", lambda: imgs.decode_probed(probed, 0))
        x = timed("to_device", lambda: pixels.to_device(image, dev))
        edge, (ch, cw), rescale, mean, std = CLIP
        rh, rw = pixels.shortest_edge_size(x.shape[0], x.shape[1], edge)
        r = timed("resize", lambda: pixels.resize(x, rh, rw))
        timed("crop_normalize", lambda: pixels.normalized(pixels.center_crop(r, ch, cw)[None], rescale, mean, std))
        timed("llava_pixels_whole", lambda: pixels.clip_pixel_values([image], CLIP, dev))
        with pixels.DeviceWork(dev) as work:
            timed("llava_pixels_side_stream", lambda: work.done(pixels.clip_pixel_values([image], CLIP, work.device)))
        timed("qwen_patches_whole", lambda: pixels.qwen_image_patches([image], QWEN, dev))
        if rep < 2:
            stages.clear()
    out = {"device": device_name() if dev.type == "cuda" else "cpu", "size": [w, h], "reps": args.reps,
           "jpeg_bytes": len(base64.b64decode(b64)),
           "median_ms": {k: round(statistics.median(v), 3) for k, v in stages.items()},
           "max_ms": {k: round(max(v), 3) for k, v in stages.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
