"""The fast decode path against the eager reference path, on CUDA with the tiny model.

Fast: decode steps replayed from CUDA graphs, paged attention in Triton reading the cache in place, the
LoRA backend's graph-safe per-row path, the step overlap (each step launched before the last one's
tokens are read back; decode rows read their token on the device). Reference: every step eager, the SDPA reference attention, the
segment path. Both engines run the same requests for 64 greedy tokens in base, unmerged, merged and
mixture steps; in fp32 the tokens must be identical and the logits within 1e-4, in bf16 the logits of
every step within a bf16 tolerance of the reference's.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vlora.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from vlora.engine.builder import build_engine  # noqa: E402
from vlora.orchestrator.policies import MERGE, MIXTURE, UNMERGE  # noqa: E402
from engine_parity import ScriptedPolicy, add_greedy, check_fast_against_eager, rel_err, step_recording  # noqa: E402
from helpers import tiny_config  # noqa: E402

REQUESTS = {"a1": "demo-r8-qv", "a2": "demo-r8-qv", "b1": "demo-r32-mlp", "c1": "demo-r16-attn", "base": None}
PROMPTS = {"a1": "Count the circles.", "a2": "Is there a red square in the corner?", "b1": "Describe the scene.",
           "c1": "Which way does it move?", "base": "Hello there, what is this?"}
MAX_NEW = 64
SCRIPTS = {
    "unmerge": [(UNMERGE, None)],
    "merge": [(MERGE, "demo-r8-qv")],
    "mixture": [(MIXTURE, "demo-r32-mlp")],
    "switching": [(MIXTURE, "demo-r8-qv"), (MERGE, "demo-r8-qv"), (UNMERGE, None), (MIXTURE, "demo-r32-mlp")],
}


def make(tiny_model_dir, demo_adapter_root, dtype: str, fast: bool, prefill_graphs: int = 0):
    return build_engine(tiny_config(tiny_model_dir, demo_adapter_root, **{
        "model.device": "cuda", "model.dtype": dtype, "lora.max_gpu_adapters": "4", "cache.num_blocks": "256",
        "orchestrator.policy": "vlora", "scheduler.max_batch_size": "8",
        "engine.cuda_graphs": "auto" if fast else "off", "engine.attention": "triton" if fast else "torch",
        "engine.overlap": "on" if fast else "off", "engine.prefill_graph_tokens": str(prefill_graphs)}))


def run(engine, script):
    engine.orchestrator.policy = ScriptedPolicy(script)
    logits, seqs = {}, {}
    for rid, adapter in REQUESTS.items():
        seqs[rid] = add_greedy(engine, rid, adapter, PROMPTS[rid], max_new=MAX_NEW)
    while engine.has_work():
        step_recording(engine, seqs, logits)
    engine.orchestrator.enter(UNMERGE, None)
    return {rid: s.output_ids for rid, s in seqs.items()}, logits


@pytest.mark.parametrize("dtype, rtol, exact", [("float32", 1e-4, True), ("bfloat16", 6e-2, False)])
def test_graphs_and_paged_attention_match_the_eager_reference(tiny_model_dir, demo_adapter_root, dtype, rtol, exact):
    fast = make(tiny_model_dir, demo_adapter_root, dtype, fast=True)
    ref = make(tiny_model_dir, demo_adapter_root, dtype, fast=False)
    assert fast.runner.graphs is not None and fast.runner.graphs.graphs, "no decode graph was captured"
    assert ref.runner.graphs is None
    check_fast_against_eager(fast, ref, SCRIPTS, run, MAX_NEW, rtol, exact)
    # Every variant replayed at least one captured graph.
    assert {v for _, v in fast.runner.graphs.graphs} >= {"base", "lora", "mixture"}


def test_padding_rows_leave_real_caches_alone(tiny_model_dir, demo_adapter_root):
    """Three requests in the bucket of four: the padding row writes only the scratch block."""
    engine = make(tiny_model_dir, demo_adapter_root, "float32", fast=True)
    kv = engine.runner.kv
    for i in range(3):
        req = GenerationRequest(f"r{i}", f"prompt number {i}", sampling=SamplingParams(max_tokens=8, ignore_eos=True))
        engine.add_request(engine.inputs.prepare(req), lambda out: None)
    engine.step()  # prefill
    used = [b for s in engine.running for b in s.blocks.blocks]
    free = sorted(set(range(kv.num_blocks)) - set(used))
    before = kv.k[0].view(kv.num_blocks + 1, kv.block_size, -1)[free].clone()
    while engine.has_work():
        engine.step()
    after = kv.k[0].view(kv.num_blocks + 1, kv.block_size, -1)[free]
    assert torch.equal(before, after)


def test_merged_and_mixture_steps_replay_graphs(tiny_model_dir, demo_adapter_root):
    """Merged decode steps replay the base model's graphs and mixture steps the mixture graphs; no decode
    step of any mode runs eagerly (a decode-only step planned eagerly would show in ``plan``)."""
    engine = make(tiny_model_dir, demo_adapter_root, "bfloat16", fast=True)
    graphs, runner = engine.runner.graphs, engine.runner
    eager_decodes = []
    plan = runner.plan

    def spy(seqs):
        if all(len(s.token_ids) == 1 for s in seqs):
            eager_decodes.append(len(seqs))
        return plan(seqs)

    runner.plan = spy

    def replays(variant):
        return sum(n for (_, v), n in graphs.replays.items() if v == variant)

    for name, variant in (("merge", "base"), ("mixture", "mixture"), ("unmerge", "lora")):
        before = replays(variant)
        run(engine, SCRIPTS[name])
        # merge: a1 and a2 merged (base graphs) until they finish; the rest then runs as a mixture
        assert replays(variant) - before >= MAX_NEW - 1, (name, dict(graphs.replays))
    assert not eager_decodes, eager_decodes


def _png(side: int, color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, format="PNG")
    return buf.getvalue()


def _prefill_run(engine):
    """Base requests of different lengths, one with an image, arriving while others decode (steps that mix
    decode rows and prompts): greedy tokens and every step's logits by (request, output index)."""
    prompts = {"p0": "Hello there, what is this?", "p1": "Describe the scene in a few words, please. " * 6,
               "p2": "<image> What colour is this?", "p3": "Count to ten. " * 20, "p4": "Which way does it move?"}
    logits, seqs, pending = {}, {}, list(prompts)
    steps = 0
    while pending or engine.has_work():
        if pending and steps % 3 == 0:  # a new prompt every third step
            rid = pending.pop(0)
            images = [_png(64, (200, 30, 30))] if "<image>" in prompts[rid] else []
            req = GenerationRequest(rid, prompts[rid], images=images,
                                    sampling=SamplingParams(max_tokens=24, ignore_eos=True))
            engine.add_request(engine.inputs.prepare(req), lambda out: None)
            seqs[rid] = engine.waiting[-1]
        steps += 1
        step_recording(engine, seqs, logits)
    engine.flush()
    return {rid: s.output_ids for rid, s in seqs.items()}, logits


@pytest.mark.parametrize("dtype, rtol, exact", [("float32", 1e-4, True), ("bfloat16", 6e-2, False)])
def test_prefill_graphs_match_eager_prefill(tiny_model_dir, demo_adapter_root, dtype, rtol, exact):
    """Prefill steps replayed from the token-bucket graphs (padding to the next bucket, decode rows of other
    requests in the same step, an image put in before the replay) against the same fast engine with every
    prefill eager (engine.prefill_graph_tokens 0)."""
    graphed = make(tiny_model_dir, demo_adapter_root, dtype, fast=True, prefill_graphs=1024)
    pg = graphed.runner.prefill_graphs
    assert pg is not None and pg.graphs and pg.sizes[0] == 24
    eager_cfg = graphed.config.with_overrides({"engine.prefill_graph_tokens": "0"})
    eager = build_engine(eager_cfg)
    assert eager.runner.prefill_graphs is None
    tokens, logits = _prefill_run(graphed)
    ref_tokens, ref_logits = _prefill_run(eager)
    assert sum(pg.replays.values()) >= 5, dict(pg.replays)
    assert all(len(t) == 24 for t in tokens.values())
    if exact:
        assert tokens == ref_tokens
    for key, want in ref_logits.items():
        rid, i = key
        if not exact and (i > 0 or tokens[rid][0] != ref_tokens[rid][0]):
            continue  # bf16: compare the prefill's logits (same inputs); later inputs may differ
        rel = rel_err(logits[key], want)
        assert rel <= rtol, f"{key}: relative error {rel:.2e} > {rtol:.0e}"


@pytest.mark.parametrize("dtype, rtol, exact", [("float32", 1e-4, True), ("bfloat16", 6e-2, False)])
def test_prefill_graphs_with_adapters_match_eager_prefill(tiny_model_dir, demo_adapter_root, dtype, rtol, exact):
    """Prompts for three adapters (two requests share one) and the base model, prefilled together in one step
    (a segment per sequence, uneven), unmerged and as a mixture (the merged adapter taken out for the other
    rows), replayed from the prefill graphs' lora and mixture variants, against the same fast engine with
    every prefill eager."""
    graphed = make(tiny_model_dir, demo_adapter_root, dtype, fast=True, prefill_graphs=1024)
    eager = make(tiny_model_dir, demo_adapter_root, dtype, fast=True, prefill_graphs=0)
    pg = graphed.runner.prefill_graphs
    assert {v for _, v in pg.graphs} >= {"base", "lora", "mixture"}
    before = dict(pg.replays)
    check_fast_against_eager(graphed, eager, {k: SCRIPTS[k] for k in ("unmerge", "mixture")}, run, MAX_NEW, rtol, exact)
    used = {v for key, n in pg.replays.items() if n > before.get(key, 0) for v in [key[1]]}
    assert {"lora", "mixture"} <= used, dict(pg.replays)


def test_prefill_graph_padding_writes_no_cache(tiny_model_dir, demo_adapter_root):
    """A short prompt runs in the smallest graph (24 tokens): its padding tokens write no KV anywhere."""
    engine = make(tiny_model_dir, demo_adapter_root, "float32", fast=True, prefill_graphs=1024)
    kv = engine.runner.kv
    before_k = [k.clone() for k in kv.k]
    replays = engine.runner.prefill_graphs.replays[(24, "base")]  # the warm start ran its short prompts there too
    req = GenerationRequest("short", "one two three", sampling=SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request(engine.inputs.prepare(req), lambda out: None)
    seq = engine.waiting[-1]
    n = len(seq.req.prompt_ids)
    engine.step()
    assert n < 24 and engine.runner.prefill_graphs.replays[(24, "base")] == replays + 1
    rows = set(kv.slots(seq.blocks, 0, n))
    for li, (k0, k1) in enumerate(zip(before_k, kv.k)):
        changed = set((k0 != k1).any(dim=(1, 2)).nonzero().flatten().tolist())
        assert changed <= rows and len(changed) == n, (li, sorted(changed - rows)[:5])
    engine.flush()
