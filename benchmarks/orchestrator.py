"""The orchestrator benchmark (issues 4 and 21): scheduling policies under an open-loop Poisson stream, and the
mode-switch time of the swift switcher against per-layer ``addmm``.

For each policy (``vlora``: the V-LoRA paper's Algorithm 1 with the cost model measured at load; the baselines
``merge-only``, ``unmerge-only`` and ``dlora``), skewness (share of requests for the most popular adapter), number of
adapters and rate, one *cell* drives the real engine in this process (``LLMEngine.step`` on this thread, real wall
clock) with text-only requests arriving open-loop for ``--duration`` seconds, then drains. It reports the average
token latency (sum of end-to-end latencies / output tokens, V-LoRA's definition), throughput, end-to-end p50/p99,
step time per mode, mode switches, adapter swaps, which LoRA compute path ran, and the cost model's estimates at the
cell's mean batch beside what the cell measured, so that a missed target can be read off the costs. Every policy
sees the same arrivals (the load harness's generator, same seed). Adapters: rank ``--rank`` over q/k/v/o of every
layer, registered in memory over ``--distinct-weights`` random weight sets, each name its own slot, swaps and merges.

Rate: ``--rate`` req/s, or ``--load`` x the unmerged capacity measured at start-up (MaxBS requests with MaxBS
distinct adapters: MaxBS / (prefill + (output tokens - 1) x decode step)). Requests still running ``--drain`` s after
the last arrival are cancelled and *censored*: their latency counts as (cutoff - arrival) with the full output, a
lower bound. ``--budget-s`` fits the run into a wall-clock budget: once the set-up is done every cell gets the same
arrival window, the longest (up to ``--duration``, at least ``--min-duration``) with which all cells fit at their
worst; no cell starts that could not end in time. Cells run adapter count by skewness by rate, the policies one
after the other on the same stream, so that a cut-short run still holds whole comparisons:

    python -m benchmarks.orchestrator --device cuda --require-atmm-ext --budget-s 400 --json-out $OUT/orchestrator.json --no-record
    python -m benchmarks.orchestrator --report path/to/orchestrator.json   # here: tables, verdicts, RESULTS.md line
    python -m benchmarks.orchestrator --device cpu --quick --no-record     # CPU smoke run (tiny model)

``--report`` (``benchmarks/orchestrator_report.py``) prints the tables, vlora's cut against each baseline, for every
missed comparison the measured costs beside the cost model's, and the run as a RESULTS.md section. ``--merge-into FILE`` adds a run's cells to FILE's
(same settings) and reuses its calibrated rates. ``--require-atmm-ext`` stops unless the ATMM extension serves (a
built ``vlora_atmm_ext*.so`` on PYTHONPATH, see ``benchmarks/run_device.sh``). Writes ``--json-out`` if given and,
unless ``--no-record``, ``benchmarks/results/orchestrator-<device>.json`` and a line in ``benchmarks/RESULTS.md``.
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

from benchmarks.common import (ComputeProbe, device_name, ensure_resident, git_commit, model_folder, numbers, register_adapters,
                               set_policy, sync_fn)
from benchmarks.orchestrator_report import POLICIES, finish, merge_results

CALIBRATION_TOKENS = 8  # output tokens of the calibration batches (prefill, then 7 decode steps)
STALL_S = 60.0  # no step could run for this long: something is wrong, stop with an error
IDLE_POLL_S = 0.0005  # sleep between steps that could not run (an adapter copy in flight)
PROMPT_WORDS = "describe the picture in detail and list every object you can see in it".split()

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
    p.add_argument("--preset", help=f"model preset YAML (random weights); GPU default {GPU_DEFAULTS['preset']}, CPU: the tiny model")
    p.add_argument("--model", help="an existing model folder (overrides --preset)")
    p.add_argument("--work", default="/tmp/vlora-bench", help="where the random model folder is written")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--skewness", default="0.1,0.3,0.6,0.9", help="share of requests for the most popular adapter")
    p.add_argument("--adapters", help="numbers of adapters (GPU default 8,64,512)")
    p.add_argument("--rate", help="request rates in req/s (comma list); default: --load x measured capacity")
    p.add_argument("--load", default="1.0", help="rates as fractions of the measured unmerged capacity")
    p.add_argument("--duration", type=float, help="seconds of arrivals per cell (GPU default 6; with --budget-s the most)")
    p.add_argument("--min-duration", type=float, help="with --budget-s: a cell's shortest arrival window (GPU 2.5 s, CPU 0.5)")
    p.add_argument("--budget-s", type=float, help="fit the whole run into this many seconds from its start (see above)")
    p.add_argument("--drain", type=float, help="seconds after the last arrival before the rest is cancelled (censored)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length (GPU default 256)")
    p.add_argument("--output-tokens", type=int, help="output tokens per request, EOS ignored (GPU default 32)")
    p.add_argument("--rank", type=int, help="LoRA rank (GPU default 64)")
    p.add_argument("--max-batch-size", type=int, help="MaxBS (GPU default 32)")
    p.add_argument("--slots", type=int, help="lora.max_gpu_adapters (GPU default 64; the ATMM extension takes <= 256)")
    p.add_argument("--distinct-weights", type=int, help="distinct random weight sets shared by the adapter names")
    p.add_argument("--theta", type=float, help="orchestrator.theta_s (default: the engine's)")
    p.add_argument("--cost-model", default="auto", help="orchestrator.cost_model: auto (cached per GPU under "
                   "--work/cost-model, else measured; measured on a CPU), measure, default, or a JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--switch-repeats", type=int, default=7, help="switches of each kind timed per switcher")
    p.add_argument("--quick", action="store_true", help="a small grid: skewness 0.1,0.9, fewest and most adapters, short cells")
    p.add_argument("--merge-into", metavar="FILE", help="add this run's cells to FILE's (and reuse its calibrated rates)")
    p.add_argument("--force-merge", action="store_true", help="merge even if FILE's settings differ")
    p.add_argument("--json-out", metavar="FILE", help="write the (merged) result here")
    p.add_argument("--no-record", action="store_true", help="do not write results/ or RESULTS.md")
    p.add_argument("--report", metavar="FILE", help="no run: print FILE's tables, verdicts and RESULTS.md section; record them")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads on a CPU run (default 1: the tiny model gains "
                   "nothing from more, and a busy machine stalls multi-threaded steps)")
    p.add_argument("--require-atmm-ext", action="store_true", help="fail at once unless vlora_atmm_ext serves the unmerged path")
    return p.parse_args(argv)


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
        **{k: getattr(args, k) or base[k] for k in ("rank", "prompt_tokens", "output_tokens", "max_batch_size", "slots",
                                                     "distinct_weights")},
        "duration_s": args.duration if args.duration is not None else base["duration"],
        "drain_s": args.drain if args.drain is not None else base["drain"],
        "min_duration_s": args.min_duration,
        "policies": numbers(args.policies, str),
        "skewness": numbers(QUICK["skewness"] if args.quick and args.skewness == "0.1,0.3,0.6,0.9" else args.skewness),
        "adapters": numbers(args.adapters or base["adapters"], int),
        "rates": numbers(args.rate) if args.rate else None,
        "loads": numbers(args.load),
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

    sync = sync_fn(engine.runner.device)
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
    sync_fn(engine.runner.device)()
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
    t_start = time.perf_counter()  # --budget-s counts from here
    args = parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        finish(result, argparse.Namespace(json_out=None, no_record=args.no_record, report=args.report), result["device"])
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

    t0 = time.perf_counter()
    model_dir = Path(s["model_dir"]) if s["model_dir"] else model_folder(s["preset"] or "tiny-llava", work, s["device"].startswith("cuda"),
                                                                        prefix="model-")
    t_model = 0.0 if s["model_dir"] else time.perf_counter() - t0
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
    deadline = budget = None
    if args.budget_s:
        n_cells = len(s["policies"]) * len(s["skewness"]) * len(s["adapters"]) * len(s["rates"])
        budget = fit_to_budget(s, args.budget_s, time.perf_counter() - t_start, n_cells)
        s["duration_s"] = budget["window_s"]
        deadline = t_start + budget["last_start_s"]
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
