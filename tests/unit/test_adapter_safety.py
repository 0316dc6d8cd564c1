"""Adapters that would hang the loader or poison every batch are refused at load, naming the adapter,
the module or key and the value: catastrophic-backtracking pattern keys, absurd scales and weights."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from adapter_edit import clone_adapter

from vlora.config import LORA_TARGETS
from vlora.lora.adapter import AdapterError, decoder_module_dims, load_adapter
from vlora.lora.peft_config import MAX_PATTERN_KEYS, _compile_pattern, _pattern_value
from vlora.lora.demo import ensure_demo_adapters

NAME = "model.language_model.layers.3.self_attn.q_proj"
OLD_NAME = "language_model.model.layers.3.self_attn.q_proj"


@pytest.fixture(scope="module")
def dims(tiny_model_dir):
    return decoder_module_dims(json.loads((tiny_model_dir / "config.json").read_text())["text_config"])


@pytest.fixture()
def root(tiny_model_dir, tmp_path) -> Path:
    return ensure_demo_adapters(tiny_model_dir, tmp_path / "adapters")


def _load(root, name, dims):
    return load_adapter(root, name, num_layers=4, module_dims=dims, max_rank=64, supported_modules=LORA_TARGETS)


def _value(pattern: dict, name: str = NAME):
    return _pattern_value(_compile_pattern(pattern, "test"), name, "default")


# ---- pattern keys


@pytest.mark.parametrize("key, hit", [
    ("q_proj", True),
    ("self_attn.q_proj", True),
    ("layers.3.self_attn.q_proj", True),
    ("model.language_model.layers.3.self_attn.q_proj", True),
    ("proj", False),  # a dotted suffix, not any suffix
    ("_proj", False),
    ("layers.3", False),
    ("layers.13.self_attn.q_proj", False),
    (r"layers\.[0-3]\.self_attn\.q_proj", True),
    (r"layers\.[4-9]\.self_attn\.q_proj", False),
    (r"(q|k)_proj", True),
    (r".*\.q_proj", True),
    (r"layers\.\d+\.mlp\..*", False),
])
def test_keys_match_as_peft_matches_them(key, hit):
    import re

    assert (_value({key: 8}) == 8) == hit
    assert (re.match(rf"(.*\.)?({key})$", NAME) is not None) == hit  # PEFT's get_pattern_key rule


def test_first_matching_key_wins_and_both_namings_match():
    assert _value({"k_proj": 1, "q_proj": 2, "self_attn.q_proj": 3}) == 2
    assert _value({"model.language_model.layers.3.self_attn.q_proj": 5}, OLD_NAME) == 5
    assert _value({"language_model.model.layers.3.self_attn.q_proj": 6}, NAME) == "default"
    assert _value({}) == "default"


@pytest.mark.parametrize("key, message", [
    ("(.+)+X", "repeat inside a repeat"),
    ("(x*)*", "repeat inside a repeat"),
    ("(x+)*y", "repeat inside a repeat"),
    ("(.*)*q_proj", "repeat inside a repeat"),
    ("(?:a{2,}){2,}", "repeat inside a repeat"),
    (r"(q)\1_proj", "backreference"),
    ("(a|aa)+b", "alternation inside a repeat"),
    (".*.*.*x", "more than 2 repeats"),
    ("(unclosed", "not a valid pattern"),
])
def test_slow_or_broken_regex_keys_are_refused(key, message):
    t0 = time.perf_counter()
    with pytest.raises(AdapterError, match=message) as err:
        _compile_pattern({key: 8}, "adapter 'x': rank_pattern")
    assert time.perf_counter() - t0 < 1.0
    assert repr(key) in str(err.value) and "rank_pattern" in str(err.value)


def test_too_many_or_too_long_keys_are_refused():
    with pytest.raises(AdapterError, match="keys; at most 1024"):
        _compile_pattern({f"k{i}": 1 for i in range(MAX_PATTERN_KEYS + 1)}, "p")
    with pytest.raises(AdapterError, match="has 300 characters"):
        _compile_pattern({"q" * 300: 1}, "p")
    with pytest.raises(AdapterError, match="regular-expression keys"):
        _compile_pattern({f"(a|b){i}": 1 for i in range(40)}, "p")
    assert len(_compile_pattern({f"layers.{i}.self_attn.q_proj": 1 for i in range(MAX_PATTERN_KEYS)}, "p")) == MAX_PATTERN_KEYS


def test_an_evil_rank_pattern_is_refused_quickly_at_load(root, dims):
    name = clone_adapter(root, "demo-r8-qv", "evil", edit_config=lambda c: c.update(rank_pattern={"(.+)+X": 8}))
    t0 = time.perf_counter()
    with pytest.raises(AdapterError, match=r"adapter 'evil': rank_pattern key '\(\.\+\)\+X' is refused"):
        _load(root, name, dims)
    assert time.perf_counter() - t0 < 1.0


def test_plain_and_regex_patterns_still_apply_at_load(root, dims):
    name = clone_adapter(root, "demo-r8-qv", "patterned", edit_config=lambda c: c.update(
        alpha_pattern={"layers.3.self_attn.q_proj": 4, r"layers\.[0-1]\.self_attn\.v_proj": 32}))
    w = _load(root, name, dims)
    assert w.scale(3, "q_proj") == 4 / 8 and w.scale(2, "q_proj") == 16 / 8
    assert w.scale(0, "v_proj") == 32 / 8 and w.scale(1, "v_proj") == 32 / 8 and w.scale(2, "v_proj") == 16 / 8


# ---- magnitude


@pytest.mark.parametrize("alpha", [1e308, 1e6, -1e6])
def test_an_absurd_lora_alpha_is_refused(root, dims, alpha):
    name = clone_adapter(root, "demo-r8-qv", "loud", edit_config=lambda c: c.update(lora_alpha=alpha))
    with pytest.raises(AdapterError, match=r"adapter 'loud': module .*layers\.0\.self_attn\.q_proj: scale .* is outside"):
        _load(root, name, dims)


def test_an_absurd_alpha_in_alpha_pattern_is_refused(root, dims):
    name = clone_adapter(root, "demo-r8-qv", "loud-v", edit_config=lambda c: c.update(alpha_pattern={"v_proj": 1e300}))
    with pytest.raises(AdapterError, match=r"adapter 'loud-v': module .*v_proj: scale 1.25e\+299"):
        _load(root, name, dims)


def test_an_integer_alpha_too_large_for_a_float_is_refused(root, dims):
    (root / "demo-r8-qv" / "adapter_config.json").write_text(
        (root / "demo-r8-qv" / "adapter_config.json").read_text().replace('"lora_alpha": 16', '"lora_alpha": 1' + "0" * 400))
    with pytest.raises(AdapterError, match="lora_alpha must be a number"):
        _load(root, "demo-r8-qv", dims)


def test_huge_weights_are_refused(root, dims):
    def scale_b(t):
        for k in t:
            if "layers.2.self_attn.v_proj.lora_B" in k:
                t[k] = t[k] * 1e5

    name = clone_adapter(root, "demo-r8-qv", "heavy", edit_tensors=scale_b)
    with pytest.raises(AdapterError, match=r"adapter 'heavy': module .*layers\.2\.self_attn\.v_proj: "
                                           r"\|scale\| \* \|\|B\|\| \* \|\|A\|\| = .* exceeds 10000"):
        _load(root, name, dims)
