"""The engine against its floors, in one run: decode, prefill and vision-tower times of the real engine
(LLaVA-1.5-7B dimensions, random weights, bf16), each next to the time the hardware needs at least and
next to a plain PyTorch decode step captured in a CUDA graph (benchmarks/plain_decode.py).

    python -m benchmarks.engine_floor --out $OUT --deadline-s 420    # the full grid
    python -m benchmarks.engine_floor --quick                          # batch 1 and 32, context 700, prefill 600
    python -m benchmarks.engine_floor --quick --profile                # plus torch.profiler over 5 decode steps
    python -m benchmarks.engine_floor --device cpu --quick --no-record # the tiny model on a CPU (a smoke run)
    python -m benchmarks.engine_floor --preset configs/models/qwen2-vl-7b.yaml --quick --deadline-s 200  # Qwen2-VL-7B
    python -m benchmarks.engine_floor --batches 1,8 --contexts 700 --gemv-max-rows 0 --variants base,gemv --skip-plain  # cuBLAS vs gemv

The 7B model folder is written under ``--work`` on first use (random weights, the folder
engine_decode.py uses). Points whose KV cache cannot fit are skipped and say so: on an 80 GB card, batch
64 at 2,000 tokens of context (64 GiB of KV) fits neither the engine nor the plain decoder.

What is measured (every point in this one process, on this one device):
- decode: ms per ``LLMEngine.step()`` of a running batch of B requests already prefilled to the context
  (prompts of that many random tokens, prefilled by the engine; EOS ignored), the mean of ``--steps``
  steps after ``--warmup``, between device synchronisations. Three workloads: ``base`` (no adapter),
  ``lora`` (one distinct rank-``--rank`` adapter per request over q/k/v/o, unmerged, in device slots) and
  ``merged`` (every request on one adapter, merged into the weights by the merge-only policy); ``gemv``:
  ``base`` with ``engine.gemv_max_rows`` at ``--gemv-rows`` (the decode-row projection kernels of
  vlora.engine.gemv; the decode graphs are captured again for it, then again as they were), so that one
  run times both on one machine. ``--gemv-max-rows`` sets it for the whole engine instead.
- plain: the same decode shape in plain PyTorch, one CUDA graph per step, on the same weights (the same
  model folder, loaded once more and freed before the engine is built: the two with their KV caches do
  not fit in device memory at once). It is checked first against a transformers forward.
- prefill: ms of the step that prefills one prompt of T tokens (the request asks for one output token).
- vision: ms of ``runner.encode_images`` on 1 and 8 preprocessed images (random pixels; Qwen: 448x448
  images through the processor, so 1,024 patches and 256 visual tokens each).
- media (Qwen2-VL family; ``--media``, default one 448x448 image and a 16-frame 448x448 video): one request
  of random-noise PNGs and a short text, asking for one token, prefilled alone in one step: ms of
  ``inputs.prepare`` (PNG decode, the processor, M-RoPE positions), of the step (vision tower + merger,
  the prompt's prefill, sampling; every repetition has new pixels, so the encoder cache never hits), and
  TTFT (the two together); then the vision tower alone on the same pixels.

Floors (rates measured in this run: a device-to-device copy, bytes read + written; an 8192^3 bf16 matmul):
- decode = bytes / copy rate; bytes = decoder weights (every layer's projections and norms) + final norm
  + LM head + the KV cache read for B sequences of that context + B new tokens' KV written (+ for
  ``lora``: the distinct adapters' A and B of every targeted projection). Embedding rows are left out.
- prefill = FLOPs / matmul rate; FLOPs = 2 * decoder projection parameters * T + causal attention
  2 * 2 * layers * heads * head_dim * T^2 / 2 + the LM head for the last token only (2 * vocab * hidden).
- vision = FLOPs / matmul rate: patch embedding, the encoder layers the feature layer needs (the
  last one is skipped by ``vision_feature_layer = -2``), attention over all patch tokens, the projector.
  Qwen2-VL / Qwen2.5-VL (:class:`QwenVisionDims`): the Conv3d patch embedding, every ViT block's
  projections and MLP, attention within each frame (Qwen2.5-VL: within 112 px windows but in its
  full-attention blocks), the 2x2 patch merger.
- media = vision floor of its pixels + prefill floor of its prompt tokens (TTFT floor; preprocessing
  on the host has no floor).

Targets (the project issue), each printed PASS/FAIL: base decode <= 1.3x floor at every batch and context,
and faster than the plain graphed step (the faster of its two attention variants); unmerged LoRA <= 1.2x
base at batch 1 and <= 1.3x at batch 32 (32 distinct adapters); merged within 3% of base; prefill <= 1.4x
its floor.

Writes ``<out>/engine-floor-<device>.json`` (with ``<out>/engine-floor-<device>.results-line.md`` where
``--out`` is not benchmarks/results) and, unless ``--no-record``, results/engine-floor-<device>.json and
one line in benchmarks/RESULTS.md. A Qwen2-VL model is named ``engine-floor-qwen`` (Qwen2.5-VL:
``engine-floor-qwen2.5``) instead, so that its results sit beside LLaVA's. A point that fails is recorded with its error and the run goes on.
Exits 1 when the plain step fails or does not match transformers, or the engine part stops early;
exits 3 on a slow host (``--slow-host-x``: the first plain point far above its floor; nothing is recorded);
targets missed do not change the exit status.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import math
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.common import ROOT, RESULTS, device_name, git_commit, record_result

NAME = "engine-floor"
GIB = 2 ** 30
TARGETS = {"base_x_floor": 1.3, "lora_x_base_bs1": 1.2, "lora_x_base_bs32": 1.3, "merged_x_base": 1.03, "prefill_x_floor": 1.4}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
FULL = dict(batches="1,8,32,64", contexts="700,2000", prefill="600,2300,8000", images="1,8")
QUICK = dict(batches="1,32", contexts="700", prefill="600", images="1,8")
QWEN_MEDIA = "image:448,video:16x448"  # --media auto on a Qwen2-VL-family model (none on LLaVA)
CUDA_RESERVE = 8 * GIB  # activations, graphs and a first KV pool, beside the weights and the adapter slots
PLAIN_MARGIN = 3 * GIB  # free memory the plain decoder leaves beside its cache (graph pool, activations)


# -- model dimensions and floors ------------------------------------------------------------------

@dataclass(frozen=True)
class ModelDims:
    """The decoder's sizes, from the checkpoint's config.json, and the bytes and FLOPs they imply."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    elt: int  # bytes per weight/cache element

    @classmethod
    def from_config(cls, text: dict, elt: int) -> "ModelDims":
        heads = text["num_attention_heads"]
        return cls(layers=text["num_hidden_layers"], hidden=text["hidden_size"], heads=heads,
                   kv_heads=text.get("num_key_value_heads") or heads,
                   head_dim=text.get("head_dim") or text["hidden_size"] // heads,
                   inter=text["intermediate_size"], vocab=text["vocab_size"], elt=elt)

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each projection."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.inter), "up_proj": (self.hidden, self.inter),
                "down_proj": (self.inter, self.hidden)}

    @property
    def linear_params(self) -> int:
        """Parameters of every layer's projections (what a token's matmuls read)."""
        return self.layers * sum(i * o for i, o in self.module_dims().values())

    @property
    def decoder_bytes(self) -> int:
        return (self.linear_params + 2 * self.layers * self.hidden) * self.elt

    @property
    def head_bytes(self) -> int:
        """LM head and the final norm."""
        return (self.vocab + 1) * self.hidden * self.elt

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.elt

    def adapter_bytes(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        dims = self.module_dims()
        return self.layers * sum(rank * (dims[m][0] + dims[m][1]) for m in targets) * self.elt


@dataclass(frozen=True)
class VisionDims:
    layers: int  # encoder layers that the feature layer needs
    hidden: int
    inter: int
    image_size: int
    patch: int
    class_token: bool
    feature_layers: int  # hidden states concatenated into the projector
    text_hidden: int

    @classmethod
    def from_config(cls, cfg: dict) -> "VisionDims":
        v = cfg["vision_config"]
        fl = cfg.get("vision_feature_layer", -2)
        fls = fl if isinstance(fl, list) else [fl]
        n = v["num_hidden_layers"]
        needed = max((n + 1 + x) if x < 0 else x for x in fls)  # hidden_states[k]: the output of k layers
        return cls(layers=needed, hidden=v["hidden_size"], inter=v["intermediate_size"], image_size=v["image_size"],
                   patch=v["patch_size"], class_token=v.get("model_type", "clip_vision_model") == "clip_vision_model",
                   feature_layers=len(fls), text_hidden=cfg["text_config"]["hidden_size"])

    def flops_per_image(self) -> int:
        patches = (self.image_size // self.patch) ** 2
        t = patches + (1 if self.class_token else 0)
        per_layer = 4 * self.hidden ** 2 + 2 * self.hidden * self.inter
        enc = 2 * t * per_layer * self.layers + self.layers * 2 * 2 * self.hidden * t * t
        embed = 2 * patches * 3 * self.patch ** 2 * self.hidden
        proj = 2 * patches * (self.hidden * self.feature_layers * self.text_hidden + self.text_hidden ** 2)
        return enc + embed + proj


QWEN_TYPES = {"qwen2_vl": "qwen", "qwen2_5_vl": "qwen2.5"}  # model_type -> the results' name suffix
QWEN_IMAGE_SIDE = 448  # px: a multiple of 28 within the processors' bounds, so 32 x 32 patches, 256 tokens


@dataclass(frozen=True)
class QwenVisionDims:
    """Qwen2-VL / Qwen2.5-VL's vision tower: a Conv3d patch embedding over temporal_patch x patch x patch
    pixels, ``depth`` ViT blocks, and the patch merger (merge x merge patches -> one text-width token
    through two linear layers). Attention runs within each frame (temporal slice of the grid); Qwen2.5-VL's
    blocks other than ``full_blocks`` attend within windows of ``window`` x ``window`` merged tokens."""

    model_type: str
    depth: int
    hidden: int
    mlp_params: int  # per token: Qwen2-VL fc1 + fc2 (2 x d x mlp_ratio d), Qwen2.5-VL gate/up/down (3 x d x I)
    patch: int
    temporal_patch: int
    merge: int
    in_channels: int
    text_hidden: int
    window: int  # merged tokens per window side (0: no windowed attention)
    full_blocks: int  # blocks with attention over the whole frame

    @classmethod
    def from_config(cls, cfg: dict) -> "QwenVisionDims":
        v = cfg["vision_config"]
        if cfg["model_type"] == "qwen2_5_vl":
            d = v["hidden_size"]
            return cls(model_type="qwen2_5_vl", depth=v["depth"], hidden=d, mlp_params=3 * d * v["intermediate_size"],
                       patch=v["patch_size"], temporal_patch=v["temporal_patch_size"], merge=v["spatial_merge_size"],
                       in_channels=v.get("in_channels", 3), text_hidden=v["out_hidden_size"],
                       window=v["window_size"] // v["spatial_merge_size"] // v["patch_size"],
                       full_blocks=len(v.get("fullatt_block_indexes") or ()))
        d = v["embed_dim"]
        return cls(model_type="qwen2_vl", depth=v["depth"], hidden=d, mlp_params=2 * d * int(d * v["mlp_ratio"]),
                   patch=v["patch_size"], temporal_patch=v["temporal_patch_size"], merge=v["spatial_merge_size"],
                   in_channels=v.get("in_channels", 3), text_hidden=v["hidden_size"], window=0, full_blocks=v["depth"])

    def _windows_sq(self, h: int, w: int) -> int:
        """Sum over one frame's windows of (patches in the window)^2; windows start at the top left corner."""
        lh, lw, ws = h // self.merge, w // self.merge, self.window
        rows = [min(ws, lh - i) for i in range(0, lh, ws)]
        cols = [min(ws, lw - j) for j in range(0, lw, ws)]
        return sum((r * c * self.merge ** 2) ** 2 for r in rows for c in cols)

    def flops(self, grids: list) -> int:
        """FLOPs of encoding items of grid (t, h, w) patches each (an image has t = 1)."""
        d, total = self.hidden, 0
        for t, h, w in grids:
            n = t * h * w
            embed = 2 * n * self.in_channels * self.temporal_patch * self.patch ** 2 * d
            linear = 2 * n * (4 * d * d + self.mlp_params) * self.depth
            full = 4 * d * t * (h * w) ** 2
            windowed = 4 * d * t * self._windows_sq(h, w) if self.window else full
            attn = self.full_blocks * full + (self.depth - self.full_blocks) * windowed
            c = d * self.merge ** 2
            merger = 2 * (n // self.merge ** 2) * (c * c + c * self.text_hidden)
            total += embed + linear + attn + merger
        return total

    def flops_per_image(self, side: int = QWEN_IMAGE_SIDE) -> int:
        return self.flops([(1, side // self.patch, side // self.patch)])


def vision_dims(cfg: dict):
    """The vision tower's dimensions of the checkpoint's family (LLaVA or Qwen2-VL)."""
    return QwenVisionDims.from_config(cfg) if cfg.get("model_type") in QWEN_TYPES else VisionDims.from_config(cfg)


def decode_floor(d: ModelDims, batch: int, context: int, bw_gbs: float, adapters: int = 0, rank: int = 0,
                 targets: tuple[str, ...] = LORA_TARGETS) -> dict:
    """The least time of one decode step: every byte it must move, at the measured copy rate."""
    parts = {"weights": d.decoder_bytes + d.head_bytes, "kv_read": batch * context * d.kv_bytes_per_token,
             "kv_write": batch * d.kv_bytes_per_token, "adapters": adapters * d.adapter_bytes(rank, targets) if adapters else 0}
    total = sum(parts.values())
    return {"floor_ms": total / (bw_gbs * 1e9) * 1e3, "bytes": total, "parts": parts}


def prefill_floor(d: ModelDims, tokens: int, tflops: float) -> dict:
    """The least time of one prompt's prefill: its FLOPs at the measured matmul rate."""
    parts = {"projections": 2 * d.linear_params * tokens,
             "attention": 2 * 2 * d.layers * d.heads * d.head_dim * tokens * tokens // 2,
             "lm_head": 2 * d.vocab * d.hidden}
    total = sum(parts.values())
    return {"floor_ms": total / (tflops * 1e12) * 1e3, "flops": total, "parts": parts}


def vision_floor(v: VisionDims, images: int, tflops: float) -> dict:
    flops = images * v.flops_per_image()
    return {"floor_ms": flops / (tflops * 1e12) * 1e3, "flops": flops}


def plan_slots(want: int, total_bytes: int, fraction: float, weight_bytes: int, slot_bytes: int, reserve: int) -> int:
    """Adapter slots that fit beside the weights and ``reserve`` in ``fraction`` of the device (>= 1)."""
    room = fraction * total_bytes - weight_bytes - reserve
    return max(1, min(want, int(room // max(slot_bytes, 1))))


def evaluate_targets(decode: list[dict], prefill: list[dict], plain: dict) -> list[dict]:
    """The issue's targets over the measured rows; ``passed`` None where a number is missing."""
    out = []

    def add(name: str, value: Optional[float], limit: float, note: str = "") -> None:
        out.append({"target": name, "value": value, "limit": limit, "passed": None if value is None else bool(value <= limit),
                    **({"note": note} if note else {})})

    ok = {(r["variant"], r["batch"], r["context"]): r for r in decode if r.get("ms") is not None}
    for (variant, b, c), r in sorted(ok.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        if variant not in ("base", "gemv"):
            continue
        what = "base decode" if variant == "base" else "base decode with gemv"  # gemv: the decode-row kernels on
        add(f"{what} bs{b} ctx{c} <= {TARGETS['base_x_floor']}x floor", r["ms"] / r["floor_ms"], TARGETS["base_x_floor"])
        p = plain.get("points", {}).get(f"{b}x{c}", {})
        best = min((p[k] for k in ("masked_ms", "exact_ms") if p.get(k) is not None), default=None)
        add(f"{what} bs{b} ctx{c} faster than plain graphed", None if best is None else r["ms"] / best, 1.0,
            "" if best is not None else "plain not measured")
    for r in decode:
        if r["variant"] == "base" and r.get("ms") is None:
            add(f"base decode bs{r['batch']} ctx{r['context']} <= {TARGETS['base_x_floor']}x floor", None,
                TARGETS["base_x_floor"], r.get("skipped") or r.get("error") or "not measured")
    for (variant, b, c), r in sorted(ok.items()):
        base = ok.get(("base", b, c))
        if variant == "lora" and b in (1, 32):
            lim = TARGETS["lora_x_base_bs1"] if b == 1 else TARGETS["lora_x_base_bs32"]
            note = "" if r.get("distinct_adapters") == b else f"only {r.get('distinct_adapters')} distinct adapters"
            value = None if base is None else r["ms"] / base["ms"]
            add(f"unmerged lora bs{b} ctx{c} ({r.get('distinct_adapters')} distinct) <= {lim}x base", value, lim, note)
        if variant == "merged" and base is not None:
            add(f"merged bs{b} ctx{c} within 3% of base", r["ms"] / base["ms"], TARGETS["merged_x_base"])
    for r in prefill:
        add(f"prefill {r['tokens']} tokens <= {TARGETS['prefill_x_floor']}x floor",
            None if r.get("ms") is None else r["ms"] / r["floor_ms"], TARGETS["prefill_x_floor"],
            "" if r.get("ms") is not None else (r.get("skipped") or r.get("error") or "not measured"))
    return out


# -- device helpers -------------------------------------------------------------------------------

def sync_fn(device) -> Callable[[], None]:
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def free_memory(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure_rates(device) -> dict:
    """Copy rate (GB/s, read + written) and bf16 matmul rate (TFLOP/s) of this device. On a CPU, small
    eager measurements (the smoke test's), so that the floor arithmetic runs end to end."""
    import torch

    if device.type == "cuda":
        from vlora.atmm.timing import copy_bandwidth_gbs, matmul_tflops

        with torch.cuda.device(device):
            bw = copy_bandwidth_gbs(2 * GIB)  # a 1 GiB source copied into a 1 GiB destination
            tf = matmul_tflops(8192, torch.bfloat16)
        free_memory(device)
        return {"copy_gbs": bw, "matmul_tflops": tf, "copy_bytes": 2 * GIB, "matmul": "8192^3 bf16"}
    a = torch.ones(8 << 20, dtype=torch.float32)
    b = torch.empty_like(a)
    t = _best_of(lambda: b.copy_(a), 5)
    m = torch.randn(256, 256)
    tm = _best_of(lambda: m @ m, 5)
    return {"copy_gbs": 2 * a.numel() * 4 / t / 1e9, "matmul_tflops": 2 * 256 ** 3 / tm / 1e12,
            "copy_bytes": 2 * a.numel() * 4, "matmul": "256^3 fp32 (CPU)"}


def _best_of(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


# -- the model folder -----------------------------------------------------------------------------

def model_folder(args: argparse.Namespace, max_prompt: int, device) -> tuple[Path, float]:
    """The model folder and the seconds it took to make. A preset's folder is written on first use
    (``<work>/<preset stem>``, the one engine_decode.py uses: same seed, same weights); where the preset's
    context is shorter than the largest prompt, a sibling folder links to its files and carries a config
    with a longer ``max_position_embeddings`` (no weight depends on it)."""
    t0 = time.perf_counter()
    if args.model:
        return Path(args.model), 0.0
    if args.preset is None:
        from vlora.models.tiny import ensure_tiny_model

        return ensure_tiny_model(), time.perf_counter() - t0
    from vlora.models.random_init import load_preset, make_random_model

    preset = Path(args.preset) if Path(args.preset).is_absolute() else ROOT / args.preset
    work = Path(args.work)
    base = make_random_model(preset, work / preset.stem, device="cuda" if device.type == "cuda" else "cpu")
    free_memory(device)
    have = load_preset(preset).text.get("max_position_embeddings", 0)
    need = max_prompt + 64
    if have >= need:
        return base, time.perf_counter() - t0
    ctx = 1024 * math.ceil(need / 1024)
    out = work / f"{preset.stem}-ctx{ctx}"
    if not (out / "config.json").is_file():
        tmp = work / f".{out.name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for f in base.iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f.resolve())
        cfg = json.loads((base / "config.json").read_text())
        # LLaVA nests the decoder's settings under text_config; the Hub's Qwen2-VL layout keeps them at the top
        (cfg["text_config"] if "text_config" in cfg else cfg)["max_position_embeddings"] = ctx
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tmp.rename(out)
    return out, time.perf_counter() - t0


def read_config(model_dir: Path) -> dict:
    """The checkpoint's configuration with every default filled in (config.json leaves out values equal
    to transformers' defaults, such as LLaMA-7B's hidden size)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True).to_dict()


def weight_file_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


# -- the plain baseline ---------------------------------------------------------------------------

class SlowHost(RuntimeError):
    """The plain graphed step runs far above its memory floor: this host's timings are not usable."""


def run_plain(model_dir: Path, device, dtype, dims: ModelDims, batches: list[int], contexts: list[int],
              steps: int, warmup: int, deadline: "Deadline", copy_gbs: float = 0.0, slow_host_x: float = 0.0) -> dict:
    """Load the model folder, check the plain step against transformers, time every decode point in
    both attention variants; everything is freed before returning. Raises SlowHost when the first point
    takes more than ``slow_host_x`` times its memory floor at ``copy_gbs`` (0: no check)."""
    import torch

    from benchmarks.plain_decode import PlainDecoder, check_against_hf
    from vlora.models.family import load_model

    out: dict[str, Any] = {"points": {}, "weights": "the same model folder as the engine, loaded once more"}
    t0 = time.perf_counter()
    loaded = load_model(model_dir, dtype, device)
    out["load_s"] = time.perf_counter() - t0
    check = check_against_hf(loaded.model, batch=2, context=16)
    out["check"] = check
    print(f"plain: check against transformers (batch 2, context 16, {check['dtype']}, graphed={check['graphed']}): "
          f"{'PASS' if check['passed'] else 'FAIL'} (rel err masked {check['masked']['rel_err']:.2e}, "
          f"exact {check['exact']['rel_err']:.2e})", flush=True)
    dec = PlainDecoder(loaded.model, 1, 16)
    del loaded
    free_memory(device)
    round_to = 256 if device.type == "cuda" else 64
    try:
        for ctx in contexts:
            max_len = round_to * math.ceil((ctx + 1) / round_to)
            dec.resize(1, 16)
            free_memory(device)
            per_batch = PlainDecoder.cache_bytes(dims.layers, dims.kv_heads, dims.head_dim, 1, max_len, dims.elt)
            if device.type == "cuda":
                room = torch.cuda.mem_get_info(device)[0] - PLAIN_MARGIN
                fits = [b for b in batches if b * per_batch <= room]
            else:
                fits = list(batches)
            for b in batches:
                if b not in fits:
                    out["points"][f"{b}x{ctx}"] = {"batch": b, "context": ctx, "skipped":
                                                   f"does not fit: a static cache of {b * per_batch / GIB:.1f} GiB "
                                                   f"beside the weights"}
                    print(f"plain bs{b} ctx{ctx}: skipped, {out['points'][f'{b}x{ctx}']['skipped']}", flush=True)
            if not fits:
                continue
            dec.resize(max(fits), max_len)
            dec.prefill_fill(ctx)
            for b in fits:
                key = f"{b}x{ctx}"
                if deadline.passed():
                    out["points"][key] = {"batch": b, "context": ctx, "skipped": "deadline"}
                    continue
                p = {"batch": b, "context": ctx, "max_len": max_len}
                try:
                    p["masked_ms"] = dec.time_decode_step(b, ctx, iters=steps, masked=True, warmup=warmup)
                    p["exact_ms"] = dec.time_decode_step(b, ctx, iters=steps, masked=False, warmup=warmup)
                except Exception as e:  # one point's failure is recorded; the run goes on
                    p["error"] = f"{type(e).__name__}: {e}"
                    free_memory(device)
                out["points"][key] = p
                print(f"plain bs{b} ctx{ctx}: " + (f"masked {p['masked_ms']:.2f} ms, exact {p['exact_ms']:.2f} ms"
                                                   if "error" not in p else p["error"]), flush=True)
                if slow_host_x and copy_gbs and "error" not in p and len(out["points"]) == 1:
                    x = min(p["masked_ms"], p["exact_ms"]) / decode_floor(dims, b, ctx, copy_gbs)["floor_ms"]
                    if x > slow_host_x:
                        raise SlowHost(f"the plain graphed step bs{b} ctx{ctx} takes {x:.1f}x its memory floor "
                                       f"(limit {slow_host_x:g}x; 1.3-1.9x on normal H100/H200 hosts)")
    finally:
        dec.release()
        del dec
        free_memory(device)
    return out


# -- the engine -----------------------------------------------------------------------------------

class Deadline:
    def __init__(self, seconds: Optional[float]) -> None:
        self.t0, self.seconds = time.monotonic(), seconds

    def passed(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.t0 > self.seconds


ATTENTION = "auto"  # engine.attention of the engine under test (--attention)
PREFILL_GRAPHS = None  # engine.prefill_graph_tokens of the engine under test (--prefill-graph-tokens; None: the default)
GEMV_ROWS = None  # engine.gemv_max_rows of the engine under test (--gemv-max-rows; None: the default)


def build(model_dir: Path, device, dtype_name: str, slots: int, rank: int, max_batch: int, budget_tokens: int,
          max_images: int = 8):
    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    cfg = EngineConfig().with_overrides({
        "model.path": str(model_dir), "model.device": str(device), "model.dtype": dtype_name, "lora.adapter_root": None,
        "lora.max_gpu_adapters": slots, "lora.max_cpu_adapters": slots, "lora.max_rank": rank,
        "lora.target_modules": list(LORA_TARGETS), "scheduler.max_batch_size": max_batch,
        "scheduler.max_num_batched_tokens": budget_tokens, "orchestrator.policy": "unmerge-only",
        "limits.max_images": max(8, max_images),  # a video's frames are its images
        "atmm.tune_at_load": "never",  # no tuner sidecar sharing the GPU while we time
        "engine.attention": ATTENTION,
        **({"engine.prefill_graph_tokens": PREFILL_GRAPHS} if PREFILL_GRAPHS is not None else {}),
        **({"engine.gemv_max_rows": GEMV_ROWS} if GEMV_ROWS is not None else {})})
    return build_engine(cfg)


def set_gemv_rows(engine, rows: int) -> None:
    """Switch the runner's decode-row kernels (engine.gemv_max_rows) and capture its graphs again: a graph
    keeps the kernels it was captured with. The decode graphs are captured at once (the variants it had),
    the prefill graphs when a step first needs them."""
    runner = engine.runner
    engine.flush()
    if runner.gemv_max_rows == rows:
        return
    runner.set_gemv_max_rows(rows)
    graphs = runner.graphs
    if graphs is not None:
        had = tuple(sorted({v for _, v in graphs.graphs}))
        graphs.graphs.clear()
        free_memory(runner.device)
        graphs.capture_missing(had)
    if runner.prefill_graphs is not None:
        runner.prefill_graphs.graphs.clear()


def kv_capacity_blocks(engine) -> Optional[int]:
    kv = getattr(engine.runner, "kv", None)
    n = getattr(kv, "num_blocks", None)
    return int(n) if isinstance(n, int) else None


class BatchRun:
    """B requests of ``context`` random prompt tokens, prefilled by the engine and decoding (EOS
    ignored) until :meth:`close`; every step is checked to hold the whole batch."""

    def __init__(self, engine, batch: int, context: int, adapters: list, max_tokens: int, tag: str, seed: int = 0) -> None:
        import torch

        from vlora.engine.api import GenerationRequest, SamplingParams

        self.engine, self.batch, self.context = engine, batch, context
        self.last = None  # the last timed step's StepResult
        self.sync = sync_fn(engine.runner.device)
        self.errors: list[str] = []
        vocab = min(len(engine.tokenizer), engine.runner.vocab_size)
        image_id = getattr(engine.runner, "image_token_id", None)
        gen = torch.Generator().manual_seed(seed * 7919 + batch * 131 + context)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.ids = []
        for i in range(batch):
            ids = torch.randint(0, vocab, (context,), generator=gen)
            if image_id is not None:
                ids[ids == image_id] = (image_id + 1) % vocab
            rid = f"{tag}-{i}-{time.monotonic_ns()}"
            template = engine.inputs.prepare(GenerationRequest(rid, "x", lora_name=adapters[i], sampling=sampling))
            req = dataclasses.replace(template, prompt_ids=ids.tolist())
            self.ids.append(rid)
            engine.add_request(req, self._on_output)

    def _on_output(self, out) -> None:
        if out.finished and out.error:
            self.errors.append(out.error)

    def prefill(self, timeout_s: float = 300.0) -> int:
        """Step until every request is prefilled; returns the steps that took."""
        eng, steps, t_end = self.engine, 0, time.monotonic() + timeout_s
        while any(not s.prefilled for s in eng.running + list(eng.waiting)):
            if eng.step() is None:
                if time.monotonic() > t_end:
                    raise RuntimeError(f"prefill made no progress for {timeout_s:.0f} s: {len(eng.waiting)} waiting, "
                                       f"{len(eng.running)} running ({self.errors[:1]})")
                time.sleep(0.001)
            steps += 1
        if self.errors or len(eng.running) != self.batch:
            raise RuntimeError(f"{len(eng.running)} of {self.batch} requests running after prefill; errors: {self.errors[:2]}")
        return steps

    def steps(self, n: int) -> list[float]:
        """``n`` decode steps; seconds of each (the sampler reads the tokens back: a step ends synchronised)."""
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.last = self.engine.step()
            if self.last is None:
                raise RuntimeError(f"a decode step did not run ({self.errors[:1]})")
            out.append(time.perf_counter() - t0)
        if n:
            self.check()
        return out

    def check(self):
        """The last step (a StepResult): a decode step of the whole batch, else RuntimeError."""
        last = self.last
        if last is None or last.num_decode != self.batch or last.num_prefill != 0:
            ran = "nothing" if last is None else f"{last.num_decode} decode and {last.num_prefill} prefill requests"
            raise RuntimeError(f"expected a decode step of {self.batch} requests, the last step ran {ran}")
        return last

    def contexts(self) -> list[int]:
        return [s.num_tokens for s in self.engine.running]

    def close(self) -> None:
        self.engine.fail_all("cancelled", "benchmark point done")
        self.engine.flush()  # the step overlap's last step in flight: its tokens are read back (and dropped)
        if self.engine.has_work():
            raise RuntimeError("requests left in the engine after the point")


def decode_max_tokens(batch: int, warmup: int, steps: int) -> int:
    """Output tokens a decode point's requests ask for: every prefill step admits at least one prompt,
    so none finishes before the timed steps are done."""
    return batch + warmup + steps + 8


def decode_point(engine, variant: str, batch: int, context: int, names: list[str], steps: int, warmup: int) -> dict:
    """One engine decode point: ms per step (mean over ``steps``), with what ran checked."""
    if variant in ("base", "sync", "gemv"):
        adapters = [None] * batch
    elif variant == "lora":
        adapters = [names[i % len(names)] for i in range(batch)]
    else:
        adapters = [names[0]] * batch
    max_tokens = decode_max_tokens(batch, warmup, steps)
    run = BatchRun(engine, batch, context, adapters, max_tokens, f"{variant}-{batch}-{context}")
    try:
        prefill_steps = run.prefill()
        run.steps(warmup)
        sync = run.sync
        sync()
        ctx0 = run.contexts()
        t0 = time.perf_counter()
        per = run.steps(steps)
        sync()
        total = time.perf_counter() - t0
        last = run.check()
    finally:
        run.close()
    distinct = len({s for s in last.slots if s is not None and s >= 0})
    if variant == "lora" and distinct != len(set(adapters)):
        raise RuntimeError(f"lora: {distinct} distinct slots ran, expected {len(set(adapters))}")
    if variant == "merged" and (last.mode != "merge" or last.merged != names[0]):
        raise RuntimeError(f"merged: the step ran mode {last.mode!r} with {last.merged!r} merged")
    if variant in ("base", "sync", "gemv") and distinct:
        raise RuntimeError(f"{variant}: {distinct} adapter slots ran")
    return {"ms": 1e3 * total / steps, "median_step_ms": 1e3 * statistics.median(per), "steps": steps,
            "prefill_steps": prefill_steps, "context_mean": statistics.mean(ctx0), "context_max": max(ctx0),
            "distinct_adapters": len(set(a for a in adapters if a is not None)), "mode": last.mode,
            "merged": last.merged}


_PREFILL_SEEDS = iter(range(10**6))  # every timed prompt its own tokens: none hits the prefix cache


def prefill_point(engine, tokens: int, reps: int) -> dict:
    """ms of the step that prefills one prompt of ``tokens`` tokens (one warm-up, then ``reps``), each
    prompt new to the engine (a prompt seen before would run only past its cached prefix)."""
    times = []
    for i in range(reps + 1):
        run = BatchRun(engine, 1, tokens, [None], 1, f"prefill-{tokens}-{i}", seed=next(_PREFILL_SEEDS))
        try:
            run.sync()
            t0 = time.perf_counter()
            last = engine.step()
            if last is None:
                raise RuntimeError(f"the prefill step did not run ({run.errors[:1]})")
            run.sync()
            dt = time.perf_counter() - t0
            if last.num_prefill != 1:
                raise RuntimeError(f"expected one prefill, the step ran {last.num_prefill}")
        finally:
            run.close()
        if i:
            times.append(dt)
    return {"ms": 1e3 * statistics.mean(times), "min_ms": 1e3 * min(times), "reps": reps}


def vision_inputs(engine, images: int):
    """(pixel_values on the device, image_grid_thw or None) of ``images`` random images: LLaVA's tower size
    as random pixels; Qwen2-VL's 448x448 noise images through the model's processor."""
    import torch

    runner = engine.runner
    loaded = getattr(runner, "loaded", None)
    if loaded is None or loaded.model.config.model_type not in QWEN_TYPES:
        size = runner.model.config.vision_config.image_size
        return torch.randn(images, 3, size, size, device=runner.device, dtype=runner.dtype), None
    from PIL import Image

    pil = [Image.open(io.BytesIO(noise_png(1000 + i, QWEN_IMAGE_SIDE))).convert("RGB") for i in range(images)]
    prompt = loaded.family.prompt(loaded, "Describe.", pil, False)
    return prompt.pixel_values.to(runner.device, runner.dtype), prompt.image_grid_thw


def vision_point(engine, images: int, reps: int) -> dict:
    import torch

    runner = engine.runner
    px, grid = vision_inputs(engine, images)
    sync = sync_fn(runner.device)
    with torch.inference_mode():
        for _ in range(2):
            runner.encode_images(px, grid)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            feats = runner.encode_images(px, grid)
        sync()
    return {"ms": 1e3 * (time.perf_counter() - t0) / reps, "reps": reps, "features": list(feats.shape),
            **({"grid": grid.tolist()} if grid is not None else {})}


def noise_png(seed: int, side: int) -> bytes:
    """A side x side RGB PNG of uniform noise (every repetition its own pixels: no encoder-cache hit)."""
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def parse_media(text: str) -> list[dict]:
    """``image:SIDE`` (one SIDE x SIDE image) and ``video:FRAMESxSIDE`` items, comma-separated."""
    out = []
    for item in (x.strip() for x in str(text).split(",") if x.strip()):
        kind, _, spec = item.partition(":")
        try:
            if kind == "image":
                out.append({"kind": "image", "images": 1, "side": int(spec or QWEN_IMAGE_SIDE)})
                continue
            if kind == "video":
                frames, _, side = spec.partition("x")
                out.append({"kind": "video", "images": int(frames), "side": int(side or QWEN_IMAGE_SIDE)})
                continue
        except ValueError:
            pass
        raise SystemExit(f"--media: {item!r} is not image:SIDE or video:FRAMESxSIDE")
    return out


def media_point(engine, m: dict, reps: int, seed0: int = 1) -> dict:
    """TTFT of one image or video request asking for one token, prefilled alone (one warm-up, then
    ``reps``, each with new pixels): ms of ``inputs.prepare`` and of the engine step, then of the vision
    tower and merger alone on the last request's pixels."""
    import torch

    from vlora.engine.api import GenerationRequest, SamplingParams
    from vlora.models.qwen2_vl import VIDEO_PLACEHOLDER

    runner = engine.runner
    loaded = runner.loaded
    family = loaded.family
    video = m["kind"] == "video"
    if video and loaded.model.config.model_type not in QWEN_TYPES:
        raise RuntimeError("a video request needs the Qwen2-VL family (LLaVA takes frames as images)")
    text = f"{VIDEO_PLACEHOLDER}What happens in this video?" if video else f"{family.image_placeholder}What is in this picture?"
    sync = sync_fn(runner.device)
    prep, step, errors = [], [], []
    prepared = None
    for i in range(reps + 1):
        frames = [noise_png(1_000_003 * (seed0 + i) + j, m["side"]) for j in range(m["images"])]
        req = GenerationRequest(f"media-{m['kind']}-{i}-{time.monotonic_ns()}", text, images=frames,
                                sampling=SamplingParams(max_tokens=1))
        sync()
        t0 = time.perf_counter()
        prepared = engine.inputs.prepare(req)
        t1 = time.perf_counter()
        engine.add_request(prepared, lambda out: errors.append(out.error) if out.finished and out.error else None)
        ran = engine.step()
        engine.flush()  # with the step overlap, its token is read back (and the request finishes) here
        sync()
        t2 = time.perf_counter()
        if ran is None or ran.num_prefill != 1 or errors:
            engine.fail_all("cancelled", "benchmark point failed")
            raise RuntimeError(f"the {m['kind']} prefill step did not run alone "
                               f"({ran.num_prefill if ran else 0} prefills, {errors[:1]})")
        if engine.has_work():
            engine.fail_all("cancelled", "benchmark point done")
        if i:
            prep.append(t1 - t0)
            step.append(t2 - t1)
    grid = prepared.image_grid_thw
    pv = prepared.pixel_values.to(runner.device, runner.dtype)
    with torch.inference_mode():
        family.encode_images(loaded, pv, grid, video=video)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            family.encode_images(loaded, pv, grid, video=video)
        sync()
    vision_ms = 1e3 * (time.perf_counter() - t0) / reps
    image_id = family.placeholder_id(loaded, video)
    out = {"prepare_ms": 1e3 * statistics.mean(prep), "step_ms": 1e3 * statistics.mean(step),
           "ttft_ms": 1e3 * (statistics.mean(prep) + statistics.mean(step)), "min_step_ms": 1e3 * min(step),
           "vision_ms": vision_ms, "step_minus_vision_ms": 1e3 * statistics.mean(step) - vision_ms,
           "prompt_tokens": len(prepared.prompt_ids),
           "visual_tokens": sum(1 for t in prepared.prompt_ids if t == image_id), "reps": reps}
    if grid is not None:
        out["grid"] = grid.tolist()
    return out


def media_floor(dims: ModelDims, vdims, row: dict, tflops: float) -> dict:
    """The vision tower's FLOPs on the row's pixels + the prefill's on its prompt, at the matmul rate."""
    if isinstance(vdims, QwenVisionDims):
        vision = vdims.flops([tuple(g) for g in row["grid"]])
    else:
        vision = row["images"] * vdims.flops_per_image()
    pre = prefill_floor(dims, row["prompt_tokens"], tflops)
    return {"vision_floor_ms": vision / (tflops * 1e12) * 1e3, "vision_flops": vision,
            "prefill_floor_ms": pre["floor_ms"], "floor_ms": vision / (tflops * 1e12) * 1e3 + pre["floor_ms"]}


def _kernel_table(prof, steps: int, top: int) -> dict:
    """The top kernels by device time per step, kernels and launch calls per step, from a finished profile."""
    kernels, launches, cpu = [], {}, []
    launch_names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
                    "cudaMemcpyAsync", "cudaMemsetAsync")
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0)
        is_device = str(getattr(evt, "device_type", "")).endswith("CUDA")
        if is_device and dev_us > 0:
            kernels.append({"name": evt.key[:120], "calls_per_step": evt.count / steps, "us_per_step": dev_us / steps})
        elif evt.key in launch_names:
            launches[evt.key] = evt.count / steps
        if not is_device and getattr(evt, "self_cpu_time_total", 0) > 0:
            cpu.append({"name": evt.key[:120], "calls_per_step": evt.count / steps,
                        "us_per_step": evt.self_cpu_time_total / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    cpu.sort(key=lambda k: -k["us_per_step"])
    return {"gpu_kernel_ms_per_step": sum(k["us_per_step"] for k in kernels) / 1e3,
            "kernels_per_step": sum(k["calls_per_step"] for k in kernels), "launch_calls_per_step": launches,
            "top_kernels": kernels[:top], "cpu_ms_per_step": sum(k["us_per_step"] for k in cpu) / 1e3,
            "top_cpu_ops": cpu[:top]}


def _activities(engine) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.runner.device.type == "cuda" else [])


def profile_decode(engine, batch: int, context: int, steps: int = 5, top: int = 15) -> dict:
    """torch.profiler over ``steps`` base-model decode steps at ``batch``: the top kernels by device time,
    kernels and launch calls per step, wall (CPU) and kernel (GPU) time per step."""
    from torch.profiler import profile

    run = BatchRun(engine, batch, context, [None] * batch, batch + 3 * steps + 16, f"profile-{batch}")
    try:
        run.prefill()
        run.steps(3)
        run.sync()
        plain_wall = statistics.mean(run.steps(steps))
        with profile(activities=_activities(engine)) as prof:
            t0 = time.perf_counter()
            run.steps(steps)
            run.sync()
            prof_wall = (time.perf_counter() - t0) / steps
    finally:
        run.close()
    return {"what": "decode", "batch": batch, "context": context, "steps": steps, "cpu_wall_ms_per_step": 1e3 * plain_wall,
            "profiled_wall_ms_per_step": 1e3 * prof_wall, **_kernel_table(prof, steps, top)}


def profile_prefill(engine, tokens: int, steps: int = 3, top: int = 15) -> dict:
    """torch.profiler over ``steps`` steps that each prefill one prompt of ``tokens`` tokens (after one
    unprofiled warm-up): the same table as :func:`profile_decode`."""
    from torch.profiler import profile, record_function

    plain_wall = prefill_point(engine, tokens, steps)["ms"]
    walls = []
    with profile(activities=_activities(engine)) as prof:
        for i in range(steps):
            run = BatchRun(engine, 1, tokens, [None], 1, f"profile-prefill-{tokens}-{i}", seed=next(_PREFILL_SEEDS))
            try:
                run.sync()
                t0 = time.perf_counter()
                with record_function("vlora_step"):
                    engine.step()
                    run.sync()
                walls.append(time.perf_counter() - t0)
            finally:
                run.close()
    return {"what": "prefill", "batch": 1, "context": tokens, "steps": steps, "cpu_wall_ms_per_step": plain_wall,
            "profiled_wall_ms_per_step": 1e3 * statistics.mean(walls), **_kernel_table(prof, steps, top),
            "timeline": _gpu_timeline(prof), "python": _python_profile(engine, tokens, steps, top)}


def _gpu_timeline(prof) -> dict:
    """Where each ``vlora_step`` window of a finished profile leaves the GPU idle (ms per step, mean): before
    its first kernel (the host's preparation), between kernels (the host behind the GPU), after its last
    kernel (read-back and the host's bookkeeping). From the profile's Chrome trace."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    finally:
        os.unlink(path)
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "vlora_step" and e.get("ph") == "X"
             and e.get("cat") == "user_annotation"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    rows = []
    for a, b in steps:
        ks = [(x, y) for x, y in kernels if a <= x < b]
        if not ks:
            continue
        gaps, end = 0.0, ks[0][0]
        for x, y in ks:
            gaps += max(0.0, x - end)
            end = max(end, y)
        rows.append({"wall": b - a, "before_first": ks[0][0] - a, "between": gaps, "after_last": b - end,
                     "busy": sum(y - x for x, y in ks)})
    if not rows:
        return {}
    return {k: statistics.mean(r[k] for r in rows) / 1e3 for k in rows[0]} | {"steps": len(rows)}


def _python_profile(engine, tokens: int, steps: int, top: int) -> list[dict]:
    """cProfile over ``steps`` prefill steps: the host's Python functions by own time per step (where an
    eager step's host time goes, which torch.profiler's op table does not show)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for i in range(steps):
        run = BatchRun(engine, 1, tokens, [None], 1, f"pyprofile-prefill-{tokens}-{i}", seed=next(_PREFILL_SEEDS))
        try:
            run.sync()
            prof.enable()
            engine.step()
            run.sync()
            prof.disable()
        finally:
            run.close()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"name": f"{Path(file).name}:{line}({fn})", "calls_per_step": nc / steps,
                     "own_us_per_step": 1e6 * tt / steps, "cum_us_per_step": 1e6 * ct / steps})
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return rows[:2 * top]


def print_profile(p: dict) -> None:
    print(f"\nprofile: base {p.get('what', 'decode')} bs{p['batch']} ctx{p['context']}, {p['steps']} steps: wall {p['cpu_wall_ms_per_step']:.2f} ms/step "
          f"unprofiled ({p['profiled_wall_ms_per_step']:.2f} profiled), GPU kernels {p['gpu_kernel_ms_per_step']:.2f} ms/step, "
          f"{p['kernels_per_step']:.0f} kernels/step; launch calls/step: "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(p["launch_calls_per_step"].items())), flush=True)
    for k in p["top_kernels"]:
        print(f"  {k['us_per_step']:9.1f} us/step  {k['calls_per_step']:6.1f} calls/step  {k['name']}", flush=True)
    if p.get("timeline"):
        t = p["timeline"]
        print(f"  GPU timeline per step (profiled): wall {t['wall']:.2f} ms, kernels {t['busy']:.2f}; GPU idle "
              f"{t['before_first']:.2f} before the first kernel, {t['between']:.2f} between kernels, "
              f"{t['after_last']:.2f} after the last", flush=True)
    if p.get("python"):
        print("  host Python, own time (cumulative) per step:", flush=True)
        for k in p["python"]:
            print(f"  {k['own_us_per_step']:9.1f} us ({k['cum_us_per_step']:9.1f})  {k['calls_per_step']:7.1f} calls  {k['name']}", flush=True)
    if p.get("top_cpu_ops"):
        print(f"  host: {p['cpu_ms_per_step']:.2f} ms/step of self CPU time in profiled ops; the top ones:", flush=True)
        for k in p["top_cpu_ops"]:
            print(f"  {k['us_per_step']:9.1f} us/step  {k['calls_per_step']:6.1f} calls/step  {k['name']}", flush=True)


def gemv_status(engine) -> dict:
    """The decode-row kernels' table (VLORA_GEMV_TABLE or the committed one) and the launch of each of the
    decoder's projections, so that the numbers say what ran."""
    import os

    from vlora.engine import gemv

    r = engine.runner
    shapes = {name: ("silu" if name == "gate_up_silu" else "linear", g.stack.shape[1], g.stack.shape[2])
              for name, g in ((n, r.groups[n.replace("_silu", "")]) for n in ("qkv", "o", "gate_up", "gate_up_silu", "down"))}
    shapes["lm_head"] = ("linear", r.lm_head.weight.shape[0], r.lm_head.weight.shape[1])
    return {"table_file": os.environ.get(gemv.TABLE_ENV), "triton": gemv.triton_available(),
            "launches": {name: gemv.config_for(*s).label() for name, s in shapes.items()}}


def atmm_status() -> dict:
    """Whether the ATMM CUDA extension is importable here, and which tiling table it serves."""
    try:
        from vlora.atmm.dispatch import default_kernels

        k = default_kernels()
        return {"extension": bool(k.available), "why_not": getattr(k, "unavailable_reason", ""),
                "table": getattr(k, "table_source", None)}
    except Exception as e:  # reported, not fatal: the numbers stand either way
        return {"error": f"{type(e).__name__}: {e}"}


def lora_compute_path(probe) -> Optional[str]:
    try:
        return probe.summary()
    except Exception as e:  # the probe belongs to benchmarks/orchestrator.py; its API may move
        return f"unknown ({type(e).__name__})"


# -- the run --------------------------------------------------------------------------------------

def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--preset", default=None, help="model preset YAML (random weights); default on CUDA "
                                                  "configs/models/llava-1.5-7b.yaml, on a CPU the tiny model")
    p.add_argument("--model", help="an existing model folder (overrides --preset)")
    p.add_argument("--work", default="/tmp/vlora-bench", help="where the random model folder is written")
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON (default benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="batch 1 and 32, context 700, prefill 600")
    p.add_argument("--batches", help=f"decode batch sizes (default {FULL['batches']})")
    p.add_argument("--contexts", help=f"decode context lengths (default {FULL['contexts']})")
    p.add_argument("--prefill", help=f"prefill prompt lengths (default {FULL['prefill']})")
    p.add_argument("--images", help=f"vision tower batch sizes (default {FULL['images']})")
    p.add_argument("--media", default="auto", help=f"image/video requests timed to their first token, e.g. "
                                                   f"{QWEN_MEDIA!r} (auto: that on Qwen2-VL models, none on LLaVA)")
    p.add_argument("--media-reps", type=int, default=3)
    p.add_argument("--variants", default="base,lora,merged",
                   help="base, lora, merged, sync: the base model without the step overlap (engine.overlap off), "
                        "and gemv: the base model with engine.gemv_max_rows at --gemv-rows")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--slots", type=int, help="adapter slots (default: the largest batch, as memory allows)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    p.add_argument("--warmup", type=int, default=5, help="decode steps before timing (graph capture, caches)")
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--skip-plain", action="store_true", help="no plain PyTorch baseline")
    p.add_argument("--profile", action="store_true", help="torch.profiler over 5 base decode steps")
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument("--attention", default="auto", help="engine.attention: auto, flash, triton or torch")
    p.add_argument("--prefill-graph-tokens", type=int, help="engine.prefill_graph_tokens (default: the config's)")
    p.add_argument("--gemv-max-rows", type=int, help="engine.gemv_max_rows of the engine (default: the config's, 0)")
    p.add_argument("--gemv-rows", type=int, default=16, help="engine.gemv_max_rows of the gemv variant (default 16)")
    p.add_argument("--profile-prefill", type=int, help="also profile prefill steps of one prompt of this many tokens")
    p.add_argument("--slow-host-x", type=float, default=3.0,
                   help="exit 3 (nothing recorded) when the first plain point takes more than this many times its "
                        "memory floor: some device hosts run every kernel 4-12x slow (0: no check)")
    p.add_argument("--deadline-s", type=float, help="start no point after this many seconds (the rest is marked skipped)")
    p.add_argument("--no-record", action="store_true", help="no line in RESULTS.md, no copy in benchmarks/results")
    p.add_argument("--cpu-threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    global ATTENTION, PREFILL_GRAPHS, GEMV_ROWS
    args = parse_args(argv)
    ATTENTION = args.attention
    PREFILL_GRAPHS = args.prefill_graph_tokens
    GEMV_ROWS = args.gemv_max_rows
    import torch

    from vlora.engine.builder import resolve_device

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.cpu_threads)
    if args.preset is None and not args.model and cuda:
        args.preset = "configs/models/llava-1.5-7b.yaml"
    grid = QUICK if args.quick else FULL
    batches = ints(args.batches or grid["batches"])
    contexts = ints(args.contexts or grid["contexts"])
    prefills = ints(args.prefill or grid["prefill"])
    images = ints(args.images or grid["images"])
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in ("base", "lora", "merged", "sync", "gemv")]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; known: base, lora, merged, sync (base without the step overlap), "
                         f"gemv (base with the decode-row kernels)")
    dtype = torch.bfloat16 if cuda else torch.float32
    dtype_name = "bfloat16" if cuda else "float32"
    deadline = Deadline(args.deadline_s)
    t_start = time.perf_counter()
    notes: list[str] = []

    rates = measure_rates(device)
    print(f"rates: copy {rates['copy_gbs']:.4g} GB/s (read + written), matmul {rates['matmul_tflops']:.4g} TFLOP/s", flush=True)
    longest = max(prefills + [c + max(batches) + args.warmup + args.steps + 16 for c in contexts])
    model_dir, make_s = model_folder(args, longest, device)
    cfg = read_config(model_dir)
    elt = torch.empty((), dtype=dtype).element_size()
    dims = ModelDims.from_config(cfg["text_config"], elt)
    vdims = vision_dims(cfg)
    qwen = cfg.get("model_type") in QWEN_TYPES
    media = parse_media(QWEN_MEDIA if args.media == "auto" and qwen else "" if args.media == "auto" else args.media)
    print(f"model: {model_dir} ({make_s:.0f} s to make), {dims.layers} layers, hidden {dims.hidden}, "
          f"{dims.linear_params / 1e9:.3g} B projection parameters", flush=True)
    result: dict[str, Any] = {
        "benchmark": f"{NAME}-{QWEN_TYPES[cfg['model_type']]}" if qwen else NAME, "device": device_name(),
        "commit": git_commit(), "model_dir": str(model_dir), "model_type": cfg.get("model_type"), "model_make_s": make_s,
        "preset": args.preset or ("tiny" if not args.model else Path(args.model).name), "dtype": dtype_name,
        "dims": dataclasses.asdict(dims), "vision_dims": dataclasses.asdict(vdims), "rates": rates,
        "settings": {"attention": args.attention, "batches": batches, "contexts": contexts, "prefill": prefills, "images": images, "rank": args.rank,
                     "steps": args.steps, "warmup": args.warmup, "variants": variants, "quick": args.quick,
                     "media": media, "gemv_max_rows": args.gemv_max_rows, "gemv_rows": args.gemv_rows},
        "floors": {"decode": "bytes / copy rate: decoder weights + final norm + LM head + KV read (B x context) + KV written "
                             "(B tokens) (+ distinct adapters' A and B for lora); embedding rows left out",
                   "prefill": "FLOPs / matmul rate: 2 x projection params x T + causal attention 2 x 2 x L x H x D x T^2 / 2 "
                              "+ LM head for the last token",
                   "vision": "FLOPs / matmul rate: patch embedding, the encoder layers up to the feature layer, "
                             "attention over all tokens, the projector (Qwen: every ViT block, attention within each "
                             "frame or window, the patch merger)",
                   "media": "vision floor of the request's pixels + prefill floor of its prompt tokens"}}

    # 1. The plain baseline, on its own copy of the weights, freed before the engine is built.
    plain: dict[str, Any] = {}
    check_failed = False
    if not args.skip_plain:
        try:
            plain = run_plain(model_dir, device, dtype, dims, batches, contexts, args.steps, min(args.warmup, 3), deadline,
                              rates["copy_gbs"], args.slow_host_x if device.type == "cuda" else 0.0)
            check_failed = not plain["check"]["passed"]
        except SlowHost as e:
            print(f"slow host: {e}; nothing recorded", flush=True)
            return 3
        except Exception as e:
            plain = {"error": f"{type(e).__name__}: {e}", "points": {}}
            check_failed = True
            print(f"plain: failed: {plain['error']}", flush=True)
            free_memory(device)
    result["plain"] = plain

    result.update(decode=[], prefill=[], media=[], vision=[], targets=[], notes=notes)
    failed = None
    try:
        run_engine(args, device, dtype_name, model_dir, dims, vdims, rates, batches, contexts, prefills, images, variants,
                   plain, deadline, result, media)
    except Exception:  # what was measured so far is still written
        failed = traceback.format_exc()
        result["error"] = failed
        print(failed, flush=True)
    result["targets"] = evaluate_targets(result["decode"], result["prefill"], plain)
    result["wall_s"] = time.perf_counter() - t_start
    print_tables(result)
    print(f"wall time {result['wall_s']:.0f} s", flush=True)
    write_outputs(result, Path(args.out), args.no_record)
    if check_failed:
        print("FAILED: the plain baseline failed or does not match transformers (see plain.check / plain.error)", flush=True)
    return 1 if check_failed or failed else 0


def run_engine(args, device, dtype_name: str, model_dir: Path, dims: ModelDims, vdims: VisionDims, rates: dict,
               batches: list[int], contexts: list[int], prefills: list[int], images: list[int], variants: list[str],
               plain: dict, deadline: Deadline, result: dict, media: Optional[list[dict]] = None) -> None:
    """Build the engine and measure every engine point into ``result``."""
    import torch

    cuda = device.type == "cuda"
    notes = result["notes"]
    slot_bytes = dims.adapter_bytes(args.rank)
    want = args.slots or max(batches)
    slots = want
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        slots = plan_slots(want, total, 0.85, weight_file_bytes(model_dir), slot_bytes, CUDA_RESERVE)
        if slots < want:
            notes.append(f"{want} adapter slots of rank {args.rank} ({want * slot_bytes / GIB:.1f} GiB) do not fit beside the "
                         f"weights on this device: {slots} slots, so lora batches above {slots} share adapters")
            print("note:", notes[-1], flush=True)
    t0 = time.perf_counter()
    media = media or []
    engine = build(model_dir, device, dtype_name, slots, args.rank, max(batches), max(16384, max(prefills) + 16),
                   max_images=max([m["images"] for m in media], default=1))
    build_s = time.perf_counter() - t0
    from benchmarks.orchestrator import ensure_resident, register_adapters, set_policy

    probe = set_policy(engine, "unmerge-only")
    names = register_adapters(engine, slots, min(8, slots), args.rank, seed=0)
    ensure_resident(engine, names)
    cap = kv_capacity_blocks(engine)
    block = engine.config.cache.block_size
    result["engine"] = {"build_s": build_s, "slots": slots, "slot_bytes": slot_bytes, "kv_capacity_tokens": cap * block if cap else None,
                        "model_info": {k: v for k, v in engine.model_info.items() if isinstance(v, (str, int, float, dict, list, type(None)))},
                        "config": engine.config.to_dict(), "gemv": gemv_status(engine)}
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        result["engine"]["memory_gib"] = {"free": free / GIB, "total": total / GIB}
    print(f"engine: built in {build_s:.0f} s, {slots} adapter slots of rank {args.rank}, "
          f"KV pool {cap * block if cap else '?'} tokens", flush=True)

    decode_rows: list[dict] = result["decode"]
    lora_path = None
    overlap = engine.overlap
    gemv_rows = engine.runner.gemv_max_rows
    if gemv_rows or "gemv" in variants:
        g = result["engine"]["gemv"]
        print(f"gemv: engine.gemv_max_rows {gemv_rows}, table {g['table_file'] or 'the committed one'}, launches "
              + ", ".join(f"{k} {v}" for k, v in g["launches"].items()), flush=True)
    for variant in variants:
        engine.flush()
        engine.overlap = overlap if variant != "sync" else False  # sync: the base model, each step read back before the next
        if variant == "gemv":
            t0 = time.perf_counter()
            set_gemv_rows(engine, args.gemv_rows)
            print(f"gemv: engine.gemv_max_rows {args.gemv_rows}, graphs captured again in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        if variant == "merged":
            set_policy(engine, "merge-only")
        elif variant == "lora" and hasattr(probe, "reset"):
            probe.reset()
        for ctx in contexts:
            for b in batches:
                row: dict[str, Any] = {"variant": variant, "batch": b, "context": ctx,
                                       "gemv_max_rows": engine.runner.gemv_max_rows}
                n_ad = min(b, slots) if variant == "lora" else 0
                row.update(decode_floor(dims, b, ctx, rates["copy_gbs"], adapters=n_ad, rank=args.rank))
                max_tokens = decode_max_tokens(b, args.warmup, args.steps)
                need = b * -(-(ctx + max_tokens) // block)
                if cap is not None and need > cap:
                    row["skipped"] = (f"does not fit: {need * block * dims.kv_bytes_per_token / GIB:.1f} GiB of KV, "
                                      f"the pool holds {cap * block * dims.kv_bytes_per_token / GIB:.1f} GiB")
                elif ctx + max_tokens > engine.max_model_len:
                    row["skipped"] = f"context {ctx} + {max_tokens} tokens > max_model_len {engine.max_model_len}"
                elif deadline.passed():
                    row["skipped"] = "deadline"
                else:
                    try:
                        row.update(decode_point(engine, variant, b, ctx, names, args.steps, args.warmup))
                        # The floor of the context the timed steps actually had (a few tokens past ctx).
                        row.update(decode_floor(dims, b, round(row["context_mean"]), rates["copy_gbs"], adapters=n_ad, rank=args.rank))
                    except Exception as e:  # recorded; the engine is emptied and the run goes on
                        row["error"] = f"{type(e).__name__}: {e}"
                        engine.fail_all("cancelled", "benchmark point failed")
                        free_memory(device)
                decode_rows.append(row)
                print_decode_row(row, plain)
        if variant == "lora":
            lora_path = lora_compute_path(probe)
        if variant == "merged":
            probe = set_policy(engine, "unmerge-only")  # the adapter is taken out of the weights again
        if variant == "gemv":
            set_gemv_rows(engine, gemv_rows)
    engine.flush()
    engine.overlap = overlap
    result["engine"]["step_overlap"] = overlap
    result["engine"]["lora_compute_path"] = lora_path
    result["engine"]["atmm"] = atmm_status()

    if args.profile:
        pb = args.profile_batch if args.profile_batch in batches else max(batches)
        try:
            result["profile"] = profile_decode(engine, pb, contexts[0])
            print_profile(result["profile"])
        except Exception as e:
            result["profile"] = {"error": f"{type(e).__name__}: {e}"}
            engine.fail_all("cancelled", "profile failed")
            print(f"profile failed: {result['profile']['error']}", flush=True)
    if args.profile_prefill:
        try:
            result["profile_prefill"] = profile_prefill(engine, args.profile_prefill)
            print_profile(result["profile_prefill"])
        except Exception as e:
            result["profile_prefill"] = {"error": f"{type(e).__name__}: {e}"}
            engine.fail_all("cancelled", "profile failed")
            print(f"prefill profile failed: {result['profile_prefill']['error']}", flush=True)

    prefill_rows = result["prefill"]
    for t in prefills:
        row = {"tokens": t, **prefill_floor(dims, t, rates["matmul_tflops"])}
        if t + 1 > engine.max_model_len:
            row["skipped"] = f"{t} + 1 tokens > max_model_len {engine.max_model_len}"
        elif deadline.passed():
            row["skipped"] = "deadline"
        else:
            try:
                row.update(prefill_point(engine, t, args.prefill_reps))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                engine.fail_all("cancelled", "benchmark point failed")
                free_memory(device)
        prefill_rows.append(row)
        print(f"prefill {t} tokens: " + (f"{row['ms']:.2f} ms (floor {row['floor_ms']:.2f}, {row['ms'] / row['floor_ms']:.2f}x)"
                                         if "ms" in row else row.get("skipped") or row.get("error")), flush=True)

    for m in media:
        row = dict(m)
        if deadline.passed():
            row["skipped"] = "deadline"
        else:
            try:
                row.update(media_point(engine, m, args.media_reps))
                row.update(media_floor(dims, vdims, row, rates["matmul_tflops"]))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                engine.fail_all("cancelled", "benchmark point failed")
                free_memory(device)
        result["media"].append(row)
        print_media_row(row)

    vision_rows = result["vision"]
    for n in images:
        row = {"images": n, **vision_floor(vdims, n, rates["matmul_tflops"])}
        if deadline.passed():
            row["skipped"] = "deadline"
            vision_rows.append(row)
            print(f"vision {n} images: skipped (deadline)", flush=True)
            continue
        try:
            row.update(vision_point(engine, n, 5))
            if "grid" in row:  # Qwen: the floor of the grids the processor made (its pixel bounds may resize)
                flops = vdims.flops([tuple(g) for g in row["grid"]])
                row.update(floor_ms=flops / (rates["matmul_tflops"] * 1e12) * 1e3, flops=flops)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            free_memory(device)
        vision_rows.append(row)
        print(f"vision {n} images: " + (f"{row['ms']:.2f} ms (floor {row['floor_ms']:.2f}, {row['ms'] / row['floor_ms']:.2f}x)"
                                        if "ms" in row else row["error"]), flush=True)


# -- output ---------------------------------------------------------------------------------------

def _f(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def plain_best(plain: dict, b: int, c: int) -> Optional[float]:
    p = plain.get("points", {}).get(f"{b}x{c}", {})
    return min((p[k] for k in ("masked_ms", "exact_ms") if p.get(k) is not None), default=None)


def media_label(r: dict) -> str:
    return f"{r['side']}x{r['side']} image" if r["kind"] == "image" else f"{r['images']}-frame {r['side']}x{r['side']} video"


def print_media_row(r: dict) -> None:
    head = f"media {media_label(r)}:"
    if r.get("ttft_ms") is None:
        print(f"{head} {r.get('skipped') or r.get('error')}", flush=True)
        return
    print(f"{head} {r['prompt_tokens']} prompt tokens ({r['visual_tokens']} visual, grid {r.get('grid')}): "
          f"TTFT {r['ttft_ms']:.1f} ms = prepare {r['prepare_ms']:.1f} + step {r['step_ms']:.1f} "
          f"(vision {r['vision_ms']:.1f}, floor {r['vision_floor_ms']:.2f}; step - vision {r['step_minus_vision_ms']:.1f}, "
          f"prefill floor {r['prefill_floor_ms']:.2f}); step {r['step_ms'] / r['floor_ms']:.2f}x its floor "
          f"{r['floor_ms']:.2f} ms", flush=True)


def print_decode_row(r: dict, plain: dict) -> None:
    head = f"decode {r['variant']:6s} bs{r['batch']:<3d} ctx{r['context']:<5d}"
    if r.get("ms") is None:
        print(f"{head} {r.get('skipped') or r.get('error')}", flush=True)
        return
    best = plain_best(plain, r["batch"], r["context"])
    print(f"{head} {r['ms']:8.2f} ms/step (median {r['median_step_ms']:.2f}), floor {r['floor_ms']:.2f} "
          f"({r['ms'] / r['floor_ms']:.2f}x), plain {_f(best)}, mode {r.get('mode')}, "
          f"{r.get('distinct_adapters', 0)} adapters", flush=True)


def print_tables(res: dict) -> None:
    rows = {(r["variant"], r["batch"], r["context"]): r for r in res["decode"]}
    plain = res.get("plain", {})
    print("\ndecode, ms per step (x floor); lora and merged also x base", flush=True)
    print(f"{'ctx':>5} {'bs':>4} | {'base':>8} {'floor':>7} {'x':>5} | {'plain':>8} {'masked':>8} | "
          f"{'lora':>8} {'floor':>7} {'x base':>6} | {'merged':>8} {'x base':>6}", flush=True)
    for c in res["settings"]["contexts"]:
        for b in res["settings"]["batches"]:
            base, lora, merged, sync, gv = (rows.get((v, b, c), {}) for v in ("base", "lora", "merged", "sync", "gemv"))
            p = plain.get("points", {}).get(f"{b}x{c}", {})
            bm = base.get("ms")
            print(f"{c:>5} {b:>4} | {_f(bm):>8} {_f(base.get('floor_ms')):>7} "
                  f"{_f(bm / base['floor_ms'] if bm else None):>5} | {_f(p.get('exact_ms')):>8} {_f(p.get('masked_ms')):>8} | "
                  f"{_f(lora.get('ms')):>8} {_f(lora.get('floor_ms')):>7} "
                  f"{_f(lora['ms'] / bm if bm and lora.get('ms') else None):>6} | {_f(merged.get('ms')):>8} "
                  f"{_f(merged['ms'] / bm if bm and merged.get('ms') else None, '.3f'):>6}"
                  + (f" | no overlap {_f(sync.get('ms'))}" if sync else "")
                  + (f" | gemv {_f(gv.get('ms'))} ({_f(gv['ms'] / gv['floor_ms'] if gv.get('ms') else None)}x floor, "
                     f"{_f(gv['ms'] / bm if bm and gv.get('ms') else None, '.3f')}x base)" if gv else ""), flush=True)
    print("\nprefill, one prompt", flush=True)
    for r in res["prefill"]:
        print(f"  {r['tokens']:>6} tokens: {_f(r.get('ms')):>8} ms, floor {r['floor_ms']:.2f} ms "
              f"({_f(r['ms'] / r['floor_ms'] if r.get('ms') else None)}x) {r.get('skipped') or r.get('error') or ''}", flush=True)
    if res.get("media"):
        print("image / video requests to their first token", flush=True)
        for r in res["media"]:
            print_media_row(r)
    print("vision tower", flush=True)
    for r in res["vision"]:
        print(f"  {r['images']:>6} images: {_f(r.get('ms')):>8} ms, floor {r['floor_ms']:.2f} ms "
              f"({_f(r['ms'] / r['floor_ms'] if r.get('ms') else None)}x) {r.get('error') or ''}", flush=True)
    print("\ntargets", flush=True)
    for t in res["targets"]:
        verdict = "SKIP" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        print(f"  {verdict}  {t['target']}: {_f(t['value'], '.3f')} (limit {t['limit']}) {t.get('note', '')}", flush=True)
    if res.get("notes"):
        print("notes: " + "; ".join(res["notes"]), flush=True)


def summary_line(res: dict) -> str:
    d = {(r["variant"], r["batch"], r["context"]): r for r in res["decode"] if r.get("ms") is not None}
    parts = [f"{res['preset']} {res['dtype']}, copy {res['rates']['copy_gbs']:.0f} GB/s, matmul {res['rates']['matmul_tflops']:.0f} TFLOP/s"]
    base = [f"bs{b}/ctx{c} {r['ms']:.1f} ({r['ms'] / r['floor_ms']:.2f}x)" for (v, b, c), r in sorted(d.items(), key=lambda kv: (kv[0][2], kv[0][1]))
            if v == "base"]
    if base:
        parts.append("base decode ms (x floor): " + ", ".join(base))
    gv = [f"bs{b}/ctx{c} {r['ms']:.1f} ({r['ms'] / r['floor_ms']:.2f}x)" for (v, b, c), r in sorted(d.items(), key=lambda kv: (kv[0][2], kv[0][1]))
          if v == "gemv"]
    if gv:
        parts.append(f"with gemv (engine.gemv_max_rows {res.get('settings', {}).get('gemv_rows')}) ms (x floor): " + ", ".join(gv))
    plain = res.get("plain", {})
    pl = [f"bs{b}/ctx{c} {plain_best(plain, b, c):.1f}" for (v, b, c) in sorted(d, key=lambda k: (k[2], k[1]))
          if v == "base" and plain_best(plain, b, c) is not None]
    if pl:
        parts.append("plain graphed ms: " + ", ".join(pl))
    for v in ("lora", "merged"):
        xs = [f"bs{b}/ctx{c} {r['ms'] / d[('base', b, c)]['ms']:.2f}" for (vv, b, c), r in sorted(d.items(), key=lambda kv: (kv[0][2], kv[0][1]))
              if vv == v and ("base", b, c) in d]
        if xs:
            parts.append(f"{v} x base: " + ", ".join(xs))
    pf = [f"{r['tokens']} {r['ms']:.1f} ms ({r['ms'] / r['floor_ms']:.2f}x)" for r in res["prefill"] if r.get("ms") is not None]
    if pf:
        parts.append("prefill: " + ", ".join(pf))
    vi = [f"{r['images']} img {r['ms']:.1f} ms" for r in res["vision"] if r.get("ms") is not None]
    if vi:
        parts.append("vision: " + ", ".join(vi))
    me = [f"{media_label(r)} ({r['prompt_tokens']} tokens) TTFT {r['ttft_ms']:.1f} ms (prepare {r['prepare_ms']:.1f}, "
          f"vision {r['vision_ms']:.1f}, step {r['step_ms']:.1f} = {r['step_ms'] / r['floor_ms']:.2f}x floor)"
          for r in res.get("media", []) if r.get("ttft_ms") is not None]
    if me:
        parts.append("media: " + ", ".join(me))
    t = res["targets"]
    parts.append(f"targets {sum(1 for x in t if x['passed'])} pass / {sum(1 for x in t if x['passed'] is False)} fail / "
                 f"{sum(1 for x in t if x['passed'] is None)} skipped")
    if res.get("plain", {}).get("check") and not res["plain"]["check"]["passed"]:
        parts.append("PLAIN CHECK FAILED")
    return "; ".join(parts)


def write_outputs(res: dict, out: Path, no_record: bool) -> Path:
    dev = res["device"]
    name = res.get("benchmark", NAME)  # engine-floor, or engine-floor-qwen (-qwen2.5) for that family
    line = summary_line(res)
    res["summary"] = line
    if not no_record:
        path = record_result(name, dev, res, line)
        if out.resolve() == path.parent.resolve():
            return path
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{dev}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    (out / f"{name}-{dev}.results-line.md").write_text(
        f"| {time.strftime('%Y-%m-%d')} | {name} | {dev} | {res['commit']} | {line} |\n")
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    sys.exit(main())
