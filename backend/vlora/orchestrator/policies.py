"""Scheduling policies: which requests run in the next step, and in which inference mode.

Pure Python over :class:`Candidate` descriptors and a clock the caller passes in, so they are
tested on simulated streams with a controlled clock. ``VLoraPolicy`` is the V-LoRA paper's
Algorithm 1 with its merge decision taken from a cost model measured on the GPU
(:mod:`vlora.orchestrator.costs`); the others are the baselines it is measured against. Chosen by
name from ``POLICIES``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from vlora.orchestrator.costs import DEFAULT, CostModel

MERGE, UNMERGE, MIXTURE = "merge", "unmerge", "mixture"
BASE = None  # the adapter "name" of base-model requests
DEFAULT_HORIZON = 16  # decode steps a plan is weighed over when the requests' remaining tokens are unknown
MAX_HORIZON = 256
# A plan that switches the merged adapter must save this share of the horizon's request-seconds over staying:
# the estimates are medians of noisy steps, and a wrong switch costs a whole switch.
MIN_GAIN = 0.03


@dataclass
class Candidate:
    """A request the scheduler may put in the next step."""

    request_id: str
    adapter: Optional[str]
    last_served: float  # arrival, then the end of the last step it ran in
    latency_target: Optional[float] = None  # seconds; None: the policy's theta
    remaining: Optional[int] = None  # output tokens it may still produce (max_tokens - generated); None: unknown
    running: bool = False  # admitted (holds KV blocks and a place among MaxBS running requests); False: waiting


@dataclass
class Estimates:
    """Costs that feed the credits and the plans: the cost model (measured at load; :data:`DEFAULT` when
    none is given) scaled by what steps and switches really took (``scale``: EMA of measured / predicted,
    per kind: decode steps, eager steps, switches), and the EMA of the measured step time per mode and of
    the switch time (the baselines' credits read these)."""

    step_s: dict[str, float] = field(default_factory=lambda: {MERGE: 0.0, UNMERGE: 0.0, MIXTURE: 0.0})
    switch_s: float = 0.0
    alpha: float = 0.2
    costs: Optional[CostModel] = None
    scale: dict[str, float] = field(default_factory=lambda: {"decode": 1.0, "eager": 1.0, "switch": 1.0})

    @property
    def model(self) -> CostModel:
        return self.costs if self.costs is not None else DEFAULT

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0.0 else (1 - self.alpha) * old + self.alpha * new

    def _rescale(self, kind: str, seconds: float, predicted: Optional[float]) -> None:
        if predicted and predicted > 0 and seconds > 0:
            ratio = min(max(seconds / predicted, 0.25), 4.0)  # one odd step (a GC pause) moves it little
            self.scale[kind] = (1 - self.alpha) * self.scale[kind] + self.alpha * ratio

    def observe_step(self, mode: str, seconds: float, predicted: Optional[float] = None, kind: str = "decode") -> None:
        self.step_s[mode] = self._ema(self.step_s.get(mode, 0.0), seconds)
        self._rescale(kind, seconds, predicted)

    def observe_switch(self, seconds: float, predicted: Optional[float] = None) -> None:
        self.switch_s = self._ema(self.switch_s, seconds)
        self._rescale("switch", seconds, predicted)

    # -- estimates (seconds) -----------------------------------------------------------------------
    def step(self, rows: int, tokens: int, lora_rows: int = 0, distinct: int = 0, delora_rows: int = 0) -> float:
        kind = "decode" if tokens <= rows else "eager"
        return self.scale[kind] * self.model.step_s(rows, tokens, lora_rows, distinct, delora_rows)

    def decode(self, rows: int, lora_rows: int = 0, distinct: int = 0, delora_rows: int = 0) -> float:
        return self.scale["decode"] * self.model.decode_s(rows, lora_rows, distinct, delora_rows)

    def switch(self, old: Optional[str], new: Optional[str]) -> float:
        return self.scale["switch"] * self.model.switch_s(old, new)


@dataclass
class Decision:
    mode: str
    merged: Optional[str]  # adapter merged into the base weights (merge and mixture modes)
    batch: list[Candidate]
    starving: int = 0


class Policy(ABC):
    name: str = ""

    def __init__(self, max_batch_size: int, theta_s: float, merge_share: float = 0.5) -> None:
        self.max_bs = max_batch_size
        self.theta = theta_s
        self.merge_share = merge_share

    @abstractmethod
    def decide(self, cands: list[Candidate], now: float, mode: str, merged: Optional[str], est: Estimates) -> Decision:
        """Pick the next batch (at most MaxBS, in priority order) and its mode, given the current state."""

    # -- shared pieces -------------------------------------------------------------------------
    def credit(self, c: Candidate, now: float, mode: str, est: Estimates, switching: bool) -> float:
        """Waiting time + estimated execution time in the current mode + switch latency (Algorithm 1)."""
        return (now - c.last_served) + est.step_s.get(mode, 0.0) + (est.switch_s if switching else 0.0)

    def starving(self, cands: list[Candidate], now: float, mode: str, est: Estimates) -> list[Candidate]:
        out = [c for c in cands if self.credit(c, now, mode, est, False) > (c.latency_target or self.theta)]
        return sorted(out, key=lambda c: c.last_served)

    @staticmethod
    def most_requested(cands: list[Candidate], prefer: Optional[str]) -> tuple[Optional[str], list[Candidate]]:
        """The adapter with the most candidates (ties: the merged one, then the oldest request)."""
        if not cands:
            return prefer, []
        counts = Counter(c.adapter for c in cands)
        oldest = {}
        for c in cands:
            oldest[c.adapter] = min(oldest.get(c.adapter, c.last_served), c.last_served)
        best = max(counts, key=lambda a: (counts[a], a == prefer, -oldest[a]))
        return best, sorted((c for c in cands if c.adapter == best), key=lambda c: c.last_served)


class VLoraPolicy(Policy):
    """Algorithm 1, with the merge decision taken from the measured costs (``est``'s cost model).

    Credits as in the paper: a request starves when its waiting time, plus the estimated step in the
    current mode, plus the switch it needs when the current mode cannot run it, passes its latency
    target (``theta`` unless the request or its adapter has one). More than half of MaxBS starving:
    unmerge, starving first (line 13). Otherwise these plans are weighed against unmerging:

    - unmerge: starving first, then first come first served (the batch U);
    - merge the most requested adapter m (only when nothing starves, line 6): m's requests only; the
      others wait until a later switch;
    - mixture with m merged (line 10): the starving and m's requests (m's at base cost), and as a second
      plan the other requests after them, each paying its adapter plus the deLoRA branch;
    - the same with the adapter merged now, when that is not m (staying costs no switch in).

    A plan is scored by the latency it adds to the requests over a horizon of H decode steps (H: the
    merge adapter's requests' mean remaining tokens; :data:`DEFAULT_HORIZON` when unknown), relative to
    unmerging, in request-seconds::

        H x [ both x (T_plan - T_U) + excluded x T_plan - added x T_U ] + switches x requests

    ``both``: requests in the plan's batch and in U (each step faster or slower for them); ``excluded``:
    requests U would run that the plan leaves waiting (each delayed by a step); ``added``: requests the
    plan runs that U would not; ``switches``: into the plan now and out of it later (every request waits
    for them). The average token latency is this sum over the tokens, so the lowest score wins: merging
    when the unmerged tax it saves on m's requests outweighs the switches and the other requests' wait
    or deLoRA tax, and not otherwise. A plan that changes the merged adapter must gain :data:`MIN_GAIN`
    of the horizon's request-seconds over staying. A prompt costs about the same in every mode, so plans
    are compared on decode steps. A plan's batch holds running requests, and waiting ones only while
    places among the MaxBS running requests are free (the engine admits no more; a running request left
    out of a merged step keeps its place). Bound: a starving request is first in the next batch (at most
    MaxBS of them, oldest first; a waiting one as soon as a place is free).
    """

    name = "vlora"

    def decide(self, cands, now, mode, merged, est):
        if not cands:
            return Decision(mode, merged, [])
        max_bs = self.max_bs
        fifo = sorted(cands, key=lambda c: c.last_served)
        counts = Counter(c.adapter for c in cands)
        rows_now = min(len(cands), max_bs)
        step_now = est.decode(rows_now, 0 if mode == MERGE else rows_now, min(rows_now, len(counts)),
                              rows_now if mode == MIXTURE else 0)
        leave = est.switch(merged, None)
        starve, rest = [], []
        for c in fifo:  # credit = waiting + estimated step + the switch it needs (Algorithm 1, line 2)
            credit = (now - c.last_served) + step_now + (leave if mode == MERGE and c.adapter != merged else 0.0)
            (starve if credit > (c.latency_target or self.theta) else rest).append(c)
        room = max_bs - sum(1 for c in cands if c.running)

        def runnable(batch: list[Candidate]) -> list[Candidate]:
            """The running requests of ``batch``, and its waiting ones while places are free."""
            out, free = [], room
            for c in batch:
                if c.running or free > 0:
                    out.append(c)
                    free -= not c.running
            return out[:max_bs]

        unmerged = runnable(starve + rest)
        if len(starve) > max_bs / 2:
            return Decision(UNMERGE, None, unmerged, len(starve))
        top, _ = self.most_requested(cands, merged)
        plans = [(UNMERGE, None, unmerged)]
        for m in dict.fromkeys((top, merged)):
            mine = [c for c in rest if c.adapter == m]
            if not starve and mine:
                plans.append((MERGE, m, runnable(mine)))  # m is BASE: base weights, base requests only
            if m is BASE:
                continue  # a mixture with nothing merged is the unmerged plan
            strict = runnable(starve + mine)
            if strict:
                plans.append((MIXTURE, m, strict))
            if len(strict) < max_bs:
                plans.append((MIXTURE, m, runnable(starve + mine + [c for c in rest if c.adapter != m])))
        horizon = {m: self.horizon([c for c in cands if c.adapter == m]) for m in dict.fromkeys((top, merged))}
        plans = [p for p in plans if p[2]]
        t_u = self.step_s(UNMERGE, None, unmerged, est)
        in_u = {c.request_id for c in unmerged}
        scored = [(self.score(p, merged, est, horizon.get(p[1], horizon[top]), in_u, t_u), i, p) for i, p in enumerate(plans)]
        best_score, _, best = min(scored)
        here = None if mode == UNMERGE else merged
        stay = [x for x in scored if (None if x[2][0] == UNMERGE else x[2][1]) == here]
        target = None if best[0] == UNMERGE else best[1]
        margin = MIN_GAIN * horizon.get(best[1], horizon[top]) * t_u * len(in_u)
        if target != here and stay and best_score > min(stay)[0] - margin:
            best = min(stay)[2]
        mode_, m, batch = best
        if mode_ == MIXTURE and all(c.adapter == m for c in batch):
            mode_ = MERGE  # no request needs its own adapter or the deLoRA branch: a merged step
        return Decision(mode_, None if mode_ == UNMERGE else m, batch, len(starve))

    @staticmethod
    def horizon(cands: list[Candidate]) -> int:
        """Decode steps a plan for these requests' adapter is weighed over: their mean remaining tokens."""
        known = [c.remaining for c in cands if c.remaining is not None]
        if not known:
            return DEFAULT_HORIZON
        return int(min(max(sum(known) / len(known), 1.0), MAX_HORIZON))

    @staticmethod
    def step_s(mode: str, m: Optional[str], batch: list[Candidate], est: Estimates) -> float:
        """Estimated decode step of ``batch`` in ``mode`` with ``m`` merged."""
        if mode == UNMERGE:
            lora = [c.adapter for c in batch if c.adapter is not None]
            delora = 0
        elif mode == MERGE:
            lora, delora = [], 0
        else:
            lora = [c.adapter for c in batch if c.adapter is not None and c.adapter != m]
            delora = sum(1 for c in batch if c.adapter != m)
        return est.decode(len(batch), len(lora), len(set(lora)), delora)

    @classmethod
    def score(cls, plan: tuple[str, Optional[str], list[Candidate]], merged: Optional[str], est: Estimates,
              horizon: int, in_u: set[str], t_u: float) -> float:
        """Request-seconds ``plan`` (mode, adapter, batch) adds over ``horizon`` decode steps, beyond what
        unmerging would (``in_u``: the unmerged batch's request ids; ``t_u``: its step), from the adapter
        merged now, the switch back out later included (see the class docstring)."""
        mode, m, batch = plan
        target = None if mode == UNMERGE else m
        switches = est.switch(merged, target) + (est.switch(target, None) if target is not None else 0.0)
        t = cls.step_s(mode, m, batch, est)
        ids = {c.request_id for c in batch}
        both, excluded, added = len(ids & in_u), len(in_u - ids), len(ids - in_u)
        return horizon * (both * (t - t_u) + excluded * t - added * t_u) + switches * len(ids | in_u)


class UnmergeOnlyPolicy(Policy):
    """Punica / S-LoRA: every adapter unmerged through the batched LoRA operator, FIFO."""

    name = "unmerge-only"

    def decide(self, cands, now, mode, merged, est):
        return Decision(UNMERGE, None, sorted(cands, key=lambda c: c.last_served)[: self.max_bs])


class MergeOnlyPolicy(Policy):
    """One adapter merged at a time: the adapter of the oldest request, and only its requests run."""

    name = "merge-only"

    def decide(self, cands, now, mode, merged, est):
        if not cands:
            return Decision(mode, merged, [])
        oldest = min(cands, key=lambda c: c.last_served)
        batch = sorted((c for c in cands if c.adapter == oldest.adapter), key=lambda c: c.last_served)
        return Decision(MERGE, oldest.adapter, batch[: self.max_bs])


class DLoraPolicy(Policy):
    """dLoRA-style: merge the dominant adapter when its share of the queue passes ``merge_share`` and
    the oldest request is not starving, else unmerge everything (no mixture mode)."""

    name = "dlora"

    def decide(self, cands, now, mode, merged, est):
        if not cands:
            return Decision(mode, merged, [])
        top, r_merge = self.most_requested(cands, merged)
        fifo = sorted(cands, key=lambda c: c.last_served)
        oldest_starves = self.credit(fifo[0], now, mode, est, False) > (fifo[0].latency_target or self.theta)
        if len(r_merge) / len(cands) > self.merge_share and not (oldest_starves and fifo[0].adapter != top):
            return Decision(MERGE, top, r_merge[: self.max_bs])
        return Decision(UNMERGE, None, fifo[: self.max_bs])


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (VLoraPolicy, UnmergeOnlyPolicy, MergeOnlyPolicy, DLoraPolicy)}


def make_policy(name: str, max_batch_size: int, theta_s: float, merge_share: float = 0.5) -> Policy:
    try:
        return POLICIES[name](max_batch_size, theta_s, merge_share)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
