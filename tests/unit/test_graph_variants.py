"""Which CUDA-graph variant each decode step would replay, per inference mode (CPU: the choice, not the replay;
tests/gpu/test_engine_graphs.py counts the replays). A merged step replays the base model's graph (no LoRA
kernel at all), a mixture step with rows of other adapters the mixture graph (their adapters plus the deLoRA
branch), a mixture step whose rows are all the merged adapter's the base graph, an unmerged step the LoRA one."""
from __future__ import annotations

from collections import Counter

import pytest

from vlora.engine.api import GenerationRequest, SamplingParams
from helpers import tiny_config
from vlora.engine.builder import build_engine
from vlora.engine.graphs import step_variant
from vlora.orchestrator.policies import MERGE, MIXTURE, UNMERGE, Decision, Policy

REQUESTS = {"a1": "demo-r8-qv", "a2": "demo-r8-qv", "b1": "demo-r32-mlp", "base": None}


class Fixed(Policy):
    """Always ``mode`` with ``merged``; the batch is every request that mode can run."""

    name = "fixed"

    def __init__(self, mode, merged):
        super().__init__(max_batch_size=16, theta_s=1e9)
        self.mode, self.merged = mode, merged

    def decide(self, cands, now, mode, merged, est):
        return Decision(self.mode, self.merged, [c for c in cands if self.mode != MERGE or c.adapter == self.merged])


@pytest.fixture(scope="module")
def engine(tiny_model_dir, demo_adapter_root):
    return build_engine(tiny_config(tiny_model_dir, demo_adapter_root,
                                    **{"lora.max_gpu_adapters": 4, "orchestrator.policy": "vlora"}))


def variants(engine, mode, merged, requests) -> Counter:
    """(mode, variant) of every decode-only step while ``requests`` run under the fixed policy."""
    engine.orchestrator.policy = Fixed(mode, merged)
    seen: Counter = Counter()
    forward = engine.runner.forward

    def spy(seqs, prev_tokens=None):
        if all(len(s.token_ids) == 1 and s.pixel_values is None for s in seqs):
            seen[(engine.orchestrator.mode, step_variant(seqs))] += 1
        return forward(seqs, prev_tokens)

    engine.runner.forward = spy
    try:
        for rid, adapter in requests.items():
            req = GenerationRequest(rid, "Count the circles.", lora_name=adapter,
                                    sampling=SamplingParams(max_tokens=4, ignore_eos=True))
            engine.add_request(engine.inputs.prepare(req), lambda out: None)
        while engine.has_work():
            engine.step()
    finally:
        engine.runner.forward = forward
        engine.orchestrator.enter(UNMERGE, None)
    return seen


def test_merged_steps_replay_the_base_graph(engine):
    seen = variants(engine, MERGE, "demo-r8-qv", {k: REQUESTS[k] for k in ("a1", "a2")})
    assert seen and set(seen) == {(MERGE, "base")}


def test_mixture_steps_replay_the_mixture_graph(engine):
    seen = variants(engine, MIXTURE, "demo-r8-qv", REQUESTS)
    assert set(seen) == {(MIXTURE, "mixture")} and seen[(MIXTURE, "mixture")] == 3


def test_a_mixture_step_of_the_merged_adapters_rows_only_replays_the_base_graph(engine):
    seen = variants(engine, MIXTURE, "demo-r8-qv", {k: REQUESTS[k] for k in ("a1", "a2")})
    assert set(seen) == {(MIXTURE, "base")}


def test_unmerged_steps_replay_the_lora_graph_and_base_requests_the_base_graph(engine):
    assert set(variants(engine, UNMERGE, None, REQUESTS)) == {(UNMERGE, "lora")}
    assert set(variants(engine, UNMERGE, None, {"base": None})) == {(UNMERGE, "base")}
