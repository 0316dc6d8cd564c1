"""The cost model (vlora.orchestrator.costs) and the vlora policy's decisions from recorded step costs.

``H100``: the engine at its floor on an H100 (benchmarks/RESULTS.md, the default model): an unmerged step
costs 1.12-1.27x a base step, mostly the per-row path's launches plus each distinct adapter's bytes, and a
switch 5.5 ms. ``LAUNCH_BOUND``: shaped on the CPU-bound engine of the first GPU run (base 45.8 ms, unmerged
62.4 ms at batch 32, whatever the adapters). ``PAPER``: the regime the V-LoRA paper describes, each adapter
of a batch dear and the deLoRA branch cheap. The same queues are decided differently under them: merging
happens where the saving repays the switches, and not where it does not. Simulations check the starvation
bound: no request waits past its latency target plus two steps (with their switches).
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from vlora.orchestrator.costs import DEFAULT, CostModel, cache_path
from vlora.orchestrator.policies import MERGE, MIXTURE, UNMERGE, Candidate, Estimates, make_policy

H100 = DEFAULT
LAUNCH_BOUND = CostModel(batch=(1, 32), base=(0.0300, 0.0458), lora=(((1, 0.0400),), ((1, 0.0624), (32, 0.0624))),
                         delora=(0.010, 0.0166), eager={"base": (0.01, 2e-5), "lora": (0.012, 3e-5)},
                         switch={"merge": 0.0055, "swap": 0.0070, "unmerge": 0.0055}, source="test: launch-bound engine")
PAPER = CostModel(batch=(1, 32), base=(0.030, 0.040), lora=(((1, 0.032),), ((1, 0.041), (32, 0.120))),
                  delora=(0.001, 0.001), eager={"base": (0.01, 2e-5), "lora": (0.012, 3e-5)},
                  switch={"merge": 0.005, "swap": 0.006, "unmerge": 0.005}, source="test: paper regime")
NO_TAX = CostModel(batch=(1, 32), base=(0.0064, 0.0114), lora=(((1, 0.0064),), ((1, 0.0114), (32, 0.0114))),
                   delora=(0.0, 0.0), eager=dict(H100.eager), switch=dict(H100.switch), source="test: LoRA costs nothing")
MAX_BS = 32


def cands(spec: dict, remaining=None, at: float = 0.0) -> list[Candidate]:
    """{adapter: count} -> candidates that last ran at ``at``."""
    out = []
    for adapter, n in spec.items():
        out += [Candidate(f"{adapter}-{i}", adapter, at, remaining=remaining) for i in range(n)]
    return out


def decide(model, queue, mode=UNMERGE, merged=None, theta=2.0, now=0.01):
    return make_policy("vlora", MAX_BS, theta).decide(queue, now, mode, merged, Estimates(costs=model))


# -- the model ---------------------------------------------------------------------------------

def test_default_is_the_recorded_h100_figures():
    assert H100.decode_s(32) == pytest.approx(11.39e-3)
    assert H100.decode_s(32, 32, 32) == pytest.approx(13.45e-3)  # one adapter per row
    assert H100.decode_s(1, 1, 1) == pytest.approx(7.16e-3)
    assert H100.decode_s(32, 32, 1) < H100.decode_s(32, 32, 8) < H100.decode_s(32, 32, 32)
    assert H100.decode_s(32, 5, 1, 5) > H100.decode_s(32, 5, 1)  # a deLoRA branch costs something
    assert H100.switch_s(None, "a") == pytest.approx(5.53e-3) and H100.switch_s("a", "b") == pytest.approx(7.0e-3)
    assert H100.switch_s("a", "a") == 0.0 and H100.switch_s("a", None) == pytest.approx(5.51e-3)


def test_decode_steps_are_priced_at_their_graph_bucket_and_eager_steps_by_tokens():
    assert H100.decode_s(17) == H100.decode_s(24)  # both replay the batch-24 graph
    assert H100.decode_s(17) < H100.decode_s(25)
    assert H100.step_s(4, 600) == pytest.approx(17.85e-3)  # a prompt: an eager step, priced by its tokens
    assert H100.step_s(4, 600, lora_rows=4) > H100.step_s(4, 600)


def test_json_round_trip_and_clear_errors(tmp_path):
    path = tmp_path / "m.json"
    H100.save(path)
    again = CostModel.load(path)
    assert again.decode_s(8, 8, 3) == pytest.approx(H100.decode_s(8, 8, 3)) and again.switch == H100.switch
    assert again.source == f"file {path}"
    bad = json.loads(path.read_text())
    bad["base"] = bad["base"][:2]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="one entry per batch size"):
        CostModel.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="cannot be read"):
        CostModel.load(path)


def test_cache_path_names_the_gpu_and_changes_with_the_key(tmp_path):
    key = {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "rank": 64, "layers": 32}
    p = cache_path(tmp_path, key)
    assert p.name.startswith("nvidia-h100-80gb-hbm3-bfloat16-r64-") and p.suffix == ".json"
    assert cache_path(tmp_path, {**key, "layers": 40}) != p


# -- decisions from recorded costs ---------------------------------------------------------------

def test_merges_one_adapter_when_the_saving_repays_the_switches():
    d = decide(H100, cands({"hot": 40}, remaining=200))
    assert (d.mode, d.merged, len(d.batch)) == (MERGE, "hot", MAX_BS)


def test_does_not_merge_when_the_requests_end_before_the_switches_are_repaid():
    d = decide(H100, cands({"hot": 40}, remaining=3))
    assert d.mode == UNMERGE and d.merged is None


def test_does_not_merge_when_lora_costs_nothing():
    d = decide(NO_TAX, cands({"hot": 40}, remaining=200))
    assert d.mode == UNMERGE


def test_does_not_merge_a_uniform_queue():
    for model in (H100, LAUNCH_BOUND, PAPER):
        d = decide(model, cands({f"a{i}": 1 for i in range(32)}, remaining=32))
        assert d.mode == UNMERGE, model.source


def test_a_skewed_queue_merges_where_unmerged_is_dear_and_not_on_the_h100():
    """28 requests of one adapter and 4 of others. Launch-bound, an unmerged step costs 36% more than a
    merged one whatever the adapters: merging the 28 (the 4 wait) pays. On the H100 a batch of 5 adapters
    costs 8% more than a merged one: a batch of 28 instead of 32 loses more than that, and the deLoRA
    branch alone costs about what mixing saves: unmerged stays."""
    queue = cands({"hot": 28, "a": 1, "b": 1, "c": 1, "d": 1}, remaining=32)
    slow = decide(LAUNCH_BOUND, queue)
    assert (slow.mode, slow.merged, len(slow.batch)) == (MERGE, "hot", 28)
    assert decide(H100, queue).mode == UNMERGE


def test_a_merged_batch_counts_only_the_requests_the_engine_can_run():
    """32 requests already run (12 of the hot adapter, 20 of others) and 30 more of the hot adapter wait: a
    merged step could run only the 12 (the others keep their places among the MaxBS running), so it does
    not pay; with nothing running yet, 32 of the hot adapter's would be admitted and merging pays."""
    running = cands({"hot": 12} | {f"o{i}": 2 for i in range(10)}, remaining=32)
    for c in running:
        c.running = True
    waiting = [Candidate(f"w{i}", "hot", 0.005, remaining=32) for i in range(30)]
    assert decide(LAUNCH_BOUND, running + waiting).mode == UNMERGE
    d = decide(LAUNCH_BOUND, [Candidate(c.request_id, c.adapter, 0.0, remaining=32) for c in running] + waiting)
    assert (d.mode, d.merged, len(d.batch)) == (MERGE, "hot", 32)


def test_staying_merged_costs_no_switch_in():
    """Merged already: the switch in is paid, and leaving costs the same unmerge as staying and leaving
    later: a short horizon no longer argues for unmerging."""
    queue = cands({"hot": 40}, remaining=3)
    d = decide(H100, queue, mode=MERGE, merged="hot")
    assert (d.mode, d.merged) == (MERGE, "hot")


def test_more_than_half_starving_unmerges_oldest_first():
    queue = cands({"hot": 20}, remaining=100, at=1.0) + cands({f"s{i}": 1 for i in range(17)}, remaining=100, at=0.0)
    d = decide(H100, queue, mode=MERGE, merged="hot", now=2.5)
    assert d.mode == UNMERGE and d.starving == 17
    assert [c.adapter for c in d.batch[:17]] == [f"s{i}" for i in range(17)]


def test_a_starving_request_runs_next_in_a_mixture_while_the_hot_adapter_stays_merged():
    queue = cands({"hot": 31}, remaining=100, at=2.9) + [Candidate("late", "rare", 0.0, remaining=10)]
    d = decide(PAPER, queue, mode=MERGE, merged="hot", now=3.0)
    assert (d.mode, d.merged, d.starving) == (MIXTURE, "hot", 1) and d.batch[0].request_id == "late"


def test_estimates_follow_the_measured_scale():
    est = Estimates(costs=H100)
    before = est.decode(32, 32, 32)
    for _ in range(50):
        est.observe_step(UNMERGE, 2 * H100.decode_s(32, 32, 32), predicted=H100.decode_s(32, 32, 32))
    assert est.decode(32, 32, 32) == pytest.approx(2 * before, rel=0.01)
    est.observe_switch(0.011, predicted=0.0055)
    assert est.switch(None, "a") > H100.switch_s(None, "a")


# -- the starvation bound ----------------------------------------------------------------------------

def simulate(model, steps: int, seed: int, theta: float, targets: dict):
    """Requests of 24 output tokens; per step about one hot arrival, now and then a rare adapter's. Each step
    lasts what ``model`` says its batch costs in the chosen mode, plus the switch it needed. Returns the
    largest gap (arrival or last service -> next service) per request, over its bound."""
    rng = random.Random(seed)
    pol = make_policy("vlora", MAX_BS, theta)
    est = Estimates(costs=model)
    now, mode, merged = 0.0, UNMERGE, None
    live: dict[str, list] = {}  # id -> [candidate, tokens left, largest gap]
    worst_over, modes, max_step, n = 0.0, [], 0.0, 0
    for step in range(steps):
        arrivals = [("hot", None)] * (1 + (rng.random() < 0.3)) if step < steps - 200 else []
        if step < steps - 200 and rng.random() < 0.08:
            a = rng.choice(["rare", "urgent", "other"])
            arrivals.append((a, targets.get(a)))
        for adapter, target in arrivals:
            c = Candidate(f"r{n}", adapter, now, latency_target=target, remaining=24)
            live[c.request_id] = [c, 24, 0.0]
            n += 1
        if not live:
            continue
        d = pol.decide([v[0] for v in live.values()], now, mode, merged, est)
        dur = est.switch(merged, None if d.mode == UNMERGE else d.merged)
        mode, merged = d.mode, (None if d.mode == UNMERGE else d.merged)
        batch = d.batch[:MAX_BS]
        if mode == MERGE:
            assert all(c.adapter == merged for c in batch)
        lora = [c.adapter for c in batch if c.adapter is not None and (mode == UNMERGE or c.adapter != merged)]
        delora = sum(1 for c in batch if mode == MIXTURE and c.adapter != merged)
        step_s = est.decode(len(batch), 0 if mode == MERGE else len(lora), len(set(lora)), delora)
        max_step = max(max_step, step_s + dur)
        now += dur + step_s
        modes.append(mode)
        for c in batch:
            v = live[c.request_id]
            gap = now - c.last_served
            bound = (c.latency_target or theta) + 2 * max_step
            worst_over = max(worst_over, gap - bound)
            c.last_served, c.remaining = now, v[1] - 1
            v[1] -= 1
            if v[1] == 0:
                del live[c.request_id]
    assert not live, f"{len(live)} requests never finished"
    return worst_over, modes


@pytest.mark.parametrize("model", [H100, LAUNCH_BOUND, PAPER], ids=["h100", "launch-bound", "paper"])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_request_starves_past_its_bound(model, seed):
    worst_over, modes = simulate(model, 1500, seed, theta=0.5, targets={"urgent": 0.1})
    assert worst_over <= 1e-9, worst_over
    if model is not H100:  # where merging pays, a good share of the stream is served merged
        assert modes.count(MERGE) + modes.count(MIXTURE) > len(modes) / 3, (modes.count(MERGE), modes.count(MIXTURE))


# -- measured at load on the tiny model (CPU) ---------------------------------------------------------

def build(tiny_model_dir, demo_adapter_root, cache, **over):
    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    cfg = EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "32", "lora.max_gpu_adapters": "6", "scheduler.max_batch_size": "4",
        "orchestrator.policy": "vlora", "orchestrator.cost_model_dir": str(cache), **over})
    return build_engine(cfg)


def test_measured_at_load_cached_and_the_runner_left_as_it_was(tiny_model_dir, demo_adapter_root, tmp_path):
    plain = build(tiny_model_dir, demo_adapter_root, tmp_path / "unused", **{"orchestrator.cost_model": "default"})
    assert plain.orchestrator.costs is DEFAULT
    engine = build(tiny_model_dir, demo_adapter_root, tmp_path, **{"orchestrator.cost_model": "measure"})
    costs = engine.orchestrator.costs
    assert costs.source == "measured on cpu" and costs.batch == (1, 4)
    assert all(x > 0 for x in costs.base) and all(v > 0 for v in costs.switch.values())
    assert [[d for d, _ in p] for p in costs.lora] == [[1], [1, 4]]  # 1 to batch distinct adapters
    assert engine.model_info["cost_model"]["source"] == "measured on cpu"
    files = list(tmp_path.glob("cpu-float32-r32-*.json"))
    assert len(files) == 1 and CostModel.load(files[0]).key == costs.key
    # The zero-weight slots it used are empty again, and the weights are those of an engine that never measured.
    assert all(r == 0 for w in engine.runner.lora_layers.values() for r in w.ranks)
    assert engine.runner.kv.allocator.num_free == engine.runner.kv.num_blocks
    for key, w in engine.runner.lora_layers.items():
        assert torch.equal(w.base.weight, plain.runner.lora_layers[key].base.weight), key
    # auto finds the cached model for this GPU, model and settings
    again = build(tiny_model_dir, demo_adapter_root, tmp_path, **{"orchestrator.cost_model": "auto"})
    assert again.orchestrator.costs.source == f"file {files[0]}"
    # a file named in the config
    named = build(tiny_model_dir, demo_adapter_root, tmp_path / "other", **{"orchestrator.cost_model": str(files[0])})
    assert named.orchestrator.costs.base == costs.base


def test_auto_on_a_cpu_without_a_cache_takes_the_default_and_a_missing_file_is_refused(tiny_model_dir, demo_adapter_root,
                                                                                        tmp_path):
    assert build(tiny_model_dir, demo_adapter_root, tmp_path).orchestrator.costs is DEFAULT
    with pytest.raises(FileNotFoundError, match="orchestrator.cost_model"):
        build(tiny_model_dir, demo_adapter_root, tmp_path, **{"orchestrator.cost_model": str(tmp_path / "nope.json")})


def test_the_engine_feeds_measured_steps_to_the_estimates(tiny_model_dir, demo_adapter_root, tmp_path):
    from vlora.engine.api import GenerationRequest, SamplingParams

    engine = build(tiny_model_dir, demo_adapter_root, tmp_path, **{"orchestrator.cost_model": "default"})
    for i, name in enumerate(["demo-r8-qv", "demo-r32-mlp", None]):
        req = GenerationRequest(f"r{i}", "Count the circles.", lora_name=name,
                                sampling=SamplingParams(max_tokens=4, ignore_eos=True))
        engine.add_request(engine.inputs.prepare(req), lambda out: None)
    cands = [s.candidate for s in engine.waiting]
    assert [c.remaining for c in cands] == [4, 4, 4]
    engine.step()
    assert [c.remaining for c in cands] == [3, 3, 3]
    while engine.has_work():
        engine.step()
    scale = engine.orchestrator.estimates.scale
    assert scale["decode"] != 1.0 and scale["eager"] != 1.0  # the CPU is not the H100 the default describes
