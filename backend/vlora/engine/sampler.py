"""Token sampling: greedy, temperature and nucleus (top-p), seeded per request, for a whole batch at once.

Semantics: for row i with temperature T_i > 0,
    token_i = argmax_v( logits[i, v] / T_i + g(seed_i, step_i, v) )  over v in the top-p set of row i
where g is Gumbel noise, so token_i is a draw from softmax(logits[i] / T_i) restricted to (and
renormalised over) the smallest set of most likely tokens whose probability reaches top_p_i
(Gumbel-max). Rows with T_i == 0 take argmax(logits[i]).

Shape:  logits [B, V] (any float dtype, on the model's device)  seeds, steps [B] host ints.

The noise is a counter-based hash of (seed, step, vocab index) computed with integer tensor ops, not a
stateful generator: a seeded request draws the same tokens whatever batch it is in and on whatever
device (the integer hash is exact everywhere; its map to Gumbel noise is float32 ``log``). ``step`` is
the number of tokens the request has generated so far. Requests without a seed get one drawn at
admission (:func:`make_seed`).

Everything runs on the logits' device in float32, as one pass over the batch; only the chosen ids
(and which rows were bad) come back to the host, in one transfer. :func:`sample_async` leaves them on
the device (the next step can read them there) with their copy to pinned host memory in flight;
:func:`sample` waits for it. Guards: temperature is divided in
float32 with a floor of ``MIN_TEMPERATURE``; the top-p mask always keeps the most likely token; a row
whose logits are not all finite (NaN, +-inf; an all -inf row included) is reported in ``bad_rows``
and sampled no token, and the other rows are unaffected.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from vlora.engine.api import MIN_TEMPERATURE, SamplingParams

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_KEY2 = 0x85EBCA6B


@dataclass(frozen=True)
class SampleResult:
    """``tokens[i]`` is row i's token, or -1 for a row listed in ``bad_rows`` (non-finite logits)."""

    tokens: list[int]
    bad_rows: list[int]


class PendingSample:
    """A batch's sampled ids on the device, with their copy to the host in flight.

    ``tokens`` [B] int64 (-1: a row with non-finite logits) stays valid on the device: the engine's next
    step reads its decode inputs from it without waiting. :meth:`result` waits for the copy (once)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens
        self._result = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = tokens, None

    def result(self) -> SampleResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            chosen = self._host.tolist()
            self._result = SampleResult(tokens=chosen, bad_rows=[i for i, t in enumerate(chosen) if t < 0])
        return self._result


def make_seed(params: SamplingParams) -> int:
    """The request's seed, or a random 64-bit one for a request that gave none (drawn once, at admission)."""
    return params.seed if params.seed is not None else secrets.randbits(64)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> SampleResult:
    """One token for each row of ``logits`` [B, V]; see the module docstring for the semantics."""
    return sample_async(logits, params, seeds, steps).result()


def sample_async(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> PendingSample:
    """As :func:`sample`, without waiting: the ids stay on the device and their copy to the host is queued."""
    x = logits.float()
    dev = x.device
    finite = torch.isfinite(x).all(dim=-1)
    out = x.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if rows:
        # The per-row settings, in two host -> device copies: [row, seed_lo, seed_hi, step] and [T, top_p].
        ints = torch.tensor([[i, seeds[i] & _M32, (seeds[i] >> 32) & _M32, steps[i] & _M32] for i in rows],
                            dtype=torch.int64).to(dev)
        floats = torch.tensor([[max(params[i].temperature, MIN_TEMPERATURE), params[i].top_p] for i in rows],
                              dtype=torch.float32).to(dev)
        idx = ints[:, 0]
        scaled = x.index_select(0, idx) / floats[:, 0:1]
        ok = torch.isfinite(scaled).all(dim=-1)
        scaled = torch.where(ok.unsqueeze(1), scaled, torch.zeros_like(scaled))  # a bad row stays harmless
        if any(params[i].top_p < 1.0 for i in rows):
            scaled = scaled.masked_fill(~_top_p_mask(scaled, floats[:, 1]), float("-inf"))
        noise = gumbel_noise(ints[:, 1:], x.shape[-1])
        out = out.index_copy(0, idx, (scaled + noise).argmax(dim=-1))
        finite = finite.index_copy(0, idx, finite.index_select(0, idx) & ok)
    return PendingSample(torch.where(finite, out, torch.full_like(out, -1)))  # the one device -> host transfer


def _top_p_mask(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True for the tokens of each row's nucleus: the most likely tokens, in order, until their
    probability reaches top_p. The most likely token is always kept, and top_p >= 1 keeps every token
    (the float32 cumulative sum may fall short of 1)."""
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = (before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [R, vocab] float32, a pure function of each row's (seed_lo, seed_hi, step).

    Shape: keys [R, 3] int64, each value in [0, 2**32). The uniform behind each draw is
    (2m + 1) / 2**24 with m the top 23 bits of a 32-bit hash, so it lies strictly inside (0, 1)
    and is exact in float32: the noise is finite.
    """
    k1 = mix32(keys[:, 0:1] ^ mix32(keys[:, 1:2] ^ mix32(keys[:, 2:3] ^ _GOLDEN)))
    k2 = mix32(k1 ^ _KEY2)
    v = mul32(torch.arange(vocab, dtype=torch.int64, device=keys.device), _GOLDEN).unsqueeze(0)
    h = mix32(mix32(v ^ k1) ^ k2)
    u = ((h >> 9) * 2 + 1).to(torch.float32) * (2.0 ** -24)
    return -torch.log(-torch.log(u))


def mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) and a constant c < 2**32, without int64 overflow (the
    product is taken in 16-bit halves of c). Works on Python ints and int64 tensors alike."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """A 32-bit bijective integer hash (Wellons' lowbias32) of x in [0, 2**32); ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
