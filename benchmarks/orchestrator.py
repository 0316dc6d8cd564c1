"""The orchestrator benchmark (issues 4 and 21): scheduling policies under an open-loop Poisson stream, and the
mode-switch time of the swift switcher against per-layer ``addmm``.

For each policy (``vlora``: the V-LoRA paper's Algorithm 1, deciding with the cost model measured at load;
the baselines ``merge-only``,
``unmerge-only`` and ``dlora``), each skewness (share of requests that go to the most popular
adapter) and each number of adapters, one *cell* drives the real engine in-process (``LLMEngine.step``
on this thread, real wall clock, as the engine thread of the server does) with text-only requests that
arrive open-loop (Poisson) for ``--duration`` seconds, then drains. It reports the average token latency
(sum of end-to-end latencies / total output tokens, as in the V-LoRA paper), the throughput (req/s and
tok/s), end-to-end p50/p99, step time per inference mode, the number of mode switches and adapter swaps,
and which LoRA compute path ran (the ATMM CUDA extension, its PyTorch reference, or dLoRA's padded einsum).
Every policy sees the same arrival times and adapters for a given (skewness, adapters, rate).

The cost model (:mod:`vlora.orchestrator.costs`: decode step by mode, batch size and distinct adapters, and
the switch times) is measured when the engine is built (``--cost-model``, default ``auto``: cached per GPU
under ``--work``/cost-model, else measured; ``measure`` on a CPU, where it takes a second) and printed; every
cell records the step time per mode it measured, the switches, and the model's estimates at the cell's mean
batch (base, unmerged, mixture step, switch), so that a missed target can be read off the costs.

Adapters are rank ``--rank`` over q, k, v, o of every layer, registered in memory
(``LoraManager.register``): ``--distinct-weights`` random weight sets shared by all the names (512
distinct rank-64 sets at 7B width would be ~134 MB each in bf16). The values do not matter for speed;
the slots, swaps and merges do, and each name has its own slot and is swapped and merged on its own.

Request rate: ``--rate`` in req/s, or (default) ``--load`` times the capacity measured at start-up:
MaxBS requests with MaxBS distinct adapters run unmerged (the prefill steps, then decode steps);
capacity = MaxBS / (prefill time + (output tokens - 1) x decode step). Load 1.0 keeps the unmerged path
at its capacity, so the queue matters. Requests still running ``--drain`` seconds after the last
arrival are cancelled and counted as *censored*: their latency counts as (cutoff - arrival) with the
full output length, a lower bound that flatters the policy that had them.

GPU (LLaVA-1.5-7B dimensions, random weights; the model folder is written under --work on first use): the full
grid in one device call (``benchmarks/device_orchestrator.sh``). ``--budget-s`` fits the run into a wall-clock
budget: once the model, the engine, the switch times and the calibrated rate are ready, every cell gets the same
arrival window, the longest (up to ``--duration``, at least ``--min-duration``) with which all cells fit, each
counted at its worst (its window, the whole ``--drain`` and the per-cell overhead); the window and the requests of
each cell are reported. No cell starts once it could not end inside the budget, so a slow machine returns with
what it measured. Cells run adapter count by skewness by rate, the four policies one after the other on the same
stream, so that a cut-short run still holds whole comparisons:

    python -m benchmarks.orchestrator --device cuda --require-atmm-ext --budget-s 400 \\
        --json-out $OUT/orchestrator.json --no-record
    python -m benchmarks.orchestrator --report path/to/orchestrator.json   # here: tables, verdicts, RESULTS.md line

``--report`` prints the tables (average and p99 token latency per cell, requests per cell), vlora's cut against
each baseline, and for every missed comparison the measured step and switch costs beside the cost model's; then
the same as a markdown section for RESULTS.md. A second run with ``--merge-into FILE`` adds its cells to FILE's
(same settings required), and reuses FILE's calibrated request rates so that every policy sees the same stream.
``--require-atmm-ext`` stops at once when the ATMM extension cannot serve (put a built ``vlora_atmm_ext*.so`` on
PYTHONPATH, see ``benchmarks/run_device.sh``). CPU smoke run (tiny model; ``--budget-s 120`` runs the full grid):

    python -m benchmarks.orchestrator --device cpu --quick --no-record

Writes ``--json-out`` if given, and (unless ``--no-record``) ``benchmarks/results/orchestrator-<device>.json``
and one line in ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import ROOT, device_name, git_commit, record_result

POLICIES = ("vlora", "merge-only", "unmerge-only", "dlora")
BASELINES = ("merge-only", "unmerge-only", "dlora")
TARGET_CUT = 0.20  # the target: vlora's average token latency at least 20% below every baseline
CALIBRATION_TOKENS = 8  # output tokens of the calibration batches (prefill, then 7 decode steps)
STALL_S = 60.0  # no step could run for this long: something is wrong, stop with an error
IDLE_POLL_S = 0.0005  # sleep between steps that could not run (an adapter copy in flight)
PROMPT_WORDS = "describe the picture in detail and list every object you can see in it".split()
# Settings that must agree for cells of two runs to be merged into one result.
MERGE_KEYS = ("model", "dtype", "rank", "prompt_tokens", "output_tokens", "max_batch_size", "slots", "duration_s",
              "drain_s", "theta_s", "distinct_weights", "target_modules")

# Defaults per kind of run: a model of real width on a GPU, or the tiny model on a CPU.
GPU_DEFAULTS = dict(preset="configs/models/llava-1.5-7b.yaml", rank=64, prompt_tokens=256, output_tokens=32,
                    max_batch_size=32, slots=64, adapters="8,64,512", duration=6.0, drain=3.0, distinct_weights=8,
                    min_duration=2.5)
CPU_DEFAULTS = dict(preset=None, rank=8, prompt_tokens=48, output_tokens=8, max_batch_size=8, slots=16,
                    adapters="4,16,64", duration=2.0, drain=2.0, distinct_weights=4, min_duration=0.5)
QUICK = dict(skewness="0.1,0.9", gpu=dict(adapters="8,512", duration=4.0, drain=3.0),
             cpu=dict(adapters="4,64", duration=1.0, drain=1.0))
# What --budget-s counts per cell beyond its arrival window and drain (making the cell's stream, tokenizing its
# prompts, filling the slots, the policy's orchestrator) and once per policy (its first warm-up batch, graphs it
# lacks), in seconds: estimates with a margin; the run prints what the cells really took.
CELL_OVERHEAD_S = {"gpu": 0.5, "cpu": 0.3}
POLICY_WARMUP_S = {"gpu": 2.0, "cpu": 0.5}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--preset", help="model preset YAML (random weights at that size); GPU default "
                                    f"{GPU_DEFAULTS['preset']}; CPU default: the tiny model")
    p.add_argument("--model", help="an existing model folder (overrides --preset)")
    p.add_argument("--work", default="/tmp/vlora-bench", help="where the random model folder is written")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--skewness", default="0.1,0.3,0.6,0.9", help="share of requests for the most popular adapter")
    p.add_argument("--adapters", help="numbers of adapters (GPU default 8,64,512)")
    p.add_argument("--rate", help="request rates in req/s (comma list); default: --load x measured capacity")
    p.add_argument("--load", default="1.0", help="rates as fractions of the measured unmerged capacity")
    p.add_argument("--duration", type=float, help="seconds of arrivals per cell (GPU default 6; with --budget-s the most)")
    p.add_argument("--min-duration", type=float, help="with --budget-s: the shortest arrival window a cell may get "
                                                      "(GPU default 2.5 s, CPU 0.5 s)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="fit the whole run into this many seconds from its start: every cell gets the same arrival "
                        "window, the longest with which all cells fit at their worst (see the module docstring)")
    p.add_argument("--drain", type=float, help="seconds after the last arrival before the rest is cancelled (censored)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length (GPU default 256)")
    p.add_argument("--output-tokens", type=int, help="output tokens per request, EOS ignored (GPU default 32)")
    p.add_argument("--rank", type=int, help="LoRA rank (GPU default 64)")
    p.add_argument("--max-batch-size", type=int, help="MaxBS (GPU default 32)")
    p.add_argument("--slots", type=int, help="lora.max_gpu_adapters (GPU default 64; the ATMM extension takes <= 256)")
    p.add_argument("--distinct-weights", type=int, help="distinct random weight sets shared by the adapter names")
    p.add_argument("--theta", type=float, help="orchestrator.theta_s (default: the engine's)")
    p.add_argument("--cost-model", default="auto",
                   help="orchestrator.cost_model: auto (cached per GPU under --work/cost-model, else measured; measured "
                        "on a CPU), measure, default, or a JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--switch-repeats", type=int, default=7, help="switches of each kind timed per switcher")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no cell after this many seconds from the start (a time-limited GPU call ends with what it has)")
    p.add_argument("--quick", action="store_true", help="a small grid: skewness 0.1,0.9, fewest and most adapters, short cells")
    p.add_argument("--merge-into", metavar="FILE", help="add this run's cells to FILE's (and reuse its calibrated rates)")
    p.add_argument("--force-merge", action="store_true", help="merge even if FILE's settings differ")
    p.add_argument("--json-out", metavar="FILE", help="write the (merged) result here")
    p.add_argument("--no-record", action="store_true", help="do not write results/ or RESULTS.md")
    p.add_argument("--report", metavar="FILE", help="no run: read FILE, print the tables, verdicts and a RESULTS.md "
                                                    "section, record them (results/ and a RESULTS.md line)")
    p.add_argument("--markdown", metavar="FILE", help="write the RESULTS.md section (markdown tables) here")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads on a CPU run (default 1: the tiny model gains nothing from more, and a busy "
                        "machine stalls multi-threaded steps)")
    p.add_argument("--require-atmm-ext", action="store_true", help="fail at once unless vlora_atmm_ext serves the unmerged path")
    return p.parse_args(argv)


def csv(text: str, kind=float) -> list:
    return [kind(x) for x in str(text).split(",") if x.strip()]


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Device-dependent defaults filled in; everything a cell depends on."""
    import torch

    from vlora.engine.builder import resolve_device

    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    base = dict(GPU_DEFAULTS if gpu else CPU_DEFAULTS)
    if args.quick:
        base.update(QUICK["gpu" if gpu else "cpu"])
    s = {
        "device": str(device),
        "dtype": args.dtype if args.dtype != "auto" else ("bfloat16" if gpu else "float32"),
        "preset": args.preset if args.preset is not None else base["preset"],
        "model_dir": args.model,
        "rank": args.rank or base["rank"],
        "prompt_tokens": args.prompt_tokens or base["prompt_tokens"],
        "output_tokens": args.output_tokens or base["output_tokens"],
        "max_batch_size": args.max_batch_size or base["max_batch_size"],
        "slots": args.slots or base["slots"],
        "distinct_weights": args.distinct_weights or base["distinct_weights"],
        "duration_s": args.duration if args.duration is not None else base["duration"],
        "drain_s": args.drain if args.drain is not None else base["drain"],
        "min_duration_s": args.min_duration,
        "policies": csv(args.policies, str),
        "skewness": csv(QUICK["skewness"] if args.quick and args.skewness == "0.1,0.3,0.6,0.9" else args.skewness),
        "adapters": csv(args.adapters or base["adapters"], int),
        "rates": csv(args.rate) if args.rate else None,
        "loads": csv(args.load),
        "theta_s": args.theta,
        "cost_model": args.cost_model if args.cost_model != "auto" or gpu else "measure",
        "seed": args.seed,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    }
    if s["min_duration_s"] is None:
        s["min_duration_s"] = min(base["min_duration"], s["duration_s"])
    bad = [p for p in s["policies"] if p not in POLICIES]
    if bad:
        raise SystemExit(f"--policies: unknown {bad}; known: {list(POLICIES)}")
    if any(not 0 < x <= 1 for x in s["skewness"]):
        raise SystemExit("--skewness: values in (0, 1]")
    if any(n < 2 or n > 1000 for n in s["adapters"]):
        raise SystemExit("--adapters: values in [2, 1000] (the workload generator's limit)")
    if s["duration_s"] <= 0 or s["drain_s"] < 0 or not 0 < s["min_duration_s"] <= s["duration_s"]:
        raise SystemExit("--duration > 0, --drain >= 0 and 0 < --min-duration <= --duration")
    if s["rates"] is not None and any(r <= 0 for r in s["rates"]):
        raise SystemExit("--rate: values > 0")
    if s["slots"] > 256 and gpu:
        print(f"warning: --slots {s['slots']} > 256: the ATMM CUDA extension serves at most 256 slots; "
              "the PyTorch reference will run instead", flush=True)
    if gpu and not torch.cuda.is_available():
        raise SystemExit("CUDA requested but not available")
    return s


# -- building the engine and the adapters ------------------------------------------------------

def model_folder(s: dict[str, Any], work: Path) -> tuple[Path, float]:
    """The model folder (written on first use for a preset) and the seconds that took."""
    t0 = time.perf_counter()
    if s["model_dir"]:
        return Path(s["model_dir"]), 0.0
    if s["preset"]:
        from vlora.models.random_init import make_random_llava

        out = make_random_llava(ROOT / s["preset"] if not Path(s["preset"]).is_absolute() else s["preset"],
                                work / ("model-" + Path(s["preset"]).stem),
                                device="cuda" if s["device"].startswith("cuda") else "cpu")
        return out, time.perf_counter() - t0
    from vlora.models.tiny import ensure_tiny_model

    return ensure_tiny_model(), time.perf_counter() - t0


def kv_blocks(s: dict[str, Any], block_size: int = 16) -> int:
    """Enough KV blocks for MaxBS running requests (waiting requests hold none), plus a margin."""
    per_request = -(-(s["prompt_tokens"] + s["output_tokens"]) // block_size)
    return per_request * (s["max_batch_size"] + 2) + 16


def build(s: dict[str, Any], model_dir: Path, work: Path):
    """The engine, built as for the vlora policy: every graph variant captured (mixture too), and the cost
    model measured or loaded (``s["cost_model"]``) before any adapter is in a slot."""
    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    overrides: dict[str, Any] = {
        "model.path": str(model_dir), "model.device": s["device"], "model.dtype": s["dtype"], "lora.adapter_root": None,
        "lora.max_gpu_adapters": s["slots"], "lora.max_cpu_adapters": s["slots"], "lora.max_rank": s["rank"],
        "lora.target_modules": list(s["target_modules"]), "scheduler.max_batch_size": s["max_batch_size"],
        "cache.num_blocks": kv_blocks(s), "orchestrator.policy": "vlora", "orchestrator.cost_model": s["cost_model"],
        "orchestrator.cost_model_dir": str(work / "cost-model"),
        # No tuner sidecar profiling on the GPU while cells are timed: the committed tiling table (or the default rule) serves.
        "atmm.tune_at_load": "never"}
    if s["theta_s"] is not None:
        overrides["orchestrator.theta_s"] = s["theta_s"]
    cfg = EngineConfig().with_overrides(overrides)
    try:
        return build_engine(cfg)
    except RuntimeError as e:
        if "out of memory" in str(e).lower():
            raise SystemExit(f"out of device memory building the engine ({e}); lower --slots (each slot holds one "
                             f"adapter of rank {s['rank']} for every targeted layer) or --max-batch-size") from e
        raise


def register_adapters(engine, count: int, distinct: int, rank: int, seed: int) -> list[str]:
    """``count`` adapter names over ``distinct`` random weight sets (rank ``rank``, every targeted
    projection of every layer), registered in memory. On CUDA they are held as the host tier stages
    adapters (the slots' dtype, pinned memory), so every adapter is in host memory, as in S-LoRA and
    V-LoRA, and a swap is one asynchronous host-to-device copy; on a CPU, float32 like a loaded adapter."""
    import torch

    from vlora.lora.adapter import AdapterWeights, LoraPair
    from vlora.lora.demo import TARGET_DELTA

    runner = engine.runner
    dims = runner.module_dims()
    modules = tuple(engine.config.lora.target_modules)
    scale = 2.0  # lora_alpha = 2 r
    dev = runner.device
    cuda = dev.type == "cuda"

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.to(runner.dtype).cpu().pin_memory() if cuda else t.float().cpu()

    gen = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(min(distinct, count)):
        pairs = {}
        for layer in range(runner.num_layers):
            for m in modules:
                d_in, d_out = dims[m]
                a = torch.randn(rank, d_in, generator=gen, device=dev) / math.sqrt(d_in)
                b = torch.randn(d_out, rank, generator=gen, device=dev) * (TARGET_DELTA / (scale * math.sqrt(rank)))
                pairs[(layer, m)] = LoraPair(a=host(a), b=host(b), scale=scale)
        sets.append(pairs)
    width = max(3, len(str(count - 1)))
    names = [f"bench-{i:0{width}d}" for i in range(count)]
    for i, name in enumerate(names):
        engine.loras.register(name, AdapterWeights(name=name, dir=Path("<in-memory>"), pairs=sets[i % len(sets)],
                                                   ranks={m: rank for m in modules}, max_rank=rank, target_modules=modules))
    return names


def prompt_text(engine, tokens: int) -> tuple[str, int]:
    """A text-only prompt of at most ``tokens`` tokens (as close as whole words allow), and its length."""
    from vlora.engine.api import GenerationRequest

    def length(words: int) -> int:
        text = " ".join(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(words))
        return len(engine.inputs.prepare(GenerationRequest("probe", text)).prompt_ids)

    lo, hi = 1, max(2, tokens)
    while length(hi) <= tokens:
        hi *= 2
    while lo < hi - 1:  # largest word count whose prompt fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if length(mid) <= tokens else (lo, mid)
    return " ".join(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(lo)), length(lo)


# -- policies, probes and timers ------------------------------------------------------------------

class ComputeProbe:
    """Wraps the step's LoRA backend (vlora.lora.backends); classifies which path served the first
    eager calls of a cell (the check is not free, so only ``checks`` calls are classified; the rest are
    only counted). Captured decode steps replay without calling it: their calls are not counted."""

    def __init__(self, backend, checks: int = 16) -> None:
        self.backend, self.name, self.checks_per_cell = backend, backend.name, checks
        self.fn = backend.segments
        self.reset()

    def segments(self, *args):
        return self(*args)

    def rows(self, *args):
        return self.backend.rows(*args)

    def reset(self) -> None:
        self.calls = 0
        self.checks = self.checks_per_cell
        self.paths: Counter = Counter()

    def __call__(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        self.calls += 1
        if self.checks > 0 and mapping.has_lora:
            self.checks -= 1
            self.paths[self.classify(y, x, lora_a, lora_b, ranks, scales, mapping)] += 1
        return self.fn(y, x, lora_a, lora_b, ranks, scales, mapping)

    def classify(self, y, x, lora_a, lora_b, ranks, scales, mapping) -> str:
        if self.name != "atmm":
            return self.name
        if not y.is_cuda:
            return "atmm: PyTorch reference (CPU)"
        from vlora.atmm.dispatch import default_kernels

        why = default_kernels().unsupported(y, x, lora_a, lora_b, ranks, scales, mapping)
        return "atmm: CUDA extension vlora_atmm_ext" if not why else f"atmm: PyTorch reference ({why})"

    def summary(self) -> str:
        if not self.paths:
            return "no unmerged LoRA compute"
        return "; ".join(f"{k} ({v} of the first calls)" if len(self.paths) > 1 else k for k, v in self.paths.items())


def set_policy(engine, policy: str) -> ComputeProbe:
    """Give the engine a fresh orchestrator for ``policy`` (base weights clean first)."""
    engine.flush()
    from vlora.orchestrator.orchestrator import Orchestrator
    from vlora.orchestrator.policies import UNMERGE

    if engine.has_work():
        raise RuntimeError("set_policy: the engine still has requests")
    old = engine.orchestrator
    old.enter(UNMERGE, None)
    old_costs = old.estimates.costs
    cfg = dataclasses.replace(engine.config.orchestrator, policy=policy)
    engine.config = dataclasses.replace(engine.config, orchestrator=cfg)
    engine.use_orchestrator(None)
    del old
    engine.use_orchestrator(Orchestrator(cfg, engine.config.scheduler.max_batch_size, engine.runner, engine.loras,
                                         engine.metrics, costs=old_costs))
    graphs = engine.runner.graphs
    if graphs is not None:  # a step of a timed cell never pays a capture
        graphs.capture_missing()
    ctx = engine.runner.lora_ctx
    probe = ComputeProbe(ctx.backend)
    ctx.backend = probe
    return probe


def ensure_resident(engine, names: list[str]) -> None:
    for name in names:
        slot = engine.loras.acquire(name)
        if slot is not None:
            engine.loras.release(slot)


def sync_fn(engine):
    import torch

    dev = engine.runner.device
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)


# -- measurements ----------------------------------------------------------------------------

def switch_times(engine, names: list[str], repeats: int) -> dict[str, Any]:
    """Median mode-switch times of the swift switcher and of per-layer addmm on the engine's weights:
    merge (nothing -> A), swap (A -> B) and unmerge (B -> nothing). Each switch is timed between two
    device synchronisations (``Switcher.switch``)."""
    from vlora.orchestrator.switcher import PerLayerSwitcher, SwiftSwitcher

    set_policy(engine, "unmerge-only")  # clean weights, no switcher of the orchestrator's own
    runner, loras = engine.runner, engine.loras
    a, b = loras.acquire(names[0]), loras.acquire(names[1])
    if hasattr(loras, "wait_ready"):  # copies into the slots may run on a side stream
        loras.wait_ready([a, b])
    out: dict[str, Any] = {"layers": runner.num_layers, "modules": list(engine.config.lora.target_modules),
                           "rank": engine.config.lora.max_rank, "repeats": repeats}
    try:
        for cls in (SwiftSwitcher, PerLayerSwitcher):
            sw = cls(runner)
            for slot in (a, b, None):  # warm-up
                sw.switch(slot)
            times: dict[str, list[float]] = {"merge": [], "swap": [], "unmerge": []}
            for _ in range(repeats):
                times["merge"].append(sw.switch(a))
                times["swap"].append(sw.switch(b))
                times["unmerge"].append(sw.switch(None))
            out[cls.name] = {k: {"median_ms": 1e3 * statistics.median(v), "all_ms": [round(1e3 * x, 3) for x in v]}
                             for k, v in times.items()}
            del sw
    finally:
        loras.release(a)
        loras.release(b)
    out["speedup"] = {k: out["per-layer"][k]["median_ms"] / max(out["swift"][k]["median_ms"], 1e-9)
                      for k in ("merge", "swap", "unmerge")}
    return out


def closed_batch(engine, prompt: str, adapters: list, max_tokens: int, tag: str) -> dict[str, float]:
    """Run one batch to completion: seconds until every request is prefilled, and the median decode step."""
    from vlora.engine.api import GenerationRequest, SamplingParams

    sync = sync_fn(engine)
    for i, name in enumerate(adapters):
        req = GenerationRequest(f"{tag}-{i}", prompt, lora_name=name,
                                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        engine.add_request(engine.inputs.prepare(req), lambda out: None)
    sync()
    t0 = time.perf_counter()
    while any(not x.prefilled for x in engine.running + list(engine.waiting)):
        if engine.step() is None:
            time.sleep(IDLE_POLL_S)
    prefill = time.perf_counter() - t0
    steps = []
    while engine.has_work():
        t = time.perf_counter()
        if engine.step() is None:  # sampling reads the tokens back: each step that ran ends synchronised
            time.sleep(IDLE_POLL_S)
            continue
        steps.append(time.perf_counter() - t)
    return {"prefill_s": prefill, "decode_step_s": statistics.median(steps) if steps else float("nan")}


def calibrate(engine, s: dict[str, Any], prompt: str, names: list[str]) -> dict[str, Any]:
    """Step times of a full batch (MaxBS) on the base model and unmerged with distinct adapters, and the
    request rate each sustains: MaxBS / (prefill + (output tokens - 1) x decode step)."""
    set_policy(engine, "unmerge-only")
    bs = s["max_batch_size"]
    distinct = names[: min(bs, s["slots"], len(names))]
    ensure_resident(engine, distinct)  # slot loads are not part of a step's cost
    closed_batch(engine, prompt, [None] * 2 + distinct[:2], 2, "cal-warm")
    out: dict[str, Any] = {"batch": bs, "distinct_adapters": len(distinct), "tokens": CALIBRATION_TOKENS}
    for label, adapters in (("base", [None] * bs), ("unmerged", [distinct[i % len(distinct)] for i in range(bs)])):
        r = closed_batch(engine, prompt, adapters, CALIBRATION_TOKENS, f"cal-{label}")
        cap = bs / (r["prefill_s"] + (s["output_tokens"] - 1) * r["decode_step_s"])
        out[label] = {"prefill_s": r["prefill_s"], "decode_step_ms": 1e3 * r["decode_step_s"], "capacity_req_s": cap}
    return out


def arrivals(s: dict[str, Any], n: int, skewness: float, rate: float, names: list[str]) -> tuple[list, float]:
    """Poisson arrival times and adapters from the load-test generators (same seed: same stream for
    every policy). Skewness below 1/n is raised to 1/n (uniform): returns the skewness used."""
    from vlora_load.generators import WorkloadGenerator
    from vlora_load.workload import Application, Arrivals, Popularity, Workload

    eff = max(skewness, 1.0 / n)
    seed = s["seed"] * 1_000_003 + int(round(skewness * 1000)) * 10_007 + n * 101 + int(round(rate * 1000))
    wl = Workload(name="orchestrator-bench", applications=(Application("bench", "visual_retrieval"),), seed=seed,
                  duration_s=s["duration_s"], arrivals=Arrivals(mode="open", rate=rate),
                  popularity=Popularity(kind="skewness", num_adapters=n, skewness=eff), image_size=16, image_pool=1)
    return [(spec.send_at, spec.adapter) for spec in WorkloadGenerator(wl, tuple(names[:n])).schedule()], eff


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_cell(engine, s: dict[str, Any], prompt: str, schedule: list, probe: ComputeProbe) -> dict[str, Any]:
    """Open loop: add each request when its arrival time has passed (between steps, as the engine
    thread does), step while there is work, sleep until the next arrival when idle. Latency counts
    from the scheduled arrival."""
    from vlora.engine.api import GenerationRequest, SamplingParams
    from vlora.orchestrator.policies import Estimates

    orch = engine.orchestrator
    orch.estimates = Estimates(alpha=orch.cfg.ema, costs=orch.estimates.costs)  # every cell starts with no measurements
    sw = orch.switcher
    before = {"mode_s": dict(orch.mode_seconds), "switches": orch.switches, "switch_s": sw.total_switch_s if sw else 0.0,
              "swaps": engine.loras.swaps_in}
    probe.reset()
    out_tokens = s["output_tokens"]
    sampling = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    tag = f"c{time.monotonic_ns()}"
    prepared = [engine.inputs.prepare(GenerationRequest(f"{tag}-{i}", prompt, lora_name=name, sampling=sampling))
                for i, (_, name) in enumerate(schedule)]
    recs = {p.request_id: {"send": t, "finish": None, "tokens": 0, "reason": None, "error": None}
            for p, (t, _) in zip(prepared, schedule)}
    clock = time.perf_counter
    t0 = 0.0

    def on_output(o) -> None:
        if o.finished:
            r = recs[o.request_id]
            r["finish"], r["tokens"], r["reason"], r["error"] = clock() - t0, o.num_output_tokens, o.finish_reason, o.error

    steps: Counter = Counter()
    batch_total = 0
    stalled: Optional[float] = None
    cutoff = s["duration_s"] + s["drain_s"]
    censored_at = None
    i, n = 0, len(schedule)
    sync_fn(engine)()
    t0 = clock()
    while True:
        now = clock() - t0
        while i < n and schedule[i][0] <= now:
            engine.add_request(prepared[i], on_output)
            i += 1
        if engine.has_work():
            if now > cutoff:
                censored_at = now
                engine.fail_all("cancelled", "benchmark drain limit reached")
                engine.flush()  # the step overlap's last step in flight: read back, its requests already failed
                break
            last = engine.step()
            if last is None:  # nothing could run: its adapters are still being copied into slots
                stalled = now if stalled is None else stalled
                if now - stalled > STALL_S:
                    raise RuntimeError(f"the engine made no progress for {STALL_S:g} s with {len(engine.waiting)} waiting "
                                       f"and {len(engine.running)} running requests")
                time.sleep(IDLE_POLL_S)
                continue
            stalled = None
            steps[last.mode] += 1
            batch_total += len(last.request_ids)
        elif i < n:
            time.sleep(max(0.0, schedule[i][0] - now))
        else:
            break
    wall = clock() - t0

    done = [r for r in recs.values() if r["reason"] in ("length", "stop")]
    censored = [r for r in recs.values() if r["reason"] == "cancelled"]
    errors = [r for r in recs.values() if r["reason"] not in ("length", "stop", "cancelled") and r["finish"] is not None]
    lost = [r for r in recs.values() if r["finish"] is None]
    lat = [r["finish"] - r["send"] for r in done] + [r["finish"] - r["send"] for r in censored]
    lat_tokens = sum(r["tokens"] for r in done) + out_tokens * len(censored)
    # Each request's own latency per output token (a censored one: its lower bound over the full output).
    per_token = [(r["finish"] - r["send"]) / max(r["tokens"], 1) for r in done] + \
                [(r["finish"] - r["send"]) / out_tokens for r in censored]
    makespan = max((r["finish"] for r in recs.values() if r["finish"] is not None), default=wall)
    generated = sum(r["tokens"] for r in recs.values())
    mode_s = {m: orch.mode_seconds.get(m, 0.0) - before["mode_s"].get(m, 0.0) for m in set(orch.mode_seconds)}
    step_s = sum(mode_s.values())
    switches = orch.switches - before["switches"]
    switch_s = (sw.total_switch_s if sw else 0.0) - before["switch_s"]
    return {
        "requests": n, "finished": len(done), "censored": len(censored), "errors": len(errors), "lost": len(lost),
        "error_examples": [r["error"] for r in errors[:3]],
        "avg_token_latency_ms": 1e3 * sum(lat) / lat_tokens if lat_tokens else float("nan"),
        "e2e_mean_s": statistics.fmean(lat) if lat else float("nan"),
        "e2e_p50_s": percentile(lat, 0.50), "e2e_p99_s": percentile(lat, 0.99),
        "token_latency_p50_ms": 1e3 * percentile(per_token, 0.50), "token_latency_p99_ms": 1e3 * percentile(per_token, 0.99),
        "arrival_window_s": s["duration_s"],
        "throughput_req_s": len(done) / makespan if makespan > 0 else 0.0,
        "throughput_tok_s": generated / makespan if makespan > 0 else 0.0,
        "output_tokens": generated, "makespan_s": makespan, "wall_s": wall,
        "censored_at_s": censored_at, "steps": sum(steps.values()), "steps_by_mode": dict(steps),
        "mean_batch": batch_total / max(sum(steps.values()), 1),
        "mode_seconds": mode_s, "mode_share": {m: v / step_s for m, v in mode_s.items()} if step_s else {},
        "switches": switches, "switch_s": switch_s, "switch_ms_mean": 1e3 * switch_s / switches if switches else 0.0,
        "adapter_swaps": engine.loras.swaps_in - before["swaps"],
        "compute_path": probe.summary(), "lora_compute_calls": probe.calls,
        "costs": cell_costs(orch, dict(steps), mode_s, batch_total / max(sum(steps.values()), 1), switches, switch_s),
    }


def cell_costs(orch, steps: dict[str, int], mode_s: dict[str, float], mean_batch: float, switches: int,
               switch_s: float) -> dict[str, Any]:
    """What the cell measured per step and switch, beside the cost model's estimates at its mean batch (ms): what
    merging could save (unmerged - base), what mixing costs (mixture - base), and what a switch pair costs."""
    est = orch.estimates
    b = max(1, round(mean_batch))
    d = max(1, min(b, 8))
    out = {"measured_step_ms": {m: 1e3 * mode_s.get(m, 0.0) / n for m, n in steps.items() if n},
           "measured_switch_ms": 1e3 * switch_s / switches if switches else None,
           "mean_batch": mean_batch, "scale": dict(est.scale), "model": est.model.source,
           "at_mean_batch_ms": {"base": 1e3 * est.decode(b), "unmerged_1_adapter": 1e3 * est.decode(b, b, 1),
                                f"unmerged_{d}_adapters": 1e3 * est.decode(b, b, d),
                                f"mixture_{d}_adapters": 1e3 * est.decode(b, b, d, b),
                                "merge_plus_unmerge": 1e3 * (est.switch(None, "x") + est.switch("x", None))}}
    return out


def warm_policy(engine, prompt: str, names: list[str], bs: int) -> None:
    """A few requests through the policy's own paths (merge, mixture, padded einsum) before timing."""
    from vlora.orchestrator.policies import UNMERGE

    hot = [names[0]] * (bs // 2 + 2) + names[1:5]
    closed_batch(engine, prompt, hot, 3, f"warm-{engine.orchestrator.cfg.policy}")
    engine.orchestrator.enter(UNMERGE, None)


def run_grid(engine, s: dict[str, Any], prompt: str, names: list[str], load_of: dict[float, float],
             deadline: Optional[float] = None, partial: Optional[Path] = None) -> tuple[list, dict]:
    """Every cell: adapter count, then skewness, then rate, and for each of these points the policies one
    after the other on the same stream (a fresh orchestrator per cell; each policy's first cell follows one
    warm-up batch through its own paths). Returns the cells and the LoRA compute path per policy.

    No cell starts after ``deadline`` (a time.perf_counter() value), so a run on a time-limited machine
    ends with what it measured, whole points first; ``partial`` is rewritten after every cell."""
    from vlora.orchestrator.policies import UNMERGE

    cells, paths = [], {p: set() for p in s["policies"]}
    warmed: set[str] = set()
    done, t0 = 0, time.perf_counter()
    total = len(s["policies"]) * len(s["skewness"]) * len(s["adapters"]) * len(s["rates"])
    for n in s["adapters"]:
        for skew in s["skewness"]:
            for rate in s["rates"]:
                schedule, eff = arrivals(s, n, skew, rate, names)
                top = sum(1 for _, a in schedule if a == names[0]) / max(len(schedule), 1)
                for policy in s["policies"]:
                    if deadline is not None and time.perf_counter() > deadline:
                        print(f"deadline reached: {policy} n={n} skew {skew:g} rate {rate:.2f} not run", flush=True)
                        continue
                    probe = set_policy(engine, policy)
                    cfg = engine.orchestrator.cfg
                    switcher = cfg.resolved_switcher if policy != "unmerge-only" else None
                    if policy not in warmed:
                        warm_policy(engine, prompt, names, s["max_batch_size"])
                        warmed.add(policy)
                        print(f"policy {policy}: switcher {switcher}, unmerged LoRA compute {cfg.resolved_lora_compute} -> "
                              f"{probe.summary()}; theta {cfg.theta_s:g} s"
                              + (f", merge_share {cfg.merge_share:g}" if policy == "dlora" else "")
                              + (f", cost model {engine.orchestrator.costs.source}" if policy == "vlora" else ""), flush=True)
                        paths[policy].add(probe.summary())
                    ensure_resident(engine, names[:n] if n <= s["slots"] else names[:1])
                    r = run_cell(engine, s, prompt, schedule, probe)
                    engine.orchestrator.enter(UNMERGE, None)
                    paths[policy].add(r["compute_path"])
                    cells.append({"policy": policy, "skewness": skew, "effective_skewness": eff, "num_adapters": n,
                                  "rate": rate, "load": load_of.get(round(rate, 4)), "top_adapter_share": top,
                                  "switcher": switcher, "lora_compute": cfg.resolved_lora_compute, **r})
                    done += 1
                    eta = (time.perf_counter() - t0) / done * (total - done)
                    print(f"[{done}/{total}] {cell_line(cells[-1])} ({r['wall_s']:.1f} s; ETA {eta / 60:.1f} min)", flush=True)
                    if partial is not None:
                        partial.write_text(json.dumps({"partial": True, "cells": cells}, indent=1) + "\n")
    if done:
        spent = time.perf_counter() - t0
        print(f"{done} cells in {spent:.0f} s: {spent / done:.2f} s a cell on average, warm-ups included "
              f"({s['duration_s']:.2f} s of arrivals, up to {s['drain_s']:g} s of drain)", flush=True)
    compute_paths = {}
    for policy in s["policies"]:
        if policy not in warmed:
            continue
        used = sorted(paths[policy] - {"no unmerged LoRA compute"}) or ["no unmerged LoRA compute"]
        cfg = dataclasses.replace(engine.config.orchestrator, policy=policy)
        compute_paths[policy] = f"{cfg.resolved_lora_compute} -> {'; '.join(used)}"
    set_policy(engine, "unmerge-only")
    return cells, compute_paths


def cell_line(c: dict[str, Any]) -> str:
    modes = " ".join(f"{m} {100 * v:.0f}%" for m, v in sorted(c["mode_share"].items()) if v > 0.005)
    skew = f"{c['skewness']:g}" + ("" if c["effective_skewness"] == c["skewness"] else f" (uniform {c['effective_skewness']:.3f})")
    return (f"{c['policy']:12s} skew {skew} n={c['num_adapters']} rate {c['rate']:.2f}/s: {c['requests']} req, "
            f"{c['avg_token_latency_ms']:.1f} ms/tok (p99 {c.get('token_latency_p99_ms', float('nan')):.1f}), "
            f"e2e p50 {c['e2e_p50_s']:.2f} s p99 {c['e2e_p99_s']:.2f} s, "
            f"{c['throughput_req_s']:.2f} req/s {c['throughput_tok_s']:.0f} tok/s, steps {modes}, {c['switches']} switches, "
            f"{c['adapter_swaps']} swaps, {c['censored']} censored"
            + (f", {c['errors']} ERRORS {c['error_examples']}" if c["errors"] else "")
            + (f", {c['lost']} LOST" if c["lost"] else ""))


# -- results -----------------------------------------------------------------------------------

def cell_key(c: dict[str, Any]) -> tuple:
    return (c["policy"], round(c["skewness"], 4), c["num_adapters"], round(c["rate"], 4))


def merge_results(old: dict[str, Any], new: dict[str, Any], force: bool) -> dict[str, Any]:
    diff = {k: (old["settings"].get(k), new["settings"].get(k)) for k in MERGE_KEYS
            if old["settings"].get(k) != new["settings"].get(k)}
    if diff and not force:
        raise SystemExit(f"--merge-into: settings differ from the file's, cells would not be comparable: {diff} "
                         "(--force-merge to merge anyway)")
    cells = {cell_key(c): c for c in old.get("cells", [])}
    cells.update({cell_key(c): c for c in new["cells"]})
    out = dict(new)
    out["cells"] = sorted(cells.values(),
                          key=lambda c: (c["skewness"], c["num_adapters"], c["rate"], POLICIES.index(c["policy"])))
    out["switch"] = new.get("switch") or old.get("switch")
    out["calibration"] = new.get("calibration") or old.get("calibration")
    if new.get("calibration") and old.get("calibration") and new["calibration"] is not old["calibration"]:
        out["calibration"] = {**new["calibration"], "rates": {**old["calibration"].get("rates", {}),
                                                              **new["calibration"].get("rates", {})}}
    out["runs"] = old.get("runs", []) + new.get("runs", [])
    out["compute_paths"] = {**old.get("compute_paths", {}), **new.get("compute_paths", {})}
    return out


def verdicts(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per skewness: vlora's cut in average token latency against each baseline at every (adapters, rate)."""
    by = {cell_key(c): c for c in cells}
    out: dict[str, Any] = {}
    for skew in sorted({round(c["skewness"], 4) for c in cells}):
        comps, missing, hints = [], [], []
        for key, v in sorted(by.items()):
            if key[0] != "vlora" or key[1] != skew:
                continue
            for b in BASELINES:
                c = by.get((b,) + key[1:])
                if c is None:
                    missing.append(f"{b} n={key[2]} rate={key[3]:g}")
                    continue
                cut = 1.0 - v["avg_token_latency_ms"] / c["avg_token_latency_ms"]
                comps.append({"baseline": b, "num_adapters": key[2], "rate": key[3],
                              "vlora_ms": v["avg_token_latency_ms"], "baseline_ms": c["avg_token_latency_ms"],
                              "cut": cut, "meets_target": cut >= TARGET_CUT,
                              "censored": {"vlora": v["censored"], b: c["censored"]}})
                if cut < TARGET_CUT:
                    hints.append(miss_hint(v, c, b, cut))
        if not comps and not missing:
            continue
        out[f"{skew:g}"] = {"meets_target": bool(comps) and not missing and all(x["meets_target"] for x in comps),
                            "min_cut": min((x["cut"] for x in comps), default=None),
                            "min_cut_by_baseline": {b: min((x["cut"] for x in comps if x["baseline"] == b), default=None)
                                                    for b in BASELINES},
                            "missing": missing, "comparisons": comps, "why_not": hints}
    return out


def miss_hint(v: dict[str, Any], c: dict[str, Any], baseline: str, cut: float) -> str:
    """What the measured cells say about a missed target (a reading, not a proof)."""
    share = v.get("mode_share", {})
    parts = [f"n={v['num_adapters']} rate {v['rate']:.2f}/s: vlora {v['avg_token_latency_ms']:.1f} ms/tok vs "
             f"{baseline} {c['avg_token_latency_ms']:.1f} ({100 * cut:+.0f}%)"]
    unmerged = share.get("unmerge", 0.0)
    if baseline == "unmerge-only" and unmerged > 0.7:
        parts.append(f"vlora ran {100 * unmerged:.0f}% of its step time unmerged, the same ATMM path as unmerge-only "
                     f"(the cost model found no merge that repays its switches)")
    costs = v.get("costs")
    if costs:
        at = costs["at_mean_batch_ms"]
        base = at["base"]
        lora = next((x for k, x in at.items() if k.startswith("unmerged_") and not k.endswith("_1_adapter")), base)
        mix = next((x for k, x in at.items() if k.startswith("mixture_")), base)
        pair = at["merge_plus_unmerge"]
        saving = lora - base
        parts.append(f"costs at batch {costs['mean_batch']:.1f}: base {base:.2f} ms, unmerged {lora:.2f} (merging saves at "
                     f"most {saving:.2f} ms a step, {100 * saving / max(lora, 1e-9):.0f}%), mixture {mix:.2f}, a merge + "
                     f"unmerge {pair:.2f} ms (repaid after {pair / max(saving, 1e-9):.1f} fully merged steps)"
                     + "; measured steps " + ", ".join(f"{m} {x:.2f}" for m, x in costs["measured_step_ms"].items()) + " ms")
    if v["switches"] and v["switch_s"] > 0.05 * max(sum(v.get("mode_seconds", {}).values()), 1e-9):
        parts.append(f"vlora spent {v['switch_s']:.2f} s in {v['switches']} switches")
    if share.get("mixture", 0.0) > 0.2:
        parts.append(f"mixture (deLoRA) took {100 * share['mixture']:.0f}% of vlora's step time")
    if v["censored"]:
        parts.append(f"vlora left {v['censored']} requests unfinished at the drain limit (overloaded)")
    if c["censored"]:
        parts.append(f"{baseline}'s latency is a lower bound ({c['censored']} censored)")
    if v["adapter_swaps"] > v["requests"] // 4:
        parts.append(f"{v['adapter_swaps']} adapter swaps into device slots for {v['requests']} requests "
                     f"({baseline}: {c['adapter_swaps']})")
    return "; ".join(parts)


def fmt_cut(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}%"


def print_report(result: dict[str, Any]) -> None:
    cells = result["cells"]
    sw = result.get("switch")
    if sw:
        print(f"\nmode switch, {sw['layers']} layers x {'/'.join(sw['modules'])}, rank {sw['rank']} (median of {sw['repeats']}):")
        for k in ("merge", "swap", "unmerge"):
            print(f"  {k:8s} swift {sw['swift'][k]['median_ms']:8.2f} ms   per-layer addmm {sw['per-layer'][k]['median_ms']:8.2f} ms"
                  f"   ({sw['speedup'][k]:.2f}x)")
    cm = result.get("cost_model")
    if cm:
        print(f"\ncost model ({cm['source']}): decode base " + "/".join(f"{x:.2f}" for x in cm["base_ms"])
              + " ms, unmerged (one adapter per row) " + "/".join(f"{x:.2f}" for x in cm["unmerged_ms"])
              + " ms, one adapter for all rows " + "/".join(f"{x:.2f}" for x in cm["unmerged_1_adapter_ms"])
              + f" ms at batch {'/'.join(map(str, cm['batch']))}; deLoRA branch +{cm['mixture_extra_ms_at_max_batch']:.2f} ms; "
              + "switch " + ", ".join(f"{k} {v:.2f} ms" for k, v in cm["switch_ms"].items()))
    policies = [p for p in POLICIES if any(c["policy"] == p for c in cells)]
    by = {cell_key(c): c for c in cells}
    points = sorted({k[1:] for k in by})
    print("\naverage token latency, ms/token (throughput tok/s) [censored]; req: requests per cell (arrival window s):")
    print(f"{'skew':>5} {'n':>4} {'rate':>7} {'req':>9} " + " ".join(f"{p:>22}" for p in policies))
    for key in points:
        row = []
        for p in policies:
            c = by.get((p,) + key)
            if c is None:
                row.append("-")
                continue
            censored = f"[{c['censored']}]" if c["censored"] else "   "
            row.append(f"{c['avg_token_latency_ms']:9.1f} ({c['throughput_tok_s']:6.0f}){censored}")
        print(f"{key[0]:5g} {key[1]:4d} {key[2]:7.2f} {point_requests(by, key, policies):>9} " + " ".join(f"{x:>22}" for x in row))
    print("\np99 token latency (each request's latency / its output tokens), ms/token; end-to-end p99, s:")
    for key in points:
        row = [f"{by[(p,) + key].get('token_latency_p99_ms', float('nan')):9.1f} ({by[(p,) + key]['e2e_p99_s']:5.2f} s)"
               if (p,) + key in by else "-" for p in policies]
        print(f"{key[0]:5g} {key[1]:4d} {key[2]:7.2f} {'':>9} " + " ".join(f"{x:>22}" for x in row))
    print(f"\ntarget: vlora's average token latency >= {100 * TARGET_CUT:.0f}% below every baseline at every skewness")
    for skew, v in result["verdicts"].items():
        mins = ", ".join(f"{b} {fmt_cut(x)}" for b, x in v["min_cut_by_baseline"].items())
        state = "MET" if v["meets_target"] else "NOT MET"
        print(f"  skewness {skew}: {state}; smallest cut vs {mins}" + (f"; missing {v['missing']}" if v["missing"] else ""))
        for h in v["why_not"]:
            print(f"      {h}")


def point_requests(by: dict, key: tuple, policies: list[str], window: bool = True) -> str:
    """Requests of a (skewness, adapters, rate) point (every policy gets the same stream) and its arrival window."""
    c = next((by[(p,) + key] for p in policies if (p,) + key in by), None)
    if c is None:
        return "-"
    seconds = c.get("arrival_window_s") if window else None
    return f"{c['requests']}" + (f" ({seconds:.3g})" if seconds else "")


def markdown_section(result: dict[str, Any]) -> str:
    """The run as a RESULTS.md section: settings, one table row per (skewness, adapters, rate) with each policy's
    average token latency (p99 of the requests' own) and vlora's cut against each baseline, the costs, the verdicts."""
    cells, st = result["cells"], result["settings"]
    by = {cell_key(c): c for c in cells}
    policies = [p for p in POLICIES if any(c["policy"] == p for c in cells)]
    verdicts_ = result.get("verdicts") or verdicts(cells)
    met = bool(verdicts_) and all(v["meets_target"] for v in verdicts_.values())
    runs = result.get("runs", [])
    cal = result.get("calibration") or {}
    unm = cal.get("unmerged", {})
    rates = sorted({round(c["rate"], 3) for c in cells})
    reqs = [c["requests"] for c in cells]
    commits = ", ".join(sorted({str(r.get("commit")) for r in runs})) or str(result.get("commit"))
    walls = ", ".join("%.0f s" % r.get("wall_s", 0.0) for r in runs)
    lines = [f"## Orchestrator policies on {result['device']} (issue 21): target {'met' if met else 'NOT met'}", ""]
    lines.append(
        f"`python -m benchmarks.orchestrator` ({len(runs)} run(s), commit {commits}, {walls} wall): "
        f"{Path(st['model']).name}, {st['dtype']}, rank-{st['rank']} "
        f"adapters on {'/'.join(st['target_modules'])} ({st['distinct_weights']} weight sets), MaxBS {st['max_batch_size']}, "
        f"{st['slots']} slots, {st.get('prompt_tokens_actual', st['prompt_tokens'])}-token prompts and {st['output_tokens']} output "
        f"tokens, open-loop Poisson at {', '.join(f'{r:g}' for r in rates)} req/s"
        + (f" (the measured unmerged capacity x load: batch {cal.get('batch')} decode step {unm.get('decode_step_ms', 0):.1f} ms "
           f"unmerged, {cal.get('base', {}).get('decode_step_ms', 0):.1f} ms base)" if unm else "")
        + f"; {st['duration_s']:.3g} s of arrivals per cell ({min(reqs)}-{max(reqs)} requests), up to {st['drain_s']:g} s of drain "
        "(requests unfinished then are censored: their latency is a lower bound).")
    lines += ["", "Average token latency, ms/token (p99 of each request's latency per token) [censored requests]; "
              "cut: vlora's average below the baseline's (target >= 20%):", "",
              "| skewness | adapters | requests | " + " | ".join(policies) + " | cut vs " + " / ".join(b for b in BASELINES if b in policies) + " |",
              "| --- | --- | --- | " + " | ".join("---" for _ in policies) + " | --- |"]
    for key in sorted({k[1:] for k in by}):
        row = []
        for p in policies:
            c = by.get((p,) + key)
            row.append("-" if c is None else f"{c['avg_token_latency_ms']:.1f} ({c.get('token_latency_p99_ms', float('nan')):.1f})"
                       + (f" [{c['censored']}]" if c["censored"] else ""))
        v = by.get(("vlora",) + key)
        cuts = []
        for b in BASELINES:
            if b not in policies:
                continue
            c = by.get((b,) + key)
            cuts.append("-" if v is None or c is None else fmt_cut(1.0 - v["avg_token_latency_ms"] / c["avg_token_latency_ms"]))
        rate = f" @ {key[2]:g}/s" if len(rates) > 1 else ""
        lines.append(f"| {key[0]:g} | {key[1]}{rate} | {point_requests(by, key, policies, window=False)} | " + " | ".join(row)
                     + " | " + " / ".join(cuts) + " |")
    cm = result.get("cost_model")
    if cm:
        lines += ["", f"Cost model ({cm['source']}): decode base " + "/".join(f"{x:.2f}" for x in cm["base_ms"])
                  + " ms, unmerged (one adapter per row) " + "/".join(f"{x:.2f}" for x in cm["unmerged_ms"])
                  + f" ms at batch {'/'.join(map(str, cm['batch']))}; deLoRA branch +{cm['mixture_extra_ms_at_max_batch']:.2f} ms; "
                  + "switch " + ", ".join(f"{k} {v:.2f} ms" for k, v in cm["switch_ms"].items()) + "."]
    sw = result.get("switch")
    if sw:
        lines += ["", "Mode switch (median): " + ", ".join(
            f"{k} swift {sw['swift'][k]['median_ms']:.2f} ms vs per-layer addmm {sw['per-layer'][k]['median_ms']:.2f} ms"
            for k in ("merge", "swap", "unmerge")) + "."]
    lines += ["", "Verdicts:"]
    for skew, v in verdicts_.items():
        mins = ", ".join(f"{b} {fmt_cut(x)}" for b, x in v["min_cut_by_baseline"].items() if b in policies)
        lines.append(f"- skewness {skew}: {'met' if v['meets_target'] else 'NOT met'}; smallest cut vs {mins}"
                     + (f"; missing {', '.join(v['missing'])}" if v["missing"] else ""))
        lines += [f"  - {h}" for h in v["why_not"]]
    return "\n".join(lines) + "\n"


def summary_line(result: dict[str, Any]) -> str:
    st = result["settings"]
    counts = ",".join(str(n) for n in sorted({c["num_adapters"] for c in result["cells"]}))
    parts = [f"{Path(st['model']).name}, rank {st['rank']}, {st['prompt_tokens']}+{st['output_tokens']} tok, "
             f"MaxBS {st['max_batch_size']}, {st['slots']} slots, n={counts}"]
    by = {cell_key(c): c for c in result["cells"]}
    for skew, v in result["verdicts"].items():
        vl = [c["avg_token_latency_ms"] for k, c in by.items() if k[0] == "vlora" and f"{k[1]:g}" == skew]
        best = " / ".join(f"{b} {fmt_cut(x)}" for b, x in v["min_cut_by_baseline"].items() if x is not None)
        parts.append(f"s{skew}: vlora {min(vl):.1f}-{max(vl):.1f} ms/tok, worst cut vs {best} "
                     f"({'target met' if v['meets_target'] else 'target missed'})")
    sw = result.get("switch")
    if sw:
        parts.append(f"switch swift {sw['swift']['merge']['median_ms']:.2f} ms merge / {sw['swift']['swap']['median_ms']:.2f} swap vs "
                     f"per-layer addmm {sw['per-layer']['merge']['median_ms']:.2f} / {sw['per-layer']['swap']['median_ms']:.2f}")
    cm = result.get("cost_model")
    if cm:
        parts.append(f"cost model ({cm['source']}) at batch {cm['batch'][-1]}: base {cm['base_ms'][-1]:.2f} ms, unmerged "
                     f"{cm['unmerged_ms'][-1]:.2f}, switch merge {cm['switch_ms']['merge']:.2f} / swap {cm['switch_ms']['swap']:.2f}")
    paths = result.get("compute_paths", {})
    if paths:
        parts.append("unmerged compute: " + ", ".join(f"{p} {v}" for p, v in paths.items()))
    return "; ".join(parts)


def finish(result: dict[str, Any], args: argparse.Namespace, device: str) -> None:
    result["verdicts"] = verdicts(result["cells"])
    print_report(result)
    markdown = markdown_section(result)
    if getattr(args, "report", None):
        print("\n-- RESULTS.md section --\n" + markdown)
    if getattr(args, "markdown", None):
        Path(args.markdown).write_text(markdown)
        print(f"wrote {args.markdown}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if not args.no_record:
        record_result("orchestrator", device, result, summary_line(result))


# -- main --------------------------------------------------------------------------------------

def estimate(s: dict[str, Any], n_rates: int, model_exists: bool) -> tuple[float, float, int]:
    """(expected, worst-case) seconds and the number of cells. On an H100 at 7B width (2026-11-25): ~37 s to
    write the random model (none when its folder exists), ~30 s to load it, capture its graphs and measure the
    cost model, a few seconds for the switch times and the calibration, one warm-up per policy; a cell is its
    arrivals, a drain of up to ``drain_s`` and ``CELL_OVERHEAD_S``."""
    cells = len(s["policies"]) * len(s["skewness"]) * len(s["adapters"]) * n_rates
    kind = "gpu" if s["device"].startswith("cuda") else "cpu"
    setup = (30.0 + (0.0 if model_exists else 40.0)) if kind == "gpu" else 5.0
    setup += (0.0 if s["rates"] else (5.0 if kind == "gpu" else 2.0)) + len(s["policies"]) * POLICY_WARMUP_S[kind]
    per_cell = s["duration_s"] + CELL_OVERHEAD_S[kind]
    return setup + cells * (per_cell + 0.4 * s["drain_s"]), setup + cells * (per_cell + s["drain_s"]), cells


def fit_to_budget(s: dict[str, Any], budget_s: float, elapsed_s: float, n_cells: int) -> dict[str, Any]:
    """The arrival window every cell gets so that ``n_cells`` cells, each at its worst (window + the whole drain +
    the per-cell overhead), and one warm-up per policy fit in what is left of ``budget_s``: the longest up to
    ``duration_s``, at least ``min_duration_s`` (then the deadline may leave the last cells out). Also the latest
    moment (seconds from the start) a cell may start and still end inside the budget."""
    kind = "gpu" if s["device"].startswith("cuda") else "cpu"
    left = budget_s - elapsed_s - len(s["policies"]) * POLICY_WARMUP_S[kind]
    fit = left / max(n_cells, 1) - s["drain_s"] - CELL_OVERHEAD_S[kind]
    window = math.floor(min(s["duration_s"], max(s["min_duration_s"], fit)) * 1000.0) / 1000.0  # whole ms, rounded down
    worst_cell = window + s["drain_s"] + CELL_OVERHEAD_S[kind]
    return {"budget_s": budget_s, "setup_s": round(elapsed_s, 1), "cells": n_cells, "window_s": window,
            "fits": fit >= s["min_duration_s"], "worst_cell_s": round(worst_cell, 3),
            "last_start_s": round(budget_s - worst_cell, 1), "cell_overhead_s": CELL_OVERHEAD_S[kind],
            "policy_warmup_s": POLICY_WARMUP_S[kind]}


def main(argv: Optional[list[str]] = None) -> int:
    t_start = time.perf_counter()  # --budget-s and --deadline-s count from here
    args = parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        finish(result, argparse.Namespace(json_out=None, no_record=args.no_record, report=args.report,
                                          markdown=args.markdown), result["device"])
        return 0

    import torch

    s = resolve_settings(args)
    if s["device"] == "cpu":
        torch.set_num_threads(args.cpu_threads)
    old = json.loads(Path(args.merge_into).read_text()) if args.merge_into else None
    rates_given = s["rates"]
    if rates_given is None and old and old.get("calibration", {}).get("rates"):
        known = old["calibration"]["rates"]
        if all(f"{x:g}" in known for x in s["loads"]):
            s["rates"] = [known[f"{x:g}"] for x in s["loads"]]
            print(f"reusing the calibrated rates of {args.merge_into}: " +
                  ", ".join(f"load {x:g} = {r:.3f} req/s" for x, r in zip(s["loads"], s["rates"])), flush=True)
    work = Path(args.work)
    preset_dir = work / ("model-" + Path(s["preset"]).stem) if s["preset"] else None
    exists = bool(s["model_dir"]) or preset_dir is None or (preset_dir / "config.json").is_file()
    n_rates = len(s["rates"]) if s["rates"] else len(s["loads"])
    lo, hi, n_cells = estimate(s, n_rates, exists)
    rates = f"rates {s['rates']} req/s" if s["rates"] else f"load {s['loads']} x measured unmerged capacity"
    print(f"orchestrator benchmark on {s['device']} ({s['dtype']}): policies {s['policies']}, skewness {s['skewness']}, "
          f"adapters {s['adapters']}, {rates}", flush=True)
    print(f"  {n_cells} cells of {s['duration_s']:g} s arrivals + up to {s['drain_s']:g} s drain; prompt {s['prompt_tokens']} tokens, "
          f"{s['output_tokens']} output tokens, rank {s['rank']} on {'/'.join(s['target_modules'])}, MaxBS {s['max_batch_size']}, "
          f"{s['slots']} adapter slots", flush=True)
    if args.budget_s:
        print(f"  within a budget of {args.budget_s:g} s: the cells' arrival window (at most {s['duration_s']:g} s, at least "
              f"{s['min_duration_s']:g} s) is set once the set-up is done", flush=True)
    else:
        print(f"  estimated time: {lo / 60:.1f} min (up to {hi / 60:.1f} min if every cell hits the drain limit)", flush=True)

    from vlora.atmm.dispatch import default_kernels

    kernels = default_kernels()
    ext_state = "available" if kernels.available else f"not available ({kernels.unavailable_reason})"
    print(f"ATMM CUDA extension: {ext_state}", flush=True)
    if args.require_atmm_ext and not (kernels.available and s["device"].startswith("cuda")):
        raise SystemExit("--require-atmm-ext: vlora_atmm_ext cannot serve here; build it (make atmm-ext, or put a prebuilt "
                         "vlora_atmm_ext*.so on PYTHONPATH) or drop the flag")

    model_dir, t_model = model_folder(s, work)
    t0 = time.perf_counter()
    engine = build(s, model_dir, work)
    t_build = time.perf_counter() - t0
    costs = engine.orchestrator.costs
    print(f"cost model {costs.describe()}", flush=True)
    t0 = time.perf_counter()
    names = register_adapters(engine, max(s["adapters"]), s["distinct_weights"], s["rank"], s["seed"])
    t_adapters = time.perf_counter() - t0
    prompt, p_len = prompt_text(engine, s["prompt_tokens"])
    mem = ""
    if s["device"].startswith("cuda"):
        free, total = torch.cuda.mem_get_info(engine.runner.device)
        mem = f"; device memory {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use"
    graphs = engine.model_info.get("cuda_graphs") or {}
    load_parts = f": CUDA graphs {graphs['capture_s']:.0f} s" if graphs.get("capture_s") is not None else ""
    print(f"model {model_dir} ready (write {t_model:.0f} s, load {t_build:.0f} s{load_parts}); {len(names)} adapters registered over "
          f"{min(s['distinct_weights'], len(names))} distinct weight sets in {t_adapters:.1f} s, "
          + ("held in pinned host memory in the slots' dtype" if s["device"].startswith("cuda") else "float32 on the host")
          + f" (the values do not matter for speed; slots, swaps and merges do); prompt {p_len} tokens{mem}", flush=True)
    s["prompt_tokens_actual"] = p_len

    sw = switch_times(engine, names, args.switch_repeats)
    print("mode switch (median ms): " + ", ".join(f"{k} swift {sw['swift'][k]['median_ms']:.2f} vs per-layer "
                                                  f"{sw['per-layer'][k]['median_ms']:.2f}" for k in ("merge", "swap", "unmerge")),
          flush=True)

    calibration = None
    if s["rates"] is None:
        t0 = time.perf_counter()
        calibration = calibrate(engine, s, prompt, names)
        calibration["seconds"] = round(time.perf_counter() - t0, 2)
        cap = calibration["unmerged"]["capacity_req_s"]
        s["rates"] = [x * cap for x in s["loads"]]
        calibration["rates"] = {f"{x:g}": r for x, r in zip(s["loads"], s["rates"])}
        print(f"calibration at batch {calibration['batch']}: base decode step {calibration['base']['decode_step_ms']:.1f} ms, "
              f"unmerged ({calibration['distinct_adapters']} distinct adapters) {calibration['unmerged']['decode_step_ms']:.1f} ms; "
              f"unmerged capacity {cap:.2f} req/s (base {calibration['base']['capacity_req_s']:.2f}) -> rates "
              + ", ".join(f"{r:.2f}" for r in s["rates"]), flush=True)
    elif old and old.get("calibration") and not rates_given:
        calibration = old["calibration"]
    load_of = {}
    if calibration and not rates_given:
        load_of = {round(r, 4): float(x) for x, r in calibration["rates"].items()}

    t_setup = time.perf_counter() - t_start
    deadline = t_start + args.deadline_s if args.deadline_s else None
    budget = None
    if args.budget_s:
        n_cells = len(s["policies"]) * len(s["skewness"]) * len(s["adapters"]) * len(s["rates"])
        budget = fit_to_budget(s, args.budget_s, time.perf_counter() - t_start, n_cells)
        s["duration_s"] = budget["window_s"]
        last = t_start + budget["last_start_s"]
        deadline = min(deadline, last) if deadline is not None else last
        print(f"budget {args.budget_s:g} s, {budget['setup_s']:.0f} s used by the set-up: {n_cells} cells of {s['duration_s']:.2f} s "
              f"arrivals (~{min(s['rates']) * s['duration_s']:.0f}-{max(s['rates']) * s['duration_s']:.0f} requests each) + up to "
              f"{s['drain_s']:g} s drain" + ("" if budget["fits"] else
                                          f"; at the {s['min_duration_s']:g} s minimum NOT all cells fit: none starts after "
                                          f"{budget['last_start_s']:.0f} s"), flush=True)
    partial = Path(args.json_out + ".partial") if args.json_out else None
    cells, compute_paths = run_grid(engine, s, prompt, names, load_of, deadline, partial)

    dev = device_name() if s["device"].startswith("cuda") else "cpu"
    settings = {"model": str(model_dir if s["model_dir"] or not s["preset"] else s["preset"]), "dtype": s["dtype"],
                **{k: s[k] for k in ("rank", "prompt_tokens", "prompt_tokens_actual", "output_tokens", "max_batch_size", "slots",
                                     "duration_s", "drain_s", "distinct_weights", "target_modules", "seed")},
                "theta_s": engine.config.orchestrator.theta_s, "merge_share": engine.config.orchestrator.merge_share,
                "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens, "kv_blocks": kv_blocks(s),
                "budget": budget}
    result = {
        "benchmark": "orchestrator", "device": dev, "commit": git_commit(), "torch": torch.__version__,
        "atmm_extension": ext_state, "settings": settings, "calibration": calibration, "switch": sw,
        "compute_paths": compute_paths, "cells": cells, "cost_model": {**costs.summary(), "full": costs.to_dict()},
        "runs": [{"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit(), "policies": s["policies"],
                  "skewness": s["skewness"], "adapters": s["adapters"], "rates": s["rates"],
                  "wall_s": time.perf_counter() - t_start, "setup_s": round(t_setup, 1),
                  "duration_s": s["duration_s"], "cost_model": costs.summary()}],
        "notes": ["avg_token_latency_ms = sum of end-to-end latencies / total output tokens (V-LoRA's definition); "
                  "latency counts from the scheduled arrival",
                  "censored requests (unfinished at the drain limit) count (cutoff - arrival) with the full output length: "
                  "a lower bound on their latency",
                  "adapters share a few random weight sets (in pinned host memory in the slots' dtype on CUDA: a swap "
                  "is one host-to-device copy); each name still has its own slot, swaps and merges",
                  "skewness below 1/num_adapters runs uniform (effective_skewness)"],
    }
    if old:
        result = merge_results(old, result, args.force_merge)
    finish(result, args, dev)
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
