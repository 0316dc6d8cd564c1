"""The three inference modes, as strategies chosen by name.

Each mode maps a request's adapter slot to what the step computes for it, given the slot whose
delta is merged into the base weights:
- merge: every request in the batch uses the merged adapter (or, with nothing merged, the base
  model): plain base-model cost, no LoRA work;
- unmerge: nothing is merged; each request adds its own adapter through ATMM;
- mixture (deLoRA): adapter m stays merged; its requests cost nothing extra, and every other request
  computes ``x @ (W + dW_m) - x @ dW_m + x @ dW_x``: its own adapter plus a deLoRA branch with m's
  weights and a negative scale. Base-model requests take the deLoRA branch only.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional


class InferenceMode(ABC):
    name = ""

    @abstractmethod
    def lora_slots(self, slot: int, merged: Optional[int]) -> tuple[int, int]:
        """(slot whose delta is added, slot whose delta is subtracted) for a request on ``slot``;
        -1 means none. ``slot`` is -1 for a base-model request."""

    def accepts(self, slot: int, merged: Optional[int]) -> bool:
        """Whether a request on ``slot`` can run in this mode with ``merged`` in the weights."""
        return True

    def check(self, slots: list[int], merged: Optional[int]) -> None:
        """Refuse a batch this mode cannot run (a bug in the caller, not a client error)."""
        bad = sorted({s for s in slots if not self.accepts(s, merged)})
        if bad:
            raise RuntimeError(f"{self.name} mode with slot {merged} merged cannot run requests on slots {bad}")


class MergeMode(InferenceMode):
    name = "merge"

    def lora_slots(self, slot, merged):
        return -1, -1

    def accepts(self, slot, merged):
        return slot == (-1 if merged is None else merged)


class UnmergeMode(InferenceMode):
    name = "unmerge"

    def lora_slots(self, slot, merged):
        return slot, -1

    def check(self, slots, merged):
        if merged is not None:
            raise RuntimeError(f"unmerge mode needs clean base weights, but slot {merged} is merged")


class MixtureMode(InferenceMode):
    name = "mixture"

    def lora_slots(self, slot, merged):
        if merged is None:
            return slot, -1
        return (-1, -1) if slot == merged else (slot, merged)


MODES: dict[str, InferenceMode] = {m.name: m for m in (MergeMode(), UnmergeMode(), MixtureMode())}
