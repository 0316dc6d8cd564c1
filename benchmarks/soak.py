"""Soak test: mixed traffic against a real vlora server for N minutes; every request's outcome, latency,
and whether the server's and its Python stub's memory stays flat after warm-up.

    python -m benchmarks.soak --minutes 5 --load 0.8          # starts `vlora serve` on loopback (tiny model)
    python -m benchmarks.soak --url 127.0.0.1:8000 --admin-token-file admin.token --rate 3

Without ``--url`` it starts ``vlora serve`` on free 127.0.0.1 ports (the tiny default model and its demo
adapters unless ``--serve-arg`` says otherwise) with a fresh admin token, and stops it at the end. First it
measures the capacity of the mix (closed loop, ``--probe-concurrency`` clients for ``--probe-seconds``),
then sends an open-loop Poisson stream at ``--rate`` requests/s, or ``--load`` times that capacity, from a
pool of client threads. The mix (``KINDS``, one class per kind of request):

- ``text``: HTTP ``/generate``, base model or a demo adapter, ``ignore_eos``: exactly ``max_tokens`` back;
- ``image``: HTTP ``/generate`` with one to three small PNGs (several: the frames of a video);
- ``stream_http`` / ``stream_grpc``: HTTP ``/generate_stream`` (server-sent events) and gRPC streaming;
- ``head``: a demo adapter's task head, with the prompt it was trained with; the label must be one of its labels;
- ``disconnect``: a stream whose client goes away after a few tokens (HTTP: the socket is closed;
  gRPC: the stream is cancelled);
- ``admin``: adapter ``list``, and ``unload``/``load`` of one demo adapter (``--cycle-adapter``) with the admin
  token while other requests use it;
- ``bad``: deliberately bad requests, each of which must get HTTP 400 naming the problem.

Outcomes: ``ok``; ``expected`` (a bad request's 400, and the documented refusals while the cycled adapter is
being unloaded or is unloaded: "is being unloaded", "is unloaded; load it again first"; and a ``load`` whose
answer shows the adapter unloaded because another ``unload`` of it overlapped the call); ``rejected`` (the
server was full and said so: "Exceeds maximum queue size", "server overloaded"); ``unexpected`` (any other
error, or an answer that is short or wrong); ``lost`` (no final answer within ``--request-timeout``).

Every ``--report-every`` seconds and at the end it prints the counts per kind and outcome, p50/p99 of the
end-to-end latency (and of the first token for streams) per kind, the RSS of tritonserver and of its
``triton_python_backend_stub`` processes (found in /proc: the tritonserver whose command line names the HTTP
port, and its children), and on CUDA the stub's GPU memory from nvidia-smi. Memory flatness compares the RSS
around 20% of the run (after warm-up) with the RSS at its end. After the traffic it checks that the server's
running and waiting gauges return to 0 and that a normal request is still answered.

Writes ``<out>/soak-<device>.json`` (default ``benchmarks/results``) and, unless ``--no-record``, a line in
``benchmarks/RESULTS.md``. Exit code 1 when any request failed unexpectedly or was lost, or a check after the
run failed; 2 when the server could not be started or reached.
"""
from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import queue
import random
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Optional

from benchmarks.common import RESULTS, device_name, git_commit, record_result

from vlora_load.generators import RequestSpec
from vlora_load.grpc_worker import GrpcSender
from vlora_load.runner import Target, wait_idle
from vlora_load.scrape import MetricsScraper
from vlora_load.summary import percentile
from vlora_load.transport import (
    HttpTransport,
    RequestRecord,
    classify_error,
    finish_timings,
    job_payload,
    record_grpc_result,
)
from vlora.server.launcher import STUB_NAME

MODEL = "vlora"
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
PROMPTS = (
    "USER: Tell me a short story about a lighthouse. ASSISTANT:",
    "USER: What is the capital of France? ASSISTANT:",
    "USER: List three colours and a fruit of each colour. ASSISTANT:",
    "USER: Explain in one sentence why the sky is blue. ASSISTANT:",
    "USER: Write a haiku about a cat sleeping in the sun. ASSISTANT:",
)


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# -- configuration -------------------------------------------------------------------------------------

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


# -- what the requests are sent with -------------------------------------------------------------------

@dataclass
class SoakContext:
    """Where the server is and what every sender shares. HTTP clients are per thread (geventhttpclient)."""

    target: Target
    admin_token: Optional[str]
    adapters: tuple[str, ...]  # demo adapters for generation (the base model is added as None)
    cycle_adapter: Optional[str]  # unloaded/loaded by admin requests (None: no admin token, list only)
    heads: dict[str, dict[str, tuple[tuple[str, ...], str]]]  # adapter -> task -> (labels, prompt)
    request_timeout_s: float
    images: list[str] = field(default_factory=list)  # base64 PNGs
    circles: list[str] = field(default_factory=list)  # base64 PNGs of 1-6 circles, for the heads
    run_start: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._local = threading.local()
        self._unloads_lock = threading.Lock()
        self._unloads: list[tuple[float, float]] = []  # (start, end) monotonic, of the latest unload calls
        self._unloads_running = 0
        self.grpc = GrpcSender(self.target.grpc_url, self.target.model)  # one client per thread inside
        host, _, port = self.target.http_url.partition(":")
        self.http_host, self.http_port = host, int(port)

    @property
    def left_out(self) -> tuple[str, ...]:
        """Kinds this server cannot take: heads without any adapter that has them."""
        return () if self.heads else ("head",)

    def unload_started(self) -> float:
        with self._unloads_lock:
            self._unloads_running += 1
        return time.monotonic()

    def unload_ended(self, start: float) -> None:
        with self._unloads_lock:
            self._unloads_running -= 1
            self._unloads = self._unloads[-63:] + [(start, time.monotonic())]

    def unload_overlapped(self, start: float, end: float) -> bool:
        """Whether an unload call ran at some moment of [start, end]."""
        with self._unloads_lock:
            return self._unloads_running > 0 or any(s <= end and e >= start for s, e in self._unloads)

    def http(self) -> HttpTransport:
        transport = getattr(self._local, "http", None)
        if transport is None:
            transport = self._local.http = HttpTransport(self.target.http_url, self.target.model,
                                                         self.request_timeout_s, concurrency=2)
        return transport

    def post(self, body: dict, timeout_s: Optional[float] = None) -> tuple[int, dict]:
        """POST to /generate; (status, JSON body). Raises OSError (e.g. socket.timeout) on no answer."""
        req = urllib.request.Request(f"http://{self.target.http_url}/v2/models/{self.target.model}/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.request_timeout_s) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read() or b"{}"
            try:
                return e.code, json.loads(raw)
            except json.JSONDecodeError:
                return e.code, {"error": raw.decode(errors="replace")[:500]}


def png_b64(rng: random.Random, size: int = 64, circles: int = 0) -> str:
    """A small PNG: random rectangles on a random background, or ``circles`` white circles on black."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (0, 0, 0) if circles else tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    if circles:
        for i in range(circles):
            cx, cy = (i % 3) * size // 3 + size // 6, (i // 3) * size // 2 + size // 4
            r = size // 10
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(255, 255, 255))
    else:
        for _ in range(rng.randint(1, 4)):
            x, y = rng.randrange(size), rng.randrange(size)
            draw.rectangle([x, y, x + rng.randrange(4, size // 2), y + rng.randrange(4, size // 2)],
                           fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def read_heads(adapter_root: Optional[str]) -> dict[str, dict[str, tuple[tuple[str, ...], str]]]:
    """adapter -> task -> (labels, training prompt), from the adapters' vlora_heads.json; the demo ones
    when the root is unknown or holds none."""
    from vlora.heads import HEADS_CONFIG

    found: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {}
    if adapter_root and Path(adapter_root).is_dir():
        for path in sorted(Path(adapter_root).glob(f"*/{HEADS_CONFIG}")):
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
                tasks = {str(h["task"]): (tuple(str(x) for x in h["labels"]), str(h["prompt"])) for h in config["heads"]}
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if tasks:
                found[path.parent.name] = tasks
    return found or dict(DEMO_HEADS)


HEAD_TASK_TYPES = {"count-circles": "counting", "color": "classification"}


def write_soak_adapters(model_dir: Path, root: Path) -> Path:
    """The soak's adapters for any LLaVA-family model folder (e.g. a random 7B one): the demo adapters
    (``vlora.lora.demo``, random weights at the model's dimensions, the cycled adapter included) and, under
    the demo head adapters' names, rank-8 q/v adapters with random task heads of the demo tasks, labels and
    prompts (a random head still answers one of its labels). Existing folders are kept. Returns ``root``."""
    import torch

    from vlora.heads import TaskHead, has_heads, save_heads
    from vlora.lora.demo import DemoAdapter, ensure_demo_adapters, write_adapter

    model_dir, root = Path(model_dir), Path(root)
    ensure_demo_adapters(model_dir, root, trained=False)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    hidden = int(text["hidden_size"])
    for i, (name, tasks) in enumerate(sorted(DEMO_HEADS.items())):
        folder = root / name
        if has_heads(folder) and (folder / "adapter_config.json").is_file():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        write_adapter(DemoAdapter(name, r=8, alpha=16, modules=("q_proj", "v_proj"), seed=900 + i), model_dir, text, folder)
        g = torch.Generator().manual_seed(900 + i)
        save_heads(folder, {task: TaskHead(task, HEAD_TASK_TYPES[task], labels, torch.randn(len(labels), hidden, generator=g) * 0.02,
                                           torch.zeros(len(labels)), prompt)
                            for task, (labels, prompt) in tasks.items()})
    return root


# -- the kinds of request --------------------------------------------------------------------------------

class RequestKind:
    """One kind of request in the mix: ``send`` returns its record with ``outcome`` in SOAK_OUTCOMES."""

    name: ClassVar[str]
    weight: ClassVar[float]

    def send(self, ctx: SoakContext, rng: random.Random, index: int) -> RequestRecord:
        raise NotImplementedError


def _record(index: int, kind: str, adapter: Optional[str], protocol: str, ctx: SoakContext) -> RequestRecord:
    return RequestRecord(index=index, application="soak", task=kind, adapter=adapter or "", protocol=protocol,
                         start_s=time.monotonic() - ctx.run_start)


def soak_outcome(record: RequestRecord, cycle_adapter: Optional[str]) -> str:
    """The soak's outcome of a load-harness record (ok, rejected, incomplete, timeout, error)."""
    if record.outcome in ("ok", "expected", "rejected", "unexpected", "lost"):
        return record.outcome
    if record.outcome == "timeout":
        return "lost"
    if (record.outcome == "error" and cycle_adapter and record.adapter == cycle_adapter
            and any(m in record.error for m in UNLOAD_REFUSALS)):
        return "expected"
    return "unexpected"


def _generation_adapter(ctx: SoakContext, rng: random.Random) -> Optional[str]:
    choices: list[Optional[str]] = [None, *ctx.adapters]
    if ctx.cycle_adapter:
        choices.append(ctx.cycle_adapter)
    return rng.choice(choices)


def _spec(index: int, kind: str, adapter: Optional[str], prompt: str, images: tuple[str, ...], max_tokens: int,
          head_task: Optional[str] = None) -> RequestSpec:
    return RequestSpec(index, "soak", kind, adapter, prompt, images, max_tokens, head_task=head_task)


class Text(RequestKind):
    name, weight = "text", 0.24

    def send(self, ctx, rng, index):
        spec = _spec(index, self.name, _generation_adapter(ctx, rng), rng.choice(PROMPTS), (), rng.randint(4, 16))
        return ctx.http().send(spec, streaming=False, run_start=ctx.run_start)


class Images(RequestKind):
    name, weight = "image", 0.16

    def send(self, ctx, rng, index):
        n = rng.choice((1, 1, 2, 3))
        images = tuple(rng.choice(ctx.images) for _ in range(n))
        prompt = f"USER: {'<image>' * n}\n" + ("Describe the picture." if n == 1 else f"What changes over these {n} frames?") + " ASSISTANT:"
        spec = _spec(index, self.name, _generation_adapter(ctx, rng), prompt, images, rng.randint(4, 12))
        return ctx.http().send(spec, streaming=False, run_start=ctx.run_start)


class StreamHttp(RequestKind):
    name, weight = "stream_http", 0.14

    def send(self, ctx, rng, index):
        images = (rng.choice(ctx.images),) if rng.random() < 0.3 else ()
        prompt = ("USER: <image>\nDescribe it. ASSISTANT:" if images else rng.choice(PROMPTS))
        spec = _spec(index, self.name, _generation_adapter(ctx, rng), prompt, images, rng.randint(8, 24))
        return ctx.http().send(spec, streaming=True, run_start=ctx.run_start)


class StreamGrpc(RequestKind):
    name, weight = "stream_grpc", 0.14

    def send(self, ctx, rng, index):
        images = (rng.choice(ctx.images),) if rng.random() < 0.3 else ()
        prompt = ("USER: <image>\nDescribe it. ASSISTANT:" if images else rng.choice(PROMPTS))
        spec = _spec(index, self.name, _generation_adapter(ctx, rng), prompt, images, rng.randint(8, 24))
        record = _record(index, self.name, spec.adapter, "grpc-stream", ctx)
        record.expected_output_tokens = spec.expected_output_tokens
        job = job_payload(spec, stream=True)
        job["timeout"] = ctx.request_timeout_s
        return record_grpc_result(record, ctx.grpc.send(job))


class Head(RequestKind):
    name, weight = "head", 0.12

    def send(self, ctx, rng, index):
        adapter = rng.choice(sorted(ctx.heads))
        task = rng.choice(sorted(ctx.heads[adapter]))
        labels, prompt = ctx.heads[adapter][task]
        image = rng.choice(ctx.circles if "circle" in task else ctx.images)
        spec = _spec(index, self.name, adapter, prompt.replace("{images}", "<image>"), (image,), 1, head_task=task)
        record = ctx.http().send(spec, streaming=False, run_start=ctx.run_start)
        if record.outcome == "ok" and record.text not in labels:
            record.outcome, record.error = "unexpected", f"head {adapter}/{task} answered {record.text!r}, not one of {labels}"
        return record


class Disconnect(RequestKind):
    """A long stream whose client goes away after a few tokens: ok when tokens came before it left."""

    name, weight = "disconnect", 0.08
    TOKENS_BEFORE_LEAVING = 3

    def send(self, ctx, rng, index):
        adapter = _generation_adapter(ctx, rng)
        spec = _spec(index, self.name, adapter, rng.choice(PROMPTS), (), 256)
        if rng.random() < 0.5:
            return self._http(ctx, spec)
        return self._grpc(ctx, spec)

    def _http(self, ctx: SoakContext, spec: RequestSpec) -> RequestRecord:
        record = _record(spec.index, self.name, spec.adapter, "http-disconnect", ctx)
        body = {"text_input": spec.prompt, "stream": True, "sampling_parameters": json.dumps(spec.sampling_parameters())}
        conn = http.client.HTTPConnection(ctx.http_host, ctx.http_port, timeout=ctx.request_timeout_s)
        t0, t_first, events = time.monotonic(), None, 0
        try:
            conn.request("POST", f"/v2/models/{ctx.target.model}/generate_stream", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                message = resp.read().decode(errors="replace")[:500]
                record.outcome, record.error = classify_error(message, resp.status), message
            else:
                while events < self.TOKENS_BEFORE_LEAVING:
                    line = resp.readline()
                    if not line:
                        break
                    text = line.decode(errors="replace").strip()
                    if not text.startswith("data:"):
                        continue
                    payload = json.loads(text[5:])
                    if "error" in payload:
                        record.outcome, record.error = classify_error(str(payload["error"])), str(payload["error"])
                        break
                    events += 1
                    t_first = t_first or time.monotonic()
                    if payload.get("finish_reason"):
                        break
                record.num_output_tokens = events
                if not record.error:
                    record.outcome = "ok" if events else "unexpected"
                    record.error = "" if events else "the stream ended before any token"
        except OSError as e:
            record.outcome = "timeout" if "timed out" in str(e) else "error"
            record.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()  # the disconnect: the server must cancel the rest of the request
        finish_timings(record, t0, t_first, time.monotonic())
        return record

    def _grpc(self, ctx: SoakContext, spec: RequestSpec) -> RequestRecord:
        import tritonclient.grpc as grpcclient

        from vlora_client.client import build_grpc_inputs

        record = _record(spec.index, self.name, spec.adapter, "grpc-cancel", ctx)
        events: "queue.Queue" = queue.Queue()
        t0, t_first, received = time.monotonic(), None, 0
        client = grpcclient.InferenceServerClient(ctx.target.grpc_url)
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error)))
            client.async_stream_infer(ctx.target.model, build_grpc_inputs(spec.prompt, [], spec.sampling_parameters(), True),
                                      request_id=f"soak-{spec.index}", enable_empty_final_response=True)
            deadline = t0 + ctx.request_timeout_s
            while received < self.TOKENS_BEFORE_LEAVING:
                try:
                    result, error = events.get(timeout=max(deadline - time.monotonic(), 0.001))
                except queue.Empty:
                    record.outcome, record.error = "timeout", f"no token within {ctx.request_timeout_s:g}s"
                    break
                if error is not None:
                    record.outcome, record.error = classify_error(str(error)), str(error)
                    break
                response = result.get_response()
                if response.outputs:
                    received += 1
                    t_first = t_first or time.monotonic()
                if response.parameters["triton_final_response"].bool_param:
                    break
            record.num_output_tokens = received
            if not record.error:
                record.outcome = "ok" if received else "unexpected"
                record.error = "" if received else "the stream ended before any token"
        except Exception as e:  # the channel failed
            record.outcome, record.error = "error", f"{type(e).__name__}: {e}"
        finally:
            try:
                client.stop_stream(cancel_requests=True)  # the disconnect
            finally:
                client.close()
        finish_timings(record, t0, t_first, time.monotonic())
        return record


class Admin(RequestKind):
    """``list`` (half), and ``unload``/``load`` of the cycled adapter with the admin token."""

    name, weight = "admin", 0.07

    def send(self, ctx, rng, index):
        action = "list" if ctx.cycle_adapter is None or rng.random() < 0.5 else rng.choice(("unload", "load"))
        record = _record(index, self.name, ctx.cycle_adapter if action != "list" else None, f"admin-{action}", ctx)
        record.head_task = action  # which action, for the report's examples
        body: dict = {"text_input": "", "adapter_action": action}
        if action != "list":
            body |= {"lora_name": ctx.cycle_adapter, "admin_token": ctx.admin_token}
        t0 = ctx.unload_started() if action == "unload" else time.monotonic()
        try:
            # An unload waits up to lora.unload_timeout_s (30 s by default) for the adapter's requests.
            status, payload = ctx.post(body, timeout_s=ctx.request_timeout_s + 60)
        except OSError as e:
            record.e2e_s = time.monotonic() - t0
            record.outcome = "timeout" if "timed out" in str(e) else "error"
            record.error = f"admin {action}: {type(e).__name__}: {e}"
            return record
        finally:
            if action == "unload":
                ctx.unload_ended(t0)
        record.e2e_s = record.ttft_s = time.monotonic() - t0
        if status != 200:
            message = str(payload.get("error", payload))
            expected = action == "load" and "is being unloaded" in message
            record.outcome = "expected" if expected else ("rejected" if classify_error(message, status) == "rejected" else "unexpected")
            record.error = f"admin {action}: HTTP {status}: {message}"
            return record
        record.outcome, record.error = "unexpected", ""
        state = ""
        try:
            answer = json.loads(payload["text_output"] if isinstance(payload["text_output"], str) else payload["text_output"][0])
            if action == "list":
                good = isinstance(answer["adapters"], list) and len(answer["adapters"]) >= len(ctx.adapters)
            elif action == "unload":
                good = answer["unloaded"].get("state") in ("unloaded", "unloading")
            else:
                good = bool(answer["loaded"].get("loaded"))
                state = str(answer["loaded"].get("state", ""))
            record.text = json.dumps(answer)[:200]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            good, record.text = False, f"{type(e).__name__}: {e}: {str(payload)[:200]}"
        if good:
            record.outcome = "ok"
        elif action == "load" and ctx.unload_overlapped(t0, time.monotonic()) and state.startswith("unload"):
            # The load succeeded, but another client's unload of the same adapter completed before the
            # answer was written: the answer shows the adapter as it is then (the load and its answer are
            # two steps in the engine). Counted as a refusal we expect, and kept in the examples.
            record.outcome, record.error = "expected", f"admin load raced an unload: answered {record.text}"
        else:
            record.error = f"admin {action}: unexpected answer {record.text}"
        return record


class Bad(RequestKind):
    """A deliberately bad request; ``expected`` when it gets HTTP 400 whose error names the problem."""

    name, weight = "bad", 0.05
    GOOD = "USER: Say something. ASSISTANT:"

    def cases(self, ctx: SoakContext, rng: random.Random) -> list[tuple[str, dict, tuple[str, ...]]]:
        sp = json.dumps
        return [
            ("unknown-adapter", {"text_input": self.GOOD, "lora_name": "no-such-adapter-soak"}, ("no-such-adapter-soak",)),
            ("empty-prompt", {"text_input": ""}, ("empty",)),
            ("bad-json", {"text_input": self.GOOD, "sampling_parameters": "{max_tokens: 5"}, ("sampling_parameters",)),
            ("not-an-image", {"text_input": self.GOOD, "image": [base64.b64encode(b"not a picture at all").decode()]}, ("image",)),
            ("seed-2**64", {"text_input": self.GOOD, "sampling_parameters": sp({"seed": 2 ** 64, "temperature": 0.7})}, ("seed",)),
            ("top_p-1e-46", {"text_input": self.GOOD, "sampling_parameters": sp({"top_p": 1e-46, "temperature": 0.7})}, ("top_p",)),
            ("too-many-images", {"text_input": self.GOOD, "image": [rng.choice(ctx.images)] * 9}, ("image",)),
            ("load-without-token", {"text_input": "", "adapter_action": "load", "lora_name": DEMO_ADAPTERS[0]}, ("admin_token",)
             if ctx.admin_token else ("admin-token-file",)),
        ]

    def send(self, ctx, rng, index):
        case, body, words = rng.choice(self.cases(ctx, rng))
        record = _record(index, self.name, None, "http", ctx)
        record.head_task = case
        t0 = time.monotonic()
        try:
            status, payload = ctx.post(body)
        except OSError as e:
            record.e2e_s = time.monotonic() - t0
            record.outcome = "timeout" if "timed out" in str(e) else "error"
            record.error = f"bad request {case}: {type(e).__name__}: {e}"
            return record
        record.e2e_s = record.ttft_s = time.monotonic() - t0
        message = str(payload.get("error", ""))
        if status == 400 and all(w.lower() in message.lower() for w in words):
            record.outcome = "expected"
        elif classify_error(message, status) == "rejected":
            record.outcome, record.error = "rejected", message
        else:
            record.outcome = "unexpected"
            record.error = f"bad request {case}: expected HTTP 400 naming {list(words)}, got {status}: {str(payload)[:300]}"
        return record


KINDS: dict[str, RequestKind] = {k.name: k() for k in (Text, Images, StreamHttp, StreamGrpc, Head, Disconnect, Admin, Bad)}


def pick_kind(rng: random.Random, leave_out: tuple[str, ...] = ()) -> RequestKind:
    names = [n for n in KINDS if n not in leave_out]
    return KINDS[rng.choices(names, weights=[KINDS[n].weight for n in names])[0]]


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
                key = f"{record.task}/{record.head_task or record.adapter}"
                self.expected_examples.setdefault(key, (record.error or "400")[:200])
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
    kinds = sorted({r[1] for r in records}, key=lambda k: list(KINDS).index(k) if k in KINDS else 99)
    out: dict = {}
    for kind in [*kinds, "all"]:
        rows = [r for r in records if kind == "all" or r[1] == kind]
        counts = Counter(r[2] for r in rows)
        # Latency of the answers the kind exists for: ok ones; a bad request's expected 400 otherwise.
        answered = [r for r in rows if r[2] == "ok"] or [r for r in rows if r[2] == "expected"]
        e2e = [r[3] for r in answered]
        ttft = [r[4] for r in answered if r[4] == r[4]]
        out[kind] = {"requests": len(rows), **{o: counts.get(o, 0) for o in SOAK_OUTCOMES},
                     "e2e_p50_ms": _ms(percentile(e2e, 50)), "e2e_p99_ms": _ms(percentile(e2e, 99)),
                     "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99))}
    return out


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None or seconds != seconds else round(seconds * 1000.0, 1)


def format_table(summary: dict) -> str:
    head = f"  {'kind':<12}{'sent':>7}{'ok':>7}{'expect':>7}{'reject':>7}{'unexp':>7}{'lost':>6}   e2e p50/p99 ms      ttft p50/p99 ms"
    lines = [head]
    for kind, s in summary.items():
        ttft = f"{_fmt(s['ttft_p50_ms'])}/{_fmt(s['ttft_p99_ms'])}" if kind.startswith(("stream", "disconnect")) else ""
        lines.append(f"  {kind:<12}{s['requests']:>7}{s['ok']:>7}{s['expected']:>7}{s['rejected']:>7}"
                     f"{s['unexpected']:>7}{s['lost']:>6}   {_fmt(s['e2e_p50_ms']) + '/' + _fmt(s['e2e_p99_ms']):<20}{ttft}")
    return "\n".join(lines)


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0f}"


# -- the server's processes ----------------------------------------------------------------------------

@dataclass
class ServerProcesses:
    """tritonserver (the process whose command line names ``--http-port=PORT``) and its stub children."""

    http_port: int

    def server_pid(self) -> Optional[int]:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if args and args[0].endswith(b"tritonserver") and f"--http-port={self.http_port}".encode() in args:
                return int(entry.name)
        return None

    @staticmethod
    def stub_pids(server_pid: int) -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                comm, _, rest = (entry / "stat").read_text().rpartition(")")
            except OSError:
                continue
            name, fields = comm.partition("(")[2], rest.split()
            if name and len(fields) > 1 and int(fields[1]) == server_pid and STUB_NAME.startswith(name):
                pids.append(int(entry.name))
        return sorted(pids)

    @staticmethod
    def rss_mb(pid: int) -> Optional[dict]:
        """VmRSS and its anonymous / shared-memory parts, MB."""
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        kb = {k: int(v.split()[0]) for k, v in re.findall(r"^(VmRSS|RssAnon|RssShmem|RssFile):\s+(.*)$", text, re.M)}
        return {"rss": kb.get("VmRSS", 0) / 1024, "anon": kb.get("RssAnon", 0) / 1024, "shmem": kb.get("RssShmem", 0) / 1024}

    def sample(self) -> dict:
        pid = self.server_pid()
        if pid is None:
            return {"server_pid": None}
        server = self.rss_mb(pid)
        stubs = {p: self.rss_mb(p) for p in self.stub_pids(pid)}
        stubs = {p: m for p, m in stubs.items() if m is not None}
        out = {"server_pid": pid, "stub_pids": sorted(stubs),
               "server_rss_mb": round(server["rss"], 1) if server else None,
               "stub_rss_mb": round(sum(m["rss"] for m in stubs.values()), 1) if stubs else None,
               "stub_anon_mb": round(sum(m["anon"] for m in stubs.values()), 1) if stubs else None,
               "stub_shmem_mb": round(sum(m["shmem"] for m in stubs.values()), 1) if stubs else None}
        out.update(gpu_memory(sorted(stubs) + [pid]))
        return out


def gpu_memory(pids: list[int]) -> dict:
    """On a CUDA machine: the GPU memory the server's processes hold (nvidia-smi, per pid) and the GPUs'
    used total; {} without nvidia-smi. (A client-side torch.cuda query would measure the wrong process.)"""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        apps = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=15).stdout
        gpus = subprocess.run([smi, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    per_pid = {}
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            per_pid[int(parts[0])] = float(parts[1])
    used = [float(p.split(",")[1]) for p in gpus.splitlines() if "," in p and p.split(",")[1].strip().isdigit()]
    ours = [per_pid[p] for p in pids if p in per_pid]
    # In a container the pids nvidia-smi shows may be the host's: then only the GPUs' total is known.
    return {"gpu_server_mb": sum(ours) if ours else None, "gpu_used_total_mb": sum(used) if used else None}


def flatness(samples: list[dict], duration_s: float, warmup_fraction: float, key: str) -> Optional[dict]:
    """``key`` (an RSS in MB) around ``warmup_fraction`` of the run (median of the samples within 5% of the
    run of that point) against the end (median of the samples of the run's last 5%)."""
    timed = [(s["t_s"], s[key]) for s in samples if s.get(key) is not None and s["t_s"] <= duration_s + 1]
    if len(timed) < 2:
        return None
    at = warmup_fraction * duration_s
    warm = [v for t, v in timed if abs(t - at) <= 0.05 * duration_s] or [min(timed, key=lambda tv: abs(tv[0] - at))[1]]
    end = [v for t, v in timed if t >= 0.95 * duration_s] or [timed[-1][1]]
    w, e = sorted(warm)[len(warm) // 2], sorted(end)[len(end) // 2]
    peak = max(v for t, v in timed if t >= at)
    return {"warmup_mb": round(w, 1), "end_mb": round(e, 1), "growth_mb": round(e - w, 1),
            "growth_pct": round(100.0 * (e - w) / w, 2) if w else None, "peak_after_warmup_mb": round(peak, 1)}


# -- the server ------------------------------------------------------------------------------------------

def start_server(out_dir: Path, device: Optional[str], serve_args: list[str]):
    """`vlora serve` on free loopback ports with a fresh admin token (the launcher, in this process)."""
    import shlex

    from vlora.server import launcher
    from vlora.server.ports import free_ports

    ws = (out_dir / "soak-server").resolve()
    ws.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    token_file = ws / "admin.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    http_port, grpc_port, metrics_port = free_ports(3)
    argv = ["--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--metrics-port", str(metrics_port), "--openai-port", "0", "--workspace", str(ws / "ws"),
            "--admin-token-file", str(token_file)]
    if device:
        argv += ["--device", device]
    for extra in serve_args:
        argv += shlex.split(extra)
    parser = argparse.ArgumentParser(prog="vlora serve")
    launcher.add_arguments(parser)
    options = launcher.options_from_args(parser.parse_args(argv))
    server = launcher.TritonServer(options, out=sys.stdout)
    server.start()
    return server, token


def server_error_lines(log_path: Optional[Path], offset: int) -> tuple[int, list[str]]:
    """Error lines (E...) and tracebacks written to tritonserver's log since ``offset``."""
    if log_path is None or not log_path.exists():
        return 0, []
    with open(log_path, "rb") as fh:
        fh.seek(offset)
        text = fh.read().decode("utf-8", errors="replace")
    errors = [ln for ln in text.splitlines() if (ln[:1] == "E" and ln[1:5].isdigit()) or "Traceback" in ln]
    return len(errors), [e[:600] for e in errors[:20]]


def gauges(metrics_url: str) -> dict:
    samples = MetricsScraper(metrics_url).scrape_once()  # the load harness's scrape: parsed samples, None on OSError
    if samples is None:
        return {}
    names = ("vlora_running_requests", "vlora_waiting_requests", "nv_inference_pending_request_count")
    return {n: sum(v for m, _l, v in samples if m == n) for n in names}


def served_adapters(ctx: SoakContext) -> list[dict]:
    """The server's adapters (adapter_action list); [] when it does not answer."""
    try:
        status, payload = ctx.post({"text_input": "", "adapter_action": "list"}, timeout_s=60)
        text = payload.get("text_output")
        return json.loads(text[0] if isinstance(text, list) else text)["adapters"] if status == 200 else []
    except (OSError, KeyError, TypeError, ValueError):
        return []


def choose_adapters(listed: list[dict], cycle: Optional[str]) -> tuple[tuple[str, ...], Optional[str]]:
    """The demo adapters when the server has them, else up to three of its others; the cycled adapter
    only when the server has it."""
    names = [a["name"] for a in listed if a.get("loaded", True)]
    cycle = cycle if cycle in names else None
    if all(n in names for n in DEMO_ADAPTERS):
        return DEMO_ADAPTERS, cycle
    return tuple(n for n in names if n != cycle)[:3], cycle


def finished_by_reason(metrics_url: str) -> dict[str, float]:
    """The server's vlora_requests_finished_total summed per finish_reason (all adapters and instances)."""
    samples = MetricsScraper(metrics_url).scrape_once()
    if samples is None:
        return {}
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "vlora_requests_finished_total":
            reason = labels.get("finish_reason", "?")
            out[reason] = out.get(reason, 0.0) + value
    return out


def health_check(ctx: SoakContext) -> tuple[bool, str]:
    """Ready is 200 and one normal request is answered in full."""
    try:
        with urllib.request.urlopen(f"http://{ctx.target.http_url}/v2/models/{ctx.target.model}/ready", timeout=10) as r:
            ready = r.status == 200
    except OSError as e:
        return False, f"ready: {e}"
    try:
        status, payload = ctx.post({"text_input": PROMPTS[0], "sampling_parameters": json.dumps(
            {"max_tokens": 4, "temperature": 0, "ignore_eos": True})}, timeout_s=60)
    except OSError as e:
        return False, f"a normal request after the run: {e}"
    n = payload.get("num_output_tokens")
    n = n[0] if isinstance(n, list) else n
    ok = ready and status == 200 and n == 4
    return ok, f"ready={ready}, normal request: HTTP {status}, {n} tokens"


# -- the run ---------------------------------------------------------------------------------------------

def warm_up(ctx: SoakContext, seed: int) -> list[RequestRecord]:
    """One request of every kind, one after the other (reads every demo adapter into memory once)."""
    rng = random.Random(seed * 7 + 3)
    out = []
    for i, kind in enumerate(KINDS.values()):
        if kind.name == "admin" or kind.name in ctx.left_out:
            continue  # no unload before the soak
        out.append(kind.send(ctx, rng, -1 - i))
    for adapter in ctx.adapters:
        out.append(ctx.http().send(_spec(-100, "text", adapter, PROMPTS[0], (), 2), False, ctx.run_start))
    return out


def probe_capacity(ctx: SoakContext, cfg: SoakConfig, outcomes: Outcomes) -> dict:
    """Closed loop: ``probe_concurrency`` clients send the mix back to back for ``probe_seconds``;
    capacity = requests answered (ok or expected) per second."""
    stop_at = time.monotonic() + cfg.probe_seconds
    t0 = time.monotonic()
    done: list[tuple[float, str]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(cfg.seed * 1_000_003 + 17 * i + 5)
        n = 0
        while time.monotonic() < stop_at:
            kind = pick_kind(rng, ctx.left_out)
            record = kind.send(ctx, rng, 10_000_000 + i * 100_000 + n)
            n += 1
            outcome = outcomes.add(record, time.monotonic() - t0)
            with lock:
                done.append((time.monotonic(), outcome))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(cfg.probe_concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg.probe_seconds + cfg.request_timeout_s + 90)
    answered = [t for t, o in done if o in ("ok", "expected") and t <= stop_at]
    capacity = len(answered) / cfg.probe_seconds
    counts = Counter(o for _t, o in done)
    return {"seconds": cfg.probe_seconds, "concurrency": cfg.probe_concurrency, "capacity_rps": round(capacity, 3),
            "requests": len(done), **{o: counts.get(o, 0) for o in SOAK_OUTCOMES},
            "wall_s": round(time.monotonic() - t0, 1)}


class Sampler:
    """Samples the server's memory and gauges every ``every_s`` on its own thread, until stopped."""

    def __init__(self, procs: Optional[ServerProcesses], metrics_url: str, every_s: float, t0: float) -> None:
        self.procs, self.metrics_url, self.every_s, self.t0 = procs, metrics_url, every_s, t0
        self.samples: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def sample_now(self) -> dict:
        s = {"t_s": round(time.monotonic() - self.t0, 1)}
        if self.procs is not None:
            s.update(self.procs.sample())
        s.update(gauges(self.metrics_url))
        with self._lock:
            self.samples.append(s)
        return s

    def latest(self) -> dict:
        with self._lock:
            return dict(self.samples[-1]) if self.samples else {}

    def all(self) -> list[dict]:
        with self._lock:
            return list(self.samples)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample_now()


def memory_line(s: dict) -> str:
    if not s.get("server_pid"):
        return "  memory: tritonserver not found on this machine (RSS not measured)"
    parts = [f"tritonserver RSS {s.get('server_rss_mb')} MB",
             f"stub RSS {s.get('stub_rss_mb')} MB (anon {s.get('stub_anon_mb')}, shm {s.get('stub_shmem_mb')})"]
    if s.get("gpu_server_mb") is not None or s.get("gpu_used_total_mb") is not None:
        parts.append(f"GPU: server {s.get('gpu_server_mb')} MB, all GPUs used {s.get('gpu_used_total_mb')} MB")
    parts.append(f"running {s.get('vlora_running_requests', '-'):g} waiting {s.get('vlora_waiting_requests', '-'):g}"
                 if "vlora_running_requests" in s else "gauges -")
    return "  memory: " + ", ".join(parts)


def run_soak(ctx: SoakContext, cfg: SoakConfig, rate: float, outcomes: Outcomes, sampler: Sampler,
             should_stop: Callable[[], bool] = lambda: False) -> dict:
    """The open-loop Poisson stream at ``rate`` for ``cfg.duration_s``; then waits for the requests in flight.
    Returns client-side figures (scheduling lag, in flight at the end)."""
    rng = random.Random(cfg.seed)
    t0 = ctx.run_start
    pending: dict[int, tuple[str, float]] = {}  # index -> (kind, sent at)
    lags: list[float] = []
    lock = threading.Lock()

    def one(kind: RequestKind, index: int, send_at: float) -> None:
        start = time.monotonic() - t0
        with lock:
            lags.append(start - send_at)
        try:
            record = kind.send(ctx, random.Random(cfg.seed * 1_000_003 + index), index)
        except Exception as e:  # a bug in a sender must not pass as a lost request
            record = RequestRecord(index=index, application="soak", task=kind.name, adapter="", protocol="?",
                                   outcome="unexpected", error=f"client error: {type(e).__name__}: {e}")
        outcomes.add(record, time.monotonic() - t0)
        with lock:
            pending.pop(index, None)

    pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="soak-send")
    index, t_next, next_report = 0, rng.expovariate(rate), cfg.report_every_s
    max_backlog = 0
    while t_next < cfg.duration_s and not should_stop():
        now = time.monotonic() - t0
        if now >= next_report:
            report_progress(now, outcomes, sampler)
            next_report += cfg.report_every_s
        if t_next > now:
            time.sleep(min(t_next - now, 0.2))
            continue
        kind = pick_kind(rng, ctx.left_out)
        with lock:
            pending[index] = (kind.name, t_next)
            max_backlog = max(max_backlog, len(pending) - cfg.workers)
        pool.submit(one, kind, index, t_next)
        index += 1
        t_next += rng.expovariate(rate)
    while time.monotonic() - t0 < cfg.duration_s and not should_stop():
        time.sleep(0.2)
    sampler.sample_now()  # the end of the traffic
    deadline = time.monotonic() + cfg.request_timeout_s + 90  # an unload may wait 30 s more than a request
    while time.monotonic() < deadline:
        with lock:
            if not pending:
                break
        time.sleep(0.25)
    with lock:
        left = dict(pending)
    for idx, (kind, sent) in left.items():  # never answered, not even by a client timeout
        outcomes.add_lost(kind, time.monotonic() - t0, f"request {idx} sent at {sent:.1f}s: no final answer by the end")
    pool.shutdown(wait=False, cancel_futures=True)
    lag_p99 = percentile(lags, 99)
    return {"sent": index, "client_backlog_max": max(max_backlog, 0),
            "send_lag_p99_ms": _ms(lag_p99), "unfinished_at_end": len(left)}


def report_progress(now: float, outcomes: Outcomes, sampler: Sampler) -> None:
    summary = summarize(outcomes.snapshot())
    say(f"[soak {now:6.0f}s] {summary['all']['requests']} requests: ok {summary['all']['ok']}, expected "
        f"{summary['all']['expected']}, rejected {summary['all']['rejected']}, unexpected {summary['all']['unexpected']}, "
        f"lost {summary['all']['lost']}")
    say(format_table(summary))
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
                server, token = start_server(out_dir, args.device, args.serve_arg)
            except Exception as e:
                say(f"soak: the server did not start: {e}")
                return 2
            target = Target(server.http_url.replace("http://", ""), server.grpc_url, server.metrics_url)
            adapter_root = server.adapter_root
        return soak(args, cfg, target, token, adapter_root, server, out_dir)[0]
    finally:
        if server is not None:
            say("stopping the server ...")
            code = server.stop()
            say(f"server stopped (exit code {code})")


def soak(args, cfg: SoakConfig, target: Target, token: Optional[str], adapter_root: Optional[str], server,
         out_dir: Path) -> tuple[int, dict]:
    """The soak against ``target``: returns the exit code (0 passed, 1 failed, 2 not serving) and the result
    (also written to ``out_dir``/soak-<device>.json, and recorded unless ``args.no_record``)."""
    rng = random.Random(cfg.seed + 99)
    ctx = SoakContext(target=target, admin_token=token, adapters=DEMO_ADAPTERS,
                      cycle_adapter=args.cycle_adapter if token else None, heads=read_heads(adapter_root),
                      request_timeout_s=cfg.request_timeout_s,
                      images=[png_b64(rng) for _ in range(16)],
                      circles=[png_b64(rng, circles=1 + i % 6) for i in range(6)])
    http_port = int(target.http_url.rpartition(":")[2])
    procs = ServerProcesses(http_port) if target.http_url.startswith(("127.", "localhost")) else None
    if procs is not None and procs.server_pid() is None:
        say(f"soak: no tritonserver with --http-port={http_port} on this machine: RSS is not measured")
        procs = None
    ok, why = health_check(ctx)
    if not ok:
        say(f"soak: the server at {target.http_url} is not serving: {why}")
        return 2, {"passed": False, "health_before": why}
    listed = served_adapters(ctx)
    ctx.adapters, ctx.cycle_adapter = choose_adapters(listed, ctx.cycle_adapter)
    served = {a["name"] for a in listed if a.get("loaded", True)}
    # Heads only of adapters this server serves (the demo heads are the fallback when the root is not readable).
    ctx.heads = {a: t for a, t in ctx.heads.items() if a != ctx.cycle_adapter and (not served or a in served)}
    if not ctx.heads:
        say("soak: no adapter with task heads: the head requests are left out")
    log_path = server.log_path if server is not None else None
    log_offset = log_path.stat().st_size if log_path is not None and log_path.exists() else 0

    say(f"soak: server {target.http_url} (gRPC {target.grpc_url}); admin {'load/unload of ' + ctx.cycle_adapter if ctx.cycle_adapter else 'list only (no token)'}; "
        f"heads {', '.join(f'{a}:{t}' for a, ts in ctx.heads.items() for t in ts)}")
    probe_outcomes = Outcomes(ctx.cycle_adapter)
    warm = warm_up(ctx, cfg.seed)
    for r in warm:
        probe_outcomes.add(r, 0.0)
    probe = None
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
    else:
        rate = cfg.rate
    wait_idle(target.metrics_url, 60, sys.stdout)

    outcomes = Outcomes(ctx.cycle_adapter)
    finished_before = finished_by_reason(target.metrics_url)
    ctx.run_start = time.monotonic()
    sampler = Sampler(procs, target.metrics_url, cfg.sample_every_s, ctx.run_start)
    sampler.sample_now()
    sampler.start()
    say(f"soak: {cfg.minutes:g} min at {rate:.2f} req/s (open loop, Poisson, seed {cfg.seed}), {cfg.workers} client threads")
    client = run_soak(ctx, cfg, rate, outcomes, sampler)
    t_end = time.monotonic() - ctx.run_start
    drained = wait_idle(target.metrics_url, cfg.drain_timeout_s, sys.stdout)
    after = sampler.sample_now()
    sampler.stop()
    finished_after = finished_by_reason(target.metrics_url)
    server_finished = {k: int(v - finished_before.get(k, 0.0)) for k, v in sorted(finished_after.items())
                       if v - finished_before.get(k, 0.0) > 0}
    healthy, health = health_check(ctx)
    n_errors, error_lines = server_error_lines(log_path, log_offset)

    records = outcomes.snapshot()
    summary = summarize(records)
    samples = sampler.all()
    memory = {key: flatness(samples, cfg.duration_s, cfg.warmup_fraction, key)
              for key in ("server_rss_mb", "stub_rss_mb", "stub_anon_mb", "gpu_server_mb", "gpu_used_total_mb")}
    memory = {k: v for k, v in memory.items() if v is not None}
    probe_failed = [f for f in probe_outcomes.failures]
    failures = summary["all"]["unexpected"] + summary["all"]["lost"] + len(probe_failed)
    passed = failures == 0 and drained and healthy
    dev = "cpu" if (args.device == "cpu" or server is not None and server.engine_config.model.device == "cpu") else device_name()
    result = {
        "benchmark": "soak", "device": dev, "commit": git_commit(), "minutes": cfg.minutes, "seed": cfg.seed,
        "target": target.http_url, "started_server": server is not None, "load": cfg.load if cfg.rate is None else None,
        "rate_rps": round(rate, 3), "probe": probe, "client": client, "traffic_s": round(t_end, 1),
        "kinds": {k: v.weight for k, v in KINDS.items()}, "cycle_adapter": ctx.cycle_adapter,
        "outcomes": summary, "memory": memory, "memory_after_drain": after,
        "memory_samples": samples, "server_finished_by_reason": server_finished, "drained": drained, "health_after": health, "healthy_after": healthy,
        "server_log_errors": n_errors, "server_log_error_examples": error_lines,
        "failures": outcomes.failures, "probe_failures": probe_failed,
        "expected_error_examples": outcomes.expected_examples, "passed": passed,
    }
    say(f"\n[soak end] {summary['all']['requests']} requests in {cfg.minutes:g} min at {rate:.2f} req/s")
    say(format_table(summary))
    for key, m in memory.items():
        say(f"  {key}: {m['warmup_mb']} MB at {100 * cfg.warmup_fraction:.0f}% -> {m['end_mb']} MB at the end: "
            f"{m['growth_mb']:+.1f} MB ({m['growth_pct']:+.2f}%), peak after warm-up {m['peak_after_warmup_mb']} MB")
    say(memory_line(after) + " (after the drain)")
    say("  the server's finished requests by reason during the soak: "
        + (", ".join(f"{k} {v}" for k, v in server_finished.items()) or "-"))
    say(f"  drained (running and waiting back to 0): {drained}; after the run: {health}; "
        f"server log: {n_errors} error lines")
    for f in (outcomes.failures + probe_failed)[:10]:
        say(f"  FAILED {f}")
    say(f"soak: {'PASSED' if passed else 'FAILED'}: {summary['all']['unexpected']} unexpected, {summary['all']['lost']} lost"
        f"{f', {len(probe_failed)} failed in the warm-up/probe' if probe_failed else ''}")

    stub = memory.get("stub_rss_mb")
    line = (f"{cfg.minutes:g} min at {rate:.2f} req/s"
            + (f" ({cfg.load:g} x capacity {probe['capacity_rps']:.2f} req/s)" if probe else "")
            + f": {summary['all']['requests']} requests, {summary['all']['ok']} ok, {summary['all']['expected']} expected errors, "
            f"{summary['all']['rejected']} rejected, {summary['all']['unexpected']} unexpected, {summary['all']['lost']} lost; "
            f"text p50/p99 {_fmt(summary.get('text', {}).get('e2e_p50_ms'))}/{_fmt(summary.get('text', {}).get('e2e_p99_ms'))} ms"
            + (f"; stub RSS {stub['warmup_mb']:.0f} -> {stub['end_mb']:.0f} MB ({stub['growth_pct']:+.1f}%)" if stub else ""))
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
