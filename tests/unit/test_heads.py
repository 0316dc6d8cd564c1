"""Vision task heads: the on-disk format and its checks, loading with an adapter, and answers from the
engine (a head request and generating requests in the same step; label, scores, one output token)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, InvalidRequest, SamplingParams
from vlora.engine.builder import build_engine
from vlora.heads import HEADS_CONFIG, HEADS_WEIGHTS, HeadError, TaskHead, load_heads, save_heads
from vlora.lora.adapter import AdapterError, decoder_module_dims, load_adapter
from vlora.lora.demo import ensure_demo_adapters

HIDDEN = 128  # the tiny model's
LABELS = ("1", "2", "3", "4")


def make_head(task="count", labels=LABELS, hidden=HIDDEN, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TaskHead(task, "counting", labels, torch.randn(len(labels), hidden, generator=g),
                    torch.randn(len(labels), generator=g), "USER: {images}\nHow many? ASSISTANT:")


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory):
    """Random demo adapters (no trained ones, to stay fast) with two heads on demo-r8-qv."""
    r = ensure_demo_adapters(tiny_model_dir, tmp_path_factory.mktemp("heads") / "adapters", trained=False)
    save_heads(r / "demo-r8-qv", {"count": make_head(), "yesno": make_head("yesno", ("yes", "no"), seed=1)})
    return r


def test_heads_round_trip(tmp_path):
    heads = {"count": make_head(), "colour.v2": make_head("colour.v2", ("red", "green"), seed=3)}
    save_heads(tmp_path, heads)
    back = load_heads(tmp_path, hidden_size=HIDDEN)
    assert list(back) == ["count", "colour.v2"]
    for name, h in heads.items():
        assert back[name].labels == h.labels and back[name].task_type == h.task_type and back[name].prompt == h.prompt
        assert torch.equal(back[name].weight, h.weight) and torch.equal(back[name].bias, h.bias)
    x = torch.randn(3, HIDDEN)
    s = back["count"].scores(x)
    assert s.shape == (3, 4) and torch.allclose(s.sum(-1), torch.ones(3))
    label, scores = back["count"].answer(x[0])
    assert label == LABELS[max(range(4), key=lambda i: scores[i])] and abs(sum(scores) - 1) < 1e-5
    assert load_heads(tmp_path / "nothing-here", hidden_size=HIDDEN) == {}


def _edit_config(d, fn):
    cfg = json.loads((d / HEADS_CONFIG).read_text())
    fn(cfg)
    (d / HEADS_CONFIG).write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(hidden_size=4096), "hidden size 4096"),
    (lambda c: c.update(format="other"), "format"),
    (lambda c: c.update(version=9), "version 9"),
    (lambda c: c["heads"].append(dict(c["heads"][0])), "listed twice"),
    (lambda c: c["heads"][0].update(task="../x"), "invalid task name"),
    (lambda c: c["heads"][0].update(task_type="regression"), "task_type"),
    (lambda c: c["heads"][0].update(labels=["1", "1", "2", "3"]), "distinct"),
    (lambda c: c["heads"][0].update(labels=["1", "2", "3"]), "shape [4, 128], expected [3, 128]"),
    (lambda c: c["heads"][0].update(task="other"), "no tensor 'other.weight'"),
    (lambda c: c.update(heads=[]), "lists no heads"),
])
def test_bad_head_config_is_refused(tmp_path, edit, message):
    save_heads(tmp_path, {"count": make_head()})
    _edit_config(tmp_path, edit)
    with pytest.raises(HeadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_heads(tmp_path, hidden_size=HIDDEN)


def test_bad_head_weights_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_heads(tmp_path, {"count": make_head()})
    w = make_head().weight.clone()
    w[0, 0] = float("nan")
    save_file({"count.weight": w, "count.bias": torch.zeros(4)}, str(tmp_path / HEADS_WEIGHTS))
    with pytest.raises(HeadError, match="finite"):
        load_heads(tmp_path, hidden_size=HIDDEN)
    save_file({"count.weight": w.nan_to_num(), "count.bias": torch.zeros(4), "stray": torch.zeros(1)}, str(tmp_path / HEADS_WEIGHTS))
    with pytest.raises(HeadError, match="no head names"):
        load_heads(tmp_path, hidden_size=HIDDEN)
    (tmp_path / HEADS_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(HeadError, match="not a valid safetensors"):
        load_heads(tmp_path, hidden_size=HIDDEN)
    (tmp_path / HEADS_CONFIG).write_text("{nope")
    with pytest.raises(HeadError, match="not valid JSON"):
        load_heads(tmp_path, hidden_size=HIDDEN)


def test_adapter_loads_its_heads_and_refuses_broken_ones(root, tiny_model_dir):
    text = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]
    dims = decoder_module_dims(text)
    kw = dict(num_layers=text["num_hidden_layers"], module_dims=dims, max_rank=64,
              supported_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    w = load_adapter(root, "demo-r8-qv", **kw)
    assert sorted(w.heads) == ["count", "yesno"] and w.heads["yesno"].labels == ("yes", "no")
    assert load_adapter(root, "demo-r16-attn", **kw).heads == {}
    shutil.copytree(root / "demo-r8-qv", root / "broken")
    (root / "broken" / HEADS_WEIGHTS).unlink()
    with pytest.raises(AdapterError, match="vlora_heads.safetensors is missing"):
        load_adapter(root, "broken", **kw)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, root):
    cfg = EngineConfig().with_overrides({"model.path": str(tiny_model_dir), "lora.adapter_root": str(root),
                                         "model.device": "cpu", "model.dtype": "float32", "lora.max_rank": "32"})
    return build_engine(cfg)


def _run(engine, reqs):
    outs = {}
    for r in reqs:
        engine.add_request(engine.inputs.prepare(r), lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    steps = []
    while engine.has_work():
        ran = engine.step()
        if ran is not None:
            steps.append({"request_ids": ran.request_ids})
    return outs, steps


def test_head_and_generating_requests_share_a_step(engine):
    gen = dict(sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    reqs = [GenerationRequest("head", "How many?", lora_name="demo-r8-qv", task="count"),
            GenerationRequest("gen", "How many?", lora_name="demo-r8-qv", **gen),
            GenerationRequest("base", "Tell me more.", **gen),
            GenerationRequest("yn", "Is it there?", lora_name="demo-r8-qv", task="yesno")]
    outs, steps = _run(engine, reqs)
    assert set(steps[0]["request_ids"]) == {"head", "gen", "base", "yn"}  # one batch, one forward
    assert all("head" not in s.get("request_ids", []) for s in steps[1:])  # finished after its prefill
    head = outs["head"]
    assert head.finish_reason == "stop" and head.num_output_tokens == 1 and head.error is None
    assert head.text == head.extra["label"] and head.extra["labels"] == list(LABELS)
    assert len(head.extra["scores"]) == 4 and abs(sum(head.extra["scores"]) - 1) < 1e-5
    assert head.extra["label"] == LABELS[max(range(4), key=lambda i: head.extra["scores"][i])]
    assert outs["yn"].text in ("yes", "no") and outs["yn"].extra["task"] == "yesno"
    assert outs["gen"].num_output_tokens == 5 and outs["gen"].extra == {} and outs["base"].num_output_tokens == 5
    assert engine.runner.kv.allocator.num_free == engine.runner.kv.num_blocks


def test_head_answer_matches_the_head_on_the_step_hidden_state(engine):
    """The label and scores are the head applied to StepResult.hidden of the request's row."""
    prepared = engine.inputs.prepare(GenerationRequest("h", "Count them.", lora_name="demo-r8-qv", task="count"))
    outs = {}
    engine.add_request(prepared, lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    result = engine.step()
    slot = engine.loras.resident["demo-r8-qv"]
    head = engine.loras.head(slot, "count")
    assert head.weight.device == engine.runner.device
    expected = head.scores(result.hidden[0:1])[0]
    assert torch.allclose(torch.tensor(outs["h"].extra["scores"]), expected.cpu(), atol=1e-6)


def test_task_requests_are_checked_before_queueing(engine):
    prep = engine.inputs.prepare
    with pytest.raises(InvalidRequest, match="needs lora_name"):
        prep(GenerationRequest("a", "hi", task="count"))
    with pytest.raises(InvalidRequest, match=r"unknown task 'nope' for adapter 'demo-r8-qv': its heads are \['count', 'yesno'\]"):
        prep(GenerationRequest("b", "hi", lora_name="demo-r8-qv", task="nope"))
    with pytest.raises(InvalidRequest, match="has no task heads"):
        prep(GenerationRequest("c", "hi", lora_name="demo-r16-attn", task="count"))
