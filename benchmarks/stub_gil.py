"""What the Triton model's threads cost the engine thread inside the Python stub, on the CPU.

The engine thread shares the stub's GIL with the response thread (one ``sender.send`` per streamed
event) and the metrics thread (``pb_utils`` metric calls). This runs the real Triton model
(model_repository/vlora/1/model.py, with tests/fake_pb_utils.py as ``pb_utils``) over the real
AsyncEngine, but with a simulated LLMEngine whose decode step is: ``--host-ms`` of Python work (broken
every ``--op-us`` by ~5 us of C work without the GIL, as torch's op dispatch does), ``--device-ms`` waiting with the GIL
released (the GPU), then one streamed event per request and the per-step metric reports of
engine/core.py. The fake IPCs release the GIL for ``--ipc-us`` (sends, increments, observes), except
``Metric.set``, which holds it (as the Python backend's ``SendSetValueRequest`` does).

It runs the same engine twice: ``inproc`` (callbacks that only count, NullMetrics: the in-process
engine) and ``stub`` (the Triton model). Per decode step it reports the pb_utils IPC calls (sends,
metric sets/increments/observes), ``gil_retakes_in_<phase>``: the IPCs that returned (and took the GIL
back) while the engine thread was in its host phase, its device wait, emitting, or between steps (those
outside ``wait`` can delay it), the response thread's drains, the other threads' CPU time, the engine
thread's context switches (each GIL wait is one), and the engine's host phase and step interval; the
ratio of the step intervals is the stub's share of the in-process rate. Counts are exact; times on a
busy CPU are indicative only.

    .venv/bin/python benchmarks/stub_gil.py --batch 32 --steps 400
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fake_pb_utils  # noqa: E402
from vlora.engine import async_engine  # noqa: E402
from vlora.engine.api import GenerationOutput  # noqa: E402
from vlora.engine.metrics import NullMetrics  # noqa: E402


OP_BUFFER = bytes(8192)  # zlib releases the GIL for buffers over 5 KiB


def spin(seconds: float) -> None:
    """Python work holding the GIL for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# What the simulated engine thread is doing: "host" (its Python work before the device wait), "wait" (the
# device wait, without the GIL), "emit" (events and reports after it), "loop" (AsyncEngine between steps).
PHASE = ["loop"]


class IpcCounts:
    """The fake pb_utils' IPCs, counted, with the engine's phase when each returned (and took the GIL
    back); sends and increments/observes release the GIL for ``ipc_s``."""

    def __init__(self, ipc_s: float) -> None:
        self.ipc_s = ipc_s
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        self.counts = {"send": 0, "set": 0, "increment": 0, "observe": 0}
        self.returns = {"host": 0, "wait": 0, "emit": 0, "loop": 0}

    def hit(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if kind != "set":  # set kept the GIL: nothing to take back
                self.returns[PHASE[0]] += 1

    def install(self) -> None:
        """Patch the fake pb_utils' Metric and FakeSender (this process only)."""
        counts, ipc = self, self.ipc_s
        metric = fake_pb_utils.Metric
        inc, set_, obs = metric.increment, metric.set, metric.observe

        def increment(m, value):
            time.sleep(ipc)  # Triton's SendIncrementRequest releases the GIL
            counts.hit("increment")
            inc(m, value)

        def set_value(m, value):
            counts.hit("set")
            spin(ipc)  # Triton's SendSetValueRequest keeps the GIL through the round trip
            set_(m, value)

        def observe(m, value):
            time.sleep(ipc)
            counts.hit("observe")
            obs(m, value)

        metric.increment, metric.set, metric.observe = increment, set_value, observe
        send = fake_pb_utils.FakeSender.send

        def send_response(sender, response=None, flags=0):
            time.sleep(ipc)  # ResponseSender::Send releases the GIL
            counts.hit("send")
            send(sender, response, flags)
            if len(sender.sent) > 4:  # keep the last events only: a long stream must not grow memory
                del sender.sent[:-2]

        fake_pb_utils.FakeSender.send = send_response


class SimEngine:
    """The part of LLMEngine that AsyncEngine drives, with a simulated decode step (see the module docstring)."""

    def __init__(self, metrics, args) -> None:
        self.metrics = metrics
        self.args = args
        self.waiting: list = []
        self.running: list = []
        self.inputs = SimpleNamespace(check=lambda req: SimpleNamespace(req=req, pixels=0),
                                      preprocess=lambda checked: checked.req)
        self.loras = SimpleNamespace(list_adapters=lambda: [], close=lambda: None)
        self.model_info: dict = {}
        self.runner = SimpleNamespace(device=SimpleNamespace(type="cpu"))
        self.tuner = None
        self.step_log: list[tuple[float, float, int]] = []  # (host seconds, end time, batch) per step
        self._aborted: set = set()
        self._reported_depth: Optional[tuple] = None
        self._inflight = None  # the launched step not completed yet (--overlap)
        self._device_end = 0.0  # when the device finishes the last launched step
        self.before_device_wait = None  # see --wake-at-device-wait

    def add_request(self, prepared, callback) -> None:
        self.waiting.append(SimpleNamespace(req=prepared, callback=callback, n=0, launched=0, text=""))
        self.metrics.request_admitted(prepared.lora_name)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    def fail_all(self, reason: str, error: Optional[str] = None) -> None:
        for s in self.running + self.waiting:
            self._finish(s, reason, error)
        self.running, self.waiting, self._inflight = [], [], None

    def _finish(self, s, reason: str, error: Optional[str] = None) -> None:
        self.metrics.request_finished(s.req.lora_name, reason, s.n)
        s.callback(GenerationOutput(s.req.request_id, "", s.text, True, finish_reason=reason,
                                    num_input_tokens=8, num_output_tokens=s.n, error=error))

    def step(self):
        """Launch the next step (host work, then the device's time queued behind the last step's) and
        complete the last one (``--overlap``, as LLMEngine on CUDA) or this one."""
        a = self.args
        # Admit everything at once: the batch decodes together from its first step.
        if self.waiting and len(self.waiting) + len(self.running) >= a.batch:
            self.running += self.waiting
            self.waiting = []
        batch = [s for s in self.running if s.launched < s.req.sampling.max_tokens]
        launched = None
        if batch:
            PHASE[0] = "host"
            t0 = time.perf_counter()
            ops = max(1, int(a.host_ms * 1000 / a.op_us))
            for _ in range(ops):  # schedule, step plan, launches: Python, with the GIL released at each op
                spin(a.op_us * 1e-6)
                zlib.crc32(OP_BUFFER)  # ~5 us of C work without the GIL, as a torch op's dispatch
            host = time.perf_counter() - t0
            self._device_end = max(time.perf_counter(), self._device_end) + a.device_ms * 1e-3
            for s in batch:
                s.launched += 1
            launched = (batch, self._device_end, host)
        prev, self._inflight = self._inflight, None
        if a.overlap:
            self._inflight = launched
            if prev is not None:
                self._complete(prev)
            PHASE[0] = "loop"
            return prev
        if launched is not None:
            self._complete(launched)
        PHASE[0] = "loop"
        return launched

    def _complete(self, launched) -> None:
        a = self.args
        batch, device_end, host = launched
        if self.before_device_wait is not None:
            self.before_device_wait()
        PHASE[0] = "wait"
        wait = device_end - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the device runs the step; the engine waits without the GIL
        PHASE[0] = "emit"
        t_done = time.perf_counter()
        for s in batch:  # detokenize and report: Python
            s.n += 1
            spin(a.token_us * 1e-6)
            s.text += " tok"
            if s.n >= s.req.sampling.max_tokens:
                self.running.remove(s)
                self._finish(s, "length")
            else:
                s.callback(GenerationOutput(s.req.request_id, " tok", s.text, False,
                                            num_input_tokens=8, num_output_tokens=s.n))
        elapsed = t_done - (self.step_log[-1][1] if self.step_log else t_done - a.device_ms * 1e-3)
        self.metrics.step(len(batch), 0, len(batch), elapsed)
        self.metrics.mode_step("unmerge", None, elapsed)
        self.metrics.queue_depth(len(self.running), len(self.waiting))
        depth = (len(self.running), len(self.waiting))  # LLMEngine._report_queue_depth: only on a change
        if depth != self._reported_depth:
            self._reported_depth = depth
            self.metrics.queue_depth(*depth)
        self.step_log.append((host, t_done, len(batch)))


def thread_stats(thread: threading.Thread) -> dict[str, float]:
    """CPU seconds and context switches of one live thread (Linux)."""
    out = {"cpu_s": time.clock_gettime(time.pthread_getcpuclockid(thread.ident))}
    try:
        for line in Path(f"/proc/self/task/{thread.native_id}/status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                key, value = line.split(":")
                out[key] = float(value)
    except OSError:
        pass
    return out


def load_model_module(path: Path):
    spec = importlib.util.spec_from_file_location("vlora_triton_model_bench", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(mode: str, args, ipc: IpcCounts, model_py: Path) -> dict[str, Any]:
    """One batch of ``args.batch`` streams for ``args.steps`` tokens each, in-process or through the model."""
    sims: list[SimEngine] = []

    def build(config, metrics=None):
        sims.append(SimEngine(metrics or NullMetrics(), args))
        return sims[-1]

    async_engine.build_engine = build
    ipc.reset()
    gc_before = [g["collections"] for g in gc.get_stats()]
    body = {"max_tokens": args.steps, "temperature": 0, "ignore_eos": True}
    drains = [0]
    if mode == "inproc":
        engine = async_engine.AsyncEngine(async_engine.EngineConfig())
        done = threading.Event()
        finished = [0]

        def collect(out: GenerationOutput) -> None:
            if out.finished:
                finished[0] += 1
                if finished[0] == args.batch:
                    done.set()

        from vlora.engine.api import GenerationRequest, SamplingParams
        for i in range(args.batch):
            req = GenerationRequest(f"r{i}", "hello", sampling=SamplingParams(**body), stream=True)
            engine.submit(req, collect)
        others: list[threading.Thread] = []
        before = {}
        done.wait(600)
        engine.shutdown()
        model = None
    else:
        pb = fake_pb_utils.fake_pb_utils()
        sys.modules["triton_python_backend_utils"] = pb
        module = load_model_module(model_py)
        real_coalesce = module.coalesce

        def counting_coalesce(items):
            drains[0] += 1
            return real_coalesce(items)

        module.coalesce = counting_coalesce
        model = module.TritonPythonModel()
        config = {"model_transaction_policy": {"decoupled": True}, "parameters": {}}
        model.initialize({"model_config": json.dumps(config), "model_name": "vlora", "model_version": "1"})
        engine = model._engine
        others = [t for t in threading.enumerate() if t.name in ("vlora-responses", "vlora-metrics")]
        before = {t.name: thread_stats(t) for t in others}
        before["engine"] = thread_stats(engine._thread)
        requests = [fake_pb_utils.FakeRequest({"text_input": "hello", "stream": True,
                                               "sampling_parameters": json.dumps(body)}) for _ in range(args.batch)]
        model.execute(requests)
        deadline = time.monotonic() + 600
        while not all(any(flags for _, flags in r.sender.sent) for r in requests):
            if time.monotonic() > deadline:
                raise RuntimeError("the streams did not finish")
            time.sleep(0.02)
    after = {t.name: thread_stats(t) for t in others if t.is_alive()}
    if model is not None:
        after["engine"] = thread_stats(engine._thread)
        model.finalize()
    gc_runs = [g["collections"] - b for g, b in zip(gc.get_stats(), gc_before)]
    log = sims[-1].step_log
    steady = [row for row in log if row[2] == args.batch][args.warmup:]
    n = len(steady)
    intervals = [b[1] - a[1] for a, b in zip(steady, steady[1:])]
    row: dict[str, Any] = {
        "mode": mode, "steps": n,
        "host_ms_mean": 1e3 * sum(h for h, _, _ in steady) / n,
        "step_interval_ms_mean": 1e3 * sum(intervals) / len(intervals),
        "gc_collections_per_generation": gc_runs,
    }
    total_steps = len(log)
    if mode == "stub":
        row["per_step"] = {**{f"ipc_{k}": v / total_steps for k, v in ipc.counts.items()},
                           **{f"gil_retakes_in_{k}": v / total_steps for k, v in ipc.returns.items()},
                           "response_drains": drains[0] / total_steps}
        for name in after:
            if name in before:
                d = {k: after[name][k] - before[name].get(k, 0.0) for k in after[name]}
                row["per_step"][f"{name}_cpu_ms"] = 1e3 * d["cpu_s"] / total_steps
                if "voluntary_ctxt_switches" in d:
                    row["per_step"][f"{name}_ctx_switches"] = (d["voluntary_ctxt_switches"]
                                                              + d.get("nonvoluntary_ctxt_switches", 0)) / total_steps
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300, help="tokens per stream (one decode step each)")
    ap.add_argument("--warmup", type=int, default=20, help="steady steps left out at the start")
    ap.add_argument("--host-ms", type=float, default=2.0, help="the engine's Python work per step before the device wait")
    ap.add_argument("--op-us", type=float, default=25.0, help="Python work between two GIL releases (torch op dispatch)")
    ap.add_argument("--device-ms", type=float, default=5.5, help="the device's time per step (GIL released)")
    ap.add_argument("--token-us", type=float, default=15.0, help="Python work per request after the step (detokenize, stop checks)")
    ap.add_argument("--ipc-us", type=float, default=30.0, help="one pb_utils IPC round trip")
    ap.add_argument("--overlap", action="store_true", help="launch step N+1 before completing step N (LLMEngine on CUDA)")
    ap.add_argument("--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval for the run (default: Python's 5 ms)")
    ap.add_argument("--model-py", default=str(ROOT / "model_repository" / "vlora" / "1" / "model.py"))
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    ipc = IpcCounts(args.ipc_us * 1e-6)
    ipc.install()
    rows = [run("inproc", args, ipc, Path(args.model_py)), run("stub", args, ipc, Path(args.model_py))]
    result = {"batch": args.batch, "host_ms": args.host_ms, "device_ms": args.device_ms, "ipc_us": args.ipc_us,
              "switch_interval_ms": sys.getswitchinterval() * 1e3, "cpus": os.cpu_count(), "runs": rows,
              "stub_rate_vs_inproc": rows[0]["step_interval_ms_mean"] / rows[1]["step_interval_ms_mean"]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
