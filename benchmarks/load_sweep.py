"""Load-test benchmark: a rate sweep up to where the queue builds, a skewness sweep below it, and an
overload run at twice that rate, all through `vlora loadtest`'s harness against one real tritonserver.

The overload run checks what the issue asks: every request is answered in full or rejected explicitly
by Triton's queue policy, none times out, none fails otherwise, and none is lost. The numbers go to
benchmarks/results/<name>-<device>.json and a line in benchmarks/RESULTS.md; the reports (markdown
with PNG plots, summary JSON) to benchmarks/load_results/<name>-<device>/.

CPU (the tiny model, small limits so the queue fills within seconds):
    python -m benchmarks.load_sweep
GPU (LLaVA-1.5-7B width, random weights, rank-64 adapters; see benchmarks/load_device.sh):
    python -m benchmarks.load_sweep --name load-7b --preset configs/models/llava-1.5-7b.yaml \\
        --rates 1,2,4,6,8,12 -- --device cuda --num-adapters 8 --adapter-rank 64 --image-size 336 \\
        --serve-arg="--max-queue-size 64"
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, device_name, git_commit, record_result

from vlora_load import cli
from vlora_load.heads import HeadPolicy
from vlora_load.runner import Point, Target, run_point, run_sweep, sweep_points, wait_idle
from vlora_load.summary import queue_built, read_records, window_stats

CPU_DEFAULTS = ["--length-scale", "0.05", "--image-size", "64", "--device", "cpu",
                "--serve-arg=--max-batch-size 8 --max-queue-size 8 --set scheduler.max_waiting=4"]
KEEP = ("report.md", "summary.json", "sweep.json", ".png")  # what is copied next to the benchmarks
RAW = ("requests.csv", "server_timeline.csv", "server_instances.json", "process_cpu.json", "plan.json", "clock.json",
       "locust_stats.csv", "locust_failures.csv")


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="load-sweep")
    p.add_argument("--workload", default="visual_retrieval")
    p.add_argument("--rates", type=floats, default=floats("2,4,6,8,10,12"))
    p.add_argument("--duration", type=float, default=30.0, help="seconds per rate point")
    p.add_argument("--skewness", type=floats, default=floats("0.25,0.5,0.75,1.0"))
    p.add_argument("--skew-duration", type=float, default=20.0)
    p.add_argument("--overload-duration", type=float, default=60.0, help="0: no overload run")
    p.add_argument("--work", default="/tmp/vlora-load", help="raw results (CSV, logs, server workspace)")
    p.add_argument("--out", help="reports to keep (default: benchmarks/load_results/<name>-<device>)")
    p.add_argument("--keep-raw", action="store_true",
                   help="copy the raw files too (what `vlora loadtest --report` needs to rebuild the plots elsewhere)")
    p.add_argument("--preset", help="generate a random model of this preset (configs/models/*.yaml) and serve it")
    p.add_argument("--closed-users", type=int, help="instead of the sweeps: one closed-loop run with N users "
                   "(the throughput the server holds; used for 1, 2 and 4 GPUs)")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="closed loop: the steady-state figures leave out the first S seconds of --duration "
                   "(first adapter loads, the batch filling); the whole-run figures keep them")
    p.add_argument("loadtest_args", nargs=argparse.REMAINDER,
                   help="after --: `vlora loadtest` flags (server, adapters, lengths); default: the CPU settings")
    args = p.parse_args(argv)
    if args.closed_users and not 0 <= args.warmup_s < args.duration:
        p.error(f"--warmup-s {args.warmup_s:g} must be at least 0 and below --duration {args.duration:g}")
    extra = [a for a in args.loadtest_args if a != "--"] or list(CPU_DEFAULTS)
    work = Path(args.work) / args.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if args.preset:
        from vlora.models.random_init import make_random_llava

        model_dir = make_random_llava(args.preset, Path(args.work) / f"model-{Path(args.preset).stem}")
        extra += ["--model", str(model_dir)]

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    lt_args = parser.parse_args(["--workload", args.workload, "--duration", str(args.duration), *extra])
    workload = cli.workload_from_args(lt_args)
    for x in args.skewness:  # refuse now, not after the rate sweep
        workload.with_overrides(skewness=x)
    out = sys.stdout
    server, adapter_root, names = cli.start_server(lt_args, workload, work, out)
    target = Target(server.http_url.replace("http://", ""), server.grpc_url, server.metrics_url)
    heads = HeadPolicy.from_adapter_root(adapter_root, tuple(names))
    settings = {"benchmark": f"python -m benchmarks.load_sweep {' '.join(sys.argv[1:])}".strip(),
                "server flags": " ".join(extra), "device": device_name(), "commit": git_commit()}
    t_start = time.time()
    if args.closed_users:
        return closed_loop(args, workload, target, work, names, heads, settings, server, extra, out)
    try:
        rates = run_sweep(workload, sweep_points(args.rates, []), target, work / "rates", names, heads, out=out,
                          settings=settings, title=f"{args.name}: rate sweep ({workload.name})")
        built = [s for s in rates if queue_built(s)]
        knee = built[0]["offered_rate_rps"] if built else rates[-1]["offered_rate_rps"]
        below = [s["offered_rate_rps"] for s in rates if s["offered_rate_rps"] < knee]
        skew_rate = below[-1] if below else knee / 2
        skews = []
        if args.skewness:  # --skewness "" skips this sweep
            wait_idle(target.metrics_url, 120, out)
            skews = run_sweep(workload.with_overrides(duration_s=args.skew_duration),
                              [Point(skew_rate, x) for x in args.skewness], target, work / "skewness",
                              names, heads, out=out, settings=settings,
                              title=f"{args.name}: skewness sweep at {skew_rate:g} req/s ({workload.name})")
        overload_rate = 2 * knee
        overload = None
        if args.overload_duration > 0:
            wait_idle(target.metrics_url, 120, out)
            overload = run_point(workload.with_overrides(rate=overload_rate, duration_s=args.overload_duration), target,
                                 work / "overload", names, heads, out=out, settings=settings)
    finally:
        server.stop()

    checks = {"sweep below the knee without failures": all(s["errors"] == 0 for s in rates if s["offered_rate_rps"] < knee)}
    if overload is not None:
        checks.update({
            "every request answered or rejected": overload["ok"] + overload["rejected"] == overload["requests"],
            "some requests rejected by the queue policy": overload["rejected"] > 0,
            "rejections name the full queue": all(k.startswith("rejected: Exceeds maximum queue size")
                                                  or "overloaded" in k for k in overload["error_messages"]),
            "none timed out (hung)": overload["timeout"] == 0,
            "none lost": overload.get("lost") == 0,
            "no other failure": overload["error"] == 0 and overload["incomplete"] == 0,
        })
    keep = Path(args.out) if args.out else ROOT / "benchmarks" / "load_results" / f"{args.name}-{device_name()}"
    if keep.exists():
        shutil.rmtree(keep)
    keep_names = KEEP + RAW if args.keep_raw else KEEP
    for src in work.rglob("*"):
        if src.is_file() and src.name.endswith(keep_names) and "server" not in src.relative_to(work).parts:
            dst = keep / src.relative_to(work)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    index = index_page(args.name, workload, rates, skews, overload, knee, checks, settings)
    (keep / "report.md").write_text(index)

    def point(s):
        return {k: s.get(k) for k in ("offered_rate_rps", "offered_actual_rps", "skewness", "requests", "ok", "rejected",
                                      "timeout", "error", "incomplete", "lost", "throughput_rps", "output_tokens_per_s",
                                      "avg_token_latency_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s",
                                      "e2e_p90_s", "e2e_p99_s", "rejection_latency_max_s", "server")}

    result = {"commit": git_commit(), "device": device_name(), "workload": workload.describe(),
              "server_flags": extra, "knee_rate_rps": knee, "overload_rate_rps": overload_rate,
              "rates": [point(s) for s in rates], "skewness": [point(s) for s in skews],
              "overload": point(overload) if overload is not None else None,
              "checks": checks, "wall_s": round(time.time() - t_start, 1),
              "report": str(keep.relative_to(ROOT)) if keep.is_relative_to(ROOT) else str(keep)}
    best = max(rates, key=lambda s: s["throughput_rps"])
    summary = (f"{workload.name}: queue builds at {knee:g} req/s (max {best['throughput_rps']:.2f} req/s answered); "
               + "; ".join(f"{s['offered_rate_rps']:g} req/s: {_ms(s['avg_token_latency_s'])}/tok, "
                           f"p99 e2e {s['e2e_p99_s']:.2f}s" for s in rates)
               + (f"; overload {overload_rate:g} req/s: {overload['ok']} answered, {overload['rejected']} rejected "
                  f"(max {overload['rejection_latency_max_s'] or 0:.3f}s), {overload['timeout']} hung, "
                  f"{overload.get('lost')} lost" if overload is not None else "; no overload run")
               + f"; checks {'pass' if all(checks.values()) else 'FAIL'}")
    record_result(args.name, device_name(), result, summary)
    print(f"report: {keep / 'report.md'}")
    for k, v in checks.items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    return 0 if all(checks.values()) else 1


def closed_loop(args, workload, target, work, names, heads, settings, server, extra, out) -> int:
    """One closed-loop point: N users back to back; records the throughput and latency it gets."""
    try:
        s = run_point(workload.with_overrides(users=args.closed_users, mode="closed"), target, work / "closed",
                      names, heads, out=out, settings=settings)
    finally:
        server.stop()
    keep = Path(args.out) if args.out else ROOT / "benchmarks" / "load_results" / f"{args.name}-{device_name()}"
    keep.mkdir(parents=True, exist_ok=True)
    keep_names = KEEP + RAW if args.keep_raw else KEEP
    for src in (work / "closed").iterdir():
        if src.is_file() and src.name.endswith(keep_names):
            shutil.copy2(src, keep / src.name)
    server_log = work / "server" / "tritonserver.log"
    if args.keep_raw and server_log.is_file():
        shutil.copy2(server_log, keep / server_log.name)
    gpus = _visible_gpus()
    steady = None
    if args.warmup_s > 0:
        steady = window_stats(read_records(work / "closed" / "requests.csv"), args.warmup_s, workload.duration_s)
    result = {"commit": git_commit(), "device": device_name(), "gpus": gpus, "users": args.closed_users,
              "workload": workload.describe(), "server_flags": extra,
              **{k: s.get(k) for k in ("requests", "ok", "errors", "window_s", "throughput_rps", "output_tokens_per_s",
                                       "avg_token_latency_s", "ttft_p50_s", "e2e_p50_s", "e2e_p99_s", "server",
                                       "process_cpu")},
              "steady": steady}
    line = (f"{workload.name}, {gpus} GPU(s), {args.closed_users} closed-loop users, {workload.duration_s:g} s: ")
    if steady is not None:
        line += (f"steady state ({args.warmup_s:g}-{workload.duration_s:g} s) {steady['throughput_rps']:.2f} req/s, "
                 f"{steady['output_tokens_per_s']:.0f} tok/s; whole run with drain ")
    line += (f"{s['throughput_rps']:.2f} req/s, {s['output_tokens_per_s']:.0f} tok/s, avg token latency "
             f"{_ms(s['avg_token_latency_s'])}, {s['errors']} errors (V-LoRA paper: 6.07 / 11.48 / 23.97 req/s on "
             f"1 / 2 / 4 A100s)")
    roles = (s.get("process_cpu") or {}).get("roles") or {}
    if roles:  # what may bound the run: the load generator, Triton's front end or the model instances
        line += "; CPU cores (all / busiest process): " + ", ".join(
            f"{k} {r['cores']:.2f}/{r['max_process_cores']:.2f}" for k, r in sorted(roles.items()))
    per_device = [i for i in (s.get("server") or {}).get("instances") or [] if i.get("device")]
    if per_device:  # the vlora_* series of each model instance, by its device label
        line += "; output tokens by device: " + ", ".join(
            f"{i['device']} {i['output_tokens'] or 0:,.0f}" for i in per_device)
    record_result(args.name, device_name(), result, line)
    return 0 if s["errors"] == 0 else 1


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def index_page(name, workload, rates, skews, overload, knee, checks, settings) -> str:
    lines = [f"# {name}: load test on {settings['device']}", "",
             f"Workload: {workload.describe()} (rates and skewness varied below).", "",
             "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | `{v}` |" for k, v in settings.items()]
    lines += ["", f"## Rate sweep: the queue builds at {knee:g} req/s", "",
              "A point counts as queueing when on average at least 0.5 requests wait (Triton's queue plus the engine's "
              "waiting list, scraped every 0.5 s) or fewer than 90% of the offered requests per second are answered.", "",
              "![latency against rate](rates/latency_vs_rate.png)", "", _table(rates, "rates"), ""]
    if skews:
        lines += ["## Skewness sweep", "", "![latency against skewness](skewness/latency_vs_skewness.png)", "",
                  _table(skews, "skewness"), ""]
    if overload is None:
        lines += ["| check | |", "| --- | --- |"] + [f"| {k} | {'pass' if v else 'FAIL'} |" for k, v in checks.items()]
        pages = [f"[{s['run']}](rates/{s['run']}/report.md)" for s in rates]
        pages += [f"[{s['run']}](skewness/{s['run']}/report.md)" for s in skews]
        return "\n".join(lines + ["", "Per-run pages: " + ", ".join(pages) + ".", ""])
    lines += [f"## Overload at {2 * knee:g} req/s (twice the knee)", "",
              f"{overload['requests']} requests: {overload['ok']} answered in full, {overload['rejected']} rejected "
              f"explicitly, {overload['timeout']} timed out, {overload['error'] + overload['incomplete']} other failures, "
              f"{overload.get('lost')} lost. Rejections came back in at most "
              f"{(overload['rejection_latency_max_s'] or 0) * 1000:.0f} ms. Failures by kind: "
              f"{', '.join(f'{n} x `{m}`' for m, n in overload['error_messages'].items()) or 'none'}.", "",
              "![overload timeline](overload/timeline.png)", "", "| check | |", "| --- | --- |"]
    lines += [f"| {k} | {'pass' if v else 'FAIL'} |" for k, v in checks.items()]
    pages = [f"[{s['run']}](rates/{s['run']}/report.md)" for s in rates]
    pages += [f"[{s['run']}](skewness/{s['run']}/report.md)" for s in skews]
    lines += ["", "Per-run pages: " + ", ".join(pages + ["[overload](overload/report.md)"]) + ".", ""]
    return "\n".join(lines)


def _table(points, folder) -> str:
    rows = ["| offered req/s | skewness | requests | answered | rejected | throughput req/s | avg token latency | "
            "TTFT p50 / p99 | e2e p50 / p99 | mean Triton queue | mean batch size |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in points:
        srv = s.get("server", {})
        rows.append(f"| {s['offered_rate_rps']:g} | {s.get('skewness')} | {s['requests']} | {s['ok']} | {s['rejected']} | "
                    f"{s['throughput_rps']:.2f} | {_ms(s['avg_token_latency_s'])} | "
                    f"{s['ttft_p50_s'] or 0:.3f} / {s['ttft_p99_s'] or 0:.3f} s | {s['e2e_p50_s'] or 0:.3f} / {s['e2e_p99_s'] or 0:.3f} s | "
                    f"{srv.get('mean_triton_queue') or 0:.2f} | {srv.get('mean_batch_size_mean') or 0:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
