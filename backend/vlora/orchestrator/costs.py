"""The cost model the ``vlora`` policy decides with: how long an engine step takes in each inference mode,
as a function of its batch size and the number of distinct adapters in it, and how long a mode switch takes.

It is measured on the real runner at model load (:func:`measure`, a few steps per point: decode steps at
batch sizes up to MaxBS, unmerged with 1 to ``batch`` distinct adapters, mixture with a deLoRA branch, two
prefill sizes, and the three kinds of switch), interpolated between the points, and cached per GPU
(:func:`cache_path`: one JSON per device name, model dimensions, dtype, rank, targets and runner settings,
under ``~/.cache/vlora/cost-model`` as the tuner's tables are under ``~/.cache/vlora/tiling``).
``orchestrator.cost_model`` chooses: ``auto`` (the cached model, else measured on CUDA, else the default),
``measure`` (always measure, and cache), ``default`` (:data:`DEFAULT`), or the path of a JSON file.

Decode step, in seconds (``b`` rows, each one token; CUDA-graph replays of the batch's bucket)::

    base(b) + [any LoRA row] lora_tax(b, d) + [any deLoRA row] delora_tax(b)

``lora_tax(b, d) = unmerged(b, d) - base(b)`` with ``d`` distinct adapters among the LoRA rows (measured
at a few ``d``, linear between them): the per-row LoRA path launches its kernels for the whole batch, so
its cost follows the adapters it reads more than the rows that use them. A step that holds a prompt runs
eagerly: ``c0 + c1 * tokens`` (fitted per kind: base, LoRA). :data:`DEFAULT` is the H100 figures of
``benchmarks/RESULTS.md`` (LLaVA-1.5-7B width, bf16, rank-64 q/k/v/o, the engine at its floor).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

FORMAT = 1
SWITCH_KINDS = ("merge", "swap", "unmerge")


def _interp(xs: tuple, ys: tuple, x: float) -> float:
    """Piecewise linear through (xs, ys), xs ascending; constant slope past the ends (never below 0)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class CostModel:
    """Measured step and switch costs (seconds). See the module docstring for the formula.

    ``batch``: the measured batch sizes, ascending; ``base[i]``: decode step with no LoRA row at
    ``batch[i]``; ``lora[i]``: ((distinct adapters, unmerged decode step), ...) at ``batch[i]``, the first
    at 1; ``delora[i]``: what a deLoRA branch adds at ``batch[i]``; ``eager``: kind -> (c0, c1) of an
    eager step of ``tokens`` tokens; ``switch``: kind -> seconds; ``buckets``: the CUDA-graph batch sizes
    a decode step is padded to (empty: none); ``source``/``key``: where it came from, what it is for.
    """

    batch: tuple[int, ...]
    base: tuple[float, ...]
    lora: tuple[tuple[tuple[int, float], ...], ...]
    delora: tuple[float, ...]
    eager: dict[str, tuple[float, float]]
    switch: dict[str, float]
    buckets: tuple[int, ...] = ()
    source: str = ""
    key: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.batch)
        if not n or list(self.batch) != sorted(set(self.batch)) or self.batch[0] < 1:
            raise ValueError(f"cost model: batch sizes {self.batch} must be ascending, distinct and >= 1")
        if len(self.base) != n or len(self.lora) != n or len(self.delora) != n:
            raise ValueError("cost model: base, lora and delora need one entry per batch size")
        if any(not pts or pts[0][0] != 1 for pts in self.lora):
            raise ValueError("cost model: each batch size's unmerged points start at 1 distinct adapter")
        if set(self.switch) != set(SWITCH_KINDS) or set(self.eager) != {"base", "lora"}:
            raise ValueError(f"cost model: switch needs {SWITCH_KINDS}, eager needs base and lora")
        values = list(self.base) + list(self.delora) + list(self.switch.values()) + [s for p in self.lora for _, s in p]
        if any(not (v >= 0.0 and v < 60.0) for v in values):
            raise ValueError("cost model: every cost must be a number of seconds in [0, 60)")

    # -- estimates -------------------------------------------------------------------------------
    def _bucket(self, b: int) -> int:
        if self.buckets:
            i = bisect.bisect_left(self.buckets, b)
            if i < len(self.buckets):
                return self.buckets[i]
        return b

    def base_s(self, b: int) -> float:
        return _interp(self.batch, self.base, self._bucket(b))

    def lora_tax_s(self, b: int, distinct: int) -> float:
        """What LoRA rows with ``distinct`` adapters add to a decode step of ``b`` rows."""
        b = self._bucket(b)
        taxes = []
        for i, pts in enumerate(self.lora):
            d = min(max(distinct, 1), pts[-1][0])
            taxes.append(max(0.0, _interp(tuple(x for x, _ in pts), tuple(s for _, s in pts), d) - self.base[i]))
        return _interp(self.batch, tuple(taxes), b)

    def delora_tax_s(self, b: int) -> float:
        return _interp(self.batch, self.delora, self._bucket(b))

    def decode_s(self, rows: int, lora_rows: int = 0, distinct: int = 0, delora_rows: int = 0) -> float:
        """A decode step of ``rows`` requests: ``lora_rows`` of them add their adapter (``distinct``
        adapters among them), ``delora_rows`` take the merged adapter out again (mixture)."""
        if rows <= 0:
            return 0.0
        t = self.base_s(rows)
        if lora_rows > 0:
            t += self.lora_tax_s(rows, max(distinct, 1))
        if delora_rows > 0:
            t += self.delora_tax_s(rows)
        return t

    def eager_s(self, tokens: int, lora: bool) -> float:
        c0, c1 = self.eager["lora" if lora else "base"]
        return c0 + c1 * tokens

    def step_s(self, rows: int, tokens: int, lora_rows: int = 0, distinct: int = 0, delora_rows: int = 0) -> float:
        """One engine step: a decode step when every row brings one token, else an eager step."""
        if tokens <= rows:
            return self.decode_s(rows, lora_rows, distinct, delora_rows)
        return self.eager_s(tokens, lora_rows > 0 or delora_rows > 0)

    def switch_s(self, old: Optional[str], new: Optional[str]) -> float:
        """Switching the merged adapter from ``old`` to ``new`` (None: none)."""
        if old == new:
            return 0.0
        return self.switch["merge" if old is None else "unmerge" if new is None else "swap"]

    # -- reporting and files ---------------------------------------------------------------------
    def describe(self) -> str:
        bmax = self.batch[-1]
        tax = [self.decode_s(b, b, b) / max(self.base_s(b), 1e-12) for b in self.batch]
        return (f"{self.source}: decode base " + "/".join(f"{1e3 * x:.2f}" for x in self.base)
                + " ms at batch " + "/".join(map(str, self.batch))
                + f"; unmerged (one adapter per row) x{min(tax):.2f}-x{max(tax):.2f} of base"
                + f"; mixture at batch {bmax} +{1e3 * self.delora_tax_s(bmax):.2f} ms"
                + "; switch " + ", ".join(f"{k} {1e3 * self.switch[k]:.2f} ms" for k in SWITCH_KINDS))

    def summary(self) -> dict[str, Any]:
        """The figures a report prints beside a benchmark cell (milliseconds)."""
        bmax = self.batch[-1]
        return {"source": self.source, "batch": list(self.batch), "base_ms": [round(1e3 * x, 3) for x in self.base],
                "unmerged_ms": [round(1e3 * self.decode_s(b, b, b), 3) for b in self.batch],
                "unmerged_1_adapter_ms": [round(1e3 * self.decode_s(b, b, 1), 3) for b in self.batch],
                "mixture_extra_ms_at_max_batch": round(1e3 * self.delora_tax_s(bmax), 3),
                "switch_ms": {k: round(1e3 * v, 3) for k, v in self.switch.items()}}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: Optional[str] = None) -> "CostModel":
        if d.get("format") != FORMAT:
            raise ValueError(f"cost model format {d.get('format')!r}, expected {FORMAT}")
        return cls(batch=tuple(int(x) for x in d["batch"]), base=tuple(float(x) for x in d["base"]),
                   lora=tuple(tuple((int(n), float(s)) for n, s in pts) for pts in d["lora"]),
                   delora=tuple(float(x) for x in d["delora"]),
                   eager={k: (float(v[0]), float(v[1])) for k, v in d["eager"].items()},
                   switch={k: float(v) for k, v in d["switch"].items()}, buckets=tuple(int(x) for x in d.get("buckets", ())),
                   source=source or d.get("source", ""), key=dict(d.get("key", {})))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "CostModel":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cost model {path}: cannot be read ({e})") from None
        try:
            return cls.from_dict(d, source=f"file {path}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"cost model {path}: {e}") from None


def _default() -> CostModel:
    """The H100 80GB HBM3 figures of benchmarks/RESULTS.md ("The engine at its floor", commit 66ca17c):
    LLaVA-1.5-7B width, bf16, rank-64 q/k/v/o, context 700. Base decode 6.40/7.93/11.39/15.66 ms at batch
    1/8/32/64; one distinct adapter per row 1.12/1.14/1.18/1.27x base. The tax with one adapter for the
    whole batch is taken as batch 1's (0.76 ms: the per-row path's launches), and a deLoRA branch (one
    adapter) costs the same. Switch: the swift switcher of the orchestrator run (5.53 / 7.00 / 5.51 ms).
    Prefill: 600 tokens 17.85 ms, 2,300 tokens 56.86 ms (eager); LoRA prefill taken as 10% dearer per token."""
    batch = (1, 8, 32, 64)
    base = (6.40e-3, 7.93e-3, 11.39e-3, 15.66e-3)
    full = (7.16e-3, 9.01e-3, 13.45e-3, 19.85e-3)
    one = 0.76e-3
    lora = tuple(((1, b0 + one), (b, f)) if b > 1 else ((1, f),) for b, b0, f in zip(batch, base, full))
    c1 = (56.86e-3 - 17.85e-3) / 1700
    return CostModel(batch=batch, base=base, lora=lora, delora=(one,) * 4,
                     eager={"base": (17.85e-3 - 600 * c1, c1), "lora": (17.85e-3 - 600 * c1 + one, 1.1 * c1)},
                     switch={"merge": 5.53e-3, "swap": 7.00e-3, "unmerge": 5.51e-3},
                     buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64), source="default (H100 figures of benchmarks/RESULTS.md)")


DEFAULT = _default()


# -- the cache -----------------------------------------------------------------------------------

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


def cache_path(cache_dir: Path, key: dict[str, Any]) -> Path:
    from vlora.atmm.tiling import gpu_slug

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{gpu_slug(key['device'])}-{key['dtype']}-r{key['rank']}-{digest}.json"


# -- measuring ---------------------------------------------------------------------------------

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


class _Probe:
    """Decode and prefill steps on the runner with synthetic rows, timed between device synchronisations."""

    def __init__(self, runner, steps: int, warmup: int, context: int) -> None:
        from vlora.engine.kv_cache import SequenceBlocks

        self.runner, self.steps, self.warmup, self.context = runner, steps, warmup, context
        self.sync: Callable[[], None] = ((lambda: torch.cuda.synchronize(runner.device)) if runner.device.type == "cuda"
                                         else (lambda: None))
        self._blocks: list[list[int]] = []
        self._seq_blocks = SequenceBlocks

    def blocks(self, n: int):
        """``n`` sequences' blocks, each room for ``context`` + 1 tokens (allocated once, reused)."""
        kv = self.runner.kv
        while len(self._blocks) < n:
            self._blocks.append(kv.allocator.allocate(kv.blocks_for(self.context + 1)))
        return [self._seq_blocks(list(b)) for b in self._blocks[:n]]

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
        from vlora.engine.model_runner import SeqInput

        blocks = self.blocks(b)
        return self.time(lambda: [SeqInput([1], self.context, blocks[i], slots[i % len(slots)] if slots else -1,
                                           delora_slot=delora) for i in range(b)])

    def eager(self, n: int, tokens: int, slots: list[int]) -> float:
        from vlora.engine.model_runner import SeqInput

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
    probe = _Probe(runner, steps, warmup, context)
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
