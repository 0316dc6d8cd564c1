"""The batched sampler: greedy rows, Gumbel-max draws from softmax(logits / T) within the top-p set,
counter-based seeding independent of the batch, and rows with non-finite logits failed alone."""
from __future__ import annotations

import math
import random

import pytest
import torch

from vlora.engine.api import SamplingParams
from vlora.engine.sampler import gumbel_noise, mix32, mul32, sample

V = 64


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(row: torch.Tensor, params: SamplingParams, seed: int, steps: int, batch: int, position: int) -> list[int]:
    """The tokens one request draws over ``steps`` steps when it sits at ``position`` of a batch of ``batch``
    rows, the other rows holding other logits and settings."""
    out = []
    for step in range(steps):
        x = _logits(batch, 1000 + step)
        x[position] = row
        ps = [SamplingParams(temperature=0.5 + 0.1 * i, top_p=0.8) if i % 2 else SamplingParams() for i in range(batch)]
        ps[position] = params
        seeds = [random.Random(step * 31 + i).getrandbits(64) for i in range(batch)]
        seeds[position] = seed
        steps_ = [random.Random(i).randrange(100) for i in range(batch)]
        steps_[position] = step
        out.append(sample(x, ps, seeds, steps_).tokens[position])
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_a_seeded_request_draws_the_same_tokens_in_any_batch(params):
    row = _logits(1, 7)[0]
    alone = _draws(row, params, seed=12345, steps=20, batch=1, position=0)
    for batch, position in ((3, 1), (8, 7), (17, 0)):
        assert _draws(row, params, seed=12345, steps=20, batch=batch, position=position) == alone
    assert _draws(row, params, seed=12346, steps=20, batch=1, position=0) != alone  # the seed matters
    assert len(set(alone)) > 1  # the step index changes the noise: not one token again and again


def test_greedy_rows_take_the_argmax():
    x = _logits(5, 3)
    ps = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=2.0, top_p=0.5),
          SamplingParams()]
    got = sample(x, ps, [1, 2, 3, 4, 5], [0] * 5)
    assert got.bad_rows == []
    for i in (0, 2, 4):
        assert got.tokens[i] == int(x[i].argmax())


def test_draws_follow_softmax_over_temperature():
    x = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    p = SamplingParams(temperature=2.0)
    n = 20000  # one batch of n rows: n requests with the same logits and different seeds
    tokens = sample(x.expand(n, 4), [p] * n, list(range(n)), [0] * n).tokens
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    expected = torch.softmax(x[0] / 2.0, dim=-1)
    assert torch.allclose(counts / n, expected, atol=0.015), (counts / n, expected)


def test_top_p_draws_only_from_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log().unsqueeze(0)
    seen = {sample(x, [SamplingParams(temperature=1.0, top_p=0.7)], [s], [s % 7]).tokens[0] for s in range(400)}
    assert seen == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    seen = {sample(x, [SamplingParams(temperature=1.0, top_p=0.001)], [s], [0]).tokens[0] for s in range(200)}
    assert seen == {0}  # the most likely token is always kept
    seen = {sample(x, [SamplingParams(temperature=1.0, top_p=1.0)], [s], [0]).tokens[0] for s in range(400)}
    assert seen == {0, 1, 2, 3}


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), "all -inf"])
def test_a_non_finite_row_fails_alone(poison):
    x = _logits(4, 11)
    clean = sample(x, [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.3, top_p=0.5),
                       SamplingParams(temperature=1.0)], [1, 2, 3, 4], [5, 5, 5, 5])
    for bad in range(4):
        y = x.clone()
        if poison == "all -inf":
            y[bad] = float("-inf")
        else:
            y[bad, 17] = poison
        got = sample(y, [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.3, top_p=0.5),
                         SamplingParams(temperature=1.0)], [1, 2, 3, 4], [5, 5, 5, 5])
        assert got.bad_rows == [bad] and got.tokens[bad] == -1
        assert [t for i, t in enumerate(got.tokens) if i != bad] == [t for i, t in enumerate(clean.tokens) if i != bad]


def test_low_temperature_and_huge_logits_stay_finite():
    """At the temperature floor, logits near the float32 range overflow in the division: such a row is
    reported bad, never sampled from NaN; ordinary rows at the floor behave as greedy."""
    x = _logits(2, 5)
    x[1, 3] = 3e37
    got = sample(x, [SamplingParams(temperature=0.01)] * 2, [1, 2], [0, 0])
    assert got.tokens[0] == int(x[0].argmax()) and got.bad_rows == [1]


def test_the_hash_is_exact_integer_arithmetic():
    """The tensor hash equals the same formula on Python ints (so every device computes the same bits)."""
    vals = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789]
    t = torch.tensor(vals, dtype=torch.int64)
    assert mix32(t).tolist() == [mix32(v) for v in vals]
    assert mul32(t, 0x846CA68B).tolist() == [(v * 0x846CA68B) % 2**32 for v in vals]
    assert len({mix32(v) for v in range(5000)}) == 5000  # a bijection on 32 bits


def test_gumbel_noise_is_finite_and_gumbel_distributed():
    keys = torch.tensor([[1, 2, 3], [0xFFFFFFFF, 0, 99]], dtype=torch.int64)
    g = gumbel_noise(keys, 50000)
    assert torch.isfinite(g).all()
    assert not torch.equal(g[0], g[1])
    assert g.mean().item() == pytest.approx(0.5772, abs=0.02)  # Euler-Mascheroni
    assert g.var().item() == pytest.approx(math.pi ** 2 / 6, abs=0.05)
    assert torch.equal(gumbel_noise(keys[1:], 50000)[0], g[1])  # a row's noise does not depend on the others


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_same_draws_on_cuda():
    row = _logits(1, 7)[0]
    p = SamplingParams(temperature=0.8, top_p=0.9)
    cpu = [sample(row.unsqueeze(0), [p], [77], [s]).tokens[0] for s in range(20)]
    gpu = [sample(row.unsqueeze(0).cuda(), [p], [77], [s]).tokens[0] for s in range(20)]
    assert cpu == gpu
