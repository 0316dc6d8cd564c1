"""The cost probe: measures the orchestrator's cost model (:class:`vlora.orchestrator.costs.CostModel`) on the
real runner at model load, and finds or caches it per GPU. The engine's builder calls :func:`resolve`; the
orchestrator only consumes the model it returns, so the measuring, which drives the model runner and the KV
cache, lives here in the engine and nothing in ``orchestrator/`` imports the engine.

What is measured and how the model is chosen (``orchestrator.cost_model``: ``auto``, ``measure``,
``default`` or a JSON path) is in :mod:`vlora.orchestrator.costs`.
"""
from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from vlora.engine.kv_cache import SequenceBlocks
from vlora.engine.model_runner import SeqInput
from vlora.orchestrator.costs import DEFAULT, FORMAT, SWITCH_KINDS, CostModel, cache_path

log = logging.getLogger(__name__)


def model_key(runner, *, dtype: str, max_rank: int, targets: tuple[str, ...], max_batch_size: int, lora_backend: str,
              switcher: str) -> dict[str, Any]:
    """What a measured model depends on: device, model dimensions, dtype, rank, targets and runner settings."""
    dev = runner.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    graphs = getattr(runner, "graphs", None)
    from vlora.atmm.dispatch import default_kernels

    return {"device": name, "layers": runner.num_layers, "hidden": runner.hidden_size, "heads": runner.n_heads,
            "kv_heads": runner.n_kv, "head_dim": runner.head_dim, "intermediate": runner.intermediate,
            "vocab": runner.vocab_size, "dtype": dtype, "rank": max_rank, "targets": sorted(targets),
            "max_batch_size": max_batch_size, "cuda_graphs": list(graphs.sizes) if graphs is not None else None,
            "attention": type(runner.attention).__name__, "lora_backend": lora_backend, "switcher": switcher,
            "atmm_extension": bool(dev.type == "cuda" and default_kernels().available), "format": FORMAT}


def batch_points(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes measured: 1, 4, 8, 16, 32, ... up to MaxBS, and MaxBS."""
    pts = {1, max_batch_size}
    b = 4
    while b < max_batch_size:
        pts.add(b)
        b *= 2
    return tuple(sorted(pts))


def distinct_points(b: int, slots: int) -> tuple[int, ...]:
    """Distinct adapters measured at batch ``b`` with ``slots`` slots to spare: 1, b/4 and b (or all slots)."""
    return tuple(sorted({min(d, slots) for d in (1, max(1, b // 4), b)}))


class CostProbe:
    """Decode and prefill steps on the runner with synthetic rows, timed between device synchronisations."""

    def __init__(self, runner, steps: int, warmup: int, context: int) -> None:
        self.runner, self.steps, self.warmup, self.context = runner, steps, warmup, context
        self.sync: Callable[[], None] = ((lambda: torch.cuda.synchronize(runner.device)) if runner.device.type == "cuda"
                                         else (lambda: None))
        self._blocks: list[list[int]] = []
        
    def blocks(self, n: int):
        """``n`` sequences' blocks, each room for ``context`` + 1 tokens (allocated once, reused)."""
        kv = self.runner.kv
        while len(self._blocks) < n:
            self._blocks.append(kv.allocator.allocate(kv.blocks_for(self.context + 1)))
        return [SequenceBlocks(list(b)) for b in self._blocks[:n]]

    def release(self) -> None:
        alloc = self.runner.kv.allocator
        for b in self._blocks:
            alloc.free(b)
        self._blocks = []

    def time(self, make_inputs: Callable[[], list]) -> float:
        seqs = make_inputs()
        for _ in range(self.warmup):
            self.runner.forward(seqs)
        self.sync()
        out = []
        for _ in range(self.steps):
            t0 = time.perf_counter()
            self.runner.forward(seqs)
            self.sync()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def decode(self, b: int, slots: list[int], delora: int = -1) -> float:
        blocks = self.blocks(b)
        return self.time(lambda: [SeqInput([1], self.context, blocks[i], slots[i % len(slots)] if slots else -1,
                                           delora_slot=delora) for i in range(b)])

    def eager(self, n: int, tokens: int, slots: list[int]) -> float:
        per = min(max(2, tokens // n), self.context)
        blocks = self.blocks(n)
        return self.time(lambda: [SeqInput([1] * per, 0, blocks[i], slots[i % len(slots)] if slots else -1) for i in range(n)])


def measure(runner, *, max_batch_size: int, switcher_cls, steps: Optional[int] = None, warmup: Optional[int] = None,
            context: Optional[int] = None, switch_repeats: int = 5, prefill_tokens: Optional[tuple[int, int]] = None,
            source: str = "measured", key: Optional[dict[str, Any]] = None, loras=None) -> CostModel:
    """Measure the cost model on ``runner``: decode steps at :func:`batch_points` (base, unmerged with
    :func:`distinct_points` adapters, mixture) with ``context`` tokens of KV each, two eager prefill steps
    per kind, and each kind of switch with ``switcher_cls``; the median of ``steps`` timed steps per point
    after ``warmup``. Defaults: on CUDA 5 / 2 steps, context 256, prefills of 512 and 2,048 tokens (about 5 s
    at 7B width on an H100); elsewhere 3 / 1, context 32, prefills of 64 and 256 tokens. Uses adapter slots
    that hold nothing, filled with zero weights at the full rank (the kernels' cost does not depend on the
    values; a zero delta merges and unmerges exactly) and emptied again; refuses when ``loras`` (the
    LoraManager) already has an adapter in a slot."""
    cuda = runner.device.type == "cuda"
    steps = steps or (5 if cuda else 3)
    warmup = warmup if warmup is not None else (2 if cuda else 1)
    context = context or (256 if cuda else 32)
    prefill_tokens = prefill_tokens or ((512, 2048) if cuda else (64, 256))
    if loras is not None and loras.resident:
        raise RuntimeError("cost model: measure it before any adapter is in a slot (at model load)")
    layers = runner.lora_layers
    if not layers:
        raise RuntimeError("cost model: the runner has no LoRA layers")
    first = next(iter(layers.values()))
    num_slots, r = first.lora_a.shape[0], first.lora_a.shape[1]
    free = [s for s in range(num_slots) if all(w.ranks[s] == 0 for w in layers.values())]
    if len(free) < 2:
        raise RuntimeError(f"cost model: needs 2 empty adapter slots, {len(free)} of {num_slots} are")
    t0 = time.perf_counter()
    kv = runner.kv
    probe = CostProbe(runner, steps, warmup, context)
    batches = batch_points(max_batch_size)
    if max(batches) * kv.blocks_for(context + 1) > kv.allocator.num_free:
        probe.context = max(15, (kv.allocator.num_free // max(batches) - 1) * kv.block_size - 1)
    zeros: dict[tuple, torch.Tensor] = {}

    def zero(*shape) -> torch.Tensor:
        if shape not in zeros:
            zeros[shape] = torch.zeros(*shape, dtype=first.lora_a.dtype, device=first.lora_a.device)
        return zeros[shape]

    used = free[:max(2, min(len(free), max(batches) + 1))]
    try:
        for s in used:
            for w in layers.values():
                w.set_slot(s, zero(r, w.in_features), zero(w.out_features, r), 1.0)
        merged, rows = used[0], used[1:]
        base, lora, delora = [], [], []
        for b in batches:
            base.append(probe.decode(b, []))
            pts = []
            for d in distinct_points(b, len(rows)):
                pts.append((d, probe.decode(b, rows[:d])))
            if pts[0][0] != 1:
                pts.insert(0, (1, probe.decode(b, rows[:1])))
            lora.append(tuple(pts))
            delora.append(max(0.0, probe.decode(b, rows[:1], delora=merged) - pts[0][1]))
        eager = {}
        seqs = min(8, max(batches))  # prompts of an eager step: 8 (of up to ``context`` tokens each, 2 at least)
        for kind, slots in (("base", []), ("lora", rows[:seqs])):
            (t1, x1), (t2, x2) = [(probe.eager(seqs, n, slots), min(n // seqs, probe.context) * seqs)
                                  for n in prefill_tokens]
            c1 = max(0.0, (t2 - t1) / (x2 - x1)) if x2 > x1 else t2 / x2
            eager[kind] = (max(0.0, t1 - c1 * x1), c1)
        sw = switcher_cls(runner)
        times: dict[str, list[float]] = {k: [] for k in SWITCH_KINDS}
        sw.switch(used[0])
        sw.switch(None)
        for _ in range(switch_repeats):
            times["merge"].append(sw.switch(used[0]))
            times["swap"].append(sw.switch(used[1]))
            times["unmerge"].append(sw.switch(None))
    finally:
        probe.release()
        for s in used:
            for w in layers.values():
                w.set_slot(s, None, None, 0.0)
        probe.sync()
    graphs = getattr(runner, "graphs", None)
    model = CostModel(batch=batches, base=tuple(base), lora=tuple(lora), delora=tuple(delora), eager=eager,
                      switch={k: statistics.median(v) for k, v in times.items()},
                      buckets=tuple(graphs.sizes) if graphs is not None else (), source=source, key=dict(key or {}))
    log.info("cost model measured in %.1f s (context %d, %d steps per point)", time.perf_counter() - t0, probe.context, steps)
    return model


def resolve(spec: str, runner, *, cache_dir: Path, key: dict[str, Any], max_batch_size: int, switcher_cls,
            loras=None, measure_on_cpu: bool = False) -> CostModel:
    """The cost model ``orchestrator.cost_model`` names (see the module docstring), logged."""
    if spec == "default":
        model = DEFAULT
    elif spec in ("auto", "measure"):
        path = cache_path(cache_dir, key)
        model = None
        if spec == "auto" and path.is_file():
            try:
                model = CostModel.load(path)
                if model.key != key:
                    model = None
            except ValueError as e:
                log.warning("%s; measuring again", e)
        if model is None and spec == "auto" and runner.device.type != "cuda" and not measure_on_cpu:
            model = DEFAULT
        if model is None:
            model = measure(runner, max_batch_size=max_batch_size, switcher_cls=switcher_cls, loras=loras, key=key,
                            source=f"measured on {key['device']}")
            try:
                model.save(path)
                log.info("cost model cached at %s", path)
            except OSError as e:
                log.warning("cost model: cannot write the cache %s (%s)", path, e)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"orchestrator.cost_model: {path} is not a file (auto, measure, default or a JSON path)")
        model = CostModel.load(path)
    log.info("cost model %s", model.describe())
    return model
