"""LoraLinear.copy_slots: one adapter's slot copy for every layer in a few batched calls (what the copy thread runs
on CUDA), against copy_slot's device semantics per layer: A into the first r rows, B times the scale into the first
r columns (in the slots' dtype), the rest of the slot zeroed, layers the adapter skips zeroed, other slots untouched."""
from __future__ import annotations

import torch
from torch import nn

from vlora.lora.adapter import LoraPair
from vlora.lora.layers import LoraContext, LoraLinear


def test_copy_slots_matches_the_per_layer_copy():
    g = torch.Generator().manual_seed(0)
    ctx = LoraContext()
    dtype = torch.bfloat16
    layers = [LoraLinear(nn.Linear(d_in, d_out, bias=False).to(dtype), ctx, num_slots=3, max_rank=16)
              for d_in, d_out in [(32, 48), (48, 32), (32, 32), (16, 64)]]
    for layer in layers:  # stale contents in every slot: the copy must clear its own slot and leave the others
        layer.lora_a.normal_(generator=g)
        layer.lora_b.normal_(generator=g)
    before = [(layer.lora_a.clone(), layer.lora_b.clone()) for layer in layers]
    ranks = [8, 16, None, 4]  # None: the adapter skips this layer
    pairs = [None if r is None else LoraPair(a=torch.randn(r, layer.in_features, generator=g).to(dtype),
                                              b=torch.randn(layer.out_features, r, generator=g).to(dtype), scale=0.5 + i)
             for i, (layer, r) in enumerate(zip(layers, ranks))]
    calls = []

    def put_many(dsts, srcs):
        calls.append(len(dsts))
        torch._foreach_copy_(dsts, srcs)

    LoraLinear.copy_slots(1, [(layer, None, None, 0.0) if p is None else (layer, p.a, p.b, p.scale)
                              for layer, p in zip(layers, pairs)], put_many)
    assert calls == [6]  # one call for the six tensors of the three layers the adapter has
    for layer, pair, (a0, b0) in zip(layers, pairs, before):
        assert torch.equal(layer.lora_a[0], a0[0]) and torch.equal(layer.lora_b[2], b0[2])  # other slots untouched
        want_a = torch.zeros_like(layer.lora_a[1])
        want_b = torch.zeros_like(layer.lora_b[1])
        if pair is not None:
            r = pair.a.shape[0]
            want_a[:r] = pair.a
            want_b[:, :r] = pair.b
            want_b[:, :r].mul_(pair.scale)  # scaled in the slots' dtype after the copy, as copy_slot does on a device
        assert torch.equal(layer.lora_a[1], want_a) and torch.equal(layer.lora_b[1], want_b)
