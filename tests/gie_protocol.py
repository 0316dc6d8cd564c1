"""The Gateway API Inference Extension's model server protocol, as its endpoint picker (EPP) reads a scrape: the
metric names vlora maps to it (deploy/kubernetes/README.md), a Prometheus text parser, and the EPP's rules
(pkg/epp/backend/metrics/metrics.go of kubernetes-sigs/gateway-api-inference-extension): a gauge spec matches
every series of the family whose labels include the spec's, and the first one is read (the exposition has no
timestamps); of the LoRA info gauge, series whose running and waiting labels are both empty are skipped and the
one with the largest value (the Unix time of its update) is read, its labels split on ','."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

# The EPP's flags (GIE v1) and the vlora metric each names; deploy/kubernetes/ sets the same.
EPP_FLAGS = {
    "total-queued-requests-metric": "vlora_queued_requests",  # made by the front end's /metrics
    "total-running-requests-metric": "vlora_running_requests",
    "kv-cache-usage-percentage-metric": "vlora_kv_cache_usage_ratio",
    "lora-info-metric": "vlora_lora_requests_info",
    "cache-info-metric": "",  # optional in the protocol; vlora has none (empty: the EPP does not scrape it)
}
QUEUED = EPP_FLAGS["total-queued-requests-metric"]
RUNNING = EPP_FLAGS["total-running-requests-metric"]
KV_USAGE = EPP_FLAGS["kv-cache-usage-percentage-metric"]
LORA_INFO = EPP_FLAGS["lora-info-metric"]
LORA_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")


@dataclass
class Family:
    name: str
    kind: Optional[str] = None  # the TYPE line's type
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


def parse(text: str) -> dict[str, Family]:
    """Families by name, from Prometheus' text exposition format (samples of a histogram's _bucket, _sum and
    _count go to their own names)."""
    families: dict[str, Family] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            families.setdefault(name, Family(name)).kind = kind.strip()
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(2) or "")}
            families.setdefault(m.group(1), Family(m.group(1))).samples.append((labels, float(m.group(3))))
    return families


def gauge(families: dict[str, Family], name: str, **labels: str) -> float:
    """The value the EPP reads for a gauge spec ``name{labels}``: the first matching series."""
    family = families.get(name)
    assert family is not None, f"metric family {name} not found"
    for sample_labels, value in family.samples:
        if labels.items() <= sample_labels.items():
            return value
    raise AssertionError(f"no series of {name} matches {labels}")


@dataclass
class LoraInfo:
    running: list[str]
    waiting: list[str]
    max_lora: int
    stamp: float


def lora_info(families: dict[str, Family]) -> Optional[LoraInfo]:
    """The LoRA info the EPP reads from a scrape; None when every series is idle (the EPP then keeps what it read
    before)."""
    family = families.get(LORA_INFO)
    assert family is not None, f"metric family {LORA_INFO} not found"
    latest, stamp = None, 0.0
    for labels, value in family.samples:
        if not labels.get("running_lora_adapters") and not labels.get("waiting_lora_adapters"):
            continue
        if value > stamp:
            latest, stamp = labels, value
    if latest is None:
        return None
    split = (lambda v: v.split(",") if v else [])
    return LoraInfo(split(latest["running_lora_adapters"]), split(latest["waiting_lora_adapters"]),
                    int(latest["max_lora"]), stamp)
