"""benchmarks/vision_apps.py runs end to end on the tiny models on a CPU and writes its JSON (the GPU figures
come from the same code)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vision_apps_tiny(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vision_apps", "--tiny", "--reps", "1", "--no-record",
                           "--out", str(tmp_path), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "vision-apps-cpu.json").read_text())
    llava, qwen = result["models"]
    assert llava["image"]["prompt_tokens"] > 0 and llava["image"]["ttft_ms_p50"] > 0 and "video16" not in llava
    assert qwen["video16"]["images"] == 16 and qwen["image"]["grid"]
