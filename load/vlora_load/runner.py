"""Run a load test: start (or use) a server, run locust headless for each sweep point, write the results.

For each point (offered rate x skewness) the runner writes a plan, runs locust in a child process
(locust monkey-patches the standard library with gevent, so it never shares a process with the
server launcher or the metrics scraper), scrapes Triton's metrics endpoint meanwhile, prints progress
from the raw CSV as it grows, then writes ``summary.json``, the plots and ``report.md``. A sweep of
more than one point adds a sweep page with latency against rate and against skewness.
"""
from __future__ import annotations

import csv
import datetime
import io
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, TextIO

from vlora_load import report
from vlora_load.generators import WorkloadGenerator
from vlora_load.heads import HeadPolicy
from vlora_load.proccpu import CPU_FILE, CpuSampler
from vlora_load.scrape import (CACHES_FILE, INSTANCES_FILE, STAGES_FILE, MetricsScraper, Snapshot, cache_deltas,
                                parse_prometheus, stage_deltas)
from vlora_load.summary import read_records, summarize, timeline_stats
from vlora_load.workload import Workload

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass(frozen=True)
class Target:
    """Where the server listens (loopback or a host you name)."""

    http_url: str  # host:port
    grpc_url: str  # host:port
    metrics_url: str  # http://host:port/metrics
    model: str = "vlora"

    @classmethod
    def from_url(cls, url: str, grpc_url: Optional[str] = None, metrics_url: Optional[str] = None,
                 model: str = "vlora") -> "Target":
        """``host:8000`` -> gRPC on 8001 and metrics on 8002 (Triton's layout) unless given."""
        base = url.replace("http://", "").rstrip("/")
        host, _, port = base.partition(":")
        http_port = int(port or 8000)
        return cls(http_url=f"{host}:{http_port}", grpc_url=grpc_url or f"{host}:{http_port + 1}",
                   metrics_url=metrics_url or f"http://{host}:{http_port + 2}/metrics", model=model)


@dataclass(frozen=True)
class Point:
    rate: Optional[float]
    skewness: Optional[float]

    def label(self, workload: Workload) -> str:
        parts = []
        if workload.arrivals.mode == "open":
            parts.append(f"rate-{(self.rate if self.rate is not None else workload.arrivals.rate):g}")
        else:
            parts.append(f"users-{workload.arrivals.users}")
        if self.skewness is not None:
            parts.append(f"skew-{self.skewness:g}")
        return "-".join(parts)


def run_point(workload: Workload, target: Target, out_dir: Path, adapter_names: Sequence[str],
              heads: HeadPolicy, out: TextIO = sys.stdout, grpc_workers: int = 256,
              progress_interval_s: float = 2.0, settings: Optional[dict] = None,
              sweep_title: Optional[str] = None) -> dict:
    """One locust run of ``workload``; returns its summary (also written to ``out_dir/summary.json``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = WorkloadGenerator(workload, tuple(adapter_names), heads)
    scheduled = len(generator.schedule()) if workload.arrivals.mode == "open" else None
    if Workload.from_dict(workload.to_dict()) != workload:  # what the locust process will rebuild
        raise RuntimeError("internal: the workload does not survive its JSON round trip")
    plan = {
        "workload": workload.to_dict(),
        "adapter_names": list(adapter_names),
        "heads": heads.to_dict(),
        "http_url": target.http_url,
        "grpc_url": target.grpc_url,
        "model": target.model,
        "out_dir": str(out_dir.resolve()),
        "grpc_workers": grpc_workers,
        "scheduled": scheduled,
        "settings": settings or {},
        "sweep_title": sweep_title,
    }
    plan_path = out_dir / "plan.json"
    report.write_json(plan_path, plan)
    if workload.arrivals.mode == "open":
        user_args = ["OpenLoopUser", "-u", "1", "-r", "1"]
    else:
        n = workload.arrivals.users
        user_args = ["ClosedLoopUser", "-u", str(n), "-r", str(n)]
    safety_s = int(math.ceil(workload.duration_s + workload.request_timeout_s + 120))
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "--vlora-plan", str(plan_path), "--csv", str(out_dir / "locust"), "-t", f"{safety_s}s",
           "--stop-timeout", str(int(workload.request_timeout_s) + 5), "--loglevel", "WARNING",
           "--exit-code-on-error", "0", *user_args]
    _say(out, f"[{out_dir.name}] {workload.describe()}")
    if scheduled is not None:
        _say(out, f"[{out_dir.name}] {scheduled} requests scheduled over {workload.duration_s:g}s")
    scraper = MetricsScraper(target.metrics_url).start()
    cpu = CpuSampler()
    log_path = out_dir / "locust.log"
    t_launch = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_loopback_env(os.environ))
        tail = _CsvTail(out_dir / "requests.csv")
        last = 0.0
        try:
            last_cpu = 0.0
            while proc.poll() is None:
                time.sleep(0.25)
                if time.monotonic() - last_cpu >= 1.0:  # the last sample is taken while the generator still runs
                    last_cpu = time.monotonic()
                    cpu.sample()
                if time.monotonic() - last >= progress_interval_s:
                    last = time.monotonic()
                    _say(out, _progress_line(out_dir.name, time.monotonic() - t_launch, tail.poll(), scheduled,
                                             scraper.latest()))
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(timeout=60)
            raise
        finally:
            scraper.stop()
    time.sleep(0.3)  # the model applies its metrics every 0.2 s: the last answers' cache counts
    last = scraper.scrape_once()
    if last is not None:
        scraper.snapshots.append(Snapshot(time.monotonic(), last))
    for path, deltas in ((CACHES_FILE, cache_deltas(scraper.snapshots)), (STAGES_FILE, stage_deltas(scraper.snapshots))):
        if deltas is not None:
            report.write_json(out_dir / path, deltas)
    code = proc.returncode
    if code != 0 or not (out_dir / "requests.csv").exists():
        raise RuntimeError(f"locust exited with code {code}; see {log_path}:\n" + _tail(log_path, 30))
    clock = json.loads((out_dir / "clock.json").read_text())
    scraper.write(out_dir / "server_timeline.csv", clock["t0_monotonic"])
    report.write_json(out_dir / CPU_FILE, cpu.cores())
    summary = finish_run(out_dir)
    _say(out, f"[{out_dir.name}] done: {summary['requests']} requests, {summary['ok']} answered, "
              f"{summary['rejected']} rejected, {summary['errors'] - summary['rejected']} other failures, "
              f"lost {summary.get('lost', '-')}; throughput {summary['throughput_rps']:.2f} req/s; "
              f"avg token latency {_ms(summary['avg_token_latency_s'])}; report {out_dir / 'report.md'}")
    return summary


def finish_run(out_dir: Path) -> dict:
    """summary.json, plots and report.md of one run, from its raw files alone (plan, requests, timeline).

    Plots need matplotlib; without it the report says so, and ``vlora loadtest --report DIR`` on a
    machine that has it rebuilds them from the same files.
    """
    plan = json.loads((out_dir / "plan.json").read_text())
    workload = Workload.from_dict(plan["workload"])
    clock = json.loads((out_dir / "clock.json").read_text())
    timeline = read_timeline(out_dir / "server_timeline.csv")
    records = read_records(out_dir / "requests.csv")
    server = timeline_stats(timeline)
    instances_path = out_dir / INSTANCES_FILE
    if instances_path.exists():
        server["instances"] = json.loads(instances_path.read_text())
    extra = {"server": server, "started_at": clock["t0_unix"]}
    if (out_dir / CPU_FILE).exists():
        extra["process_cpu"] = json.loads((out_dir / CPU_FILE).read_text())
    for path, key in ((CACHES_FILE, "server_caches"), (STAGES_FILE, "server_stages")):
        if (out_dir / path).exists():
            extra[key] = json.loads((out_dir / path).read_text())
    summary = summarize(records, workload, scheduled=plan.get("scheduled"), extra=extra)
    summary["run"] = out_dir.name
    report.write_json(out_dir / "summary.json", summary)
    plots: dict[str, str] = {}
    if report.can_plot():
        plots["Timeline: latency per request, batch size and mode, queues"] = report.plot_timeline(
            records, timeline, out_dir / "timeline.png", workload.describe()).name
        plots["Latency distribution"] = report.plot_cdf(records, out_dir / "latency_cdf.png").name
    run_settings = {"workload file": workload.source or "-",
                    "server (HTTP / gRPC)": f"{plan['http_url']} / {plan['grpc_url']}",
                    **plan.get("settings", {}), "heads": HeadPolicy(plan.get("heads", {})).describe()}
    (out_dir / "report.md").write_text(report.run_markdown(summary, plots, run_settings))
    return summary


def read_timeline(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            rows.append({k: (v if k == "mode" else (float(v) if v not in ("", "None") else None)) for k, v in row.items()})
    return rows


def write_sweep_page(out_dir: Path, summaries: list[dict], workload: Workload, settings: dict,
                     title: Optional[str] = None) -> Path:
    """The sweep page: latency against rate and against skewness when the sweep varies them."""
    plots = {}
    if report.can_plot():
        if len({s.get("offered_rate_rps") for s in summaries}) > 1:
            path = report.plot_sweep(summaries, "offered_rate_rps", "offered request rate (req/s)",
                                     out_dir / "latency_vs_rate.png", f"{workload.name}: latency against request rate")
            if path:
                plots["Latency against request rate"] = path.name
        if len({s.get("skewness") for s in summaries}) > 1:
            path = report.plot_sweep(summaries, "skewness", "skewness (share of the most popular adapter)",
                                     out_dir / "latency_vs_skewness.png", f"{workload.name}: latency against skewness")
            if path:
                plots["Latency against skewness"] = path.name
    report.write_json(out_dir / "sweep.json", summaries)
    page = out_dir / "report.md"
    page.write_text(report.sweep_markdown(title or f"Load test sweep: {workload.name}", summaries, plots,
                                          {"workload": workload.describe(), **settings}))
    return page


def rebuild_reports(folder: Path, out: TextIO = sys.stdout) -> int:
    """Rebuild every run's report under ``folder`` (and the sweep pages) from the raw files."""
    runs = sorted(p.parent for p in folder.rglob("plan.json"))
    by_parent: dict[Path, list[tuple[Path, dict]]] = {}
    for run_dir in runs:
        summary = finish_run(run_dir)
        _say(out, f"rebuilt {run_dir / 'report.md'}")
        by_parent.setdefault(run_dir.parent, []).append((run_dir, summary))
    for parent, items in by_parent.items():
        if len(items) > 1 and parent != folder.parent:
            plan = json.loads((items[0][0] / "plan.json").read_text())
            write_sweep_page(parent, [s for _d, s in items], Workload.from_dict(plan["workload"]),
                             plan.get("settings", {}), plan.get("sweep_title"))
            _say(out, f"rebuilt {parent / 'report.md'}")
    return len(runs)


def run_sweep(workload: Workload, points: Sequence[Point], target: Target, out_dir: Path,
              adapter_names: Sequence[str], heads: HeadPolicy, out: TextIO = sys.stdout,
              grpc_workers: int = 256, settle_timeout_s: float = 120.0, settings: Optional[dict] = None,
              title: Optional[str] = None) -> list[dict]:
    """Every point against the same server; one folder per point and a sweep page when there are several.

    Point i draws its requests from seed ``workload.seed + i``: with one seed, every point would send the images,
    clips and prompts of the point before it again (a video stream's k-th chunk is the same clip at any rate), and
    the server's encoder and prefix caches would answer them, so that only the first point measured new content.
    Each point's summary says what its answers took from those caches (``server_caches``) and where the engine's
    time went over the point (``server_stages``: its stage timers' means)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = []
    for i, point in enumerate(points):
        wl = workload.with_overrides(rate=point.rate, skewness=point.skewness, seed=workload.seed + i)
        sub = out_dir if len(points) == 1 else out_dir / point.label(workload)
        if i > 0:
            wait_idle(target.metrics_url, settle_timeout_s, out)
        summary = run_point(wl, target, sub, adapter_names, heads, out=out, grpc_workers=grpc_workers,
                            settings=settings, sweep_title=title)
        summaries.append(summary)
    if len(points) > 1:
        page = write_sweep_page(out_dir, summaries, workload, settings or {}, title)
        _say(out, f"sweep report: {page}")
    return summaries


def wait_idle(metrics_url: str, timeout_s: float, out: TextIO) -> bool:
    """Wait until the server has nothing running, waiting or queued (between sweep points)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(metrics_url, timeout=5) as r:
                samples = parse_prometheus(r.read().decode())
        except OSError:
            return False
        busy = sum(v for n, _l, v in samples if n in ("vlora_running_requests", "vlora_waiting_requests",
                                                      "nv_inference_pending_request_count"))
        if busy == 0:
            return True
        time.sleep(0.5)
    _say(out, f"warning: the server was still busy after {timeout_s:g}s; starting the next point anyway")
    return False


class _CsvTail:
    """Counts outcomes in the raw CSV as locust appends to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._header: Optional[list[str]] = None
        self.counts: dict[str, int] = {}
        self.output_tokens = 0

    def poll(self) -> dict[str, int]:
        if not self.path.exists():
            return self.counts
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        end = data.rfind(b"\n")
        if end < 0:
            return self.counts
        self._offset += end + 1
        for row in csv.reader(io.StringIO(data[: end + 1].decode("utf-8", errors="replace"))):
            if self._header is None:
                self._header = row
                continue
            rec = dict(zip(self._header, row))
            outcome = rec.get("outcome", "error")
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
        return self.counts


def _progress_line(name: str, elapsed: float, counts: dict[str, int], scheduled: Optional[int], snap) -> str:
    done = sum(counts.values())
    failed = done - counts.get("ok", 0) - counts.get("rejected", 0)
    parts = [f"[{name}] {elapsed:5.0f}s", f"done {done}" + (f"/{scheduled}" if scheduled else ""),
             f"ok {counts.get('ok', 0)}", f"rejected {counts.get('rejected', 0)}", f"failed {failed}"]
    if snap is not None:
        vals = {n: v for n, _l, v in snap.samples if n in ("vlora_batch_size", "vlora_running_requests",
                                                           "vlora_waiting_requests", "nv_inference_pending_request_count")}
        parts.append(f"server: batch {vals.get('vlora_batch_size', 0):.0f}, running {vals.get('vlora_running_requests', 0):.0f}, "
                     f"waiting {vals.get('vlora_waiting_requests', 0):.0f}, Triton queue {vals.get('nv_inference_pending_request_count', 0):.0f}")
    return " | ".join(parts)


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms/token"


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _loopback_env(env: dict) -> dict:
    """gRPC and urllib honour *_proxy variables; traffic to the server must not go through a proxy."""
    env = dict(env)
    for var in ("no_proxy", "NO_PROXY"):
        env[var] = ",".join(filter(None, [env.get(var, ""), "127.0.0.1", "localhost"]))
    return env


def _say(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


def default_out_dir(workload_name: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(".work") / "loadtest" / f"{workload_name}-{stamp}"


def sweep_points(rates: Sequence[float], skews: Sequence[float]) -> list[Point]:
    """Every (rate, skewness) pair, rates varying fastest; an empty list keeps the workload's value."""
    rs = list(rates) or [None]
    ss = list(skews) or [None]
    return [Point(r, s) for s in ss for r in rs]


