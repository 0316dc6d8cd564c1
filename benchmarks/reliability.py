"""Reliability on one server (issue 26): a soak at a fraction of the measured capacity, then an overload at
twice the load harness's measured capacity, against the same `vlora serve` (the real tritonserver).

    # GPU, one device call (benchmarks/device_reliability.sh): LLaVA-1.5-7B width, random weights
    python -m benchmarks.reliability --preset configs/models/llava-1.5-7b.yaml --device cuda --soak-minutes 4 \\
        --overload-s 60 --budget-s 400 --out $OUT/reliability
    # CPU smoke run (the tiny model and its demo adapters)
    python -m benchmarks.reliability --device cpu --soak-minutes 0.3 --capacity-s 6 --overload-s 8 --no-record

1. The model: a preset's random weights (written once under ``--work``), else the tiny model. For a preset, the
   soak's adapters at its dimensions (``soak.write_soak_adapters``: the demo adapters, the cycled one included,
   and the demo task heads with random weights); the tiny model serves its own demo adapters.
2. One `vlora serve` on loopback with an admin token and the engine's queue bounded (``--max-queue-size``, which
   sets ``scheduler.max_waiting``; Triton queues nothing for the model): past it, a request is refused at once,
   explicitly ("server overloaded").
3. Soak (``benchmarks/soak.py``: text, images, HTTP and gRPC streams, task heads, disconnects, adapter unload and
   load, bad requests): one request of each kind, the mix's capacity in closed loop (``--probe-concurrency``
   clients for ``--probe-s``), then the open-loop mix at ``--load`` x that for ``--soak-minutes``, shortened to
   what ``--budget-s`` leaves once the overload's share is set aside (the minutes run are in the result). Passes
   with 0 unexpected and 0 lost, the server drained and healthy after. Writes ``soak-<device>.json``.
4. Overload through the load harness (``vlora_load``: locust, the transports and the accounting of
   ``vlora loadtest`` and ``benchmarks/load_sweep.py``) with the workload ``--workload``: its capacity in closed
   loop (``--closed-users`` for ``--capacity-s``, requests answered per second after the first third), then the
   open loop at ``--overload-factor`` x that for ``--overload-s``. Checks: every request answered in full or
   rejected explicitly, some rejected, none timed out, none failed otherwise, none lost (each scheduled request
   has a record), and the server drains and answers a normal request after it. Writes ``overload-<device>.json``.

Both JSON files go to ``--out`` and, unless ``--no-record``, to benchmarks/results/ with a line each in
benchmarks/RESULTS.md. The harness's raw files (requests.csv, the server timeline, locust's CSVs) stay under
``--out``/harness. Exit code 0 when both phases pass, 1 when one fails, 2 when the server did not start.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks import soak
from benchmarks.common import RESULTS, device_name, git_commit, record_result

from vlora_load.server import health_check, log_offset, served_adapters, server_error_lines, start_server, target_of


# Seconds the overload phase takes beyond its capacity and overload windows (two locust starts, the requests
# in flight finishing, waiting for an idle server between them), and the soak phase beyond its minutes (the
# warm-up requests, the drain, the checks after it): what --budget-s sets aside.
OVERLOAD_EXTRA_S = 45.0
SOAK_EXTRA_S = 25.0
MIN_SOAK_MINUTES = 0.25
CPU_SERVE_ARGS = ("--max-batch-size 8", "--set scheduler.max_waiting=4")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", help="model preset YAML (random weights at that size, written once under --work); "
                                     "default: the tiny model")
    ap.add_argument("--model", help="an existing model folder instead of --preset")
    ap.add_argument("--adapters", help="adapter root to serve (default: for --preset/--model the soak's adapters written "
                                       "under --work; for the tiny model its demo adapters)")
    ap.add_argument("--device", default="auto", help="device of the server: auto, cpu, cuda")
    ap.add_argument("--work", default="/tmp/vlora-reliability", help="model, adapters and the server's workspace")
    ap.add_argument("--out", help=f"where the JSON files and the harness's raw files go (default {RESULTS})")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG", help="more `vlora serve` arguments")
    ap.add_argument("--max-queue-size", type=int, help="the engine's queue (scheduler.max_waiting): past it requests are "
                                                        "refused (GPU default 32, CPU 8)")
    ap.add_argument("--budget-s", type=float, help="the whole run in this many seconds from its start: the soak is "
                                                   "shortened to fit (never below 0.25 min)")
    sk = ap.add_argument_group("soak")
    sk.add_argument("--soak-minutes", type=float, default=4.0, help="minutes of soak traffic (at most, with --budget-s)")
    sk.add_argument("--load", type=float, default=0.8, help="soak rate as a fraction of the mix's measured capacity")
    sk.add_argument("--probe-s", type=float, default=15.0, help="seconds of the closed-loop capacity probe of the mix")
    sk.add_argument("--probe-concurrency", type=int, help="clients of that probe (default: MaxBS)")
    sk.add_argument("--workers", type=int, default=64, help="client threads of the open-loop soak")
    sk.add_argument("--request-timeout", type=float, default=90.0, help="seconds before a soak request counts as lost")
    over = ap.add_argument_group("overload (load harness)")
    over.add_argument("--workload", default="mixed", help="harness workload (configs/workloads) for the overload")
    over.add_argument("--length-scale", type=float, help="scale its prompt and answer lengths (GPU default 0.25, CPU 0.05)")
    over.add_argument("--image-size", type=int, help="its image side in pixels (GPU default 336, CPU 64)")
    over.add_argument("--frames-per-chunk", type=int, help="its video frames per request (GPU default 6: 6 x 576 image "
                                                           "tokens fit LLaVA-1.5's 4,096; CPU default 3)")
    over.add_argument("--closed-users", type=int, help="closed-loop users of the capacity run (default: MaxBS)")
    over.add_argument("--capacity-s", type=float, default=15.0, help="seconds of the closed-loop capacity run")
    over.add_argument("--overload-factor", type=float, default=2.0, help="overload rate / measured capacity")
    over.add_argument("--overload-s", type=float, default=60.0, help="seconds of overload sending (0: no overload phase, "
                                                                     "the soak alone)")
    ap.add_argument("--no-record", action="store_true", help="no results/ files or RESULTS.md lines (JSON in --out only)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def prepare(args, work: Path) -> tuple[Optional[Path], Optional[Path]]:
    """The model folder and the adapter root to serve (None, None: the tiny model and its demo adapters)."""
    model_dir = Path(args.model) if args.model else None
    if args.preset and model_dir is None:
        from vlora.models.random_init import make_random_llava

        t0 = time.perf_counter()
        model_dir = make_random_llava(args.preset, work / ("model-" + Path(args.preset).stem),
                                      device="cuda" if args.device.startswith("cuda") else "cpu")
        print(f"model {model_dir} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    root = Path(args.adapters) if args.adapters else None
    if root is None and model_dir is not None:
        t0 = time.perf_counter()
        root = soak.write_soak_adapters(model_dir, work / f"adapters-{model_dir.name}")
        print(f"soak adapters at {root} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return model_dir, root


def soak_minutes(args, elapsed_s: float) -> float:
    """The soak's minutes: ``--soak-minutes``, or less when --budget-s would not hold it and the overload."""
    if not args.budget_s:
        return args.soak_minutes
    overload = (args.capacity_s + args.overload_s + OVERLOAD_EXTRA_S) if args.overload_s > 0 else 0.0
    left = args.budget_s - elapsed_s - overload - (args.probe_s + SOAK_EXTRA_S)
    return round(max(MIN_SOAK_MINUTES, min(args.soak_minutes, left / 60.0)), 2)


def harness_overload(args, target, names: list[str], adapter_root: Optional[str], gpu: bool, max_batch: int,
                     out_dir: Path, out=sys.stdout) -> dict:
    """The closed-loop capacity of the harness workload, then the open loop at ``overload_factor`` x it."""
    from vlora_load.heads import HeadPolicy
    from vlora_load.runner import run_point, wait_idle
    from vlora_load.summary import read_records, window_stats
    from vlora_load.workload import Workload, resolve_workload

    base = Workload.from_yaml(resolve_workload(args.workload))
    wl = base.with_overrides(
        num_adapters=min(len(names), max(1, base.popularity.num_adapters)), adapter_names=tuple(names), seed=args.seed,
        length_scale=args.length_scale if args.length_scale is not None else (0.25 if gpu else 0.05),
        image_size=args.image_size or (336 if gpu else 64), frames_per_chunk=args.frames_per_chunk or (6 if gpu else 3))
    heads = HeadPolicy.from_adapter_root(adapter_root, tuple(names))
    settings = {"benchmark": "python -m benchmarks.reliability " + " ".join(sys.argv[1:]), "device": device_name(),
                "commit": git_commit()}
    users = args.closed_users or max_batch
    wait_idle(target.metrics_url, 120, out)
    cap = run_point(wl.with_overrides(mode="closed", users=users, duration_s=args.capacity_s), target, out_dir / "capacity",
                    names, heads, out=out, settings=settings)
    warm = args.capacity_s / 3.0  # the first requests' adapter loads and the batch filling stay out
    steady = window_stats(read_records(out_dir / "capacity" / "requests.csv"), warm, args.capacity_s)
    capacity = steady["throughput_rps"] or cap["throughput_rps"]
    if capacity <= 0:
        return {"capacity": {"closed_users": users, **_point(cap), "steady": steady}, "checks": {"capacity measured": False},
                "passed": False}
    rate = args.overload_factor * capacity
    out.write(f"overload: harness capacity {capacity:.2f} req/s ({users} closed-loop users, steady {warm:.0f}-"
              f"{args.capacity_s:g} s); sending {rate:.2f} req/s for {args.overload_s:g} s\n")
    out.flush()
    wait_idle(target.metrics_url, 120, out)
    over_wl = wl.with_overrides(mode="open", rate=rate, duration_s=args.overload_s)
    over = run_point(over_wl, target, out_dir / "overload", names, heads, out=out, settings=settings)
    drained = wait_idle(target.metrics_url, 120, out)
    checks = {
        "every request answered or rejected": over["ok"] + over["rejected"] == over["requests"],
        "some requests rejected explicitly": over["rejected"] > 0,
        "rejections name the full queue or the overload": all(
            k.startswith("rejected: Exceeds maximum queue size") or "overloaded" in k
            for k in over["error_messages"] if k.startswith("rejected")),
        "none timed out (hung)": over["timeout"] == 0,
        "none lost": over.get("lost") == 0,
        "no other failure": over["error"] == 0 and over["incomplete"] == 0,
        "server drained after it": drained,
    }
    return {"workload": over_wl.describe(), "heads": heads.describe(), "capacity": {"closed_users": users, "seconds": args.capacity_s, "rps": capacity,
                                                    "steady": steady, **_point(cap)},
            "overload_factor": args.overload_factor, "rate_rps": rate, "overload": _point(over), "checks": checks,
            "passed": all(checks.values())}


def _point(s: dict) -> dict:
    keys = ("offered_rate_rps", "offered_actual_rps", "users", "scheduled", "requests", "ok", "rejected", "timeout", "error",
            "incomplete", "lost", "throughput_rps", "output_tokens_per_s", "avg_token_latency_s", "ttft_p50_s", "ttft_p99_s",
            "e2e_p50_s", "e2e_p99_s", "rejection_latency_p50_s", "rejection_latency_max_s", "error_messages", "server")
    return {k: s.get(k) for k in keys if k in s}


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    gpu = args.device.startswith("cuda") or (args.device == "auto" and _cuda())
    out_dir = Path(args.out) if args.out else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, root = prepare(args, work)

    args.max_queue_size = args.max_queue_size or (32 if gpu else 8)
    # On a CPU the tiny model's queue must fill within seconds (load_sweep.py's CPU settings).
    serve_args = [f"--max-queue-size {args.max_queue_size}", *(CPU_SERVE_ARGS if not gpu else ()), *args.serve_arg]
    if model_dir is not None:
        serve_args.append(f"--model {model_dir}")
    if root is not None:
        serve_args.append(f"--adapters {root}")
    try:
        server, token = start_server(work / "soak-server", None if args.device == "auto" else args.device, serve_args)
    except Exception as e:
        print(f"reliability: the server did not start: {e}", flush=True)
        return 2
    code, written = 1, []
    try:
        target = target_of(server)
        max_batch = server.engine_config.scheduler.max_batch_size
        minutes = soak_minutes(args, time.perf_counter() - t_start)
        print(f"reliability: server ready after {time.perf_counter() - t_start:.0f} s; soak {minutes:g} min "
              f"(asked {args.soak_minutes:g}), then overload {args.overload_s:g} s", flush=True)
        cfg = soak.SoakConfig(minutes=minutes, load=args.load, seed=args.seed, workers=args.workers,
                              request_timeout_s=args.request_timeout, report_every_s=30.0, probe_seconds=args.probe_s,
                              probe_concurrency=args.probe_concurrency or max_batch)
        soak_args = argparse.Namespace(cycle_adapter=soak.CYCLE_ADAPTER, device=args.device, no_record=args.no_record)
        soak_code, soak_result = soak.soak(soak_args, cfg, target, token, server.adapter_root, server, out_dir)
        dev = soak_result.get("device") or ("cpu" if not gpu else device_name())
        if args.overload_s <= 0:  # the soak alone (the longest one a device call holds)
            code = soak_code
            print(f"reliability: soak {'passed' if soak_code == 0 else 'FAILED'} ({minutes:g} min), no overload; "
                  f"{time.perf_counter() - t_start:.0f} s in all", flush=True)
            return code

        # The overload goes to the generation adapters the soak used (not the cycled one, perhaps unloaded now)
        # and the head adapters; the harness's video requests use their heads where they declare one.
        names = [a for a in soak.DEMO_ADAPTERS if a != soak.CYCLE_ADAPTER] + sorted(soak.DEMO_HEADS)
        served = {a["name"] for a in served_adapters(target)}
        names = [n for n in names if n in served] or sorted(served - {soak.CYCLE_ADAPTER})
        t0 = time.perf_counter()
        log_path = server.log_path
        offset = log_offset(log_path)
        overload = harness_overload(args, target, names, server.adapter_root, gpu, max_batch, out_dir / "harness")
        healthy, health = health_check(target)
        overload["checks"]["a normal request answered after it"] = healthy
        overload["passed"] = all(overload["checks"].values())
        n_errors, error_lines = server_error_lines(log_path, offset)
        result = {"benchmark": "overload", "device": dev, "commit": git_commit(), "adapters": names,
                  "max_queue_size": args.max_queue_size, "max_batch_size": max_batch, **overload,
                  "health_after": health, "wall_s": round(time.perf_counter() - t0, 1),
                  "server_log_error_lines": n_errors, "server_log_error_examples": error_lines[:10]}
        line = overload_line(result)
        for k, v in result["checks"].items():
            print(f"  {'ok  ' if v else 'FAIL'} {k}", flush=True)
        print(f"overload: {'PASSED' if result['passed'] else 'FAILED'}: {line}", flush=True)
        written = [out_dir / f"overload-{dev}.json"]
        if args.no_record:
            written[0].write_text(json.dumps(result, indent=2) + "\n")
        else:
            path = record_result("overload", dev, result, line)
            if written[0].resolve() != path.resolve():
                written[0].write_text(path.read_text())
                written.append(path)
        code = 0 if soak_code == 0 and result["passed"] else 1
        print(f"reliability: soak {'passed' if soak_code == 0 else 'FAILED'} ({minutes:g} min), overload "
              f"{'passed' if result['passed'] else 'FAILED'}; {time.perf_counter() - t_start:.0f} s in all", flush=True)
    finally:
        print("stopping the server ...", flush=True)
        t0 = time.perf_counter()
        stopped = server.stop()
        stop = {"exit_code": stopped, "seconds": round(time.perf_counter() - t0, 1)}
        print(f"server stopped (exit code {stopped}) in {stop['seconds']:g} s", flush=True)
        for path in written:  # how the shutdown went, beside the overload's figures (issue 26: shutdown ends it all)
            data = json.loads(path.read_text())
            data["server_stop"] = stop
            path.write_text(json.dumps(data, indent=2) + "\n")
    return code


def overload_line(r: dict) -> str:
    if "overload" not in r:
        return f"no overload run: the harness's capacity run answered nothing ({r.get('capacity')}); checks FAIL"
    o, c = r["overload"], r["capacity"]
    return (f"{r['workload']}; capacity {c['rps']:.2f} req/s ({c['closed_users']} closed-loop users, {c['seconds']:g} s); "
            f"{r['overload_factor']:g}x = {r['rate_rps']:.2f} req/s for {o.get('scheduled') or o['requests']} requests: "
            f"{o['ok']} answered, {o['rejected']} rejected (max {o.get('rejection_latency_max_s') or 0:.3f} s), "
            f"{o['timeout']} timed out, {o['error'] + o['incomplete']} other failures, {o.get('lost')} lost; "
            f"queue {r['max_queue_size']}; checks {'pass' if r['passed'] else 'FAIL'}")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
