"""Shared by the benchmark scripts: device naming, the commit, where results are written, and the model
presets, options, model folders and engines of the scripts that time the engine on them."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Mapping, Optional

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
                 overrides: Optional[Mapping[str, Any]] = None) -> Path:
    """The model folder of one of ``--presets``: ``tiny-llava`` and ``tiny-qwen2-vl`` are the tiny models
    (under ``tiny_dir``, by default their own cache folder); any other name is a preset YAML (relative to
    the repository root unless absolute) whose model with random weights (``overrides`` on its config) is
    written to ``<work>/<preset stem><suffix>``. Either is made on first use."""
    if preset == "tiny-llava":
        from vlora.models.tiny import ensure_tiny_model

        return ensure_tiny_model(tiny_dir)
    if preset == "tiny-qwen2-vl":
        from vlora.models.tiny_qwen import ensure_tiny_qwen

        return ensure_tiny_qwen(tiny_dir, variant="qwen2_vl")
    from vlora.models.random_init import make_random_model

    path = Path(preset) if Path(preset).is_absolute() else ROOT / preset
    return make_random_model(path, work / f"{path.stem}{suffix}", device="cuda" if cuda else "cpu", overrides=overrides)


def build_model_engine(model_dir: Path, device, settings: Mapping[str, Any]):
    """An engine on ``model_dir`` and ``device`` (bf16 on CUDA, fp32 elsewhere) with no CUDA graphs and no
    tuning at load, ``settings`` (``{"section.field": value}``) the script's own overrides."""
    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    return build_engine(EngineConfig().with_overrides({
        "model.path": str(model_dir), "model.device": str(device),
        "model.dtype": "bfloat16" if device.type == "cuda" else "float32",
        "engine.cuda_graphs": "off", "atmm.tune_at_load": "never", **settings}))
