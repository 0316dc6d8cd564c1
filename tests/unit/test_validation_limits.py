"""Every sampling field is checked against its real range before queueing (a clear InvalidRequest,
a 400), and the engine survives what slips past: a request with non-finite logits fails alone."""
from __future__ import annotations

import json
import time

import pytest

from vlora.engine import core
from vlora.engine.api import (
    MAX_SAMPLING_JSON_BYTES,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    parse_sampling_json,
)
from vlora.engine.async_engine import AsyncEngine

from helpers import Collector, tiny_config


def _from_json(text):
    return SamplingParams.from_dict(parse_sampling_json(text))


@pytest.mark.parametrize("fields, message", [
    ({"seed": 2**64}, "seed must be an integer in \\[0, 2\\*\\*64\\)"),
    ({"seed": "18446744073709551616"}, "seed"),
    ({"seed": -1}, "seed"),
    ({"temperature": 1e-40}, "temperature must be 0 \\(greedy\\) or a number in \\[0.01, 100\\]"),
    ({"temperature": 0.009}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": 1e-46}, "top_p must be a number in \\[0.001, 1\\]"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": "9" * 5000}, "max_tokens must be a number; got a string of 5000 characters"),
    ({"temperature": "1" * 40}, "temperature must be a number; got a string of 40"),
    ({"max_tokens": 10**30}, "max_tokens must be an integer in \\[1, 1048576\\]"),
    ({"stop": ["x" * 257]}, "at most 256 characters"),
    ({"stop": ["a"] * 17}, "at most 16 strings"),
])
def test_out_of_range_fields_are_refused(fields, message):
    with pytest.raises(InvalidRequest, match=message):
        _from_json(json.dumps(fields))


@pytest.mark.parametrize("fields", [
    {"seed": 2**64 - 1}, {"seed": 0}, {"seed": "42"}, {"temperature": 0}, {"temperature": 0.01}, {"temperature": "0.7"},
    {"top_p": 0.001}, {"top_p": 1}, {"max_tokens": "16"}, {"stop": ["y" * 256]},
])
def test_values_at_the_limits_are_accepted(fields):
    _from_json(json.dumps(fields))


def test_a_long_number_as_json_is_refused():
    with pytest.raises(InvalidRequest, match="sampling_parameters is not valid JSON"):
        parse_sampling_json('{"max_tokens": ' + "9" * 5000 + "}")  # over Python's int digit limit


@pytest.mark.parametrize("text", ['{"stop": ' + "[" * 100_000 + "]" * 100_000 + "}", "[" * 100_000])
def test_deep_json_is_refused_quickly(text):
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest, match="sampling_parameters nests .* levels deep"):
        parse_sampling_json(text[:MAX_SAMPLING_JSON_BYTES])
    assert time.perf_counter() - t0 < 0.5


def test_json_depth_ignores_brackets_in_strings():
    deep_string = json.dumps({"stop": ["[[[[[[[[[[{{{{{{{{{{\\\"[[[[[[[["], "max_tokens": 3})
    assert _from_json(deep_string).stop == ('[[[[[[[[[[{{{{{{{{{{\\"[[[[[[[[',)
    assert _from_json(deep_string.encode()).max_tokens == 3


def test_large_json_is_refused():
    with pytest.raises(InvalidRequest, match="longer than 65536 bytes"):
        parse_sampling_json(json.dumps({"stop": ["x" * 70_000]}))
    with pytest.raises(InvalidRequest, match="longer than 65536 bytes"):
        parse_sampling_json(json.dumps({"stop": ["é" * 40_000]}, ensure_ascii=False))  # 80 KB as UTF-8


# ---- at the engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir, demo_adapter_root):
    eng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root))
    yield eng
    eng.shutdown()


def run_all(engine, reqs):
    col = Collector()
    for r in reqs:
        engine.submit(engine.prepare(r), col)
    col.wait(len(reqs))
    return col.done


def req(rid, prompt="Count the circles.", lora=None, **sp):
    sp.setdefault("max_tokens", 8)
    return GenerationRequest(request_id=rid, prompt=prompt, lora_name=lora, sampling=SamplingParams(**sp))


@pytest.mark.parametrize("name", ["demo-r8-qv\x00", "demo-r8-qv\x00../../etc", "\x00", "demo r8", "démo", "a" * 129])
def test_a_lora_name_outside_the_rule_is_refused(engine, name):
    with pytest.raises(InvalidRequest, match="invalid adapter name"):
        engine.prepare(req("bad", lora=name))


def test_a_lora_name_with_a_nul_is_never_served_as_another_adapter(engine):
    assert engine.prepare(req("ok", lora="demo-r8-qv")).lora_name == "demo-r8-qv"
    with pytest.raises(InvalidRequest, match=r"invalid adapter name 'demo-r8-qv\\x00'"):
        engine.prepare(req("nul", lora="demo-r8-qv\x00"))


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_batches(engine):
    seeded = dict(temperature=0.9, top_p=0.95, seed=2**64 - 5, max_tokens=12, ignore_eos=True)
    alone = run_all(engine, [req("s", **seeded)])["s"].text
    for n in (2, 5):
        others = [req(f"o{n}-{i}", prompt=f"Other prompt number {i} " * (i + 1), temperature=1.0 if i % 2 else 0.0,
                      max_tokens=6 + i, ignore_eos=True) for i in range(n)]
        done = run_all(engine, others[: n // 2] + [req(f"s{n}", **seeded)] + others[n // 2:])
        assert done[f"s{n}"].text == alone


def test_non_finite_logits_fail_only_that_request(engine, monkeypatch):
    """One request's logits turn NaN mid-generation: it ends with an error naming the cause; the
    requests batched with it finish normally and the engine keeps serving."""
    poisoned_seed = 987654321
    real_sample = core.sample_async

    def poisoning_sample(logits, params, seeds, steps):
        logits = logits.clone()
        for i, (p, step) in enumerate(zip(params, steps)):
            if p.seed == poisoned_seed and step == 3:
                logits[i, 5] = float("nan")
        return real_sample(logits, params, seeds, steps)

    monkeypatch.setattr(core, "sample_async", poisoning_sample)
    reqs = [req("ok1", max_tokens=10, ignore_eos=True), req("bad", temperature=1.0, seed=poisoned_seed, max_tokens=10, ignore_eos=True),
            req("ok2", temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)]
    done = run_all(engine, reqs)
    assert done["bad"].finish_reason == "error" and "non-finite logits" in done["bad"].error
    assert done["bad"].num_output_tokens == 3
    assert done["ok1"].finish_reason == "length" and done["ok1"].num_output_tokens == 10
    assert done["ok2"].finish_reason == "length" and done["ok2"].num_output_tokens == 10
    monkeypatch.undo()
    assert run_all(engine, [req("after", max_tokens=3, ignore_eos=True)])["after"].num_output_tokens == 3
