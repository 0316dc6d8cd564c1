"""Soak test: mixed traffic against a real vlora server for N minutes; every request's outcome and latency, and
whether the server's and its Python stub's memory stays flat after warm-up.

    python -m benchmarks.soak --minutes 5 --load 0.8          # starts `vlora serve` on loopback (tiny model)
    python -m benchmarks.soak --url 127.0.0.1:8000 --admin-token-file admin.token --rate 3

Without ``--url`` it starts ``vlora serve`` on free loopback ports (the tiny model and its demo adapters unless
``--serve-arg`` says otherwise) with a fresh admin token. It measures the mix's capacity (closed loop), then sends an
open-loop Poisson stream at ``--rate`` req/s or ``--load`` x that capacity. The mix (``KINDS``): ``text`` and
``image`` (one to three images: a video's frames) generation with ``ignore_eos`` (exactly ``max_tokens`` back), HTTP
and gRPC streams, ``head`` (a task head with its training prompt: the label must be one of its labels),
``disconnect`` (the client leaves a stream after a few tokens), ``admin`` (list, and unload/load of
``--cycle-adapter`` while other requests use it) and ``bad`` (each must get HTTP 400 naming the problem). The load
harness (``vlora_load``) sends and times the requests, draws the images, runs the loops on threads, scrapes the
metrics and samples the memory of tritonserver and its stubs (RSS; GPU memory on CUDA): this file holds the mix and
its checks.

Outcomes: ``ok``; ``expected`` (a bad request's 400, the documented refusals while the cycled adapter is (being)
unloaded, a ``load`` answered "unloaded" by an overlapping ``unload``); ``rejected`` (the server was full and said
so); ``unexpected`` (any other error, or a short or wrong answer); ``lost`` (no answer in ``--request-timeout``).
Every ``--report-every`` seconds and at the end: counts and p50/p99 latency per kind and the memory. Flatness
compares the RSS at 20% of the run with its end; after the traffic the server must drain and answer a request.

Writes ``<out>/soak-<device>.json`` (default ``benchmarks/results``) and, unless ``--no-record``, a line in
``benchmarks/RESULTS.md``. Exit code 1 when a request failed unexpectedly or was lost or a check after the run
failed; 2 when the server could not be started or reached.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from benchmarks.common import RESULTS, device_name, git_commit, record_result

from vlora_load.adapters import ensure_head_adapters
from vlora_load.disconnect import leave_stream
from vlora_load.generators import ImagePool, RequestSpec, task_images
from vlora_load.grpc_worker import GrpcSender
from vlora_load.heads import head_prompts
from vlora_load.procmem import MemorySampler, ServerProcesses, flatness, memory_line
from vlora_load.runner import Target, wait_idle
from vlora_load.server import ServerWatch, health_check, post_generate, served_adapters, start_server, target_of
from vlora_load.summary import percentile
from vlora_load.threads import closed_loop, open_loop
from vlora_load.transport import HttpTransport, RequestRecord, classify_error, job_payload, new_record, record_grpc_result

SOAK_OUTCOMES = ("ok", "expected", "rejected", "unexpected", "lost")
DEMO_ADAPTERS = ("demo-r8-qv", "demo-r16-attn", "demo-r32-mlp")
CYCLE_ADAPTER = "demo-r4-pattern"  # unloaded and loaded again during the run; no head request uses it
# The documented answers while an adapter is unloaded, or being unloaded (README, "Unloading under traffic").
UNLOAD_REFUSALS = ("is being unloaded", "is unloaded; load it again")
# The demo adapters' heads (their vlora_heads.json), used when the adapter root cannot be read (--url).
DEMO_HEADS = {
    "demo-count-circles": {"count-circles": (("1", "2", "3", "4", "5", "6"),
                                             "USER: {images}\nHow many circles are in the image? Answer with a number. ASSISTANT:")},
    "demo-shapes": {"color": (("red", "green", "blue", "yellow", "purple"),
                              "USER: {images}\nWhat colour is the shape? Answer with one word: red, green, blue, yellow or purple. ASSISTANT:")},
}
HEAD_TASK_TYPES = {"count-circles": "counting", "color": "classification"}
PROMPTS = (
    "USER: Tell me a short story about a lighthouse. ASSISTANT:",
    "USER: What is the capital of France? ASSISTANT:",
    "USER: List three colours and a fruit of each colour. ASSISTANT:",
    "USER: Explain in one sentence why the sky is blue. ASSISTANT:",
    "USER: Write a haiku about a cat sleeping in the sun. ASSISTANT:",
)
KINDS = {"text": 0.24, "image": 0.16, "stream_http": 0.14, "stream_grpc": 0.14, "head": 0.12, "disconnect": 0.08,
         "admin": 0.07, "bad": 0.05}  # the mix: kind -> share of the requests


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class SoakConfig:
    """One soak run: how long, how fast, and how long one request may take."""

    minutes: float = 5.0
    rate: Optional[float] = None  # requests/s; None: load x the measured capacity
    load: float = 0.8
    seed: int = 0
    workers: int = 64  # client threads sending the open-loop stream
    request_timeout_s: float = 120.0  # no final answer by then: lost
    report_every_s: float = 30.0
    sample_every_s: float = 5.0  # RSS / GPU memory samples
    probe_seconds: float = 30.0
    probe_concurrency: int = 16
    warmup_fraction: float = 0.2  # memory is compared between this point of the run and its end
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.minutes <= 0:
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if not 0 < self.load <= 4:
            raise ValueError(f"--load must be in (0, 4], got {self.load}")
        if self.workers < 1 or self.probe_concurrency < 1:
            raise ValueError("--workers and --probe-concurrency must be >= 1")
        if not 0 < self.warmup_fraction < 1:
            raise ValueError(f"warm-up fraction must be in (0, 1), got {self.warmup_fraction}")

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0


@dataclass
class SoakContext:
    """Where the server is and what every sender shares. HTTP clients are per thread (geventhttpclient)."""

    target: Target
    admin_token: Optional[str]
    adapters: tuple[str, ...]  # demo adapters for generation (the base model is added as None)
    cycle_adapter: Optional[str]  # unloaded/loaded by admin requests (None: no admin token, list only)
    heads: dict[str, dict[str, tuple[tuple[str, ...], str]]]  # adapter -> task -> (labels, prompt)
    request_timeout_s: float
    images: list[str] = field(default_factory=list)  # base64 images (the load harness's)
    head_images: dict[str, list[str]] = field(default_factory=dict)  # a generated task's own images (vlora.fusion)
    run_start: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        # (start, end) monotonic of the latest unload and load calls, and how many of each are running now
        self._calls: dict[str, list[tuple[float, float]]] = {"unload": [], "load": []}
        self._running: dict[str, int] = {"unload": 0, "load": 0}
        self.grpc = GrpcSender(self.target.grpc_url, self.target.model)  # one client per thread inside

    @property
    def left_out(self) -> tuple[str, ...]:
        """Kinds this server cannot take: heads without any adapter that has them."""
        return () if self.heads else ("head",)

    def admin_started(self, action: str) -> float:
        with self._lock:
            self._running[action] += 1
        return time.monotonic()

    def admin_ended(self, action: str, start: float) -> None:
        with self._lock:
            self._running[action] -= 1
            self._calls[action] = self._calls[action][-63:] + [(start, time.monotonic())]

    def overlapped(self, action: str, start: float, end: float) -> bool:
        """Whether an ``action`` (unload or load) call ran at some moment of [start, end]."""
        with self._lock:
            return self._running[action] > 0 or any(s <= end and e >= start for s, e in self._calls[action])

    def http(self) -> HttpTransport:
        if getattr(self._local, "http", None) is None:
            self._local.http = HttpTransport(self.target.http_url, self.target.model, self.request_timeout_s, concurrency=2)
        return self._local.http

    def post(self, body: dict, timeout_s: Optional[float] = None) -> tuple[int, dict]:
        return post_generate(self.target, body, timeout_s or self.request_timeout_s)


def read_heads(adapter_root: Optional[str]) -> dict[str, dict[str, tuple[tuple[str, ...], str]]]:
    """adapter -> task -> (labels, training prompt), from the adapters' vlora_heads.json; the demo ones
    when the root is unknown or holds none."""
    return head_prompts(adapter_root) or dict(DEMO_HEADS)


def write_soak_adapters(model_dir: Path, root: Path) -> Path:
    """The soak's adapters for any LLaVA-family model folder (e.g. a random 7B one): the demo adapters
    (``vlora.lora.demo``, random weights at the model's dimensions, the cycled adapter included) and, under
    the demo head adapters' names, rank-8 q/v adapters with random task heads of the demo tasks, labels and
    prompts (a random head still answers one of its labels). Existing folders are kept. Returns ``root``."""
    from vlora.lora.demo import ensure_demo_adapters

    ensure_demo_adapters(Path(model_dir), Path(root), trained=False)
    ensure_head_adapters(model_dir, root, {name: {task: (HEAD_TASK_TYPES[task], labels, prompt) for task, (labels, prompt)
                                                  in tasks.items()} for name, tasks in DEMO_HEADS.items()})
    return Path(root)


# -- the kinds of request: each returns its record with ``outcome`` in SOAK_OUTCOMES (or the harness's) ----------

def soak_outcome(record: RequestRecord, cycle_adapter: Optional[str]) -> str:
    """The soak's outcome of a load-harness record (ok, rejected, incomplete, timeout, error)."""
    if record.outcome in SOAK_OUTCOMES:
        return record.outcome
    if record.outcome == "timeout":
        return "lost"
    if (record.outcome == "error" and cycle_adapter and record.adapter == cycle_adapter
            and any(m in record.error for m in UNLOAD_REFUSALS)):
        return "expected"
    return "unexpected"


def _record(index: int, kind: str, adapter: Optional[str], protocol: str, ctx: SoakContext) -> RequestRecord:
    return RequestRecord(index=index, application="soak", task=kind, adapter=adapter or "", protocol=protocol,
                         start_s=time.monotonic() - ctx.run_start)


def _adapter(ctx: SoakContext, rng: random.Random) -> Optional[str]:
    return rng.choice([None, *ctx.adapters, *([ctx.cycle_adapter] if ctx.cycle_adapter else [])])


def send_generation(kind: str, ctx: SoakContext, rng: random.Random, index: int) -> RequestRecord:
    """text, image, stream_http, stream_grpc: generation on the base model or an adapter."""
    if kind == "image":
        n = rng.choice((1, 1, 2, 3))
        images = tuple(rng.choice(ctx.images) for _ in range(n))
        prompt = (f"USER: {'<image>' * n}\n" + ("Describe the picture." if n == 1 else f"What changes over these {n} frames?")
                  + " ASSISTANT:")
    elif kind != "text" and rng.random() < 0.3:
        images, prompt = (rng.choice(ctx.images),), "USER: <image>\nDescribe it. ASSISTANT:"
    else:
        images, prompt = (), rng.choice(PROMPTS)
    lo, hi = {"text": (4, 16), "image": (4, 12)}.get(kind, (8, 24))
    spec = RequestSpec(index, "soak", kind, _adapter(ctx, rng), prompt, images, rng.randint(lo, hi))
    if kind != "stream_grpc":
        return ctx.http().send(spec, streaming=kind == "stream_http", run_start=ctx.run_start)
    job = job_payload(spec, stream=True) | {"timeout": ctx.request_timeout_s}
    return record_grpc_result(new_record(spec, "grpc-stream", ctx.run_start), ctx.grpc.send(job))


def send_head(ctx: SoakContext, rng: random.Random, index: int) -> RequestRecord:
    adapter = rng.choice(sorted(ctx.heads))
    task = rng.choice(sorted(ctx.heads[adapter]))
    labels, prompt = ctx.heads[adapter][task]
    image = rng.choice(ctx.head_images.get(task) or ctx.images)
    spec = RequestSpec(index, "soak", "head", adapter, prompt.replace("{images}", "<image>"), (image,), 1, head_task=task)
    record = ctx.http().send(spec, streaming=False, run_start=ctx.run_start)
    if record.outcome == "ok" and record.text not in labels:
        record.outcome, record.error = "unexpected", f"head {adapter}/{task} answered {record.text!r}, not one of {labels}"
    return record


def send_disconnect(ctx: SoakContext, rng: random.Random, index: int) -> RequestRecord:
    """A long stream whose client goes away after 3 responses (HTTP or gRPC, half each): ok when tokens came."""
    spec = RequestSpec(index, "soak", "disconnect", _adapter(ctx, rng), rng.choice(PROMPTS), (), 256)
    http = rng.random() < 0.5
    record = _record(index, "disconnect", spec.adapter, "http-disconnect" if http else "grpc-cancel", ctx)
    return leave_stream(ctx.target, spec, record, http, responses=3, timeout_s=ctx.request_timeout_s)


def _post_timed(ctx: SoakContext, record: RequestRecord, body: dict, what: str, timeout_s: Optional[float] = None):
    """POST for admin and bad requests: (status, payload), or None with the record failed when nothing came back."""
    t0 = time.monotonic()
    try:
        status, payload = ctx.post(body, timeout_s)
    except OSError as e:
        record.e2e_s = time.monotonic() - t0
        record.outcome, record.error = "timeout" if "timed out" in str(e) else "error", f"{what}: {type(e).__name__}: {e}"
        return None
    record.e2e_s = record.ttft_s = time.monotonic() - t0
    return status, payload


def send_admin(ctx: SoakContext, rng: random.Random, index: int) -> RequestRecord:
    """``list`` (half), and ``unload``/``load`` of the cycled adapter with the admin token."""
    action = "list" if ctx.cycle_adapter is None or rng.random() < 0.5 else rng.choice(("unload", "load"))
    record = _record(index, "admin", ctx.cycle_adapter if action != "list" else None, f"admin-{action}", ctx)
    record.head_task = action  # which action, for the report's examples
    body: dict = {"text_input": "", "adapter_action": action}
    if action != "list":
        body |= {"lora_name": ctx.cycle_adapter, "admin_token": ctx.admin_token}
    t0 = ctx.admin_started(action) if action != "list" else time.monotonic()
    try:  # an unload waits up to lora.unload_timeout_s (30 s by default) for the adapter's requests
        answer = _post_timed(ctx, record, body, f"admin {action}", ctx.request_timeout_s + 60)
    finally:
        if action != "list":
            ctx.admin_ended(action, t0)
    if answer is None:
        return record
    status, payload = answer
    if status != 200:
        message = str(payload.get("error", payload))
        expected = action == "load" and "is being unloaded" in message
        record.outcome = "expected" if expected else ("rejected" if classify_error(message, status) == "rejected" else "unexpected")
        record.error = f"admin {action}: HTTP {status}: {message}"
        return record
    record.outcome, state = "unexpected", ""
    try:
        answer = json.loads(payload["text_output"] if isinstance(payload["text_output"], str) else payload["text_output"][0])
        if action == "list":
            good = isinstance(answer["adapters"], list) and len(answer["adapters"]) >= len(ctx.adapters)
        elif action == "unload":
            state = str(answer["unloaded"].get("state", ""))
            good = state in ("unloaded", "unloading")
        else:
            good, state = bool(answer["loaded"].get("loaded")), str(answer["loaded"].get("state", ""))
        record.text = json.dumps(answer)[:200]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        good, record.text = False, f"{type(e).__name__}: {e}: {str(payload)[:200]}"
    if good:
        record.outcome = "ok"
    elif action == "load" and ctx.overlapped("unload", t0, time.monotonic()) and state.startswith("unload"):
        # The load succeeded, but another client's unload of the same adapter completed before the answer was
        # written: the answer shows the adapter as it is then (the load and its answer are two steps in the engine).
        record.outcome, record.error = "expected", f"admin load raced an unload: answered {record.text}"
    elif action == "unload" and ctx.overlapped("load", t0, time.monotonic()) and state == "loaded":
        # The mirror case: the unload completed, then another client's load (on its own thread) read the adapter
        # back before the unload's answer was written, which shows the adapter as it is then.
        record.outcome, record.error = "expected", f"admin unload raced a load: answered {record.text}"
    else:
        record.error = f"admin {action}: unexpected answer (state {state!r}) {record.text}"
    return record


GOOD = "USER: Say something. ASSISTANT:"


def send_bad(ctx: SoakContext, rng: random.Random, index: int) -> RequestRecord:
    """A deliberately bad request; ``expected`` when it gets HTTP 400 whose error names the problem."""
    sp = json.dumps
    case, body, words = rng.choice([
        ("unknown-adapter", {"text_input": GOOD, "lora_name": "no-such-adapter-soak"}, ("no-such-adapter-soak",)),
        ("empty-prompt", {"text_input": ""}, ("empty",)),
        ("bad-json", {"text_input": GOOD, "sampling_parameters": "{max_tokens: 5"}, ("sampling_parameters",)),
        ("not-an-image", {"text_input": GOOD, "image": [base64.b64encode(b"not a picture at all").decode()]}, ("image",)),
        ("seed-2**64", {"text_input": GOOD, "sampling_parameters": sp({"seed": 2 ** 64, "temperature": 0.7})}, ("seed",)),
        ("top_p-1e-46", {"text_input": GOOD, "sampling_parameters": sp({"top_p": 1e-46, "temperature": 0.7})}, ("top_p",)),
        ("too-many-images", {"text_input": GOOD, "image": [rng.choice(ctx.images)] * 9}, ("image",)),
        ("load-without-token", {"text_input": "", "adapter_action": "load", "lora_name": DEMO_ADAPTERS[0]},
         ("admin_token",) if ctx.admin_token else ("admin-token-file",)),
    ])
    record = _record(index, "bad", None, "http", ctx)
    record.head_task = case
    answer = _post_timed(ctx, record, body, f"bad request {case}")
    if answer is None:
        return record
    status, payload = answer
    message = str(payload.get("error", ""))
    if status == 400 and all(w.lower() in message.lower() for w in words):
        record.outcome = "expected"
    elif classify_error(message, status) == "rejected":
        record.outcome, record.error = "rejected", message
    else:
        record.outcome = "unexpected"
        record.error = f"bad request {case}: expected HTTP 400 naming {list(words)}, got {status}: {str(payload)[:300]}"
    return record


SENDERS: dict[str, Callable[[SoakContext, random.Random, int], RequestRecord]] = {
    **{k: (lambda ctx, rng, i, k=k: send_generation(k, ctx, rng, i)) for k in ("text", "image", "stream_http", "stream_grpc")},
    "head": send_head, "disconnect": send_disconnect, "admin": send_admin, "bad": send_bad}


def pick_kind(rng: random.Random, leave_out: tuple[str, ...] = ()) -> str:
    names = [n for n in KINDS if n not in leave_out]
    return rng.choices(names, weights=[KINDS[n] for n in names])[0]


# -- results -------------------------------------------------------------------------------------------

@dataclass
class Outcomes:
    """Every finished request (thread-safe): kind, soak outcome, latencies, and the unexpected ones."""

    cycle_adapter: Optional[str]
    records: list[tuple[float, str, str, float, float]] = field(default_factory=list)  # (t_done, kind, outcome, e2e, ttft)
    failures: list[dict] = field(default_factory=list)
    expected_examples: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, record: RequestRecord, t_done: float) -> str:
        outcome = soak_outcome(record, self.cycle_adapter)
        with self._lock:
            self.records.append((t_done, record.task, outcome, record.e2e_s, record.ttft_s))
            if outcome in ("unexpected", "lost") and len(self.failures) < 200:
                self.failures.append({"t_s": round(t_done, 2), "kind": record.task, "outcome": outcome,
                                      "protocol": record.protocol, "adapter": record.adapter,
                                      "error": (record.error or "")[:600], "text": record.text[:200],
                                      "num_output_tokens": record.num_output_tokens,
                                      "expected_output_tokens": record.expected_output_tokens,
                                      "finish_reason": record.finish_reason})
            if outcome == "expected":
                self.expected_examples.setdefault(f"{record.task}/{record.head_task or record.adapter}", (record.error or "400")[:200])
        return outcome

    def add_lost(self, kind: str, t_done: float, why: str) -> None:
        with self._lock:
            self.records.append((t_done, kind, "lost", float("nan"), float("nan")))
            self.failures.append({"t_s": round(t_done, 2), "kind": kind, "outcome": "lost", "error": why})

    def snapshot(self) -> list[tuple[float, str, str, float, float]]:
        with self._lock:
            return list(self.records)


def summarize(records: list[tuple[float, str, str, float, float]]) -> dict:
    """Per kind and in total: counts per outcome, and p50/p99 of e2e (and TTFT) latency of the ok ones."""
    out: dict = {}
    for kind in [*sorted({r[1] for r in records}, key=lambda k: list(KINDS).index(k) if k in KINDS else 99), "all"]:
        rows = [r for r in records if kind == "all" or r[1] == kind]
        counts = Counter(r[2] for r in rows)
        # Latency of the answers the kind exists for: ok ones; a bad request's expected 400 otherwise.
        answered = [r for r in rows if r[2] == "ok"] or [r for r in rows if r[2] == "expected"]
        e2e, ttft = [r[3] for r in answered], [r[4] for r in answered if r[4] == r[4]]
        out[kind] = {"requests": len(rows), **{o: counts.get(o, 0) for o in SOAK_OUTCOMES},
                     **{f"{name}_p{q}_ms": _ms(percentile(values, q)) for name, values in (("e2e", e2e), ("ttft", ttft))
                        for q in (50, 99)}}
    return out


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None or seconds != seconds else round(seconds * 1000.0, 1)


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0f}"


def format_table(summary: dict) -> str:
    lines = [f"  {'kind':<12}{'sent':>7}{'ok':>7}{'expect':>7}{'reject':>7}{'unexp':>7}{'lost':>6}   e2e p50/p99 ms      ttft p50/p99 ms"]
    for kind, s in summary.items():
        ttft = f"{_fmt(s['ttft_p50_ms'])}/{_fmt(s['ttft_p99_ms'])}" if kind.startswith(("stream", "disconnect")) else ""
        lines.append(f"  {kind:<12}{s['requests']:>7}{s['ok']:>7}{s['expected']:>7}{s['rejected']:>7}"
                     f"{s['unexpected']:>7}{s['lost']:>6}   {_fmt(s['e2e_p50_ms']) + '/' + _fmt(s['e2e_p99_ms']):<20}{ttft}")
    return "\n".join(lines)


def choose_adapters(listed: list[dict], cycle: Optional[str]) -> tuple[tuple[str, ...], Optional[str]]:
    """The demo adapters when the server has them, else up to three of its others; the cycled adapter
    only when the server has it."""
    names = [a["name"] for a in listed if a.get("loaded", True)]
    cycle = cycle if cycle in names else None
    if all(n in names for n in DEMO_ADAPTERS):
        return DEMO_ADAPTERS, cycle
    return tuple(n for n in names if n != cycle)[:3], cycle


# -- the run ---------------------------------------------------------------------------------------------

def warm_up(ctx: SoakContext, seed: int) -> list[RequestRecord]:
    """One request of every kind, one after the other (reads every demo adapter into memory once)."""
    rng = random.Random(seed * 7 + 3)
    out = [SENDERS[kind](ctx, rng, -1 - i) for i, kind in enumerate(KINDS)
           if kind != "admin" and kind not in ctx.left_out]  # no unload before the soak
    for adapter in ctx.adapters:
        out.append(ctx.http().send(RequestSpec(-100, "soak", "text", adapter, PROMPTS[0], (), 2), False, ctx.run_start))
    return out


def send_any(ctx: SoakContext):
    def send(kind: str, rng: random.Random, index: int) -> RequestRecord:
        try:
            return SENDERS[kind](ctx, rng, index)
        except Exception as e:  # a bug in a sender must not pass as a lost request
            return RequestRecord(index=index, application="soak", task=kind, adapter="", protocol="?",
                                 outcome="unexpected", error=f"client error: {type(e).__name__}: {e}")
    return send


def probe_capacity(ctx: SoakContext, cfg: SoakConfig, outcomes: Outcomes) -> dict:
    """Closed loop: ``probe_concurrency`` clients send the mix back to back for ``probe_seconds``;
    capacity = requests answered (ok or expected) per second."""
    t0 = time.monotonic()
    done = closed_loop(cfg.probe_concurrency, cfg.probe_seconds, seed=cfg.seed, pick=lambda rng: pick_kind(rng, ctx.left_out),
                       send=lambda kind, rng, i: SENDERS[kind](ctx, rng, i), on_done=outcomes.add,
                       join_s=cfg.probe_seconds + cfg.request_timeout_s + 90)
    answered = [t for t, o in done if o in ("ok", "expected") and t <= t0 + cfg.probe_seconds]
    counts = Counter(o for _t, o in done)
    return {"seconds": cfg.probe_seconds, "concurrency": cfg.probe_concurrency,
            "capacity_rps": round(len(answered) / cfg.probe_seconds, 3), "requests": len(done),
            **{o: counts.get(o, 0) for o in SOAK_OUTCOMES}, "wall_s": round(time.monotonic() - t0, 1)}


def run_soak(ctx: SoakContext, cfg: SoakConfig, rate: float, outcomes: Outcomes, sampler: MemorySampler) -> dict:
    """The open-loop Poisson stream at ``rate`` for ``cfg.duration_s``; then waits for the requests in flight (an
    unload may wait 30 s more than a request). Returns client-side figures (scheduling lag, in flight at the end)."""
    client = open_loop(rate, cfg.duration_s, ctx.run_start, seed=cfg.seed, workers=cfg.workers,
                       pick=lambda rng: pick_kind(rng, ctx.left_out), send=send_any(ctx), on_done=outcomes.add,
                       grace_s=cfg.request_timeout_s + 90, tick=lambda now: report_progress(now, outcomes, sampler),
                       tick_every_s=cfg.report_every_s, at_end=sampler.sample_now)
    left = client.pop("unfinished")
    for idx, (kind, sent) in left.items():  # never answered, not even by a client timeout
        outcomes.add_lost(kind, time.monotonic() - ctx.run_start, f"request {idx} sent at {sent:.1f}s: no final answer by the end")
    return {**client, "unfinished_at_end": len(left)}


def report_progress(now: float, outcomes: Outcomes, sampler: MemorySampler) -> None:
    s = summarize(outcomes.snapshot())
    a = s["all"]
    say(f"[soak {now:6.0f}s] {a['requests']} requests: ok {a['ok']}, expected {a['expected']}, rejected {a['rejected']}, "
        f"unexpected {a['unexpected']}, lost {a['lost']}")
    say(format_table(s))
    say(memory_line(sampler.latest()))


# -- main ------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="minutes of traffic (default 5)")
    rate = ap.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="open-loop requests/s (Poisson); skips the capacity probe")
    rate.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity (default 0.8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", metavar="HOST:PORT", help="a running server's HTTP address (gRPC PORT+1, metrics PORT+2) "
                    "instead of starting one; it must be on this machine for RSS figures")
    ap.add_argument("--grpc-url", metavar="HOST:PORT")
    ap.add_argument("--metrics-url", metavar="URL")
    ap.add_argument("--admin-token-file", metavar="FILE", help="with --url: the server's admin token (without it: list only)")
    ap.add_argument("--adapters", metavar="DIR", help="with --url: the server's adapter root (for the heads' prompts)")
    ap.add_argument("--cycle-adapter", default=CYCLE_ADAPTER, help=f"adapter the admin requests unload and load (default {CYCLE_ADAPTER})")
    ap.add_argument("--device", help="device of the started server (auto, cpu, cuda)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG", help="more `vlora serve` arguments (repeatable)")
    ap.add_argument("--workers", type=int, default=64, help="client threads of the open-loop stream (default 64)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request counts as lost")
    ap.add_argument("--probe-seconds", type=float, default=30.0)
    ap.add_argument("--probe-concurrency", type=int, default=16)
    ap.add_argument("--report-every", type=float, default=30.0)
    ap.add_argument("--out", metavar="DIR", help=f"where soak-<device>.json and the server's workspace go (default {RESULTS})")
    ap.add_argument("--no-record", action="store_true", help="no line in benchmarks/RESULTS.md")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    for var in ("no_proxy", "NO_PROXY"):  # loopback traffic never goes through a proxy
        os.environ[var] = ",".join(filter(None, [os.environ.get(var, ""), "127.0.0.1", "localhost"]))
    args = parse_args(argv)
    cfg = SoakConfig(minutes=args.minutes, rate=args.rate, load=args.load, seed=args.seed, workers=args.workers,
                     request_timeout_s=args.request_timeout, report_every_s=args.report_every,
                     probe_seconds=args.probe_seconds, probe_concurrency=args.probe_concurrency)
    out_dir = Path(args.out) if args.out else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        if args.url:
            target = Target.from_url(args.url, args.grpc_url, args.metrics_url)
            token = Path(args.admin_token_file).read_text().strip() if args.admin_token_file else None
            adapter_root = args.adapters
        else:
            try:
                server, token = start_server(out_dir / "soak-server", args.device, args.serve_arg)
            except Exception as e:
                say(f"soak: the server did not start: {e}")
                return 2
            target, adapter_root = target_of(server), server.adapter_root
        return soak(args, cfg, target, token, adapter_root, server, out_dir)[0]
    finally:
        if server is not None:
            say("stopping the server ...")
            say(f"server stopped (exit code {server.stop()})")


def soak(args, cfg: SoakConfig, target: Target, token: Optional[str], adapter_root: Optional[str], server,
         out_dir: Path) -> tuple[int, dict]:
    """The soak against ``target``: returns the exit code (0 passed, 1 failed, 2 not serving) and the result
    (also written to ``out_dir``/soak-<device>.json, and recorded unless ``args.no_record``)."""
    pool = ImagePool(cfg.seed + 99, 64, 16)
    ctx = SoakContext(target=target, admin_token=token, adapters=DEMO_ADAPTERS, cycle_adapter=args.cycle_adapter if token else None,
                      heads=read_heads(adapter_root), request_timeout_s=cfg.request_timeout_s,
                      images=[pool.image(i) for i in range(16)])
    ok, why = health_check(target)
    if not ok:
        say(f"soak: the server at {target.http_url} is not serving: {why}")
        return 2, {"passed": False, "health_before": why}
    listed = served_adapters(target)
    ctx.adapters, ctx.cycle_adapter = choose_adapters(listed, ctx.cycle_adapter)
    served = {a["name"] for a in listed if a.get("loaded", True)}
    # Heads only of adapters this server serves (the demo heads are the fallback when the root is not readable).
    ctx.heads = {a: t for a, t in ctx.heads.items() if a != ctx.cycle_adapter and (not served or a in served)}
    ctx.head_images = {task: task_images(task) for tasks in ctx.heads.values() for task in tasks}
    if not ctx.heads:
        say("soak: no adapter with task heads: the head requests are left out")
    watch = ServerWatch(target, server.log_path if server is not None else None)

    say(f"soak: server {target.http_url} (gRPC {target.grpc_url}); admin "
        f"{'load/unload of ' + ctx.cycle_adapter if ctx.cycle_adapter else 'list only (no token)'}; "
        f"heads {', '.join(f'{a}:{t}' for a, ts in ctx.heads.items() for t in ts)}")
    probe_outcomes = Outcomes(ctx.cycle_adapter)
    for r in warm_up(ctx, cfg.seed):
        probe_outcomes.add(r, 0.0)
    probe, rate = None, cfg.rate
    if cfg.rate is None:
        say(f"soak: measuring capacity: {cfg.probe_concurrency} closed-loop clients for {cfg.probe_seconds:g}s ...")
        probe = probe_capacity(ctx, cfg, probe_outcomes)
        rate = cfg.load * probe["capacity_rps"]
        say(f"soak: capacity {probe['capacity_rps']:.2f} req/s ({probe['requests']} requests: {probe['ok']} ok, "
            f"{probe['expected']} expected, {probe['unexpected']} unexpected, {probe['lost']} lost); "
            f"soak rate {rate:.2f} req/s = {cfg.load:g} x capacity")
        if rate <= 0:
            say("soak: capacity probe answered nothing")
            return 1, {"passed": False, "probe": probe}
    wait_idle(target.metrics_url, 60, sys.stdout)

    outcomes = Outcomes(ctx.cycle_adapter)
    ctx.run_start = time.monotonic()
    sampler = watch.start(ServerProcesses.of(target.http_url), cfg.sample_every_s, ctx.run_start)
    say(f"soak: {cfg.minutes:g} min at {rate:.2f} req/s (open loop, Poisson, seed {cfg.seed}), {cfg.workers} client threads")
    client = run_soak(ctx, cfg, rate, outcomes, sampler)
    t_end = time.monotonic() - ctx.run_start
    checks = watch.finish(cfg.drain_timeout_s)
    summary = summarize(outcomes.snapshot())
    a = summary["all"]
    samples = sampler.all()
    memory = {key: m for key in ("server_rss_mb", "stub_rss_mb", "stub_anon_mb", "gpu_server_mb", "gpu_used_total_mb")
              if (m := flatness(samples, cfg.duration_s, cfg.warmup_fraction, key)) is not None}
    probe_failed = list(probe_outcomes.failures)
    passed = a["unexpected"] + a["lost"] + len(probe_failed) == 0 and checks["drained"] and checks["healthy_after"]
    dev = "cpu" if (args.device == "cpu" or server is not None and server.engine_config.model.device == "cpu") else device_name()
    result = {
        "benchmark": "soak", "device": dev, "commit": git_commit(), "minutes": cfg.minutes, "seed": cfg.seed,
        "target": target.http_url, "started_server": server is not None, "load": cfg.load if cfg.rate is None else None,
        "rate_rps": round(rate, 3), "probe": probe, "client": client, "traffic_s": round(t_end, 1), "kinds": dict(KINDS),
        "cycle_adapter": ctx.cycle_adapter, "outcomes": summary, "memory": memory,
        "memory_after_drain": checks["memory_after_drain"], "memory_samples": samples,
        **{k: checks[k] for k in ("server_finished_by_reason", "drained", "health_after", "healthy_after",
                                  "server_log_errors", "server_log_error_examples")},
        "failures": outcomes.failures, "probe_failures": probe_failed, "expected_error_examples": outcomes.expected_examples,
        "passed": passed,
    }
    say(f"\n[soak end] {a['requests']} requests in {cfg.minutes:g} min at {rate:.2f} req/s")
    say(format_table(summary))
    for key, m in memory.items():
        say(f"  {key}: {m['warmup_mb']} MB at {100 * cfg.warmup_fraction:.0f}% -> {m['end_mb']} MB at the end: "
            f"{m['growth_mb']:+.1f} MB ({m['growth_pct']:+.2f}%), peak after warm-up {m['peak_after_warmup_mb']} MB")
    say(memory_line(checks["memory_after_drain"]) + " (after the drain)")
    say("  the server's finished requests by reason during the soak: "
        + (", ".join(f"{k} {v}" for k, v in checks["server_finished_by_reason"].items()) or "-"))
    say(f"  drained (running and waiting back to 0): {checks['drained']}; after the run: {checks['health_after']}; "
        f"server log: {checks['server_log_errors']} error lines")
    for f in (outcomes.failures + probe_failed)[:10]:
        say(f"  FAILED {f}")
    say(f"soak: {'PASSED' if passed else 'FAILED'}: {a['unexpected']} unexpected, {a['lost']} lost"
        f"{f', {len(probe_failed)} failed in the warm-up/probe' if probe_failed else ''}")

    stub, text = memory.get("stub_rss_mb"), summary.get("text", {})
    line = (f"{cfg.minutes:g} min at {rate:.2f} req/s" + (f" ({cfg.load:g} x capacity {probe['capacity_rps']:.2f} req/s)" if probe else "")
            + f": {a['requests']} requests, {a['ok']} ok, {a['expected']} expected errors, {a['rejected']} rejected, "
            f"{a['unexpected']} unexpected, {a['lost']} lost; text p50/p99 {_fmt(text.get('e2e_p50_ms'))}/{_fmt(text.get('e2e_p99_ms'))} ms"
            + (f"; stub RSS {stub['warmup_mb']:.0f} -> {stub['end_mb']:.0f} MB ({stub['growth_pct']:+.1f}%)" if stub else "")
            + (f"; GPU memory of the server {gpu['warmup_mb']:.0f} -> {gpu['end_mb']:.0f} MB ({gpu['growth_pct']:+.1f}%)"
               if (gpu := memory.get("gpu_server_mb")) else ""))
    if args.no_record:
        path = out_dir / f"soak-{dev}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {path}\nsummary: {line}")
    else:
        path = record_result("soak", dev, result, line)
        if out_dir.resolve() != RESULTS.resolve():
            (out_dir / path.name).write_text(path.read_text())
    result["summary_line"] = line
    return (0 if passed else 1), result


if __name__ == "__main__":
    sys.exit(main())
