"""Training adapters with heads (PEFT) and fusing datasets, on the tiny model, in few steps.

- a head adapter trained briefly on generated counting beats chance on held-out data, and the server's
  engine gives the same answers as the trainer;
- a rolled-back adapter is bit-identical to its snapshot, down to the saved files;
- a floor a fused adapter cannot meet splits the tasks; loose floors pack them into one adapter;
- ``vlora train`` writes a standard PEFT folder (PEFT loads it) and ``vlora fuse`` its report.
"""
from __future__ import annotations

import json

import pytest
import torch

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest
from vlora.engine.builder import build_engine
from vlora.fusion.datasets import generate
from vlora.fusion.fuse import FusionTask, fuse
from vlora.fusion.report import PLOT_FILE, REPORT_FILE, write_report
from vlora.fusion.train import AdapterTrainer, TrainConfig
from vlora.heads import HEADS_WEIGHTS
from vlora.lora.adapter import WEIGHTS_FILE
from vlora.models.loader import load_llava

pytestmark = pytest.mark.slow
TINY = {"train": 32, "val": 16, "test": 16}


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    loaded = load_llava(tiny_model_dir, torch.float32, "cpu")
    return AdapterTrainer(loaded, TrainConfig(steps=2, batch_size=8, lr=1e-3, probe_samples=256, seed=1))


@pytest.fixture(scope="module")
def small(trainer):
    return {t: trainer.prepare(generate(t, seed=5, sizes=TINY)) for t in ("color", "shape")}


def _png(img) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_counting_head_beats_chance_and_serves_the_same_answers(trainer, tiny_model_dir, tmp_path):
    ds = generate("count-circles", seed=0, sizes={"train": 192, "val": 16, "test": 96})
    p = trainer.prepare(ds)
    trainer.new_adapter()
    losses = trainer.train([p], steps=8)
    assert all(torch.isfinite(torch.tensor(losses)))
    acc = trainer.evaluate(p, "test")
    assert ds.chance < 0.2 and acc >= ds.chance + 0.15, f"accuracy {acc:.1%} vs chance {ds.chance:.1%}"

    out = trainer.save(tmp_path / "adapters" / "count-head")
    assert {f.name for f in out.iterdir()} >= {"adapter_config.json", WEIGHTS_FILE, "vlora_heads.json", HEADS_WEIGHTS}
    cfg = EngineConfig().with_overrides({"model.path": str(tiny_model_dir), "lora.adapter_root": str(out.parent),
                                         "model.device": "cpu", "model.dtype": "float32"})
    engine = build_engine(cfg)
    samples = ds.split("test")[:6]
    outs = {}
    for i, s in enumerate(samples):
        req = GenerationRequest(f"r{i}", ds.prompt_for(1), images=[_png(s.images[0])], lora_name="count-head",
                                task="count-circles")
        engine.add_request(engine.inputs.prepare(req), lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    while engine.has_work():
        engine.step()
    # The trainer's view of the same samples (the images went through PNG, which is lossless).
    one = trainer.prepare(type(ds)(ds.name, ds.task_type, ds.labels, ds.prompt, {"test": samples}), splits=("test",))
    hidden, _ = trainer.last_hidden(one, "test")
    probs = torch.softmax(trainer.heads["count-circles"](hidden), -1)
    for i in range(len(samples)):
        got = outs[f"r{i}"]
        assert got.num_output_tokens == 1 and got.text == got.extra["label"]
        assert got.extra["label"] == ds.labels[int(probs[i].argmax())]
        assert torch.allclose(torch.tensor(got.extra["scores"]), probs[i], atol=1e-4)


def test_rollback_is_bit_identical(trainer, small, tmp_path):
    trainer.new_adapter()
    trainer.train([small["color"]])
    a = trainer.save(tmp_path / "a")
    snap = trainer.snapshot()
    trainer.train([small["shape"]])
    assert "shape" in trainer.heads and not trainer.matches(snap)
    trainer.restore(snap)
    assert trainer.matches(snap) and list(trainer.heads) == ["color"]
    b = trainer.save(tmp_path / "b")
    for f in (WEIGHTS_FILE, HEADS_WEIGHTS):
        assert (a / f).read_bytes() == (b / f).read_bytes()


def test_tight_floor_splits_and_loose_floor_packs(trainer, small, tmp_path):
    names = ["color", "shape"]
    tight = fuse(trainer, [FusionTask(small[n].dataset, 1.0 if n == "shape" else 0.0) for n in names],
                 out_dir=tmp_path / "tight")
    assert [a.tasks for a in tight.adapters] == [["color"], ["shape"]]  # shape cannot reach 100% in 2 steps
    rolled = [s for s in tight.steps if not s.accepted]
    assert len(rolled) == 1 and rolled[0].restored_bit_identical and rolled[0].violations == ["shape"]
    assert tight.adapters[1].below_floor == ["shape"]

    loose = fuse(trainer, [FusionTask(small[n].dataset, 0.0) for n in names], out_dir=tmp_path / "loose")
    assert [a.tasks for a in loose.adapters] == [names]
    heads = json.loads((tmp_path / "loose" / "fused-0" / "vlora_heads.json").read_text())["heads"]
    assert [h["task"] for h in heads] == names

    report = write_report(tight, tmp_path / "tight")
    text = report.read_text()
    assert report.name == REPORT_FILE and (tmp_path / "tight" / PLOT_FILE).stat().st_size > 1000
    assert f"**{len(tight.adapters)} adapter(s)**" in text and "| shape | fused-" in text


def test_cli_train_writes_a_peft_folder(tiny_model_dir, vlora_cache, tmp_path, capsys):
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    from vlora.cli import main

    out = tmp_path / "lm-adapter"
    rc = main(["train", "--dataset", "color", "--out", str(out), "--mode", "lm", "--steps", "2", "--batch-size", "4",
               "--train-size", "16", "--val-size", "8", "--test-size", "8", "--device", "cpu",
               "--cache-dir", str(vlora_cache), "--targets", "q_proj,k_proj,v_proj,o_proj"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["adapter"] == str(out) and "color" in result["accuracy"]
    assert not (out / "vlora_heads.json").exists()  # lm mode: no head
    base = LlavaForConditionalGeneration.from_pretrained(str(tiny_model_dir))
    model = PeftModel.from_pretrained(base, str(out))
    assert any("lora_A" in n for n, _ in model.named_parameters())
    assert main(["train", "--dataset", "count-unicorns", "--out", str(tmp_path / "x")]) == 2
