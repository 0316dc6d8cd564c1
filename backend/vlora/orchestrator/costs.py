"""The cost model the ``vlora`` policy decides with: how long an engine step takes in each inference mode,
as a function of its batch size and the number of distinct adapters in it, and how long a mode switch takes.

The orchestrator only consumes a cost model. The engine measures it on the real runner at model load
(:mod:`vlora.engine.cost_probe`: a few steps per point: decode steps at batch sizes up to MaxBS, unmerged
with 1 to ``batch`` distinct adapters, mixture with a deLoRA branch, two prefill sizes, and the three kinds
of switch); it is interpolated between the points, and cached per GPU (:func:`cache_path`: one JSON per
device name, model dimensions, dtype, rank, targets and runner settings, under ``~/.cache/vlora/cost-model``
as the tuner's tables are under ``~/.cache/vlora/tiling``). ``orchestrator.cost_model`` chooses: ``auto``
(the cached model, else measured on CUDA, else the default), ``measure`` (always measure, and cache),
``default`` (:data:`DEFAULT`), or the path of a JSON file.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

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

def cache_path(cache_dir: Path, key: dict[str, Any]) -> Path:
    from vlora.atmm.tiling import gpu_slug

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{gpu_slug(key['device'])}-{key['dtype']}-r{key['rank']}-{digest}.json"
