"""CPU smoke test of benchmarks/engine_floor.py and benchmarks/plain_decode.py on the tiny model: the
floor arithmetic at LLaVA-1.5-7B dimensions, the plain decode step against transformers (fp32, eager:
graphs are captured only on CUDA), and one whole run of the benchmark at a tiny grid, so that the GPU
run cannot fail on something a CPU would have shown."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ef():
    return importlib.import_module("benchmarks.engine_floor")


@pytest.fixture(scope="module")
def plain_decode(ef):
    return importlib.import_module("benchmarks.plain_decode")


LLAVA_7B_TEXT = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=11008, vocab_size=32064)


def test_floor_arithmetic(ef):
    d = ef.ModelDims.from_config(LLAVA_7B_TEXT, elt=2)
    assert d.head_dim == 128
    assert d.linear_params == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert d.kv_bytes_per_token == 2 * 32 * 4096 * 2
    assert d.adapter_bytes(64) == 32 * 4 * 64 * (4096 + 4096) * 2  # rank 64 over q/k/v/o: 128 MiB
    f = ef.decode_floor(d, batch=32, context=2000, bw_gbs=1000.0)
    assert f["parts"]["weights"] == d.decoder_bytes + d.head_bytes
    assert f["parts"]["kv_read"] == 32 * 2000 * d.kv_bytes_per_token and f["parts"]["adapters"] == 0
    assert f["floor_ms"] == pytest.approx(f["bytes"] / 1e12 * 1e3)
    fl = ef.decode_floor(d, batch=32, context=2000, bw_gbs=1000.0, adapters=32, rank=64)
    assert fl["bytes"] - f["bytes"] == 32 * d.adapter_bytes(64)
    p = ef.prefill_floor(d, tokens=8000, tflops=500.0)
    assert p["parts"]["projections"] == 2 * d.linear_params * 8000
    assert p["parts"]["attention"] == 2 * 32 * 4096 * 8000 ** 2  # 2 * 2 * L * H * D * T^2 / 2
    assert p["parts"]["lm_head"] == 2 * 32064 * 4096
    assert p["floor_ms"] == pytest.approx(p["flops"] / 500e12 * 1e3)
    v = ef.VisionDims.from_config({"vision_config": dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=4096,
                                                         image_size=336, patch_size=14, model_type="clip_vision_model"),
                                   "vision_feature_layer": -2, "text_config": {"hidden_size": 4096}})
    assert v.layers == 23  # hidden_states[-2]: the last encoder layer is not needed
    assert ef.vision_floor(v, 8, 100.0)["flops"] == 8 * v.flops_per_image()
    # 64 slots of 128 MiB fit on an 80 GB card beside 14 GB of weights; on a 24 GB card only a few do.
    assert ef.plan_slots(64, 85e9, 0.85, 14.1e9, d.adapter_bytes(64), ef.CUDA_RESERVE) == 64
    assert 1 <= ef.plan_slots(64, 24e9, 0.85, 14.1e9, d.adapter_bytes(64), 2 * 2**30) < 64


def test_targets_verdicts(ef):
    decode = [
        {"variant": "base", "batch": 1, "context": 700, "ms": 6.0, "floor_ms": 5.0},
        {"variant": "base", "batch": 32, "context": 700, "ms": 9.0, "floor_ms": 8.0},
        {"variant": "lora", "batch": 1, "context": 700, "ms": 7.5, "floor_ms": 5.1, "distinct_adapters": 1},
        {"variant": "lora", "batch": 32, "context": 700, "ms": 11.0, "floor_ms": 9.0, "distinct_adapters": 32},
        {"variant": "merged", "batch": 32, "context": 700, "ms": 9.1, "floor_ms": 8.0},
        {"variant": "base", "batch": 64, "context": 2000, "floor_ms": 27.0, "skipped": "does not fit"},
    ]
    plain = {"points": {"1x700": {"masked_ms": 7.0, "exact_ms": 6.5}, "32x700": {"masked_ms": 8.5}}}
    got = {t["target"]: t for t in ef.evaluate_targets(decode, [{"tokens": 600, "ms": 15.0, "floor_ms": 10.0}], plain)}
    assert got["base decode bs1 ctx700 <= 1.3x floor"]["passed"] is True
    assert got["base decode bs1 ctx700 faster than plain graphed"]["passed"] is True  # 6.0 < 6.5 (the faster variant)
    assert got["base decode bs32 ctx700 faster than plain graphed"]["passed"] is False  # 9.0 > 8.5
    assert got["unmerged lora bs1 ctx700 (1 distinct) <= 1.2x base"]["passed"] is False  # 1.25x
    assert got["unmerged lora bs32 ctx700 (32 distinct) <= 1.3x base"]["passed"] is True  # 1.22x
    assert got["merged bs32 ctx700 within 3% of base"]["passed"] is True
    assert got["base decode bs64 ctx2000 <= 1.3x floor"]["passed"] is None
    assert got["prefill 600 tokens <= 1.4x floor"]["passed"] is False


def test_plain_decoder_matches_transformers(plain_decode, tiny_model_dir):
    from vlora.models.loader import load_llava

    model = load_llava(tiny_model_dir, torch.float32, "cpu").model
    check = plain_decode.check_against_hf(model, batch=2, context=12)
    assert check["passed"] and not check["graphed"], check
    assert check["masked"]["argmax_equal"] and check["exact"]["argmax_equal"]
    dec = plain_decode.PlainDecoder(model, max_batch=2, max_len=32)
    assert not dec.graphs
    dec.prefill_fill(20)
    assert dec.time_decode_step(2, 20, iters=2, warmup=1) > 0
    assert dec.time_decode_step(1, 20, iters=2, warmup=1, masked=False) > 0
    with pytest.raises(ValueError, match="max_len"):
        dec.time_decode_step(1, 32, iters=1)


def test_whole_run_on_tiny_model(ef, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    rc = ef.main(["--device", "cpu", "--model", str(tiny_model_dir), "--batches", "1,2", "--contexts", "12",
                  "--prefill", "20", "--images", "1", "--rank", "8", "--steps", "2", "--warmup", "1", "--prefill-reps", "1",
                  "--profile", "--profile-batch", "2", "--no-record", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "engine-floor-cpu.json").read_text())
    assert (tmp_path / "engine-floor-cpu.results-line.md").read_text().startswith("| ")
    assert res["plain"]["check"]["passed"]
    assert set(res["plain"]["points"]) == {"1x12", "2x12"}
    rows = {(r["variant"], r["batch"]): r for r in res["decode"]}
    assert set(rows) == {(v, b) for v in ("base", "lora", "merged") for b in (1, 2)}
    for r in rows.values():
        assert r.get("ms", 0) > 0 and r["floor_ms"] > 0, r
        assert r["context_mean"] >= 12
    assert rows[("lora", 2)]["distinct_adapters"] == 2 and rows[("lora", 2)]["mode"] == "unmerge"
    assert rows[("merged", 2)]["mode"] == "merge" and rows[("merged", 2)]["merged"]
    assert rows[("lora", 2)]["parts"]["adapters"] > 0 and rows[("base", 2)]["parts"]["adapters"] == 0
    assert res["prefill"][0]["ms"] > 0 and res["vision"][0]["ms"] > 0
    # batches of 1 and 2, but the engine is built as the server's (its prefill graphs carry that many LoRA segments)
    assert res["engine"]["config"]["scheduler"]["max_batch_size"] == 32
    assert res["profile"]["cpu_wall_ms_per_step"] > 0
    assert any(t["target"].startswith("base decode bs1") for t in res["targets"])
    assert "targets" in res["summary"]


def test_results_line_is_recorded(ef, tmp_path, monkeypatch):
    common = importlib.import_module("benchmarks.common")
    (tmp_path / "benchmarks").mkdir()
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(common, "RESULTS", tmp_path / "benchmarks" / "results")
    res = {"device": "cpu", "commit": "abc1234", "preset": "tiny", "dtype": "float32",
           "rates": {"copy_gbs": 10.0, "matmul_tflops": 0.1}, "plain": {}, "prefill": [], "vision": [], "targets": [],
           "decode": [{"variant": "base", "batch": 1, "context": 12, "ms": 2.0, "floor_ms": 1.0}]}
    path = ef.write_outputs(res, tmp_path / "benchmarks" / "results", no_record=False)
    assert json.loads(path.read_text())["summary"].startswith("tiny float32")
    line = (tmp_path / "benchmarks" / "RESULTS.md").read_text().splitlines()[-1]
    assert line.startswith("| ") and "| engine-floor | cpu | abc1234 | " in line and "bs1/ctx12 2.0 (2.00x)" in line


def test_qwen_vision_floor_arithmetic(ef):
    """The Qwen2-VL-7B and Qwen2.5-VL-7B vision towers (configs/models/qwen2*-vl-7b.yaml) at 448x448."""
    floors = importlib.import_module("benchmarks.floors")
    v2 = floors.QwenVisionDims.from_config({"model_type": "qwen2_vl", "vision_config": dict(
        depth=32, embed_dim=1280, mlp_ratio=4, hidden_size=3584, patch_size=14, temporal_patch_size=2,
        spatial_merge_size=2, in_channels=3)})
    n, d, c = 32 * 32, 1280, 4 * 1280  # patches of a 448x448 image, the ViT width, the merger's width
    embed = 2 * n * (3 * 2 * 14 * 14) * d
    linear = 2 * n * (4 * d * d + 2 * d * 4 * d) * 32
    merger = 2 * (n // 4) * (c * c + c * 3584)
    assert v2.flops_per_image() == embed + linear + 32 * 4 * d * n * n + merger
    assert v2.flops([(8, 32, 32)]) == 8 * (embed + linear + merger) + 32 * 4 * d * 8 * n * n  # attention per frame
    v25 = floors.QwenVisionDims.from_config({"model_type": "qwen2_5_vl", "vision_config": dict(
        depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=3584, patch_size=14, temporal_patch_size=2,
        spatial_merge_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])})
    assert v25.window == 4 and v25.full_blocks == 4  # 112 px windows: 4 x 4 merged tokens, 64 patches
    assert v25._windows_sq(32, 32) == 16 * 64 ** 2
    assert v25._windows_sq(36, 36) == sum((r * c * 4) ** 2 for r in (4, 4, 4, 4, 2) for c in (4, 4, 4, 4, 2))
    linear25 = 2 * n * (4 * d * d + 3 * d * 3420) * 32
    assert v25.flops_per_image() == embed + linear25 + 4 * 4 * d * n * n + 28 * 4 * d * 16 * 64 ** 2 + merger
    assert ef.parse_media("image:448,video:16x448") == [{"kind": "image", "images": 1, "side": 448},
                                                         {"kind": "video", "images": 16, "side": 448}]
    with pytest.raises(SystemExit, match="--media"):
        ef.parse_media("video:sixteen")


def test_whole_run_on_tiny_qwen(ef, vlora_cache, tmp_path):
    """The run at Qwen2.5-VL's layout: the plain step (q/k/v biases) against transformers, decode, and an
    image and a video request to their first token with their floors; results named engine-floor-qwen2.5."""
    from vlora.models.tiny_qwen import ensure_tiny_qwen

    model_dir = ensure_tiny_qwen(vlora_cache, variant="qwen2_5_vl")
    torch.manual_seed(0)
    rc = ef.main(["--device", "cpu", "--model", str(model_dir), "--batches", "1,2", "--contexts", "12",
                  "--prefill", "20", "--images", "1", "--rank", "8", "--steps", "2", "--warmup", "1", "--prefill-reps", "1",
                  "--media-reps", "1", "--variants", "base,lora", "--no-record", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "engine-floor-qwen2.5-cpu.json").read_text())
    assert res["benchmark"] == "engine-floor-qwen2.5" and res["model_type"] == "qwen2_5_vl"
    assert res["plain"]["check"]["passed"]
    assert all(r.get("ms", 0) > 0 for r in res["decode"]), res["decode"]
    image, video = res["media"]
    assert (image["kind"], video["kind"], video["images"]) == ("image", "video", 16)  # --media auto on Qwen
    assert video["grid"][0][0] == 8 and video["visual_tokens"] > image["visual_tokens"] > 0  # 16 frames: 8 temporal patches
    for r in (image, video):
        assert r["ttft_ms"] == pytest.approx(r["prepare_ms"] + r["step_ms"]) and r["vision_ms"] > 0
        assert r["floor_ms"] == pytest.approx(r["vision_floor_ms"] + r["prefill_floor_ms"]) and r["vision_flops"] > 0
    assert res["vision"][0]["ms"] > 0 and res["vision"][0]["grid"]
    assert "media: 448x448 image" in res["summary"]
