"""The orchestrator: per engine step, the policy picks the batch and the inference mode, the switcher
merges or unmerges adapters between steps, and every step and switch is timed to feed the policy: the
cost model (measured at load, :mod:`vlora.orchestrator.costs`) predicts each step and switch, and the
ratio of measured to predicted keeps its scale right (:class:`~vlora.orchestrator.policies.Estimates`).

KV caches stay valid across a switch: they hold the keys and values each request computed with its
own adapter, whatever mode produced them, and a request that the policy leaves out of a step simply
waits, its cache untouched.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Callable, Optional

from vlora.config import OrchestratorConfig
from vlora.errors import InvalidRequest
from vlora.lora.backends import get_lora_backend
from vlora.orchestrator.costs import CostModel
from vlora.orchestrator.modes import MODES, InferenceMode
from vlora.orchestrator.policies import MERGE, UNMERGE, Candidate, Decision, Estimates, make_policy
from vlora.orchestrator.switcher import SWITCHERS, Switcher

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig, max_batch_size: int, runner, loras, metrics=None,
                 clock: Callable[[], float] = time.monotonic, costs: Optional[CostModel] = None) -> None:
        self.cfg = cfg
        self.loras = loras
        self.metrics = metrics
        self.clock = clock
        self.policy = make_policy(cfg.policy, max_batch_size, cfg.theta_s, cfg.merge_share)
        runner.lora_ctx.backend = get_lora_backend(cfg.resolved_lora_compute)
        # Only policies that merge need the contiguous weight stacks.
        self.switcher: Optional[Switcher] = None
        if cfg.policy != "unmerge-only":
            self.switcher = SWITCHERS[cfg.resolved_switcher](runner)
        self.estimates = Estimates(alpha=cfg.ema, costs=costs)
        self.mode = UNMERGE
        self.merged: Optional[str] = None  # adapter name merged into the base weights
        self.merged_slot: Optional[int] = None
        self.mode_seconds: dict[str, float] = defaultdict(float)
        self.switches = 0
        self.last_switch_s = 0.0

    def forget(self) -> None:
        """Back to unmerged mode with fresh estimates from the same cost model, the counters at zero: what
        the warm start leaves (:mod:`vlora.engine.warmup`; its steps paid for compilation and plans)."""
        if self.mode != UNMERGE or self.merged is not None:
            self.enter(UNMERGE, None)
        self.estimates = Estimates(alpha=self.cfg.ema, costs=self.estimates.costs)
        self.mode_seconds.clear()
        self.switches = 0
        self.last_switch_s = 0.0

    @property
    def mode_impl(self) -> InferenceMode:
        return MODES[self.mode]

    def latency_target(self, adapter: Optional[str], requested: Optional[float]) -> Optional[float]:
        return requested if requested is not None else self.cfg.latency_targets.get(adapter) if adapter else None

    @property
    def costs(self) -> CostModel:
        """The cost model the estimates start from (the default one until the engine measured or loaded one)."""
        return self.estimates.model

    def set_costs(self, costs: CostModel) -> None:
        self.estimates.costs = costs

    def decide(self, cands: list[Candidate]) -> Decision:
        return self.policy.decide(cands, self.clock(), self.mode, self.merged, self.estimates)

    def enter(self, mode: str, merged: Optional[str]) -> bool:
        """Switch to ``mode`` with ``merged`` in the weights. False if the adapter is not in a ready slot
        yet (no free slot, or its load is in flight) or can no longer be loaded (its requests fail
        when they are admitted)."""
        if mode == UNMERGE:
            merged = None
        if merged != self.merged:
            new_slot = None
            if merged is not None:
                try:
                    new_slot = self.loras.try_acquire(merged)  # pinned for as long as it stays merged
                except InvalidRequest:
                    return False
                if new_slot is None:
                    return False
                self.loras.wait_ready([new_slot])
            if self.switcher is None:
                raise RuntimeError(f"policy {self.cfg.policy} cannot merge: no switcher")
            predicted = self.estimates.model.switch_s(self.merged, merged)
            dt = self.switcher.switch(new_slot)
            if self.merged_slot is not None:
                self.loras.release(self.merged_slot)
            self.merged, self.merged_slot = merged, new_slot
            self.estimates.observe_switch(dt, predicted)
            if self.metrics is not None:
                self.metrics.mode_switch(self.mode, mode, dt)
            self.switches += 1
            self.last_switch_s = dt
        self.mode = mode
        return True

    def observe_step(self, seconds: float, inputs=None) -> None:
        """Record a step of ``seconds``; ``inputs`` (the step's :class:`~vlora.engine.model_runner.SeqInput`
        list) lets the cost model's prediction for that batch be compared with it."""
        predicted, kind = None, "decode"
        if inputs:
            slots = [s.slot for s in inputs if s.slot >= 0]
            tokens = sum(len(s.token_ids) for s in inputs)
            predicted = self.estimates.model.step_s(len(inputs), tokens, len(slots), len(set(slots)),
                                                    sum(1 for s in inputs if s.delora_slot >= 0))
            kind = "decode" if tokens <= len(inputs) else "eager"
        self.estimates.observe_step(self.mode, seconds, predicted, kind)
        self.mode_seconds[self.mode] += seconds

    def lora_slots(self, slot: int) -> tuple[int, int]:
        return self.mode_impl.lora_slots(slot, self.merged_slot)


__all__ = ["Orchestrator", "MERGE", "UNMERGE"]
