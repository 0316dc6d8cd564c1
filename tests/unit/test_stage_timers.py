"""The engine's own stage timers (vlora.metrics.STAGES): an image request on the tiny LLaVA reports its queue,
image decode, preprocessing and vision times and its prefill and decode steps, each once per request or step,
all positive; a text request reports no image stages."""
from __future__ import annotations

import io

from PIL import Image

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.builder import build_engine
from vlora.metrics import STAGES, NullMetrics


class StageRecorder(NullMetrics):
    def __init__(self):
        self.stages: list[tuple[str, float]] = []

    def stage(self, name, seconds):
        self.stages.append((name, seconds))


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (90, 60), (200, 40, 90)).save(buf, format="PNG")
    return buf.getvalue()


def _run(engine, req):
    done = []
    engine.add_request(engine.inputs.prepare(req), lambda out: done.append(out) if out.finished else None)
    while not done:
        engine.step()
    engine.flush()
    return done[0]


def test_an_image_request_reports_every_stage(tiny_model_dir):
    metrics = StageRecorder()
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "64"}),
        metrics)
    out = _run(engine, GenerationRequest("img", "<image>What is it?", images=[_png()],
                                         sampling=SamplingParams(max_tokens=3, ignore_eos=True)))
    assert out.error is None
    names = [n for n, _ in metrics.stages]
    assert set(names) == set(STAGES)
    for once in ("admit", "queue", "image_decode", "preprocess", "vision", "prefill_step"):
        assert names.count(once) == 1, names
    assert names.count("decode_step") == 2  # three tokens: the prefill's, then two decode steps
    assert all(seconds > 0 for _, seconds in metrics.stages), metrics.stages
    metrics.stages.clear()
    _run(engine, GenerationRequest("txt", "Hello there", sampling=SamplingParams(max_tokens=1, ignore_eos=True)))
    assert sorted(n for n, _ in metrics.stages) == ["admit", "prefill_step", "queue"]
