"""Shared by the benchmark scripts: device naming, the commit, where results are written, the model presets,
options, model folders and engines of the scripts that time the engine on them, and what the scripts that drive an
engine in this process share (number lists, deadlines, device sync, noise images, in-memory adapters, policies)."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import math
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PRESETS = "configs/models/llava-1.5-7b.yaml,configs/models/qwen2-vl-7b.yaml"  # LLaVA-1.5-7B and Qwen2-VL-7B
TINY = "tiny-llava,tiny-qwen2-vl"  # the tiny models of the same two families, for a CPU


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-").lower()
    except ImportError:
        pass
    return "cpu"


def git_commit() -> str:
    """The checkout's commit; VLORA_COMMIT overrides it where the tree was copied without its history
    (the GPU machine's copy of the working tree carries a stale .git)."""
    if os.environ.get("VLORA_COMMIT"):
        return os.environ["VLORA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
        return out.stdout.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record_result(name: str, device: str, result: dict, summary: str) -> Path:
    """Write results/<name>-<device>.json and append one line to RESULTS.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{device}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    line = f"| {datetime.date.today().isoformat()} | {name} | {device} | {result.get('commit', git_commit())} | {summary} |\n"
    md = ROOT / "benchmarks" / "RESULTS.md"
    if not md.exists():
        md.write_text("# Benchmark results\n\nOne line per run, newest last. Full numbers in `results/<name>-<device>.json`.\n\n"
                      "| date | benchmark | device | commit | figures |\n| --- | --- | --- | --- | --- |\n")
    with md.open("a") as fh:
        fh.write(line)
    print(f"wrote {path}\n{line}", end="")
    return path


def write_result(name: str, out: str | os.PathLike, result: dict, summary: str, record: bool) -> Path:
    """Write ``<out>/<name>-<result's device>.json`` and, if ``record``, its copy and RESULTS.md line
    (:func:`record_result`); returns the first."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{result['device']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    if record:
        record_result(name, result["device"], result, summary)
    return path


def model_parser(doc: str, presets_help: str, work_help: str, tiny_help: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of a script that times models of :data:`PRESETS` (``doc``: its description), with the
    options they all take: ``--device``, ``--presets``, ``--tiny`` (where ``tiny_help`` is given), ``--work``
    and ``--out``; the script adds its own after these."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--presets", help=presets_help)
    if tiny_help is not None:
        p.add_argument("--tiny", action="store_true", help=tiny_help)
    p.add_argument("--work", default="/tmp/vlora-bench", help=work_help)
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON (default benchmarks/results)")
    return p


def model_folder(preset: str, work: Path, cuda: bool, *, tiny_dir: Optional[Path] = None, suffix: str = "",
                 overrides: Optional[Mapping[str, Any]] = None, prefix: str = "") -> Path:
    """The model folder of one of ``--presets``: ``tiny-llava`` and ``tiny-qwen2-vl`` are the tiny models
    (under ``tiny_dir``, by default their own cache folder); any other name is a preset YAML (relative to
    the repository root unless absolute) whose model with random weights (``overrides`` on its config) is
    written to ``<work>/<prefix><preset stem><suffix>``. Either is made on first use."""
    if preset == "tiny-llava":
        from vlora.models.tiny import ensure_tiny_model

        return ensure_tiny_model(tiny_dir)
    if preset == "tiny-qwen2-vl":
        from vlora.models.tiny_qwen import ensure_tiny_qwen

        return ensure_tiny_qwen(tiny_dir, variant="qwen2_vl")
    from vlora.models.random_init import make_random_model

    path = Path(preset) if Path(preset).is_absolute() else ROOT / preset
    return make_random_model(path, work / f"{prefix}{path.stem}{suffix}", device="cuda" if cuda else "cpu", overrides=overrides)


def build_model_engine(model_dir: Path, device, settings: Mapping[str, Any]):
    """An engine on ``model_dir`` and ``device`` (bf16 on CUDA, fp32 elsewhere) with no CUDA graphs and no
    tuning at load, ``settings`` (``{"section.field": value}``) the script's own overrides."""
    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    return build_engine(EngineConfig().with_overrides({
        "model.path": str(model_dir), "model.device": str(device),
        "model.dtype": "bfloat16" if device.type == "cuda" else "float32",
        "engine.cuda_graphs": "off", "atmm.tune_at_load": "never", **settings}))


# -- small helpers of the scripts that drive an engine in this process --------------------------------------

def numbers(text: str, kind: Callable[[str], Any] = float) -> list:
    """A comma-separated list of numbers (``kind`` each); empty items are skipped."""
    return [kind(x) for x in str(text).split(",") if x.strip()]


class Deadline:
    """``seconds`` from now (None: never): :meth:`passed` once they are over."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.t0, self.seconds = time.monotonic(), seconds

    def passed(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.t0 > self.seconds


def sync_fn(device) -> Callable[[], None]:
    """Waits for ``device`` (a torch.device) to finish its work; nothing on a CPU."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def free_memory(device) -> None:
    """Collect garbage and, on CUDA, give the cached blocks back."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def noise_png(seed: int, side: int) -> bytes:
    """A side x side RGB PNG of uniform noise (each seed its own content: no encoder-cache hit)."""
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def register_adapters(engine, count: int, distinct: int, rank: int, seed: int) -> list[str]:
    """``count`` adapter names over ``distinct`` random weight sets (rank ``rank``, every targeted
    projection of every layer), registered in memory. On CUDA they are held as the host tier stages
    adapters (the slots' dtype, pinned memory), so every adapter is in host memory, as in S-LoRA and
    V-LoRA, and a swap is one asynchronous host-to-device copy; on a CPU, float32 like a loaded adapter."""
    import torch

    from vlora.lora.adapter import AdapterWeights, LoraPair
    from vlora.lora.demo import TARGET_DELTA

    runner = engine.runner
    dims = runner.module_dims()
    modules = tuple(engine.config.lora.target_modules)
    scale = 2.0  # lora_alpha = 2 r
    dev = runner.device

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.to(runner.dtype).cpu().pin_memory() if dev.type == "cuda" else t.float().cpu()

    gen = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(min(distinct, count)):
        pairs = {}
        for layer in range(runner.num_layers):
            for m in modules:
                d_in, d_out = dims[m]
                a = torch.randn(rank, d_in, generator=gen, device=dev) / math.sqrt(d_in)
                b = torch.randn(d_out, rank, generator=gen, device=dev) * (TARGET_DELTA / (scale * math.sqrt(rank)))
                pairs[(layer, m)] = LoraPair(a=host(a), b=host(b), scale=scale)
        sets.append(pairs)
    width = max(3, len(str(count - 1)))
    names = [f"bench-{i:0{width}d}" for i in range(count)]
    for i, name in enumerate(names):
        engine.loras.register(name, AdapterWeights(name=name, dir=Path("<in-memory>"), pairs=sets[i % len(sets)],
                                                   ranks={m: rank for m in modules}, max_rank=rank, target_modules=modules))
    return names


def ensure_resident(engine, names: list[str]) -> None:
    """Each of ``names`` copied into a device slot once (slot loads are not part of a timed step)."""
    for name in names:
        slot = engine.loras.acquire(name)
        if slot is not None:
            engine.loras.release(slot)


class ComputeProbe:
    """Wraps the step's LoRA backend (vlora.lora.backends); classifies which path served the first
    eager calls of a cell (the check is not free, so only ``checks`` calls are classified; the rest are
    only counted). Captured decode steps replay without calling it: their calls are not counted."""

    def __init__(self, backend, checks: int = 16) -> None:
        self.backend, self.name, self.checks_per_cell = backend, backend.name, checks
        self.fn = backend.segments
        self.reset()

    def segments(self, *args):
        return self(*args)

    def rows(self, *args):
        return self.backend.rows(*args)

    def reset(self) -> None:
        self.calls = 0
        self.checks = self.checks_per_cell
        self.paths: Counter = Counter()

    def __call__(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        self.calls += 1
        if self.checks > 0 and mapping.has_lora:
            self.checks -= 1
            self.paths[self.classify(y, x, lora_a, lora_b, ranks, scales, mapping)] += 1
        return self.fn(y, x, lora_a, lora_b, ranks, scales, mapping)

    def classify(self, y, x, lora_a, lora_b, ranks, scales, mapping) -> str:
        if self.name != "atmm":
            return self.name
        if not y.is_cuda:
            return "atmm: PyTorch reference (CPU)"
        from vlora.atmm.dispatch import default_kernels

        why = default_kernels().unsupported(y, x, lora_a, lora_b, ranks, scales, mapping)
        return "atmm: CUDA extension vlora_atmm_ext" if not why else f"atmm: PyTorch reference ({why})"

    def summary(self) -> str:
        if not self.paths:
            return "no unmerged LoRA compute"
        return "; ".join(f"{k} ({v} of the first calls)" if len(self.paths) > 1 else k for k, v in self.paths.items())


def set_policy(engine, policy: str) -> ComputeProbe:
    """Give the engine a fresh orchestrator for ``policy`` (base weights clean first), its missing graphs
    captured, and a :class:`ComputeProbe` around its LoRA backend (returned)."""
    engine.flush()
    from vlora.orchestrator.orchestrator import Orchestrator
    from vlora.orchestrator.policies import UNMERGE

    if engine.has_work():
        raise RuntimeError("set_policy: the engine still has requests")
    old = engine.orchestrator
    old.enter(UNMERGE, None)
    old_costs = old.estimates.costs
    cfg = dataclasses.replace(engine.config.orchestrator, policy=policy)
    engine.config = dataclasses.replace(engine.config, orchestrator=cfg)
    engine.use_orchestrator(None)
    del old
    engine.use_orchestrator(Orchestrator(cfg, engine.config.scheduler.max_batch_size, engine.runner, engine.loras,
                                         engine.metrics, costs=old_costs))
    graphs = engine.runner.graphs
    if graphs is not None:  # a step of a timed cell never pays a capture
        graphs.capture_missing()
    ctx = engine.runner.lora_ctx
    probe = ComputeProbe(ctx.backend)
    ctx.backend = probe
    return probe
