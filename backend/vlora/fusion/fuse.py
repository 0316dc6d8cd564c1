"""Accuracy-aware knowledge fusion: pack datasets into the fewest adapters that meet every accuracy floor.

The V-LoRA paper's greedy heuristic (section 4.2.1): take the datasets one at a time (in the order given
or a seeded random order) and train the current adapter on each. After each one, evaluate every task
fused into the adapter so far, on its validation split. If any falls below its floor, restore the
adapter's previous weights (bit for bit, from a snapshot taken before the step), close it, and start a
new adapter with that dataset. A dataset that cannot meet its floor even alone in a fresh adapter
keeps that adapter (nothing better exists) and is marked as below its floor; that adapter is closed.

Each task gets its own head in the adapter (mode ``head`` or ``both``). Training on a new dataset
updates the shared LoRA and the new head; then (``refit_heads``, the default) the earlier heads are
refitted as linear probes on the adapter's new features. What can make an earlier task fall is the
shared LoRA's features losing what that task needs as they move toward the new one: exactly what
the floors guard.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from vlora.fusion.datasets import VisionDataset
from vlora.fusion.train import AdapterTrainer, PreparedDataset, ProgressFn, TrainConfig


@dataclass(frozen=True)
class FusionTask:
    dataset: VisionDataset
    floor: float  # the lowest acceptable accuracy (0..1) on the validation split

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"task {self.dataset.name!r}: floor {self.floor} is not in [0, 1]")


@dataclass
class FusionStep:
    """One attempt to fuse a dataset into an adapter."""

    task: str
    adapter: int
    accepted: bool
    val_accuracy: dict[str, float]  # every task of the adapter after training on ``task``
    violations: list[str]  # tasks below their floor (empty when accepted)
    seconds: float
    restored_bit_identical: Optional[bool] = None  # set when the step was rolled back


@dataclass
class FusedAdapter:
    name: str
    tasks: list[str]
    path: Optional[Path] = None
    val_accuracy: dict[str, float] = field(default_factory=dict)
    test_accuracy: dict[str, float] = field(default_factory=dict)
    below_floor: list[str] = field(default_factory=list)  # tasks that missed their floor even alone


@dataclass
class FusionResult:
    adapters: list[FusedAdapter]
    steps: list[FusionStep]
    order: list[str]
    floors: dict[str, float]
    added_val_accuracy: dict[str, float]  # each task right after it was trained into its adapter
    added_test_accuracy: dict[str, float]
    config: TrainConfig
    seconds: float

    def adapter_of(self, task: str) -> FusedAdapter:
        return next(a for a in self.adapters if task in a.tasks)


def fuse(trainer: AdapterTrainer, tasks: Sequence[FusionTask], *, out_dir: Optional[Path] = None,
         prefix: str = "fused", order: str = "given", seed: int = 0,
         progress: Optional[ProgressFn] = None) -> FusionResult:
    """Run the greedy fusion. Writes each closed adapter to ``out_dir/<prefix>-<i>`` when out_dir is set."""
    say = progress or (lambda msg: None)
    if not tasks:
        raise ValueError("fuse: no datasets")
    names = [t.dataset.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"fuse: dataset names must be distinct, got {names}")
    if not trainer.config.uses_head:
        raise ValueError("fuse: the adapters need task heads (mode 'head' or 'both')")
    if order not in ("given", "random"):
        raise ValueError(f"order must be 'given' or 'random', got {order!r}")
    queue = list(tasks)
    if order == "random":
        random.Random(seed).shuffle(queue)
    floors = {t.dataset.name: t.floor for t in tasks}
    t_start = time.perf_counter()
    if trainer.heads:  # start from a fresh adapter, not from whatever the trainer last trained
        trainer.new_adapter()
    prepared: dict[str, PreparedDataset] = {}
    for t in queue:
        say(f"preparing {t.dataset.name} ({t.dataset.source})")
        prepared[t.dataset.name] = trainer.prepare(t.dataset)

    adapters: list[FusedAdapter] = []
    steps: list[FusionStep] = []
    added_val: dict[str, float] = {}
    added_test: dict[str, float] = {}
    current = FusedAdapter(name=f"{prefix}-0", tasks=[])

    def close(adapter: FusedAdapter) -> None:
        for name in adapter.tasks:
            adapter.val_accuracy[name] = trainer.evaluate(prepared[name], "val")
            adapter.test_accuracy[name] = trainer.evaluate(prepared[name], "test")
        if out_dir is not None:
            desc = (f"Fused by `vlora fuse` from {', '.join(adapter.tasks)}. Test accuracy: "
                    + ", ".join(f"{k} {v:.1%}" for k, v in adapter.test_accuracy.items()) + ".")
            adapter.path = trainer.save(Path(out_dir) / adapter.name, description=desc)
        adapters.append(adapter)
        say(f"closed {adapter.name}: {', '.join(adapter.tasks)}")

    for t in queue:
        name = t.dataset.name
        p = prepared[name]
        snap = trainer.snapshot() if current.tasks else None
        t0 = time.perf_counter()
        say(f"training {current.name} on {name}")
        trainer.train([p], label=f"{current.name} + {name}")
        if trainer.config.refit_heads:  # earlier heads follow the shared LoRA's new features
            for x in current.tasks:
                trainer.fit_head(prepared[x])
        acc = {x: trainer.evaluate(prepared[x], "val") for x in current.tasks + [name]}
        violations = [x for x, a in acc.items() if a < floors[x]]
        accepted = not violations or not current.tasks  # a fresh adapter keeps its first dataset
        step = FusionStep(name, len(adapters), accepted, acc, violations, time.perf_counter() - t0)
        steps.append(step)
        say(f"  val accuracy: " + ", ".join(f"{k} {v:.1%} (floor {floors[k]:.0%})" for k, v in acc.items())
            + ("" if accepted else f" -> below floor: {', '.join(violations)}; rolling back"))
        if not accepted:
            trainer.restore(snap)
            step.restored_bit_identical = trainer.matches(snap)
            if not step.restored_bit_identical:
                raise RuntimeError(f"rollback of {current.name} after {name} did not restore the weights exactly")
            close(current)
            trainer.new_adapter()
            current = FusedAdapter(name=f"{prefix}-{len(adapters)}", tasks=[])
            t0 = time.perf_counter()
            say(f"training {current.name} on {name}")
            trainer.train([p], label=f"{current.name} + {name}")
            acc = {name: trainer.evaluate(p, "val")}
            steps.append(FusionStep(name, len(adapters), True, acc, [], time.perf_counter() - t0))
            say(f"  val accuracy: {name} {acc[name]:.1%} (floor {floors[name]:.0%})")
        current.tasks.append(name)
        added_val.setdefault(name, acc[name])
        if name not in added_test:
            added_test[name] = trainer.evaluate(p, "test")
        if acc[name] < floors[name] and current.tasks == [name]:
            current.below_floor.append(name)
            say(f"  {name} misses its floor even alone; {current.name} takes no more datasets")
            close(current)
            if t is not queue[-1]:
                trainer.new_adapter()
            current = FusedAdapter(name=f"{prefix}-{len(adapters)}", tasks=[])
    if current.tasks:
        close(current)
    return FusionResult(adapters=adapters, steps=steps, order=[t.dataset.name for t in queue], floors=floors,
                        added_val_accuracy=added_val, added_test_accuracy=added_test, config=trainer.config,
                        seconds=time.perf_counter() - t_start)
