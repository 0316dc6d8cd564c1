"""The warm start (vlora.engine.warmup): one request of every path runs to its end before the engine is ready,
on the tiny LLaVA (with a demo adapter and its task heads) and the tiny Qwen2-VL (a video too); the engine is
left idle, and its metrics report none of it."""
from __future__ import annotations

import pytest
import torch

from vlora.config import EngineConfig
from vlora.engine.builder import build_engine
from vlora.engine.warmup import GatedMetrics, warm_requests


class Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


def test_llava_warm_up_runs_every_path_before_ready(tiny_model_dir, demo_adapter_root):
    metrics = Recorder()
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cpu",
        "cache.num_blocks": "256", "engine.warmup": "on"}), metrics)
    info = engine.model_info["warmup"]
    names = {name for name, _ in warm_requests(engine)}
    assert set(info["paths"]) == names and "failed" not in info
    assert {"text", "text-sampled", "text-eager-48", "text-eager-49", "image", "lora-text", "lora-image"} <= names
    assert any(n.startswith("head-") for n in names)  # the first demo adapter carries task heads
    assert not engine.has_work() and not engine.running and not engine.waiting
    assert metrics.calls == []  # nothing reported until the engine is ready
    assert isinstance(engine.metrics, GatedMetrics) and engine.metrics.open
    orch = engine.orchestrator  # nothing merged, no estimate from the warm-up's steps
    assert orch.mode == "unmerge" and orch.merged is None and orch.switches == 0
    assert all(v == 0.0 for v in orch.estimates.step_s.values())


def test_qwen_warm_up_includes_a_video(tmp_path_factory):
    from vlora.models.tiny_qwen import ensure_tiny_qwen

    model_dir = ensure_tiny_qwen(tmp_path_factory.mktemp("qwen"))
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "256",
        "engine.warmup": "on"}))
    info = engine.model_info["warmup"]
    assert set(info["paths"]) == {"text", "text-sampled", "text-eager-48", "text-eager-49", "image", "video"}
    assert "failed" not in info


def test_warm_up_is_off_on_cpu_by_default(tiny_model_dir):
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "64"}))
    assert "warmup" not in engine.model_info


@pytest.mark.parametrize("value", ["sometimes", 3])
def test_a_bad_warmup_setting_is_refused(value):
    from vlora.config import ConfigError

    with pytest.raises(ConfigError, match="engine.warmup"):
        EngineConfig().with_overrides({"engine.warmup": value})


def test_the_warm_up_waits_instead_of_spinning_while_its_adapter_loads(monkeypatch):
    """A step that ran nothing (the request's adapter still being read and copied in by other threads) is followed
    by a short sleep: a loop that steps without pause holds the GIL those threads need for every call."""
    import threading
    import time

    from vlora.engine import warmup
    from vlora.engine.api import GenerationRequest

    class Engine:
        def __init__(self):
            self.steps = 0
            self.loaded = threading.Event()
            self.callback = None
            self.inputs = self

        def prepare(self, req):
            return req

        def add_request(self, prepared, callback):
            self.callback = callback
            threading.Timer(0.3, self.loaded.set).start()  # the adapter arrives 0.3 s later

        def step(self):
            self.steps += 1
            if not self.loaded.is_set():
                return None  # nothing ran: the request waits for its adapter
            self.callback(type("Out", (), {"finished": True, "error": None})())
            return object()

        def flush(self):
            pass

    eng = Engine()
    t0 = time.perf_counter()
    assert warmup._run(eng, GenerationRequest("warmup-x", "hi"), time.perf_counter() + 10) is None
    assert 0.3 <= time.perf_counter() - t0 < 5
    assert eng.steps <= 0.3 / warmup.IDLE_WAIT_S + 20  # ~150 steps, where a spinning loop makes hundreds of thousands


def test_the_eager_paths_prefill_fresh_prompts_of_their_lengths_without_the_prefill_graphs(tiny_model_dir, monkeypatch):
    """text-eager-N: a prompt of exactly N tokens, no cached prefix (its prefill starts at 0), run with the runner's
    prefill graphs set aside and given back after."""
    from vlora.engine import warmup

    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu", "cache.num_blocks": "256"}))
    sentinel = object()
    engine.runner.prefill_graphs = sentinel
    seen = []
    step = engine.step

    def spy():
        for s in engine.waiting:
            seen.append((len(s.req.prompt_ids), s.cached_tokens, engine.runner.prefill_graphs is None))
        return step()
    monkeypatch.setattr(engine, "step", spy)
    for name, req in warmup.warm_requests(engine):
        if name.startswith("text-eager-"):
            assert warmup._run(engine, req, 1e18, int(name.rsplit("-", 1)[1])) is None
    assert engine.runner.prefill_graphs is sentinel
    assert (48, 0, True) in seen and (49, 0, True) in seen


def test_the_warm_up_never_merges_so_the_base_weights_stay_the_checkpoints(tiny_model_dir, demo_adapter_root):
    """Even under a policy that merges every adapter it serves: a merge and its unmerge leave the rounding of the
    weights' dtype behind (fp32 here, bf16 on a GPU), and the warm start would then leave every later request on
    weights that are not the checkpoint's. The engine's own policy is back in place after."""
    from vlora.orchestrator.policies import MergeOnlyPolicy

    def build(warm):
        return build_engine(EngineConfig().with_overrides({
            "model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cpu",
            "cache.num_blocks": "256", "orchestrator.policy": "merge-only", "engine.warmup": warm}))

    warm, cold = build("on"), build("off")
    assert "lora-text" in warm.model_info["warmup"]["paths"]
    assert isinstance(warm.orchestrator.policy, MergeOnlyPolicy) and warm.orchestrator.merged is None
    want = dict(cold.runner.model.named_parameters())
    for name, p in warm.runner.model.named_parameters():
        assert torch.equal(p, want[name]), name
    # the same policy merges once the engine serves: the check above is not vacuous
    from engine_parity import add_greedy
    add_greedy(warm, "r", "demo-r8-qv", "Count the circles.", max_new=2)
    while warm.has_work():
        warm.step()
    warm.flush()
    assert warm.orchestrator.merged == "demo-r8-qv"
