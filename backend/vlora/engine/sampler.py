"""Token sampling: greedy, temperature and nucleus (top-p), seeded per request.

Sampling runs on the host in float32 with one ``torch.Generator`` per request, so a seeded request
draws the same tokens on any device and in any batch.
"""
from __future__ import annotations

from typing import Optional

import torch

from vlora.engine.api import SamplingParams


def make_generator(params: SamplingParams) -> Optional[torch.Generator]:
    if params.temperature == 0.0:
        return None
    g = torch.Generator(device="cpu")
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[Optional[torch.Generator]]) -> list[int]:
    """One token for each row of ``logits`` [B, V]."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    if all(p.temperature == 0.0 for p in params):
        return greedy
    host = logits.cpu()
    out = []
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.temperature == 0.0:
            out.append(greedy[i])
            continue
        probs = torch.softmax(host[i] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            keep = cum - sorted_p < p.top_p  # always keeps the most likely token
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=g)
            out.append(int(idx[choice]))
        else:
            out.append(int(torch.multinomial(probs, 1, generator=g)))
    return out
