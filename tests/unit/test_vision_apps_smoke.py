"""benchmarks/vision_apps.py runs end to end on the tiny models on a CPU and writes its JSON (the GPU figures
come from the same code)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vision_apps_tiny(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vision_apps", "--tiny", "--part", "engine", "--reps", "1", "--no-record",
                           "--out", str(tmp_path), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "vision-apps-cpu.json").read_text())
    llava, qwen = result["models"]
    assert llava["image"]["prompt_tokens"] > 0 and llava["image"]["ttft_ms_p50"] > 0 and "video16" not in llava
    assert qwen["video16"]["images"] == 16 and qwen["image"]["grid"]


def test_vision_apps_through_the_server_tiny(tmp_path):
    """The server part: a real `vlora serve` on the tiny LLaVA, idle new-image requests over HTTP with and without
    an adapter, and both applications at one Poisson rate through the load harness, every request answered."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vision_apps", "--tiny", "--part", "server", "--presets",
                           "tiny-llava", "--reps", "2", "--rates", "2", "--duration", "4", "--adapters", "2", "--rank", "8",
                           "--no-record", "--out", str(tmp_path), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (served,) = json.loads((tmp_path / "vision-apps-cpu.json").read_text())["served"]
    assert served["video_frames"] == 8  # the tiny LLaVA's context holds a whole chunk
    assert served["warm_s"] > 0  # each adapter answered a chunk before the sweeps
    assert served["first_request_ms"] > 0 and served["idle_image_ms_adapter"]["reps"] == 2
    for app in ("visual_retrieval", "video_analytics"):
        (point,) = served[app]
        assert point["requests"] > 0 and point["ok"] == point["requests"], point
        assert point["ttft_s"]["p50"] is not None
        roof = point["roofline"]  # the workload's floor per request, from the lengths the harness saw
        assert roof["compute_ms"] > 0 and roof["decode_ms"] > 0 and point["fraction_of_roofline"] > 0, roof
        assert point["arrival_rps"] == point["requests"] / 4 and point["arrivals_fraction_of_roofline"] > 0
        stages = served[f"{app}_stages"]  # the engine's own timers, read from the server's metrics
        assert {"queue", "image_decode", "preprocess", "vision", "prefill_step"} <= set(stages), stages
        assert all(v["mean_ms"] > 0 and v["count"] > 0 for v in stages.values()), stages
        # the point's own counters: its images are new, so the encoder cache answered none of them
        caches, own = point["server_caches"], point["server_stages"]
        assert caches["encoder_hits"] == 0 and caches["encoder_misses"] > 0, caches
        assert caches["prefix_prompt_tokens"] > 0 and "prefill_step" in own, (caches, own)
        # each sweep's line is printed when it ends, so a run cut short later still shows it
        assert f"vision-apps: tiny-llava {app}" in proc.stdout, proc.stdout[-2000:]


def test_a_llava_chunk_holds_the_frames_its_context_fits(tmp_path):
    """LLaVA-1.5-7B takes a chunk's frames as images of 576 tokens in a 4,096-token context: 8 frames (4,608 tokens)
    are refused by the server, so the benchmark sends 6; a model folder without a fixed-size tower keeps them all."""
    from benchmarks.vision_apps import frames_that_fit

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llava", "vision_config": {"image_size": 336, "patch_size": 14},
        "text_config": {"max_position_embeddings": 4096}}))
    assert frames_that_fit(tmp_path, 8) == 6 and frames_that_fit(tmp_path, 4) == 4
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {"patch_size": 14}}))
    assert frames_that_fit(tmp_path, 8) == 8


def test_the_rate_at_the_slo_is_the_highest_point_that_met_it():
    """An application's figure: the highest rate point with every request answered and 90% within its SLO."""
    from benchmarks.vision_apps import at_slo

    def point(rate, met, error=0):
        return {"offered_rate_rps": rate, "slo_attainment": {"app": met}, "error": error, "rejected": 0, "timeout": 0}

    assert at_slo([point(4, 1.0), point(8, 0.95), point(16, 0.8)])["offered_rate_rps"] == 8
    assert at_slo([point(4, 1.0), point(8, 1.0, error=3)])["offered_rate_rps"] == 4
    assert at_slo([point(4, 0.5)]) is None


def test_rates_empty_skips_an_application():
    """--rates "" runs no retrieval point, --video-rates "" no video point; the video's rates default to --rates."""
    from benchmarks.vision_apps import parse_rates

    assert parse_rates("10,11", None) == ([10.0, 11.0], [10.0, 11.0])
    assert parse_rates("", "44,48") == ([], [44.0, 48.0])
    assert parse_rates("14, 16", "") == ([14.0, 16.0], [])
    assert parse_rates("", None) == ([], [])
