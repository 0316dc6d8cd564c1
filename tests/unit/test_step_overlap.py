"""The step overlap (``engine.overlap``): a step is launched before the last one's tokens are read back,
and its decode rows read their token on the device. Every request must come out as it does without the
overlap: tokens, text, finish reasons, stop strings, EOS, seeds, task heads, cancellation and failures.
On a CPU nothing overlaps in time, but the code path is the same one CUDA runs (``overlap: on``)."""
from __future__ import annotations

import pytest
import torch

from engine_parity import check_mixed_batch, make_engine, make_reference
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.heads import TaskHead, save_heads
from vlora.lora.demo import ensure_demo_adapters

HIDDEN = 128


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory):
    """Random demo adapters with a task head on demo-r8-qv."""
    r = ensure_demo_adapters(tiny_model_dir, tmp_path_factory.mktemp("overlap") / "adapters", trained=False)
    g = torch.Generator().manual_seed(0)
    labels = ("1", "2", "3", "4")
    save_heads(r / "demo-r8-qv", {"count": TaskHead("count", "counting", labels, torch.randn(4, HIDDEN, generator=g),
                                                     torch.randn(4, generator=g), "USER: {images}\nHow many? ASSISTANT:")})
    return r


@pytest.fixture(scope="module")
def engines(tiny_model_dir, root):
    on = make_engine(tiny_model_dir, root, "cpu", "float32", **{"engine.overlap": "on"})
    off = make_engine(tiny_model_dir, root, "cpu", "float32", **{"engine.overlap": "off"})
    assert on.overlap and not off.overlap
    return on, off


def _run(engine, reqs, abort_after: dict | None = None):
    """Every request to completion; ``abort_after`` {request id: step}: cancel it before that step."""
    outs, seqs, events = {}, {}, {}

    def cb(o):
        events.setdefault(o.request_id, []).append(o)
        if o.finished:
            outs[o.request_id] = o

    for r in reqs:
        engine.add_request(engine.inputs.prepare(r), cb)
        seqs[r.request_id] = engine.waiting[-1]
    steps = 0
    while engine.has_work():
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
        engine.step()
        steps += 1
        assert steps < 500, "the engine made no progress"
    assert engine.runner.kv.allocator.num_free == engine.runner.kv.num_blocks  # every block came back
    assert not any(engine.loras._pins)  # every adapter slot was released
    return outs, seqs, events, steps


def _requests(eos_tok=None):
    g = lambda **kw: SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **kw})  # noqa: E731
    return [
        GenerationRequest("greedy", "Count the circles.", sampling=g()),
        GenerationRequest("lora", "How many triangles?", lora_name="demo-r16-attn", sampling=g(max_tokens=9)),
        GenerationRequest("one", "Hello there", lora_name="demo-r32-mlp", sampling=g(max_tokens=1)),
        GenerationRequest("seeded", "Tell me a story.", lora_name="demo-r8-qv",
                          sampling=g(temperature=0.9, top_p=0.8, seed=11)),
        GenerationRequest("eos", "Is there a red square?", sampling=g(ignore_eos=False, max_tokens=16)),
        GenerationRequest("head", "How many?", lora_name="demo-r8-qv", task="count"),
        GenerationRequest("stream", "Describe it.", lora_name="demo-r16-attn", stream=True, sampling=g()),
    ]


def _same(a, b):
    assert set(a) == set(b)
    for rid in a:
        x, y = a[rid], b[rid]
        assert (x.text, x.finish_reason, x.num_output_tokens, x.error) == (y.text, y.finish_reason, y.num_output_tokens, y.error), rid
        assert x.extra == y.extra, rid


def test_overlap_gives_the_same_outputs(engines):
    on, off = engines
    ref, ref_seqs, ref_events, ref_steps = _run(off, _requests())
    got, seqs, events, steps = _run(on, _requests())
    _same(got, ref)
    for rid in ref_seqs:
        assert seqs[rid].output_ids == ref_seqs[rid].output_ids, rid
    # Streamed deltas add up to the same text.
    assert "".join(e.text_delta for e in events["stream"]) == "".join(e.text_delta for e in ref_events["stream"])
    assert ref["head"].extra["label"] in ("1", "2", "3", "4")
    # The last step's tokens are read back by one more call (a step that launches nothing).
    assert steps == ref_steps + 1


def test_a_token_that_stops_a_request_costs_one_discarded_row(engines):
    """EOS and stop strings are seen one step late: the request ran one more decode row, which is discarded."""
    on, off = engines
    probe, seqs, _, _ = _run(off, [GenerationRequest("p", "Count the circles.", sampling=SamplingParams(max_tokens=12, ignore_eos=True))])
    text = probe["p"].text
    # Make a generated token (the first new one after the second) an EOS, for both engines.
    seq_ids = seqs["p"].output_ids
    k = next((k for k in range(2, len(seq_ids)) if seq_ids[k] not in seq_ids[:k]), None)
    if k is None:
        pytest.skip("no token of the greedy output is new after the second")
    eos = seq_ids[k]
    reqs = lambda: [GenerationRequest("e", "Count the circles.", sampling=SamplingParams(max_tokens=12)),  # noqa: E731
                    GenerationRequest("s", "Count the circles.", sampling=SamplingParams(max_tokens=12, ignore_eos=True,
                                                                                            stop=[text[len(text) // 2:len(text) // 2 + 2]])),
                    GenerationRequest("k", "How many?", sampling=SamplingParams(max_tokens=12, ignore_eos=True))]
    saved = (on.eos_ids, off.eos_ids)
    on.eos_ids, off.eos_ids = {eos}, {eos}
    try:
        ref, _, _, _ = _run(off, reqs())
        got, seqs, _, _ = _run(on, reqs())
    finally:
        on.eos_ids, off.eos_ids = saved
    _same(got, ref)
    assert got["e"].finish_reason == "stop" and got["e"].num_output_tokens == k + 1
    assert len(seqs["e"].output_ids) == k + 1 and seqs["e"].inflight == 1  # the discarded row's token never landed


def test_cancel_under_overlap(engines):
    on, off = engines
    reqs = lambda: [GenerationRequest(f"r{i}", f"Question {i}?", lora_name=[None, "demo-r8-qv"][i % 2],  # noqa: E731
                                      sampling=SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(4)]
    got, seqs, _, _ = _run(on, reqs(), abort_after={"r1": 5})
    ref, _, _, _ = _run(off, reqs())
    assert got["r1"].finish_reason == "cancelled" and got["r1"].num_output_tokens < 20
    for rid in ("r0", "r2", "r3"):
        assert got[rid].text == ref[rid].text and got[rid].num_output_tokens == 20


def test_mixed_batch_matches_transformers_peft_under_overlap(tiny_model_dir, demo_adapter_root):
    engine = make_engine(tiny_model_dir, demo_adapter_root, "cpu", "float32", **{"engine.overlap": "on"})
    check_mixed_batch(engine, make_reference(tiny_model_dir, demo_adapter_root, "cpu", torch.float32), rtol=1e-4)


def test_the_engine_thread_drains_the_step_in_flight(tiny_model_dir, root):
    """Through AsyncEngine: the last step's tokens are read back and reported, and shutdown waits for them."""
    import threading

    from vlora.config import EngineConfig
    from vlora.engine.async_engine import AsyncEngine

    cfg = EngineConfig().with_overrides({"model.path": str(tiny_model_dir), "lora.adapter_root": str(root),
                                         "model.device": "cpu", "model.dtype": "float32", "lora.max_rank": "32",
                                         "engine.overlap": "on"})
    eng = AsyncEngine(cfg)
    done, cv = {}, threading.Condition()

    def cb(o):
        if o.finished:
            with cv:
                done[o.request_id] = o
                cv.notify_all()
    try:
        assert eng.engine.overlap
        for i in range(5):
            r = GenerationRequest(f"a{i}", f"Question {i}?", lora_name=[None, "demo-r8-qv"][i % 2],
                                  sampling=SamplingParams(max_tokens=6, ignore_eos=True))
            eng.submit(eng.prepare(r), cb)
        with cv:
            assert cv.wait_for(lambda: len(done) == 5, 60)
        assert all(o.num_output_tokens == 6 and o.finish_reason == "length" for o in done.values())
    finally:
        eng.shutdown()
    assert eng.engine._inflight is None and not eng.engine.has_work()
