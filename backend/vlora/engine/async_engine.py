"""The engine behind the Triton model: input validation on the caller's thread, the iteration loop
on its own thread, back-pressure on admission, cancellation, a draining shutdown, and the adapter
administration of clients (list, load, unload) run on the engine thread between steps.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Optional

from vlora.config import EngineConfig
from vlora.engine.api import EngineOverloaded, GenerationRequest, OutputCallback
from vlora.engine.builder import build_engine
from vlora.engine.core import LLMEngine, PreparedRequest
from vlora.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)

# How long the loop waits when a step ran nothing although requests wait (their adapters are being
# loaded): new requests and control calls wake it at once.
IDLE_POLL_S = 0.002


class AsyncEngine:
    """Thread-safe front of :class:`LLMEngine`. See ``vlora.engine.api`` for the request types."""

    def __init__(self, config: EngineConfig, metrics: Optional[EngineMetrics] = None) -> None:
        self.config = config
        self.engine = build_engine(config, metrics)
        self.inputs = self.engine.inputs
        self.loras = self.engine.loras
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._cancels: set[str] = set()
        self._control: deque[tuple[Callable[[LLMEngine], Any], Future]] = deque()
        self._backlog = 0
        self._stopping = False
        self._stopped = False
        self._cancel_all = False
        self._thread = threading.Thread(target=self._loop, name="vlora-engine", daemon=True)
        self._thread.start()

    # -- info ------------------------------------------------------------------------------------
    @property
    def model_info(self) -> dict:
        return self.engine.model_info

    def list_adapters(self) -> list[str]:
        return self.loras.list_adapters()

    # -- adapters (any thread but the engine's) --------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], Any], timeout: float = 120.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result (or raise
        its exception). The engine's state is only touched there."""
        fut: Future = Future()
        with self._cond:
            if self._stopping:
                raise EngineOverloaded("server is shutting down")
            self._control.append((fn, fut))
            self._cond.notify_all()
        return fut.result(timeout)

    def adapters(self) -> list[dict]:
        """Every adapter known to the server: id, tier (gpu, cpu, disk), rank, targets, heads, requests."""
        return self.call(lambda eng: eng.describe_adapters())

    def load_adapter(self, name: str) -> dict:
        """Read and check ``name`` from the adapter root into host memory (on this thread: the engine
        keeps decoding); refused with the reason (AdapterError) when it cannot be served."""
        self.loras.load(name)
        return self.call(lambda eng: eng.describe_adapters([name]))[0]

    def unload_adapter(self, name: str) -> dict:
        """Drop ``name`` from the device and host tiers; refused (AdapterBusy) while requests use it."""
        return self.call(lambda eng: eng.unload_adapter(name))

    # -- requests --------------------------------------------------------------------------------
    def prepare(self, req: GenerationRequest) -> PreparedRequest:
        """Validate and preprocess on the caller's thread. Raises InvalidRequest naming the problem."""
        return self.inputs.prepare(req)

    def submit(self, prepared: PreparedRequest, callback: OutputCallback, timeout: Optional[float] = None) -> None:
        """Queue a prepared request. Blocks while the engine's waiting queue is full (back-pressure)."""
        limit = self.config.scheduler.max_waiting
        deadline = time.monotonic() + (self.config.scheduler.admission_timeout_s if timeout is None else timeout)
        with self._cond:
            while self._backlog + len(self._inbox) >= limit:
                if self._stopping:
                    raise EngineOverloaded("server is shutting down")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineOverloaded(f"server overloaded: {limit} requests already waiting")
                self._cond.wait(remaining)
            if self._stopping:
                raise EngineOverloaded("server is shutting down")
            self._inbox.append((prepared, callback))
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._cancels.add(request_id)
            self._cond.notify_all()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish (cancel what remains at ``timeout``), join."""
        with self._cond:
            if self._stopped:
                return
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._cancel_all = True
                self._cond.notify_all()
            self._thread.join(10.0)
        self._stopped = True
        if self.engine.tuner is not None:
            self.engine.tuner.stop()
        self.loras.close()

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        dev = eng.runner.device
        if dev.type == "cuda":
            # Make this thread's current device the engine's: extensions that launch on the current
            # device (ATMM's) and side streams then land on the right GPU of a multi-GPU host.
            import torch

            torch.cuda.set_device(dev)
        while True:
            with self._cond:
                while (not self._inbox and not self._cancels and not self._control and not eng.has_work()
                       and not self._stopping):
                    self._cond.wait()
                while self._inbox:
                    eng.add_request(*self._inbox.popleft())
                self._backlog = len(eng.waiting)  # moved from inbox to waiting: still counted against max_waiting
                for rid in self._cancels:
                    eng.abort(rid)
                self._cancels.clear()
                control, self._control = self._control, deque()
                if self._cancel_all:
                    eng.fail_all("cancelled", "server shut down before the request finished")
                stop = self._stopping and not eng.has_work()
            self._run_control(control)
            if stop:
                with self._cond:
                    self._backlog = 0
                    for _, fut in self._control:
                        fut.set_exception(EngineOverloaded("server is shutting down"))
                    self._control.clear()
                    self._cond.notify_all()
                return
            try:
                ran = eng.step()
            except Exception as e:  # never let the loop die with requests in flight
                log.exception("engine step crashed")
                eng.fail_all("error", f"internal error: {e}")
                ran = None
            with self._cond:
                self._backlog = len(eng.waiting)
                self._cond.notify_all()
                if ran is None and eng.has_work() and not (self._inbox or self._cancels or self._control):
                    self._cond.wait(IDLE_POLL_S)  # the waiting requests' adapters are still loading

    def _run_control(self, control: deque) -> None:
        for fn, fut in control:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # the caller gets it; the loop goes on
                fut.set_exception(e)


