"""Shared by the benchmark scripts: device naming, the commit, and where results are written."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


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
