"""PNG plots and one markdown page per run (and per sweep), for a colleague to read.

Per run: a timeline (each request's latency by send time and outcome; the server's batch size and
mode; Triton's queue and the engine's running/waiting requests) and the TTFT / end-to-end CDFs.
Per sweep: average token latency, p90 end-to-end time, throughput and rejections against the offered
request rate, and against skewness when the sweep varies it.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Optional

from vlora_load.transport import RequestRecord

OUTCOME_STYLE = {"ok": ("tab:blue", "o"), "rejected": ("tab:red", "x"), "incomplete": ("tab:orange", "s"),
                 "timeout": ("tab:purple", "v"), "error": ("black", "D")}


def can_plot() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(records: list[RequestRecord], timeline: list[dict], path: Path, title: str) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True, dpi=80)
    ax = axes[0]
    for outcome, (colour, marker) in OUTCOME_STYLE.items():
        pts = [(r.start_s, r.e2e_s) for r in records if r.outcome == outcome and r.e2e_s == r.e2e_s]
        if pts:
            ax.scatter(*zip(*pts), s=10, c=colour, marker=marker, label=f"{outcome} ({len(pts)})", alpha=0.7)
    ttft = [(r.start_s, r.ttft_s) for r in records if r.outcome == "ok" and r.ttft_s == r.ttft_s]
    if ttft:
        ax.scatter(*zip(*ttft), s=6, c="tab:green", marker=".", label="TTFT (ok)", alpha=0.6)
    ax.set_ylabel("latency (s)")
    ax.set_title(textwrap.fill(title, 110), fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)

    t = [r["t_s"] for r in timeline]
    ax = axes[1]
    for key, label in (("batch_size_mean", "mean batch size per step"), ("batch_size_last", "batch size (last step)")):
        series = [(x, r[key]) for x, r in zip(t, timeline) if isinstance(r.get(key), (int, float))]
        if series:
            ax.plot(*zip(*series), label=label, lw=1.2)
    modes = [r.get("mode") or "" for r in timeline]
    handles = []
    if any(modes):
        from matplotlib.patches import Patch

        names = sorted(set(m for m in modes if m))
        colours = ["#dbe9f6", "#fde0c5", "#d5f0d5", "#eadcf2"]
        for i in range(len(t) - 1):
            if modes[i]:
                ax.axvspan(t[i], t[i + 1], color=colours[names.index(modes[i]) % len(colours)], lw=0)
        handles = [Patch(color=colours[k % len(colours)], label=f"mode: {n}") for k, n in enumerate(names)]
    else:
        ax.text(0.99, 0.95, "no inference mode exported by the server", transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color="gray")
    lines, labels = ax.get_legend_handles_labels()
    ax.legend(handles=lines + handles, fontsize=7, loc="upper left")
    ax.set_ylabel("requests per step")
    ax.grid(alpha=0.3)

    ax = axes[2]
    for key, label in (("triton_queue", "Triton queue (pending)"), ("running", "engine running"), ("waiting", "engine waiting")):
        series = [(x, r[key]) for x, r in zip(t, timeline) if isinstance(r.get(key), (int, float))]
        if series:
            ax.plot(*zip(*series), label=label, lw=1.2)
    ax.set_ylabel("requests")
    ax.set_xlabel("time since start (s)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_cdf(records: list[RequestRecord], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    apps = sorted({r.application for r in records})
    for ax, attr, label in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "e2e_s", "end-to-end (s)")):
        for app in apps:
            vals = sorted(getattr(r, attr) for r in records if r.application == app and r.outcome == "ok")
            if vals:
                ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post", label=app)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of answered requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(points: list[dict], x_key: str, x_label: str, path: Path, title: str) -> Optional[Path]:
    """Latency, throughput and rejections against ``x_key`` (offered rate or skewness), per application."""
    pts = [p for p in points if isinstance(p.get(x_key), (int, float))]
    if not pts:
        return None
    plt = _plt()
    pts.sort(key=lambda p: p[x_key])
    xs = [p[x_key] for p in pts]
    apps = sorted({a for p in pts for a in p.get("applications", {})})
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), dpi=80)
    ax = axes[0]
    for app in apps:
        ys = [_ms(p["applications"].get(app, {}).get("avg_token_latency_s")) for p in pts]
        ax.plot(xs, ys, marker="o", label=f"{app}: avg token latency")
    ax.set_ylabel("average token latency (ms/token)")
    ax.set_xlabel(x_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    for app in apps:
        ax.plot(xs, [p["applications"].get(app, {}).get("e2e_p90_s") for p in pts], marker="o", label=f"{app}: p90 e2e")
        ax.plot(xs, [p["applications"].get(app, {}).get("ttft_p90_s") for p in pts], marker="x", ls="--", label=f"{app}: p90 TTFT")
    ax.set_ylabel("seconds")
    ax.set_xlabel(x_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot(xs, [p.get("throughput_rps") for p in pts], marker="o", label="answered req/s")
    if x_key == "offered_rate_rps":
        ax.plot(xs, xs, ls=":", c="gray", label="offered")
    ax.set_ylabel("requests per second")
    ax.set_xlabel(x_label)
    ax2 = ax.twinx()
    ax2.bar(xs, [p.get("rejected", 0) / max(p.get("requests", 1), 1) for p in pts],
            width=0.25 * (max(xs) - min(xs) if len(xs) > 1 else 1) / max(len(xs), 1), alpha=0.3, color="tab:red",
            label="rejected share")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("rejected share", color="tab:red")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(textwrap.fill(title, 140), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _ms(x):
    return None if x is None else x * 1000.0


def _fmt(x, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x * scale:.{digits}g}{unit}"
    return f"{x}{unit}"


def _count(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def run_markdown(summary: dict, plots: dict[str, str], settings: dict) -> str:
    s = summary
    lines = [
        f"# Load test: {s['workload']}",
        "",
        f"{s['description']}",
        "",
        "| setting | value |",
        "| --- | --- |",
    ]
    for k, v in settings.items():
        lines.append(f"| {k} | {v} |")
    lines += [
        "",
        "## Result",
        "",
        "| requests | answered | rejected | incomplete | timeout | error | lost | throughput | tokens/s | avg token latency |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {s['requests']} | {s['ok']} | {s['rejected']} | {s['incomplete']} | {s['timeout']} | {s['error']} | "
        f"{s.get('lost', '-')} | {_fmt(s['throughput_rps'], ' req/s')} | {_fmt(s['output_tokens_per_s'])} | "
        f"{_fmt(s['avg_token_latency_s'], ' ms', 1000)} |",
        "",
        "| application | protocol | requests | answered | rejected | TTFT p50 / p90 / p99 | e2e p50 / p90 / p99 | TPOT p50 | avg token latency | SLO | SLO attainment |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, a in s["applications"].items():
        lines.append(
            f"| {name} | {a['protocol']} | {a['requests']} | {a['ok']} | {a['rejected']} | "
            f"{_fmt(a['ttft_p50_s'], 's')} / {_fmt(a['ttft_p90_s'], 's')} / {_fmt(a['ttft_p99_s'], 's')} | "
            f"{_fmt(a['e2e_p50_s'], 's')} / {_fmt(a['e2e_p90_s'], 's')} / {_fmt(a['e2e_p99_s'], 's')} | "
            f"{_fmt(a['tpot_p50_s'], ' ms', 1000)} | {_fmt(a['avg_token_latency_s'], ' ms', 1000)} | {a['slo']} | "
            f"{_fmt(a['slo_attainment'], '%', 100)} |")
    server = s.get("server", {})
    if server:
        lines += ["", f"Server, from its metrics endpoint ({server.get('scrapes', 0)} scrapes): peak mean batch size "
                  f"{_fmt(server.get('max_batch_size_mean'))}, peak Triton queue {_fmt(server.get('max_triton_queue'))}, "
                  f"peak engine waiting {_fmt(server.get('max_waiting'))}; modes seen: {server.get('modes') or 'none exported'}."]
        inst = [i for i in server.get("instances") or [] if i.get("instance") or i.get("device")]
        if inst:
            lines += ["", "Per model instance (the `instance` and `device` labels of the vlora_* series):", "",
                      "| instance | device | engine steps | output tokens |", "| --- | --- | --- | --- |"]
            lines += [f"| {i['instance']} | {i['device']} | {_count(i.get('steps'))} | {_count(i.get('output_tokens'))} |"
                      for i in inst]
    roles = (s.get("process_cpu") or {}).get("roles") or {}
    if roles:
        lines += ["", f"CPU cores used over {s['process_cpu']['window_s']:g} s of the run (all processes of a role / "
                  "the busiest one): " + ", ".join(f"{k} {r['cores']:.2f} / {r['max_process_cores']:.2f} "
                                                   f"({r['processes']} processes)" for k, r in sorted(roles.items())) + "."]
    if s.get("error_messages"):
        lines += ["", "Failures by kind:", ""]
        lines += [f"- {n} x `{m}`" for m, n in s["error_messages"].items()]
    lines += ["", "Requests per adapter (top): " + ", ".join(f"{k} {v}" for k, v in s["requests_per_adapter"].items()), ""]
    for title, rel in plots.items():
        lines += [f"## {title}", "", f"![{title}]({rel})", ""]
    if not plots:
        lines += ["(No plots: matplotlib is not installed here. `vlora loadtest --report DIR` rebuilds this page "
                  "with them from the raw files.)", ""]
    lines += ["Raw data: `requests.csv` (one row per request), `server_timeline.csv` (scraped metrics), "
              "`locust_stats.csv` / `locust_failures.csv` (locust's own), `summary.json`.", ""]
    return "\n".join(lines)


def sweep_markdown(title: str, points: list[dict], plots: dict[str, str], settings: dict) -> str:
    lines = [f"# {title}", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in settings.items()]
    lines += ["", "| run | offered req/s | skewness | requests | answered | rejected | lost | throughput req/s | "
              "avg token latency | TTFT p50 / p99 | e2e p50 / p99 | peak Triton queue | SLO attainment |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        slo = ", ".join(f"{n} {_fmt(a.get('slo_attainment'), '%', 100)}" for n, a in p.get("applications", {}).items())
        lines.append(
            f"| [{p['run']}]({p['run']}/report.md) | {_fmt(p.get('offered_rate_rps'))} | {_fmt(p.get('skewness'))} | "
            f"{p['requests']} | {p['ok']} | {p['rejected']} | {p.get('lost', '-')} | {_fmt(p['throughput_rps'])} | "
            f"{_fmt(p['avg_token_latency_s'], ' ms', 1000)} | {_fmt(p['ttft_p50_s'], 's')} / {_fmt(p['ttft_p99_s'], 's')} | "
            f"{_fmt(p['e2e_p50_s'], 's')} / {_fmt(p['e2e_p99_s'], 's')} | "
            f"{_fmt(p.get('server', {}).get('max_triton_queue'))} | {slo} |")
    lines.append("")
    for t, rel in plots.items():
        lines += [f"## {t}", "", f"![{t}]({rel})", ""]
    return "\n".join(lines)


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(x):
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    return str(x)
