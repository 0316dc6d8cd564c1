"""The engine behind the Triton model: input validation on the caller's thread, the iteration loop
on its own thread, back-pressure on admission, cancellation, and a draining shutdown.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Optional

from vlora.config import EngineConfig
from vlora.engine.api import EngineOverloaded, GenerationRequest, OutputCallback
from vlora.engine.builder import build_engine
from vlora.engine.core import PreparedRequest
from vlora.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)


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

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not self._inbox and not self._cancels and not eng.has_work() and not self._stopping:
                    self._cond.wait()
                while self._inbox:
                    eng.add_request(*self._inbox.popleft())
                self._backlog = len(eng.waiting)  # moved from inbox to waiting: still counted against max_waiting
                for rid in self._cancels:
                    eng.abort(rid)
                self._cancels.clear()
                if self._cancel_all:
                    eng.fail_all("cancelled", "server shut down before the request finished")
                if self._stopping and not eng.has_work():
                    self._backlog = 0
                    self._cond.notify_all()
                    return
            try:
                eng.step()
            except Exception as e:  # never let the loop die with requests in flight
                log.exception("engine step crashed")
                eng.fail_all("error", f"internal error: {e}")
            with self._cond:
                self._backlog = len(eng.waiting)
                self._cond.notify_all()


