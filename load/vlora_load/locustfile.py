"""Locust users that load a vlora Triton server with a workload from ``configs/workloads``.

``vlora loadtest`` runs this file headless; it can also be run by hand (the plan file is what
``vlora loadtest --plan-only`` writes):

    locust -f load/locustfile.py --headless --vlora-plan run/plan.json OpenLoopUser -u 1

- ``OpenLoopUser`` (one instance) sends the workload's seeded open-loop schedule: Poisson arrivals
  for visual retrieval, fixed-period camera streams for video. Each request runs in its own greenlet,
  so late answers never hold back the next arrival.
- ``ClosedLoopUser`` (``-u N``): each user sends its next request when the previous one is answered.

Every request is reported to locust with ``request_type`` = protocol (grpc, http, http-stream),
``name`` = ``<application>/<adapter>``, the end-to-end time, the response size, and an exception
whose type says what went wrong (``Rejected``, ``Incomplete``, ``Timeout``, ``RequestError``), so
rejections are counted as their own failure. Each request is also written as one row of the raw CSV
(``RequestRecord``: TTFT, time per output token, end-to-end time, tokens, adapter, application).
"""
from __future__ import annotations

import csv
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import gevent
from gevent.event import AsyncResult, Event
from gevent.lock import Semaphore
from gevent.pool import Group
from locust import User, constant, events, task
from locust import stats as locust_stats
from locust.exception import StopUser

from vlora_load.generators import RequestSpec, WorkloadGenerator
from vlora_load.heads import HeadPolicy
from vlora_load.summary import error_kind
from vlora_load.transport import (
    HttpTransport,
    RequestRecord,
    job_payload,
    new_record,
    record_grpc_result,
)
from vlora_load.workload import Workload


class Rejected(Exception):
    """The server refused the request because it was full (queue policy or admission timeout)."""


class Incomplete(Exception):
    """Answered, but not in full."""


class Timeout(Exception):
    """No final answer within the request timeout."""


class RequestError(Exception):
    """Any other failure; the message is the server's or the client's."""


FAILURES = {"rejected": Rejected, "incomplete": Incomplete, "timeout": Timeout, "error": RequestError}


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--vlora-plan", type=str, default="", help="the run plan JSON written by `vlora loadtest`")


class GrpcWorkerClient:
    """Sends gRPC requests through a ``vlora_load.grpc_worker`` process and waits on its answers."""

    def __init__(self, grpc_url: str, model: str, workers: int, log_path: Path) -> None:
        self._log = open(log_path, "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vlora_load.grpc_worker", "--url", grpc_url, "--model", model,
             "--workers", str(workers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        )
        self._pending: dict[int, AsyncResult] = {}
        self._write_lock = Semaphore()
        self._ready = AsyncResult()
        self._reader = gevent.spawn(self._read)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        if not self._ready.get(timeout=timeout_s):
            raise RuntimeError("the gRPC worker process exited before it was ready; see grpc_worker.log")

    def _read(self) -> None:
        for raw in self._proc.stdout:
            res = json.loads(raw)
            if "ready" in res:
                self._ready.set(True)
                continue
            waiter = self._pending.pop(res["id"], None)
            if waiter is not None:
                waiter.set(res)
        self._ready.set(False)
        for waiter in self._pending.values():  # the worker died: fail what it held
            waiter.set(None)

    def send(self, spec: RequestSpec, stream: bool, timeout_s: float, run_start: float) -> RequestRecord:
        record = new_record(spec, "grpc", run_start)
        job = job_payload(spec, stream)
        job["timeout"] = timeout_s
        line = (json.dumps(job) + "\n").encode("utf-8")
        record.request_bytes = len(line)
        waiter = AsyncResult()
        self._pending[spec.index] = waiter
        with self._write_lock:
            self._proc.stdin.write(line)
            self._proc.stdin.flush()
        res = waiter.get(timeout=timeout_s + 60)
        if res is None:
            record.outcome, record.error = "error", "the gRPC worker process exited"
            return record
        record.start_s = res["t_start"] - run_start
        return record_grpc_result(record, res)

    def close(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        except Exception:
            self._proc.kill()
        self._log.close()


class LoadContext:
    """Everything the users of one run share: the plan, the generator, the transports and the raw CSV."""

    def __init__(self, environment, plan: dict) -> None:
        self.environment = environment
        self.plan = plan
        self.workload = Workload.from_dict(plan["workload"])
        heads = HeadPolicy(plan.get("heads", {}))
        self.generator = WorkloadGenerator(self.workload, tuple(plan["adapter_names"]), heads)
        out = Path(plan["out_dir"])
        self.timeout_s = self.workload.request_timeout_s
        protocols = {self.workload.protocol_of(a) for a in self.workload.applications}
        self.grpc = (GrpcWorkerClient(plan["grpc_url"], plan["model"], plan.get("grpc_workers", 256),
                                      out / "grpc_worker.log") if "grpc" in protocols else None)
        self.http = (HttpTransport(plan["http_url"], plan["model"], self.timeout_s, concurrency=plan.get("http_concurrency", 256))
                     if protocols & {"http", "http-stream"} else None)
        self._csv_file = open(out / "requests.csv", "w", newline="")
        self._csv = csv.writer(self._csv_file)
        self._csv.writerow(RequestRecord.columns())
        self._csv_file.flush()
        self._user_ids = itertools.count()
        self.done = Event()
        # Everything slow happens before the clock starts: the schedule (images included) and the gRPC worker.
        self.schedule = self.generator.schedule() if self.workload.arrivals.mode == "open" else []
        if self.grpc is not None:
            self.grpc.wait_ready()
        self.t0 = time.monotonic() + 0.2
        (out / "clock.json").write_text(json.dumps({"t0_monotonic": self.t0, "t0_unix": time.time() + 0.2}))

    def next_user_index(self) -> int:
        return next(self._user_ids)

    def send(self, spec: RequestSpec) -> RequestRecord:
        app = self.workload.application(spec.application)
        protocol = self.workload.protocol_of(app)
        try:
            if protocol == "grpc":
                record = self.grpc.send(spec, self.workload.stream, self.timeout_s, self.t0)
            else:
                record = self.http.send(spec, protocol == "http-stream", self.t0)
        except gevent.Timeout:
            record = new_record(spec, protocol, self.t0)
            record.outcome, record.error = "timeout", f"no answer within {self.timeout_s:g}s"
        except Exception as e:  # a request must always end as a record
            record = new_record(spec, protocol, self.t0)
            record.outcome, record.error = "error", f"{type(e).__name__}: {e}"
        self._csv.writerow(record.row())
        self._csv_file.flush()
        failure = FAILURES.get(record.outcome)
        self.environment.events.request.fire(
            request_type=protocol,
            name=f"{spec.application}/{spec.adapter or 'base'}",
            response_time=(record.e2e_s if record.e2e_s == record.e2e_s else 0.0) * 1000.0,
            response_length=record.response_bytes,
            exception=failure(_short(record.error)) if failure else None,
            context={"application": spec.application, "adapter": spec.adapter or "", "task": spec.task,
                     "ttft_s": record.ttft_s, "tpot_s": record.tpot_s, "output_tokens": record.num_output_tokens},
        )
        return record

    def close(self) -> None:
        if self.grpc is not None:
            self.grpc.close()
        self._csv_file.close()


def _short(message: str) -> str:
    """Group failures by kind: drop the request id and everything after the first line."""
    return error_kind(message)


def context_of(environment) -> LoadContext:
    """The run's LoadContext, kept on the locust Environment that owns it."""
    ctx = getattr(environment, "vlora_context", None)
    if ctx is None:
        plan_path = environment.parsed_options.vlora_plan
        if not plan_path:
            raise RuntimeError("run with --vlora-plan PLAN.json (written by `vlora loadtest`)")
        ctx = LoadContext(environment, json.loads(Path(plan_path).read_text()))
        environment.vlora_context = ctx
        gevent.spawn(_stop_when_done, environment, ctx)
    return ctx


@events.test_start.add_listener
def _on_test_start(environment, **_kw) -> None:
    try:
        context_of(environment)
    except Exception:
        environment.process_exit_code = 3
        if environment.runner is not None:
            gevent.spawn(environment.runner.quit)
        raise


@events.quitting.add_listener
def _on_quitting(environment, **_kw) -> None:
    ctx = getattr(environment, "vlora_context", None)
    if ctx is not None:
        environment.vlora_context = None
        ctx.close()


def _stop_when_done(environment, ctx: LoadContext) -> None:
    """Quit once the schedule is sent and answered (open loop) or every user has stopped (closed loop)."""
    duration = ctx.workload.duration_s
    gevent.sleep(max(ctx.t0 + duration - time.monotonic(), 0) + 0.5)
    while not ctx.done.is_set():
        runner = environment.runner
        if runner is not None and ctx.workload.arrivals.mode == "closed" and runner.user_count == 0:
            break
        gevent.sleep(0.2)
    # locust rewrites its stats CSVs every CSV_STATS_INTERVAL_SEC and not at shutdown: let one more
    # write happen, so that they count the last requests too.
    gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.5)
    if environment.runner is not None:
        environment.runner.quit()


class OpenLoopUser(User):
    """Sends the seeded open-loop schedule; one instance drives the whole run."""

    fixed_count = 1
    wait_time = constant(0)

    @task
    def drive(self) -> None:
        ctx = context_of(self.environment)
        group = Group()
        for spec in ctx.schedule:
            delay = ctx.t0 + spec.send_at - time.monotonic()
            if delay > 0:
                gevent.sleep(delay)
            group.spawn(ctx.send, spec)
        group.join(timeout=ctx.timeout_s + 90)
        ctx.done.set()
        raise StopUser()


class ClosedLoopUser(User):
    """Sends its next request as soon as the previous one is answered, until the run's duration."""

    wait_time = constant(0)

    def on_start(self) -> None:
        ctx = context_of(self.environment)
        self._ctx = ctx
        self._requests = ctx.generator.user_stream(ctx.next_user_index())
        delay = ctx.t0 - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)

    @task
    def one(self) -> None:
        ctx: LoadContext = self._ctx
        if time.monotonic() - ctx.t0 >= ctx.workload.duration_s:
            raise StopUser()
        ctx.send(next(self._requests))
