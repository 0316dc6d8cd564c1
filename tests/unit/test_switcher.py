"""The swift switcher on the model runner's slot stacks (CPU, fp32, the tiny model): every LoRA layer's slot
buffers are views of one stack per weight group, and a merge, a fused swap and an unmerge leave each
projection's weight at W + B @ A of the merged adapter (B holding scale * B), as the per-layer switcher does.
The tiny model's q/k/v have different widths (GQA: each module into its own rows), its o, gate/up and down
groups share one width (one merge over the whole stack)."""
from __future__ import annotations

import pytest
import torch

from helpers import synthetic_runner, tiny_config
from vlora.engine.builder import build_engine
from vlora.orchestrator.switcher import PerLayerSwitcher, SwiftSwitcher

ADAPTERS = ("demo-r8-qv", "demo-r32-mlp", "demo-r16-attn")


@pytest.fixture(scope="module")
def engine(tiny_model_dir, demo_adapter_root):
    return build_engine(tiny_config(tiny_model_dir, demo_adapter_root,
                                    **{"lora.max_gpu_adapters": 4, "orchestrator.policy": "unmerge-only"}))


def test_slot_buffers_are_views_of_one_stack_per_group(engine):
    runner = engine.runner
    assert set(runner.slot_stacks) == {"qkv", "o", "gate_up", "down"}
    for group in runner.groups.values():
        stack = group.slots
        assert stack is runner.slot_stacks[group.name]
        base = stack.a.untyped_storage().data_ptr()
        for li in range(runner.num_layers):
            for k, m in enumerate(stack.modules):
                w = runner.lora_layers[(li, m)]
                assert w.lora_a.is_contiguous() and w.lora_b.is_contiguous()
                assert w.lora_a.untyped_storage().data_ptr() == base
                assert w.lora_a.data_ptr() == stack.a[li, k].data_ptr()
                assert w.lora_b.data_ptr() == stack.b_parts[k][li].data_ptr()
    widths = {g.name: {d for _, _, d in g.modules} for g in runner.groups.values()}
    assert len(widths["qkv"]) == 2 and runner.groups["qkv"].slots.b is None  # GQA: k/v narrower than q
    assert runner.groups["gate_up"].slots.b is not None


@pytest.mark.parametrize("cls", [SwiftSwitcher, PerLayerSwitcher])
def test_merge_swap_unmerge_put_exactly_the_adapters_delta_in(engine, cls):
    runner, loras = engine.runner, engine.loras
    slots = [loras.acquire(name) for name in ADAPTERS]
    try:
        w0 = {k: w.base.weight.detach().clone() for k, w in runner.lora_layers.items()}
        sw = cls(runner)

        def check(slot):
            for key, w in runner.lora_layers.items():
                want = w0[key] + (w.lora_b[slot] @ w.lora_a[slot] if slot is not None else 0)
                torch.testing.assert_close(w.base.weight, want, rtol=0, atol=2e-6, msg=f"{key} slot {slot}")

        for target in (slots[0], slots[1], slots[2], None, slots[1], None):
            assert sw.switch(target) > 0
            check(target)
        assert sw.num_switches == 6
    finally:
        for s in slots:
            loras.release(s)


def test_the_swift_switch_skips_groups_the_adapters_do_not_target(engine, monkeypatch):
    """demo-r8-qv targets q and v only: its merge touches the qkv stack alone."""
    runner, loras = engine.runner, engine.loras
    slot = loras.acquire("demo-r8-qv")
    try:
        before = {name: g.stack.clone() for name, g in runner.groups.items()}
        sw = SwiftSwitcher(runner)
        sw.switch(slot)
        changed = {name for name, g in runner.groups.items() if not torch.equal(g.stack, before[name])}
        sw.switch(None)
        assert changed == {"qkv"}
    finally:
        loras.release(slot)


def test_each_group_merges_in_one_call_from_the_slot_stacks(monkeypatch):
    """One merge call per weight group (q/k/v: 3L matrices, o: L) covers every layer and module, a swap included
    (the new adapter in and the old one out as two terms of one call), with A and B read in place: the operands
    are views of the slot stacks, not copies (the switchers' synthetic runner of tests/helpers.py, in fp64 here);
    an adapter that targets q/k/v only leaves o alone."""
    import vlora.orchestrator.switcher as switcher

    L, d, r, S = 3, 16, 4, 5
    runner = synthetic_runner(L, d, r, S, torch.float64, "cpu")
    gen = torch.Generator().manual_seed(0)
    for slot in (1, 3):
        for w in runner.lora_layers.values():
            w.set_slot(slot, torch.randn(r, d, generator=gen, dtype=torch.float64),
                       torch.randn(d, r, generator=gen, dtype=torch.float64), 0.5)
    for key, w in runner.lora_layers.items():  # slot 4: q/k/v only
        if key[1] != "o_proj":
            w.set_slot(4, torch.randn(r, d, generator=gen, dtype=torch.float64), torch.randn(d, r, generator=gen, dtype=torch.float64), 1.0)
    calls = []
    slot_storages = {g.slots.a.untyped_storage().data_ptr() for g in runner.groups.values()} | \
        {g.slots.b.untyped_storage().data_ptr() for g in runner.groups.values()}

    def spy(w, terms, *x):
        assert all(a.untyped_storage().data_ptr() in slot_storages and b.untyped_storage().data_ptr() in slot_storages
                   for a, b, _ in terms), "the switcher copied A or B"
        calls.append((w.shape[0], len(terms)))
        return merge(w, terms, *x)

    merge = switcher.merge_lora_terms
    monkeypatch.setattr(switcher, "merge_lora_terms", spy)
    sw = SwiftSwitcher(runner)
    assert [g.matrices for g in sw.groups] == [3 * L, L]
    w0 = {k: w.base.weight.clone() for k, w in runner.lora_layers.items()}
    # merge, swap (two terms), unmerge: one call per group; q/k/v only: the q/k/v group alone; from q/k/v-only
    # to all four, the o stack takes the new adapter alone
    both, one = [(3 * L, 2), (L, 2)], [(3 * L, 1), (L, 1)]
    for target, want_calls in ((1, one), (3, both), (None, one), (4, [(3 * L, 1)]), (1, [(3 * L, 2), (L, 1)]),
                               (None, one)):
        calls.clear()
        sw.switch(target)
        for key, w in runner.lora_layers.items():
            want = w0[key] + (w.lora_b[target] @ w.lora_a[target] if target is not None else 0)
            torch.testing.assert_close(w.base.weight, want, rtol=0, atol=1e-12, msg=f"{key} slot {target}")
        assert calls == want_calls, (target, calls)


def test_the_runner_keeps_square_attention_stacks_in_one_buffer():
    """A model without GQA: the q/k/v and o stacks are one buffer (each layer's weights copied in unchanged),
    and the swift switcher merges each group exactly."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from vlora.config import LORA_TARGETS
    from vlora.engine.model_runner import ModelRunner
    from vlora.models import tiny

    text = LlamaConfig(**{**tiny.TEXT, "num_key_value_heads": tiny.TEXT["num_attention_heads"]}, vocab_size=64)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**tiny.VISION), text_config=text, image_token_index=63,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    layers = model.model.language_model.layers
    before = {(i, m): getattr(l.self_attn, m).weight.detach().clone() for i, l in enumerate(layers) for m in ("q_proj", "o_proj")}
    runner = ModelRunner(model, image_token_id=63, num_slots=3, max_rank=8, target_modules=LORA_TARGETS)
    qkv, o = runner.groups["qkv"].stack, runner.groups["o"].stack
    assert qkv.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
    assert o.storage_offset() == qkv.storage_offset() + qkv.numel()
    for (i, m), w in before.items():
        assert torch.equal(runner.lora_layers[(i, m)].base.weight, w)
    sw = SwiftSwitcher(runner)
    assert [g.stack.shape[1] for g in sw.groups] == [3 * 128, 128, 512, 128]
    gen = torch.Generator().manual_seed(1)
    for w in runner.lora_layers.values():
        w.set_slot(2, torch.randn(8, w.in_features, generator=gen) * 0.1, torch.randn(w.out_features, 8, generator=gen) * 0.1, 2.0)
    w0 = {k: w.base.weight.clone() for k, w in runner.lora_layers.items()}
    sw.switch(2)
    for key, w in runner.lora_layers.items():
        torch.testing.assert_close(w.base.weight, w0[key] + w.lora_b[2] @ w.lora_a[2], rtol=1e-5, atol=1e-6)
    sw.switch(None)
    for key, w in runner.lora_layers.items():
        torch.testing.assert_close(w.base.weight, w0[key], rtol=0, atol=1e-6)
