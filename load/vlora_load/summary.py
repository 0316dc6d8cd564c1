"""The numbers of one load-test run, from its raw per-request CSV.

- throughput: answered requests per second over the sending window (from the first send to the last
  answer), and generated tokens per second;
- average token latency, as the V-LoRA paper defines it: the sum of every answered request's
  end-to-end latency divided by the total number of output tokens;
- p50/p90/p99 of TTFT and end-to-end time, p50/p90 of the time per output token;
- counts per outcome (ok, rejected, incomplete, timeout, error) and the error count (everything not ok);
- per application: the same, and SLO attainment = requests that met every target / all requests
  sent (rejected and failed ones miss it);
- requests per adapter.
"""
from __future__ import annotations

import csv
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Optional

from vlora_load.transport import OUTCOMES, RequestRecord
from vlora_load.workload import Workload


def read_records(path: Path) -> list[RequestRecord]:
    with open(path, newline="") as fh:
        return [RequestRecord.from_row(row) for row in csv.DictReader(fh)]


def percentile(values: list[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    vals = sorted(v for v in values if v == v)
    if not vals:
        return None
    k = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] if lo == hi else vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def _stats(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.outcome == "ok"]
    counts = Counter(r.outcome for r in records)
    total_tokens = sum(r.num_output_tokens for r in ok)
    sum_e2e = sum(r.e2e_s for r in ok)
    started = [r.start_s for r in records if r.start_s == r.start_s]
    ended = [r.start_s + r.e2e_s for r in ok if r.e2e_s == r.e2e_s]
    window = (max(ended) - min(started)) if started and ended else 0.0
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s == r.tpot_s]
    out = {
        "requests": len(records),
        **{o: counts.get(o, 0) for o in OUTCOMES},
        "errors": len(records) - len(ok),
        "window_s": round(window, 3),
        "throughput_rps": len(ok) / window if window > 0 else 0.0,
        "output_tokens": total_tokens,
        "output_tokens_per_s": total_tokens / window if window > 0 else 0.0,
        "avg_token_latency_s": sum_e2e / total_tokens if total_tokens else None,
        "mean_input_tokens": (sum(r.num_input_tokens for r in ok) / len(ok)) if ok else None,
        "mean_output_tokens": (total_tokens / len(ok)) if ok else None,
    }
    for name, values, qs in (("ttft_s", ttft, (50, 90, 99)), ("e2e_s", e2e, (50, 90, 99)), ("tpot_s", tpot, (50, 90))):
        for q in qs:
            out[f"{name.replace('_s', '')}_p{q}_s"] = percentile(values, q)
        out[f"{name.replace('_s', '')}_mean_s"] = (sum(values) / len(values)) if values else None
    return out


def summarize(records: list[RequestRecord], workload: Workload, scheduled: Optional[int] = None,
              extra: Optional[dict] = None) -> dict:
    """The summary JSON of one run. ``scheduled``: requests the open-loop schedule held (to check none is lost)."""
    summary = {
        "workload": workload.name,
        "description": workload.describe(),
        "offered_rate_rps": workload.arrivals.rate if workload.arrivals.mode == "open" else None,
        "users": workload.arrivals.users if workload.arrivals.mode == "closed" else None,
        "popularity": workload.popularity.describe(),
        "skewness": workload.popularity.skewness if workload.popularity.kind == "skewness" else None,
        "zipf_alpha": workload.popularity.zipf_alpha if workload.popularity.kind == "zipf" else None,
        "num_adapters": workload.popularity.num_adapters,
        "duration_s": workload.duration_s,
        **_stats(records),
    }
    if scheduled is not None:
        summary["scheduled"] = scheduled
        summary["lost"] = scheduled - len(records)
        summary["offered_actual_rps"] = scheduled / workload.duration_s
    rejected = [r.e2e_s for r in records if r.outcome == "rejected"]
    summary["rejection_latency_p50_s"] = percentile(rejected, 50)
    summary["rejection_latency_max_s"] = max(rejected) if rejected else None
    lateness = [r.start_s - r.scheduled_s for r in records if r.scheduled_s == r.scheduled_s and r.start_s == r.start_s]
    summary["send_lateness_p99_s"] = percentile(lateness, 99)
    apps = {}
    by_app: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_app[r.application].append(r)
    for app in workload.applications:
        recs = by_app.get(app.name, [])
        stats = _stats(recs)
        met = sum(1 for r in recs if r.outcome == "ok" and app.slo.met(r.ttft_s, r.e2e_s, _nan_none(r.tpot_s)))
        stats["slo"] = app.slo.describe()
        stats["slo_attainment"] = met / len(recs) if recs else None
        stats["protocol"] = workload.protocol_of(app)
        stats["tasks"] = dict(Counter(r.task for r in recs))
        apps[app.name] = stats
    summary["applications"] = apps
    adapters = Counter(r.adapter or "base" for r in records)
    summary["requests_per_adapter"] = dict(adapters.most_common(20))
    summary["distinct_adapters"] = len(adapters)
    errors = Counter(f"{r.outcome}: {error_kind(r.error)}" for r in records if r.outcome != "ok")
    summary["error_messages"] = dict(errors.most_common(10))
    if extra:
        summary.update(extra)
    return summary


def window_stats(records: list[RequestRecord], t_from: float, t_to: float) -> dict:
    """What the server sustained between ``t_from`` and ``t_to`` (seconds from the run's start): a closed
    loop's steady state, without its ramp-up (first adapter loads, the first batch filling) or its drain.

    Requests answered in the window per second, and output tokens per second generated in the window:
    each answered request's first token at its TTFT, the others spread evenly from there to its end.
    """
    span = t_to - t_from
    if span <= 0:
        raise ValueError(f"empty window [{t_from}, {t_to}]")
    answered, tokens = 0, 0.0
    for r in records:
        if r.outcome != "ok" or r.start_s != r.start_s or r.e2e_s != r.e2e_s:
            continue
        end = r.start_s + r.e2e_s
        first = r.start_s + r.ttft_s if r.ttft_s == r.ttft_s else end
        answered += t_from <= end <= t_to
        if r.num_output_tokens <= 0:
            continue
        tokens += t_from <= first <= t_to
        rest = r.num_output_tokens - 1
        if rest and end > first:
            tokens += rest * max(0.0, min(end, t_to) - max(first, t_from)) / (end - first)
        elif rest:
            tokens += rest * (t_from <= end <= t_to)
    failed = sum(1 for r in records if r.outcome != "ok" and r.start_s == r.start_s and t_from <= r.start_s <= t_to)
    return {"window_from_s": t_from, "window_to_s": t_to, "answered": answered, "failed_sent_in_window": failed,
            "throughput_rps": answered / span, "output_tokens_per_s": tokens / span}


_REQUEST_ID = re.compile(r"\[request id: [^\]]*\]\s*")


def error_kind(message: str) -> str:
    """A failure message without its request-specific parts, to group failures by kind."""
    return _REQUEST_ID.sub("", (message.splitlines() or [""])[0])[:120]


def _nan_none(x: float) -> Optional[float]:
    return None if x != x else x


def timeline_stats(rows: Iterable[dict]) -> dict:
    """Peaks and means of the scraped server timeline (for the summary)."""
    rows = list(rows)

    def col(name):
        return [r[name] for r in rows if isinstance(r.get(name), (int, float))]

    out = {"scrapes": len(rows)}
    for name in ("batch_size_mean", "running", "waiting", "triton_queue"):
        values = col(name)
        out[f"max_{name}"] = max(values) if values else None
        out[f"mean_{name}"] = sum(values) / len(values) if values else None
    modes = Counter(r["mode"] for r in rows if r.get("mode"))
    out["modes"] = dict(modes)
    return out


def queue_built(summary: dict, threshold: float = 0.5) -> bool:
    """Whether requests queued up in this run: on average at least ``threshold`` requests waited (in
    Triton's queue or the engine's waiting list), or fewer than 90% of the offered requests per second
    were answered."""
    server = summary.get("server") or {}
    waiting = (server.get("mean_triton_queue") or 0.0) + (server.get("mean_waiting") or 0.0)
    offered = summary.get("offered_actual_rps") or summary.get("offered_rate_rps") or 0.0
    return waiting >= threshold or (offered > 0 and summary["throughput_rps"] < 0.9 * offered)
