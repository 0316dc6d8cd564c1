"""Issue 37: an adapter file holding the same weight under both key namings (transformers 4's
``language_model.model.layers.N...`` and 5's ``model.language_model.layers.N...``) is refused at load, naming
both keys; before, it loaded silently and one copy won."""
from __future__ import annotations

import json

import pytest
from adapter_edit import clone_adapter

from vlora.config import LORA_TARGETS
from vlora.lora.adapter import AdapterError, decoder_module_dims, load_adapter
from vlora.lora.demo import ensure_demo_adapters

NEW = "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_{}.weight"
OLD = "base_model.model.language_model.model.layers.1.self_attn.q_proj.lora_{}.weight"


@pytest.fixture()
def setup(tiny_model_dir, tmp_path):
    root = ensure_demo_adapters(tiny_model_dir, tmp_path / "adapters")
    dims = decoder_module_dims(json.loads((tiny_model_dir / "config.json").read_text())["text_config"])
    return root, dims


def _load(root, name, dims):
    return load_adapter(root, name, num_layers=4, module_dims=dims, max_rank=64, supported_modules=LORA_TARGETS)


@pytest.mark.parametrize("ab", ["A", "B", "AB"])
def test_the_same_weight_under_two_namings_is_refused(setup, ab):
    root, dims = setup

    def add_old_copies(t):
        for x in ab:
            t[OLD.format(x)] = t[NEW.format(x)].clone() * 2

    name = clone_adapter(root, "demo-r8-qv", f"twice-{ab}", edit_tensors=add_old_copies)
    x = ab[0]
    with pytest.raises(AdapterError, match=rf"'{OLD.format(x)}' and '{NEW.format(x)}' are the same lora_{x} weight "
                                           rf"\(of q_proj in layer 1\) under two key namings"):
        _load(root, name, dims)


def test_old_naming_alone_still_loads(setup):
    root, dims = setup

    def rename(t):
        for x in "AB":
            t[OLD.format(x)] = t.pop(NEW.format(x))

    name = clone_adapter(root, "demo-r8-qv", "old-naming", edit_tensors=rename)
    w = _load(root, name, dims)
    assert (1, "q_proj") in w.pairs
