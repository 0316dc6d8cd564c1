"""The engine against its floors, in one run: decode, prefill and vision-tower times of the real engine
(LLaVA-1.5-7B dimensions, random weights, bf16), each next to the time the hardware needs at least and
next to a plain PyTorch decode step captured in a CUDA graph (benchmarks/plain_decode.py).

    python -m benchmarks.engine_floor --out $OUT --deadline-s 420    # the full grid
    python -m benchmarks.engine_floor --quick                          # batch 1 and 32, context 700, prefill 600
    python -m benchmarks.engine_floor --quick --profile                # plus torch.profiler over 5 decode steps
    python -m benchmarks.engine_floor --device cpu --quick --no-record # the tiny model on a CPU (a smoke run)
    python -m benchmarks.engine_floor --preset configs/models/qwen2-vl-7b.yaml --quick --deadline-s 200  # Qwen2-VL-7B
    python -m benchmarks.engine_floor --batches 1,8 --contexts 700 --gemv-max-rows 0 --variants base,gemv --skip-plain  # cuBLAS vs gemv

The 7B model folder is written under ``--work`` on first use (random weights, the folder engine_decode.py uses).
Points whose KV cache cannot fit are skipped and say so (on an 80 GB card, batch 64 at 2,000 tokens of context).
What is measured (every point in this one process, on this one device):
- decode: ms per ``LLMEngine.step()`` of a running batch of B requests prefilled to the context (random prompt
  tokens, EOS ignored), the mean of ``--steps`` steps after ``--warmup``. Variants: ``base`` (no adapter), ``lora``
  (one distinct rank-``--rank`` q/k/v/o adapter per request, unmerged, in device slots), ``merged`` (one adapter
  merged by the merge-only policy), ``sync`` (base without the step overlap) and ``gemv`` (base with
  ``engine.gemv_max_rows`` at ``--gemv-rows``, its graphs captured again, so that one run times both kernels).
- plain: the same decode shape in plain PyTorch, one CUDA graph per step, on the same model folder (loaded once more
  and freed before the engine is built), checked first against a transformers forward.
- prefill: ms of the step that prefills one prompt of T tokens (asking for one output token), on an engine whose
  scheduler.max_batch_size is at least the server's default (32), as its prefill graphs' LoRA segments are.
- vision: ms of ``runner.encode_images`` on 1 and 8 images (random pixels; Qwen: 448x448 images, 256 tokens each).
- media (Qwen2-VL family; ``--media``, default one 448x448 image and a 16-frame 448x448 video): one request of noise
  PNGs asking for one token, prefilled alone: ms of ``inputs.prepare``, of the step (new pixels every repetition: no
  encoder-cache hit) and TTFT (the two), then the vision tower alone on the same pixels.

Floors (``benchmarks/floors.py``, which says what each counts; rates measured in this run): decode = bytes / copy
rate, prefill, vision and media = FLOPs / matmul rate. Profiles (``--profile``, ``--profile-prefill``): read by
``benchmarks/profiling.py``.

Targets (the project issue), each printed PASS/FAIL: base decode <= 1.3x floor at every point and faster than the
plain graphed step (the faster attention variant); unmerged LoRA <= 1.2x base at batch 1 and <= 1.3x at batch 32;
merged within 3% of base; prefill <= 1.4x its floor.

Writes ``<out>/engine-floor-<device>.json`` (with ``<out>/engine-floor-<device>.results-line.md`` where ``--out``
is not benchmarks/results) and, unless ``--no-record``, results/engine-floor-<device>.json and a line in
benchmarks/RESULTS.md; a Qwen2-VL model's are ``engine-floor-qwen`` (Qwen2.5-VL: ``engine-floor-qwen2.5``). A point
that fails is recorded with its error and the run goes on. Exits 1 when the plain step fails or does not match
transformers, or the engine part stops early; 3 on a slow host (``--slow-host-x``: the first plain point far
above its floor; nothing is recorded); missed targets do not change the exit status.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.common import (ROOT, RESULTS, Deadline, device_name, ensure_resident, free_memory, git_commit, model_folder, noise_png,
                               numbers, register_adapters, set_policy, sync_fn)
from benchmarks.engine_floor_report import (NAME, evaluate_targets, floor_text, media_label, print_decode_row, print_media_row, print_tables,
                                            write_outputs)
from benchmarks.floors import (GIB, LORA_TARGETS, QWEN_IMAGE_SIDE, QWEN_TYPES, ModelDims, VisionDims, decode_floor, measure_rates,
                               media_floor, plan_slots, prefill_floor, vision_dims, vision_floor)
from benchmarks.profiling import activities, gpu_timeline, kernel_table, print_profile, python_rows

FULL = dict(batches="1,8,32,64", contexts="700,2000", prefill="600,2300,8000", images="1,8")
QUICK = dict(batches="1,32", contexts="700", prefill="600", images="1,8")
QWEN_MEDIA = "image:448,video:16x448"  # --media auto on a Qwen2-VL-family model (none on LLaVA)
CUDA_RESERVE = 8 * GIB  # activations, graphs and a first KV pool, beside the weights and the adapter slots
PLAIN_MARGIN = 3 * GIB  # free memory the plain decoder leaves beside its cache (graph pool, activations)


# -- the model folder -----------------------------------------------------------------------------

def make_model(args: argparse.Namespace, max_prompt: int, device) -> tuple[Path, float]:
    """The model folder and the seconds it took to make. A preset's folder is written on first use
    (``<work>/<preset stem>``, the one engine_decode.py uses: same seed, same weights); where the preset's
    context is shorter than the largest prompt, a sibling folder links to its files and carries a config
    with a longer ``max_position_embeddings`` (no weight depends on it)."""
    t0 = time.perf_counter()
    if args.model:
        return Path(args.model), 0.0
    work = Path(args.work)
    base = model_folder(args.preset or "tiny-llava", work, device.type == "cuda")
    if args.preset in (None, "tiny-llava", "tiny-qwen2-vl"):  # the tiny models: no preset YAML to stretch
        return base, time.perf_counter() - t0
    from vlora.models.random_init import load_preset

    preset = Path(args.preset) if Path(args.preset).is_absolute() else ROOT / args.preset
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
            per_batch = max_len * dims.kv_bytes_per_token  # the static cache of one sequence
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

def build(args: argparse.Namespace, model_dir: Path, device, dtype_name: str, slots: int, max_batch: int, budget_tokens: int,
          max_images: int = 8, media: Optional[list[dict]] = None):
    """The engine under test: unmerge-only, ``--attention``, and ``--prefill-graph-tokens`` / ``--gemv-max-rows``
    where given (else the config's); the ``media`` items' sizes captured at load where the tower takes many
    grids (``engine.vision_graph_grids``, as a deployment names its cameras' sizes)."""
    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    cfg = EngineConfig().with_overrides({
        "model.path": str(model_dir), "model.device": str(device), "model.dtype": dtype_name, "lora.adapter_root": None,
        "lora.max_gpu_adapters": slots, "lora.max_cpu_adapters": slots, "lora.max_rank": args.rank,
        "lora.target_modules": list(LORA_TARGETS), "scheduler.max_batch_size": max_batch,
        "scheduler.max_num_batched_tokens": budget_tokens, "orchestrator.policy": "unmerge-only",
        "limits.max_images": max(8, max_images),  # a video's frames are its images
        "atmm.tune_at_load": "never",  # no tuner sidecar sharing the GPU while we time
        "engine.attention": args.attention,
        **({"engine.prefill_graph_tokens": args.prefill_graph_tokens} if args.prefill_graph_tokens is not None else {}),
        **({"engine.gemv_max_rows": args.gemv_max_rows} if args.gemv_max_rows is not None else {}),
        **({"engine.vision_graph_grids": sorted({f"{m['side']}x{m['side']}" if m["kind"] == "image" else
                                                 f"{m['images']}x{m['side']}x{m['side']}" for m in media} | {"448x448"})}
           if media else {})})
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


_USED_LENGTHS: set[int] = set()  # prompt lengths this process has prefilled


def _new_length(tokens: int) -> int:
    """The first length from ``tokens + 1`` up that this process has not prefilled: a shape new to every kernel
    that plans, autotunes or compiles per shape, as a user's next prompt is."""
    n = tokens + 1
    while n in _USED_LENGTHS:
        n += 1
    return n


def _prefill_once(engine, tokens: int, label: str, adapter: Optional[str] = None) -> float:
    """Seconds of the step that prefills one new prompt of ``tokens`` tokens (its own tokens: no prefix hit),
    for ``adapter`` (resident: unmerged LoRA) or the base model."""
    _USED_LENGTHS.add(tokens)
    run = BatchRun(engine, 1, tokens, [adapter], 1, label, seed=next(_PREFILL_SEEDS))
    try:
        run.sync()
        t0 = time.perf_counter()
        last = engine.step()
        if last is None:
            raise RuntimeError(f"the prefill step did not run ({run.errors[:1]})")
        run.sync()
        dt = time.perf_counter() - t0
        if last.num_prefill != 1 or last.partial_prefills:
            raise RuntimeError(f"expected one whole prefill, the step ran {last.num_prefill} "
                               f"({len(last.partial_prefills)} in part)")
    finally:
        run.close()
    return dt


def prefill_point(engine, tokens: int, reps: int, adapter: Optional[str] = None) -> dict:
    """ms of the step that prefills one prompt, each prompt new to the engine (a prompt seen before would run
    only past its cached prefix): after one warm-up, ``reps`` prompts of lengths this process has never run
    (``tokens`` + 1, + 2, ...: the figure, ``ms``), then ``reps`` of exactly ``tokens`` (``repeated_ms``: what
    per-shape plans and caches make of a length seen before). With ``adapter``: each prompt for that resident
    adapter (unmerged LoRA on every targeted projection)."""
    tag = f"prefill-{tokens}" + (f"-{adapter}" if adapter else "")
    _prefill_once(engine, tokens, f"{tag}-warm", adapter)
    new = [_prefill_once(engine, _new_length(tokens), f"{tag}-new{i}", adapter) for i in range(reps)]
    repeated = [_prefill_once(engine, tokens, f"{tag}-again{i}", adapter) for i in range(reps)]
    return {"ms": 1e3 * statistics.mean(new), "min_ms": 1e3 * min(new), "repeated_ms": 1e3 * statistics.mean(repeated),
            "new_lengths": True, "reps": reps}


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
        runner.encode(pv, grid, video=video)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            runner.encode(pv, grid, video=video)
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


def profile_media(engine, m: dict, reps: int = 3, top: int = 15) -> dict:
    """Where one image or video request's time goes, each request with new pixels: cProfile and torch.profiler
    over ``inputs.prepare`` (``prepare``), over the vision tower and merger alone on its pixels (``vision``),
    and over the engine step that prefills it (``step``), each part in its own profile (one warm-up request
    first, unprofiled). Each part: the top kernels, the GPU's idle time per call (``timeline``) and the host's
    Python functions by own time."""
    import cProfile

    import torch
    from torch.profiler import profile, record_function

    from vlora.engine.api import GenerationRequest, SamplingParams
    from vlora.models.qwen2_vl import VIDEO_PLACEHOLDER

    runner = engine.runner
    loaded, family = runner.loaded, runner.loaded.family
    video = m["kind"] == "video"
    text = f"{VIDEO_PLACEHOLDER}What happens in this video?" if video else f"{family.image_placeholder}What is in this picture?"
    sync = sync_fn(runner.device)
    seeds = iter(range(7_000_000, 8_000_000, 1000))
    errors: list = []

    def request():
        frames = [noise_png(next(seeds) + j, m["side"]) for j in range(m["images"])]
        return GenerationRequest(f"profile-media-{time.monotonic_ns()}", text, images=frames,
                                 sampling=SamplingParams(max_tokens=1))

    def prepare():
        return engine.inputs.prepare(request())

    def pixels():
        prepared = prepare()
        return prepared.pixel_values.to(runner.device, runner.dtype), prepared.image_grid_thw

    def vision(args):
        with torch.inference_mode():
            return runner.encode(args[0], args[1], video=video)

    def step(prepared):
        engine.add_request(prepared, lambda out: errors.append(out.error) if out.finished and out.error else None)
        ran = engine.step()
        engine.flush()
        if ran is None or ran.num_prefill != 1 or errors:
            engine.fail_all("cancelled", "profile failed")
            raise RuntimeError(f"the {m['kind']} prefill step did not run alone ({errors[:1]})")
        if engine.has_work():
            engine.fail_all("cancelled", "profile done")

    out = {"what": f"media {media_label(m)}", "reps": reps}
    for part, setup, fn in (("prepare", request, engine.inputs.prepare), ("vision", pixels, vision), ("step", prepare, step)):
        inputs = [setup() for _ in range(reps + 1)]
        sync()
        fn(inputs[0])  # warm-up
        sync()
        py = cProfile.Profile()
        with profile(activities=activities(runner.device)) as prof:
            for x in inputs[1:]:
                with record_function("vlora_step"):
                    py.enable()
                    fn(x)
                    sync()
                    py.disable()
        out[part] = {**kernel_table(prof, reps, top), "timeline": gpu_timeline(prof), "python": python_rows(py, reps, top)}
    return out


def print_media_profile(p: dict) -> None:
    print(f"\nprofile: {p['what']}, {p['reps']} requests with new pixels, per request:", flush=True)
    for k in ("prepare", "vision", "step"):
        q = p[k]
        t = q.get("timeline") or {}
        print(f"  {k}: wall {t.get('wall', float('nan')):.2f} ms, GPU kernels {q['gpu_kernel_ms_per_step']:.2f} ms, "
              f"{q['kernels_per_step']:.0f} kernels; GPU idle {t.get('before_first', float('nan')):.2f} before the first kernel, "
              f"{t.get('between', float('nan')):.2f} between, {t.get('after_last', float('nan')):.2f} after the last", flush=True)
        for r in q["top_kernels"][:8]:
            print(f"    {r['us_per_step']:9.1f} us  {r['calls_per_step']:6.1f} calls  {r['name'][:100]}", flush=True)
        for r in q["python"][:10]:
            print(f"    py {r['own_us_per_step']:9.1f} us own {r['cum_us_per_step']:9.1f} cum {r['calls_per_step']:7.1f} calls  "
                  f"{r['name'][:90]}", flush=True)


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
        with profile(activities=activities(engine.runner.device)) as prof:
            t0 = time.perf_counter()
            run.steps(steps)
            run.sync()
            prof_wall = (time.perf_counter() - t0) / steps
    finally:
        run.close()
    return {"what": "base decode", "batch": batch, "context": context, "steps": steps, "cpu_wall_ms_per_step": 1e3 * plain_wall,
            "profiled_wall_ms_per_step": 1e3 * prof_wall, **kernel_table(prof, steps, top)}


def profile_prefill(engine, tokens: int, steps: int = 3, top: int = 15, adapter: Optional[str] = None) -> dict:
    """torch.profiler over ``steps`` steps that each prefill one prompt of ``tokens`` tokens (after one
    unprofiled warm-up), for ``adapter`` or the base model: the same table as :func:`profile_decode`."""
    from torch.profiler import profile, record_function

    plain_wall = prefill_point(engine, tokens, steps, adapter=adapter)["ms"]
    walls = []
    with profile(activities=activities(engine.runner.device)) as prof:
        for i in range(steps):
            run = BatchRun(engine, 1, tokens, [adapter], 1, f"profile-prefill-{tokens}-{i}", seed=next(_PREFILL_SEEDS))
            try:
                run.sync()
                t0 = time.perf_counter()
                with record_function("vlora_step"):
                    engine.step()
                    run.sync()
                walls.append(time.perf_counter() - t0)
            finally:
                run.close()
    return {"what": "prefill" + (" with one adapter" if adapter else " (base)"), "batch": 1, "context": tokens, "steps": steps,
            "cpu_wall_ms_per_step": plain_wall, "profiled_wall_ms_per_step": 1e3 * statistics.mean(walls),
            **kernel_table(prof, steps, top), "timeline": gpu_timeline(prof),
            "python": _python_profile(engine, tokens, steps, top, adapter)}


def _python_profile(engine, tokens: int, steps: int, top: int, adapter: Optional[str] = None) -> list[dict]:
    """cProfile over ``steps`` prefill steps: the host's Python functions by own time per step (where an
    eager step's host time goes, which torch.profiler's op table does not show)."""
    import cProfile

    prof = cProfile.Profile()
    for i in range(steps):
        run = BatchRun(engine, 1, tokens, [adapter], 1, f"pyprofile-prefill-{tokens}-{i}", seed=next(_PREFILL_SEEDS))
        try:
            run.sync()
            prof.enable()
            engine.step()
            run.sync()
            prof.disable()
        finally:
            run.close()
    return python_rows(prof, steps, top)


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


# -- the run --------------------------------------------------------------------------------------

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
    p.add_argument("--profile-prefill", type=int, help="also profile prefill steps of one prompt of this many tokens "
                   "(and, with the lora variant, of one for a resident adapter)")
    p.add_argument("--profile-media", action="store_true", help="also profile each --media request: prepare, vision "
                   "tower, prefill step (torch.profiler and cProfile)")
    p.add_argument("--slow-host-x", type=float, default=3.0,
                   help="exit 3 (nothing recorded) when the first plain point takes more than this many times its "
                        "memory floor: some device hosts run every kernel 4-12x slow (0: no check)")
    p.add_argument("--deadline-s", type=float, help="start no point after this many seconds (the rest is marked skipped)")
    p.add_argument("--no-record", action="store_true", help="no line in RESULTS.md, no copy in benchmarks/results")
    p.add_argument("--cpu-threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
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
    batches = numbers(args.batches or grid["batches"], int)
    contexts = numbers(args.contexts or grid["contexts"], int)
    prefills = numbers(args.prefill or grid["prefill"], int)
    images = numbers(args.images or grid["images"], int)
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
    model_dir, make_s = make_model(args, longest, device)
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
    # At least the server's max_batch_size: the prefill graphs carry that many LoRA segments (empty ones too), and
    # a one-prompt LoRA prefill over one segment read 1.17x base on an H200 where the server's 32 read 1.21-1.23x.
    from vlora.config import EngineConfig

    max_batch = max(max(batches), EngineConfig().scheduler.max_batch_size)
    engine = build(args, model_dir, device, dtype_name, slots, max_batch, max(16384, max(prefills) + 16),
                   max_images=max([m["images"] for m in media], default=1), media=media)
    build_s = time.perf_counter() - t0
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

    def measure(row: dict, skipped: Optional[str], fn: Callable[[], Any]) -> dict:
        """``row`` measured by ``fn`` unless it is skipped (or the deadline passed); a failure is recorded, the engine
        emptied, and the run goes on."""
        if skipped or deadline.passed():
            row["skipped"] = skipped or "deadline"
            return row
        try:
            fn()
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            engine.fail_all("cancelled", "benchmark point failed")
            free_memory(device)
        return row

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
        elif variant == "lora":
            probe.reset()
        for ctx in contexts:
            for b in batches:
                n_ad = min(b, slots) if variant == "lora" else 0
                row: dict[str, Any] = {"variant": variant, "batch": b, "context": ctx, "gemv_max_rows": engine.runner.gemv_max_rows,
                                       **decode_floor(dims, b, ctx, rates["copy_gbs"], adapters=n_ad, rank=args.rank)}
                max_tokens = decode_max_tokens(b, args.warmup, args.steps)
                need = b * -(-(ctx + max_tokens) // block)
                skipped = (f"does not fit: {need * block * dims.kv_bytes_per_token / GIB:.1f} GiB of KV, the pool holds "
                           f"{cap * block * dims.kv_bytes_per_token / GIB:.1f} GiB" if cap is not None and need > cap else
                           f"context {ctx} + {max_tokens} tokens > max_model_len {engine.max_model_len}"
                           if ctx + max_tokens > engine.max_model_len else None)

                def point(row=row, variant=variant, b=b, ctx=ctx, n_ad=n_ad) -> None:
                    row.update(decode_point(engine, variant, b, ctx, names, args.steps, args.warmup))
                    # The floor of the context the timed steps actually had (a few tokens past ctx).
                    row.update(decode_floor(dims, b, round(row["context_mean"]), rates["copy_gbs"], adapters=n_ad, rank=args.rank))

                result["decode"].append(measure(row, skipped, point))
                print_decode_row(row, plain)
        if variant == "lora":
            lora_path = probe.summary()
        if variant == "merged":
            probe = set_policy(engine, "unmerge-only")  # the adapter is taken out of the weights again
        if variant == "gemv":
            set_gemv_rows(engine, gemv_rows)
    engine.flush()
    engine.overlap = overlap
    result["engine"].update(step_overlap=overlap, lora_compute_path=lora_path, atmm=atmm_status())

    profiles = {"profile": (args.profile, "", lambda: profile_decode(
                    engine, args.profile_batch if args.profile_batch in batches else max(batches), contexts[0])),
                "profile_prefill": (args.profile_prefill, "prefill ", lambda: profile_prefill(engine, args.profile_prefill)),
                "profile_prefill_lora": (args.profile_prefill and "lora" in variants and names, "LoRA prefill ",
                                         lambda: profile_prefill(engine, args.profile_prefill, adapter=names[0]))}
    for key, (wanted, what, run) in profiles.items():
        if not wanted:
            continue
        try:
            result[key] = run()
            print_profile(result[key])
        except Exception as e:
            result[key] = {"error": f"{type(e).__name__}: {e}"}
            engine.fail_all("cancelled", "profile failed")
            print(f"{what}profile failed: {result[key]['error']}", flush=True)

    for t in prefills:
        row = {"tokens": t, **prefill_floor(dims, t, rates["matmul_tflops"])}
        too_long = f"{t} + 1 tokens > max_model_len {engine.max_model_len}" if t + 1 > engine.max_model_len else None
        result["prefill"].append(measure(row, too_long, lambda row=row, t=t: row.update(prefill_point(engine, t, args.prefill_reps))))
        if "lora" in variants and names and row.get("ms") is not None:
            def lora_prefill(row=row, t=t) -> None:
                p = prefill_point(engine, t, args.prefill_reps, adapter=names[0])
                row.update(lora_ms=p["ms"], lora_repeated_ms=p["repeated_ms"], lora_x_base=p["ms"] / row["ms"])
            measure(row, None, lora_prefill)
        print(f"prefill {t} tokens: {floor_text(row)}"
              + (f"; one rank-{args.rank} adapter {row['lora_ms']:.2f} ms ({row['lora_x_base']:.2f}x base)" if "lora_ms" in row else ""),
              flush=True)

    for m in media:
        row = dict(m)

        def media_request(row=row, m=m) -> None:
            row.update(media_point(engine, m, args.media_reps))
            row.update(media_floor(dims, vdims, row, rates["matmul_tflops"]))

        result["media"].append(measure(row, None, media_request))
        print_media_row(row)
        if args.profile_media:
            try:
                row["profile"] = profile_media(engine, m)
                print_media_profile(row["profile"])
            except Exception as e:
                row["profile"] = {"error": f"{type(e).__name__}: {e}"}
                engine.fail_all("cancelled", "profile failed")
                print(f"media profile failed: {row['profile']['error']}", flush=True)

    for n in images:
        row = {"images": n, **vision_floor(vdims, n, rates["matmul_tflops"])}

        def vision(row=row, n=n) -> None:
            row.update(vision_point(engine, n, 5))
            if "grid" in row:  # Qwen: the floor of the grids the processor made (its pixel bounds may resize)
                flops = vdims.flops([tuple(g) for g in row["grid"]])
                row.update(floor_ms=flops / (rates["matmul_tflops"] * 1e12) * 1e3, flops=flops)

        result["vision"].append(measure(row, None, vision))
        print(f"vision {n} images: {floor_text(row)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
