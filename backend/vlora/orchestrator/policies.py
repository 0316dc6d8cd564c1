"""Scheduling policies: which requests run in the next step, and in which inference mode.

Pure Python over :class:`Candidate` descriptors and a clock the caller passes in, so they are
tested on simulated streams with a controlled clock. ``VLoraPolicy`` is the V-LoRA paper's
Algorithm 1; the others are the baselines it is measured against. Chosen by name from ``POLICIES``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

MERGE, UNMERGE, MIXTURE = "merge", "unmerge", "mixture"
BASE = None  # the adapter "name" of base-model requests


@dataclass
class Candidate:
    """A request the scheduler may put in the next step."""

    request_id: str
    adapter: Optional[str]
    last_served: float  # arrival, then the end of the last step it ran in
    latency_target: Optional[float] = None  # seconds; None: the policy's theta


@dataclass
class Estimates:
    """Measured costs that feed the credits: step time per mode and switch time (seconds, EMA)."""

    step_s: dict[str, float] = field(default_factory=lambda: {MERGE: 0.0, UNMERGE: 0.0, MIXTURE: 0.0})
    switch_s: float = 0.0
    alpha: float = 0.2

    def observe_step(self, mode: str, seconds: float) -> None:
        old = self.step_s.get(mode, 0.0)
        self.step_s[mode] = seconds if old == 0.0 else (1 - self.alpha) * old + self.alpha * seconds

    def observe_switch(self, seconds: float) -> None:
        self.switch_s = seconds if self.switch_s == 0.0 else (1 - self.alpha) * self.switch_s + self.alpha * seconds


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
    """Algorithm 1: merge when skewed and nothing starves; mixture for a starving minority; unmerge
    when more than half of MaxBS starves (or no adapter dominates)."""

    name = "vlora"

    def decide(self, cands, now, mode, merged, est):
        starve = self.starving(cands, now, mode, est)
        room = self.max_bs - len(starve)
        top, r_merge = self.most_requested(cands, merged)
        fifo = sorted(cands, key=lambda c: c.last_served)
        if len(starve) / self.max_bs <= 0.5 and len(r_merge) / self.max_bs > self.merge_share:
            if not starve:  # merging the base model (top is BASE) means: base weights, no LoRA at all
                return Decision(MERGE, top, r_merge[: self.max_bs])
            starving_ids = {c.request_id for c in starve}
            rest = [c for c in r_merge if c.request_id not in starving_ids]
            # With nothing merged, the mixture is plain unmerged inference.
            return Decision(MIXTURE if top is not BASE else UNMERGE, top, starve + rest[: max(room, 0)], len(starve))
        starving_ids = {c.request_id for c in starve}
        rest = [c for c in fifo if c.request_id not in starving_ids]
        return Decision(UNMERGE, None, (starve + rest)[: self.max_bs], len(starve))


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
