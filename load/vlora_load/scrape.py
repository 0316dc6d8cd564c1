"""Scrape Triton's metrics endpoint during a load test: a timeline of batch size, queue depth and mode.

Every ``interval_s`` the scraper reads the Prometheus text once and keeps one row per sample:

- ``vlora_batch_size`` (requests in the latest engine step) and, from the
  ``vlora_batch_size_per_step`` histogram, the mean batch size over the interval;
- ``vlora_running_requests``, ``vlora_waiting_requests`` (the engine) and Triton's own
  ``nv_inference_pending_request_count`` (requests waiting in Triton's queue);
- engine steps and generated tokens per second (from the counters);
- the inference mode when the orchestrator exports one: any ``vlora_*mode*`` family with a ``mode``
  label; a gauge names the current mode by its largest value, a ``*_total`` counter by its largest
  increase over the interval.

Beside the timeline (which sums every model instance), ``server_instances.json`` holds each instance's own
series: the ``vlora_*`` samples carry ``instance`` and ``device`` labels when the server runs one model
instance per GPU, and :func:`instance_series` gives each (instance, device) its engine steps and output
tokens over the run, so a multi-GPU run shows that every device served.
"""
from __future__ import annotations

import csv
import json
import math
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

TIMELINE_COLUMNS = ("t_s", "batch_size_last", "batch_size_mean", "running", "waiting", "triton_queue",
                    "steps_per_s", "tokens_per_s", "mode")


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, value))
    return out


def _total(samples, name: str, **match) -> Optional[float]:
    values = [v for n, labels, v in samples if n == name and all(labels.get(k) == x for k, x in match.items())]
    return sum(values) if values else None


@dataclass
class Snapshot:
    t_s: float
    samples: list


@dataclass
class MetricsScraper:
    """Polls ``metrics_url`` on its own thread until ``stop()``; ``t0`` is the run's monotonic start."""

    metrics_url: str
    interval_s: float = 0.5
    snapshots: list[Snapshot] = field(default_factory=list)
    errors: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vlora-metrics-scraper", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "MetricsScraper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def scrape_once(self) -> Optional[list]:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
                return parse_prometheus(r.read().decode("utf-8", errors="replace"))
        except OSError:
            self.errors += 1
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            samples = self.scrape_once()
            if samples is not None:
                with self._lock:
                    self.snapshots.append(Snapshot(t, samples))
            self._stop.wait(max(self.interval_s - (time.monotonic() - t), 0.01))

    def latest(self) -> Optional[Snapshot]:
        with self._lock:
            return self.snapshots[-1] if self.snapshots else None

    def timeline(self, t0: float) -> list[dict]:
        with self._lock:
            snaps = list(self.snapshots)
        return build_timeline(snaps, t0)

    def write(self, path: Path, t0: float) -> list[dict]:
        """The timeline CSV at ``path``, and each instance's series beside it (``server_instances.json``)."""
        with self._lock:
            snaps = list(self.snapshots)
        (path.parent / INSTANCES_FILE).write_text(json.dumps(instance_series(snaps), indent=1))
        rows = build_timeline(snaps, t0)
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=TIMELINE_COLUMNS)
            w.writeheader()
            for row in rows:
                w.writerow(row)
        return rows


INSTANCES_FILE = "server_instances.json"
INSTANCE_COUNTERS = {"steps": "vlora_engine_steps_total", "output_tokens": "vlora_output_tokens_total"}


def instance_series(snaps: list[Snapshot]) -> list[dict]:
    """One entry per (instance, device) label pair seen on the last scrape's ``vlora_*`` samples: its engine
    steps and output tokens between the first and the last scrape (None: the counter is not exported).
    Samples without those labels (one instance, or a server that does not label them) form one entry with
    empty names."""
    if not snaps:
        return []
    first, last = snaps[0].samples, snaps[-1].samples
    keys = sorted({(labels.get("instance", ""), labels.get("device", "")) for name, labels, _ in last
                   if name.startswith("vlora_")})
    out = []
    for inst, dev in keys:
        entry: dict = {"instance": inst, "device": dev}
        for field_name, metric in INSTANCE_COUNTERS.items():
            end = _labelled(last, metric, inst, dev)
            start = _labelled(first, metric, inst, dev) or 0.0
            entry[field_name] = None if end is None else max(end - start, 0.0)
        out.append(entry)
    return out


def _labelled(samples, name: str, instance: str, device: str) -> Optional[float]:
    values = [v for n, labels, v in samples
              if n == name and labels.get("instance", "") == instance and labels.get("device", "") == device]
    return sum(values) if values else None


def build_timeline(snaps: list[Snapshot], t0: float) -> list[dict]:
    rows = []
    prev = None
    for snap in snaps:
        s = snap.samples
        row = {
            "t_s": round(snap.t_s - t0, 3),
            "batch_size_last": _total(s, "vlora_batch_size"),
            "running": _total(s, "vlora_running_requests"),
            "waiting": _total(s, "vlora_waiting_requests"),
            "triton_queue": _total(s, "nv_inference_pending_request_count"),
            "batch_size_mean": None,
            "steps_per_s": None,
            "tokens_per_s": None,
            "mode": current_mode(s, prev.samples if prev else None),
        }
        if prev is not None:
            dt = snap.t_s - prev.t_s
            hs, hc = _delta(s, prev.samples, "vlora_batch_size_per_step_sum"), _delta(s, prev.samples, "vlora_batch_size_per_step_count")
            if hc:
                row["batch_size_mean"] = hs / hc
            steps = _delta(s, prev.samples, "vlora_engine_steps_total")
            tokens = _delta(s, prev.samples, "vlora_output_tokens_total")
            if dt > 0:
                row["steps_per_s"] = None if steps is None else steps / dt
                row["tokens_per_s"] = None if tokens is None else tokens / dt
        rows.append(row)
        prev = snap
    return rows


def _delta(now, before, name: str) -> Optional[float]:
    a, b = _total(now, name), _total(before, name)
    if a is None or b is None:
        return None
    return max(a - b, 0.0)


def current_mode(samples, previous) -> str:
    """The orchestrator's mode, from any vlora_*mode* family with a ``mode`` label; "" when none is exported."""
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    for name, labels, value in samples:
        if not name.startswith("vlora_") or "mode" not in name or "mode" not in labels:
            continue
        target = counters if name.endswith("_total") else gauges
        target[labels["mode"]] = target.get(labels["mode"], 0.0) + value
    if gauges:
        best = max(gauges.items(), key=lambda kv: kv[1])
        return best[0] if best[1] > 0 else ""
    if counters and previous is not None:
        before: dict[str, float] = {}
        for name, labels, value in previous:
            if name.startswith("vlora_") and "mode" in name and "mode" in labels and name.endswith("_total"):
                before[labels["mode"]] = before.get(labels["mode"], 0.0) + value
        grown = {m: v - before.get(m, 0.0) for m, v in counters.items()}
        best = max(grown.items(), key=lambda kv: kv[1])
        return best[0] if best[1] > 0 else ""
    return ""


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


GAUGES = ("vlora_running_requests", "vlora_waiting_requests", "nv_inference_pending_request_count")


def gauges(metrics_url: str, names: tuple[str, ...] = GAUGES) -> dict[str, float]:
    """One scrape: each of ``names`` summed over its label sets; {} when the endpoint does not answer."""
    samples = MetricsScraper(metrics_url).scrape_once()
    if samples is None:
        return {}
    return {n: sum(v for m, _l, v in samples if m == n) for n in names}


def totals_by_label(metrics_url: str, name: str, label: str) -> dict[str, float]:
    """One scrape: the samples of ``name`` summed per value of ``label`` ("?" where it is missing); {} when the
    endpoint does not answer."""
    samples = MetricsScraper(metrics_url).scrape_once()
    out: dict[str, float] = {}
    for metric, labels, value in samples or ():
        if metric == name:
            key = labels.get(label, "?")
            out[key] = out.get(key, 0.0) + value
    return out


# The server's cache counters (vlora_encoder_cache_*, vlora_prefix_cache_*): what a run's answers took from the
# caches rather than from the GPU, which a run of new content must show near zero.
CACHE_COUNTERS = {"encoder_hits": "vlora_encoder_cache_hits_total", "encoder_misses": "vlora_encoder_cache_misses_total",
                  "prefix_prompt_tokens": "vlora_prefix_cache_prompt_tokens_total",
                  "prefix_reused_tokens": "vlora_prefix_cache_reused_tokens_total"}
CACHES_FILE = "server_caches.json"


def cache_deltas(snapshots: list[Snapshot]) -> Optional[dict]:
    """The cache counters' growth from the first snapshot to the last (summed over instances), and the shares
    they make: ``encoder_hit_rate`` (of the images a step needed) and ``prefix_reused_share`` (of the prompt
    tokens admitted); None without two snapshots or without those counters."""
    if len(snapshots) < 2:
        return None

    def totals(snap: Snapshot) -> dict:
        got = {k: 0.0 for k in CACHE_COUNTERS}
        seen = False
        for name, _labels, value in snap.samples:
            for k, metric in CACHE_COUNTERS.items():
                if name == metric:
                    got[k] += value
                    seen = True
        return got if seen else {}

    first, last = totals(snapshots[0]), totals(snapshots[-1])
    if not first or not last:
        return None
    out = {k: int(round(last[k] - first[k])) for k in CACHE_COUNTERS}
    images = out["encoder_hits"] + out["encoder_misses"]
    out["encoder_hit_rate"] = round(out["encoder_hits"] / images, 4) if images else None
    out["prefix_reused_share"] = (round(out["prefix_reused_tokens"] / out["prefix_prompt_tokens"], 4)
                                  if out["prefix_prompt_tokens"] else None)
    return out


STAGES_FILE = "server_stages.json"


def stage_totals(samples: list) -> dict[str, tuple[float, float]]:
    """stage -> (seconds, count) of the engine's stage timers (``vlora_stage_seconds``: queue, image_decode,
    preprocess, vision, prefill_step, decode_step, ...) in one scrape's samples, summed over instances."""
    got: dict[str, list[float]] = {}
    for name, labels, value in samples:
        if name in ("vlora_stage_seconds_sum", "vlora_stage_seconds_count") and "stage" in labels:
            pair = got.setdefault(labels["stage"], [0.0, 0.0])
            pair[0 if name.endswith("_sum") else 1] += value
    return {k: (v[0], v[1]) for k, v in got.items()}


def stage_means(before: dict, after: dict) -> dict[str, dict]:
    """Per stage: the mean ms and the count of what was timed between two :func:`stage_totals`."""
    out = {}
    for stage, (s1, c1) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        if c1 > c0:
            out[stage] = {"mean_ms": round(1e3 * (s1 - s0) / (c1 - c0), 2), "count": int(round(c1 - c0))}
    return out


def stage_deltas(snapshots: list[Snapshot]) -> Optional[dict]:
    """The engine's stage timers over a run, from the first snapshot to the last (:func:`stage_means`); None
    without two snapshots or without those timers."""
    if len(snapshots) < 2:
        return None
    return stage_means(stage_totals(snapshots[0].samples), stage_totals(snapshots[-1].samples)) or None
