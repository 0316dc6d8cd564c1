"""The engine behind the Triton model: input validation on the caller's thread (image decoding on the
image workers), the iteration loop on its own thread, back-pressure on admission, cancellation, a
draining shutdown, and the adapter administration of clients (list, load, unload) run on the engine
thread between steps.

Outputs: each request's callback gets its events on the engine thread (GenerationOutput). A consumer
that sends them elsewhere (the Triton model's response thread) may pass ``after_outputs``: it is called
once after each loop iteration that delivered events (a step's whole batch of them), so the callback
only buffers and the consumer is woken once per step, not once per token.

Fail-safe: one request that cannot be admitted fails alone; a step that raises fails its batch. A
watchdog thread declares the engine dead when its thread has exited, or when one loop iteration (a
step or an adapter action) has run longer than ``scheduler.stall_timeout_s`` while requests wait or
run. Then every request in flight is failed with the cause, new ones are refused (EngineDead), and
``on_dead`` tells the owner (the Triton model takes its stub process down, so the launcher sees it).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

from vlora.config import EngineConfig
from vlora.engine.api import (EngineDead, EngineOverloaded, GenerationOutput, GenerationRequest, InvalidRequest, OutputCallback,
                              PreparedRequest)
from vlora.engine.builder import build_engine
from vlora.engine.core import LLMEngine
from vlora.engine.inputs import CheckedRequest
from vlora.metrics import EngineMetrics
from vlora.engine.preprocess import ImageBudget, ImageCharge, PreprocessPool, image_bytes
from vlora.errors import RequestCancelled
from vlora.models.images import keep_image_blocks

log = logging.getLogger(__name__)

# How long the loop waits when a step ran nothing although requests wait (their adapters are being
# loaded): new requests and control calls wake it at once.
IDLE_POLL_S = 0.002
# The ATMM tuner sidecar (atmm.tune_at_load) shares the GPU: it is stopped from a request's arrival until the
# engine has been idle this long (vlora.atmm.tuner.TunerSidecar.pause).
TUNER_IDLE_RESUME_S = 1.0
# Faults a test may inject when scheduler.fault_injection is on: "kill" raises out of the engine loop,
# "wedge" blocks the engine thread in its next step.
FAULTS = ("kill", "wedge")
# Pillow's kept blocks of freed images per image worker (vlora.models.images.keep_image_blocks): a request's images
# and their conversions, a video's frames; at most 16 MiB each, given back at the image budget's trim after a burst.
IMAGE_BLOCKS_PER_WORKER = 4


class InjectedFault(RuntimeError):
    """Raised out of the engine loop by the test-only fault ``kill``."""


class AsyncEngine:
    """Thread-safe front of :class:`LLMEngine`. See ``vlora.engine.api`` for the request types."""

    def __init__(self, config: EngineConfig, metrics: Optional[EngineMetrics] = None,
                 on_dead: Optional[Callable[[str], None]] = None,
                 after_outputs: Optional[Callable[[], None]] = None) -> None:
        """``on_dead(cause)`` is called once, on the watchdog's or the dying engine's thread, after
        every request in flight has been failed. ``after_outputs()`` is called on the engine thread
        after each loop iteration in which callbacks got events, and on any other thread right after
        it delivered events there (the watchdog failing the requests of a dead engine)."""
        self.config = config
        self.engine = build_engine(config, metrics)
        self.inputs = self.engine.inputs
        self.loras = self.engine.loras
        limits = config.limits
        self.image_workers = PreprocessPool(limits.resolved_image_workers, limits.image_queue_size)
        # Freed images' blocks kept for the next decodes (no page faults per new image); freed by the budget's trim.
        keep_image_blocks(IMAGE_BLOCKS_PER_WORKER * self.image_workers.workers)
        self.image_budget = ImageBudget(limits.resolved_inflight_image_bytes)
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._cancels: set[str] = set()
        self._control: deque[tuple[Callable[[LLMEngine], Any], Future]] = deque()
        self._backlog = 0
        self._stopping = False
        self._stopped = False
        self._cancel_all = False
        # Fail-safe state, guarded by _cond: the loop's last heartbeat, whether it sleeps with nothing
        # to do, how many requests it holds, and the cause once the engine is dead.
        self._beat = time.monotonic()
        self._idle = False
        self._active = 0
        self._free_slots = config.scheduler.max_batch_size  # batch places free at the last iteration (not waiting)
        self._dead: Optional[str] = None
        self._exited = False  # the loop returned normally (shutdown)
        self._wedge_next = False  # the injected fault "wedge" is pending
        self._unwedge = threading.Event()  # releases an injected wedge at shutdown
        self._on_dead = on_dead
        self._after_outputs = after_outputs
        self._delivered = False  # events went to callbacks on the engine thread since after_outputs last ran
        # Every request submitted and not finished: token -> callback (its final event goes out once).
        self._callbacks_lock = threading.Lock()
        self._callbacks: dict[int, tuple[str, OutputCallback]] = {}
        self._tokens = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="vlora-engine", daemon=True)
        self._thread.start()
        self._watch_stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="vlora-engine-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def dead(self) -> Optional[str]:
        """Why the engine is dead, or None while it serves."""
        with self._cond:
            return self._dead

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
            self._check_alive()
            if self._stopping:
                raise EngineOverloaded("server is shutting down")
            if self._idle:
                self._beat = time.monotonic()
            self._control.append((fn, fut))
            self._cond.notify_all()
        return fut.result(timeout)

    def adapters(self) -> list[dict]:
        """Every adapter known to the server: id, tier (gpu or cpu-slot, cpu, disk), rank, targets, heads, requests."""
        return self.call(lambda eng: eng.describe_adapters())

    def load_adapter(self, name: str) -> dict:
        """Read and check ``name`` from the adapter root into host memory (on this thread: the engine
        keeps decoding); refused with the reason (AdapterError) when it cannot be served."""
        self.loras.load(name)
        return self.call(lambda eng: eng.describe_adapters([name]))[0]

    def unload_adapter(self, name: str, timeout: Optional[float] = None) -> dict:
        """Unload ``name``: new requests for it are refused at once, and it leaves the device and host
        tiers when its running and waiting requests have finished (LLMEngine.unload_adapter). Waits for
        that up to ``timeout`` (default lora.unload_timeout_s) and returns the adapter's entry: ``state``
        "unloaded", or "unloading" when the wait timed out (the unload still completes)."""
        done: Future = Future()
        entry = self.call(lambda eng: eng.unload_adapter(name, on_unloaded=done.set_result))
        if entry.get("state") != "unloading":
            return entry
        wait = self.config.lora.unload_timeout_s if timeout is None else timeout
        try:
            return done.result(wait) if wait > 0 else entry
        except FutureTimeout:
            return self.call(lambda eng: eng.describe_adapters([name]))[0]

    # -- requests --------------------------------------------------------------------------------
    def prepare(self, req: GenerationRequest) -> PreparedRequest:
        """Validate and preprocess on the caller's thread. Raises InvalidRequest naming the problem."""
        return self.inputs.prepare(req)

    def check(self, req: GenerationRequest) -> CheckedRequest:
        """The cheap half of ``prepare``: fields, adapter, image headers and pixel budget."""
        return self.inputs.check(req)

    def preprocess(self, checked: CheckedRequest) -> PreparedRequest:
        """The costly half of ``prepare``: decode the images, build the model inputs."""
        return self.inputs.preprocess(checked)

    def generate(self, req: GenerationRequest, callback: OutputCallback, refuse: Callable[[Exception], None], *,
                 is_cancelled: Optional[Callable[[], bool]] = None, fault: Optional[str] = None,
                 wait: Optional[float] = None) -> None:
        """The one request entry: check, defer to the image workers when the images are heavy, preprocess,
        submit. Never raises: a request that never reaches the engine is answered by ``refuse(error)``, once,
        with InvalidRequest (a bad request), EngineOverloaded (the server cannot take it now: a full queue,
        shutting down, dead), RequestCancelled (its client went away while it waited for the image workers)
        or any other exception (an internal error); one that does gets its events through ``callback``.

        A request whose images have more than limits.inline_image_pixels pixels is decoded on the image
        workers (a bounded pool): this call returns at once, and a heavy request delays only itself.
        Otherwise it preprocesses and submits here, blocking while the engine is full (back-pressure) for up to
        ``wait`` seconds (default scheduler.admission_timeout_s; 0: refused at once, as the Triton model asks, whose
        execute() must never wait); a deferred request waits for room on its image worker, as configured.
        ``is_cancelled()`` is asked before a deferred request is preprocessed."""
        tuner = self.engine.tuner
        if tuner is not None:  # no client request shares the GPU with the tuner's profiling
            tuner.pause()
        try:
            # Fields, the adapter (not read here when cold: no arrival waits behind another's disk read; the engine
            # reads it once the request is queued), image headers: no pixel decoded yet.
            checked = self.inputs.check(req, wait_adapter=False)
            # Its images' bytes count against limits.max_inflight_image_bytes from here until its final event
            # or its refusal (whichever path: every refusal below goes through refuse_released).
            charge = self.image_budget.take(image_bytes(req.images, checked.images))
        except Exception as e:  # every refusal goes to the caller's refuse()
            if req.images:  # what came in counts toward the heap's trim after a burst, refused or not
                self.image_budget.refused(image_bytes(req.images, ()))
            refuse(e)
            return

        def refuse_released(error: Exception) -> None:
            charge.release()
            refuse(error)

        try:
            if checked.pixels > self.config.limits.inline_image_pixels:
                self.defer(lambda: self._enter(checked, callback, refuse_released, is_cancelled, fault, charge),
                           lambda reason: refuse_released(EngineOverloaded(reason or "server is shutting down")))
                return
        except Exception as e:
            refuse_released(e)
            return
        self._enter(checked, callback, refuse_released, None, fault, charge, wait)

    def _enter(self, checked: CheckedRequest, callback: OutputCallback, refuse: Callable[[Exception], None],
               is_cancelled: Optional[Callable[[], bool]], fault: Optional[str], charge: Optional[ImageCharge] = None,
               wait: Optional[float] = None) -> None:
        try:
            if is_cancelled is not None and is_cancelled():
                raise RequestCancelled("request cancelled")
            if charge is not None and charge.bytes:
                callback = _releasing(callback, charge)
            self.submit(self.inputs.preprocess(checked), callback, timeout=wait, fault=fault)
        except Exception as e:
            refuse(e)

    def preparing(self) -> int:
        """Requests this engine took that its scheduler does not hold yet: on the image workers (each deferred
        request is one job there, queued or running), or in the loop's inbox (what the routing board adds to the
        engine's waiting requests: vlora.server.routing)."""
        busy, queued = self.image_workers.load()
        return busy + queued + len(self._inbox)

    def defer(self, run: Callable[[], None], refuse: Callable[[str], None]) -> None:
        """Run ``run()`` on the image workers (it preprocesses and submits a request, and answers its
        client); ``refuse(reason)`` instead if the server shuts down first. Raises EngineOverloaded when
        limits.image_queue_size requests already wait for them, or the server is stopping."""
        with self._cond:
            self._check_alive()
            if self._stopping:
                raise EngineOverloaded("server is shutting down")
        self.image_workers.submit(run, refuse)

    def submit(self, prepared: PreparedRequest, callback: OutputCallback, timeout: Optional[float] = None,
               fault: Optional[str] = None) -> None:
        """Queue a prepared request. Blocks while the engine's waiting queue is full (back-pressure).

        ``fault`` (tests only, refused unless scheduler.fault_injection is on) is injected into the
        engine loop when it takes this request: see FAULTS."""
        if fault is not None:
            if not self.config.scheduler.fault_injection:
                raise InvalidRequest("fault injection is off (scheduler.fault_injection)")
            if fault not in FAULTS:
                raise InvalidRequest(f"vlora_test_fault must be one of {list(FAULTS)}, got {fault!r}")
        limit = self.config.scheduler.max_waiting
        deadline = time.monotonic() + (self.config.scheduler.admission_timeout_s if timeout is None else timeout)
        with self._cond:
            # The queue bound counts requests beyond what the batch has room for: a burst into an idle engine
            # fills its free batch places and then max_waiting, though none has been moved into the batch yet.
            while self._backlog + len(self._inbox) >= limit + self._free_slots:
                self._check_alive()
                if self._stopping:
                    raise EngineOverloaded("server is shutting down")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineOverloaded(f"server overloaded: {limit} requests already waiting")
                self._cond.wait(remaining)
            self._check_alive()
            if self._stopping:
                raise EngineOverloaded("server is shutting down")
            token = next(self._tokens)
            with self._callbacks_lock:
                self._callbacks[token] = (prepared.request_id, callback)
            if self._idle:
                self._beat = time.monotonic()
            self._inbox.append((prepared, self._tracked(token, callback), fault))
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._cancels.add(request_id)
            self._cond.notify_all()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish (cancel what remains at ``timeout``), join."""
        # The image workers first: what waits for them is refused, what they hold is submitted (the
        # engine still admits it) and drained with the rest.
        self.image_workers.shutdown(min(timeout, self.config.limits.image_decode_timeout_s + 5.0))
        with self._cond:
            if self._stopped:
                return
            self._stopping = True
            dead = self._dead is not None
            self._cond.notify_all()
        if dead:  # nothing to drain: the requests were failed; an injected wedge lets go
            self._unwedge.set()
            timeout = min(timeout, 1.0)
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._cancel_all = True
                self._cond.notify_all()
            self._thread.join(1.0 if dead else 10.0)
        self._watch_stop.set()
        self._unwedge.set()
        self._watchdog.join(5.0)
        self._stopped = True
        if self.engine.tuner is not None:
            self.engine.tuner.stop()
        self.loras.close()

    # -- fail-safe -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        """Under _cond: refuse with the cause once the engine is dead."""
        if self._dead is not None:
            raise EngineDead(f"the engine has failed and serves no more requests: {self._dead}")

    def _tracked(self, token: int, callback: OutputCallback) -> OutputCallback:
        """``callback`` for the engine: events of a request the watchdog already failed are dropped, so
        each request gets exactly one final event."""
        def deliver(out: GenerationOutput) -> None:
            with self._callbacks_lock:
                if token not in self._callbacks:
                    return
                if out.finished:
                    del self._callbacks[token]
                callback(out)
            if self._after_outputs is not None:
                if threading.get_ident() == self._thread.ident:
                    self._delivered = True  # the loop calls after_outputs once the iteration is done
                else:
                    self._after_outputs()
        return deliver

    def _outputs_done(self) -> None:
        """On the engine thread: tell the consumer that the events of this iteration were delivered."""
        if self._delivered:
            self._delivered = False
            self._after_outputs()

    def _watch(self) -> None:
        """The watchdog thread: declare the engine dead when its thread is gone or stalls."""
        stall = self.config.scheduler.stall_timeout_s
        period = min(0.5, stall / 10) if stall > 0 else 0.5
        while not self._watch_stop.wait(period):
            with self._cond:
                if self._dead is not None or self._exited:
                    return
                now = time.monotonic()
                pending = self._active + len(self._inbox) + len(self._control)
                stalled = stall > 0 and pending and not self._idle and now - self._beat > stall
                alive = self._thread.is_alive()
            if not alive:
                self._declare_dead("the engine thread exited unexpectedly")
                return
            if stalled:
                self._declare_dead(f"the engine made no progress for {now - self._beat:.1f} s with {pending} "
                                   f"request(s) or action(s) pending (scheduler.stall_timeout_s={stall:g})")
                return

    def _declare_dead(self, cause: str) -> None:
        """Fail every request in flight and every pending action with ``cause``, refuse new ones, and
        tell the owner. Runs once, on the watchdog's or the dying engine's thread."""
        with self._cond:
            if self._dead is not None:
                return
            self._dead = cause
            self._stopping = True
            self._inbox.clear()
            control, self._control = self._control, deque()
            self._cond.notify_all()
        log.critical("vlora engine failed: %s", cause)
        error = f"the engine has failed: {cause}"
        for _, fut in control:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDead(error))
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, {}
        for request_id, callback in callbacks.values():
            try:
                callback(GenerationOutput(request_id, "", "", True, finish_reason="error", error=error))
            except Exception:
                log.exception("failing a request of the dead engine")
        if self._after_outputs is not None:
            try:
                self._after_outputs()
            except Exception:
                log.exception("after_outputs failed")
        if self._on_dead is not None:
            self._on_dead(cause)

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
            self._outputs_done()
        except BaseException as e:  # the loop itself broke: nothing may wait for it any more
            log.exception("the engine loop died")
            self._declare_dead(f"the engine thread died: {type(e).__name__}: {e}")
            return
        with self._cond:
            self._exited = True

    def _run(self) -> None:
        eng = self.engine
        dev = eng.runner.device
        if dev.type == "cuda":
            # Make this thread's current device the engine's: extensions that launch on the current
            # device (ATMM's) and side streams then land on the right GPU of a multi-GPU host.
            import torch

            torch.cuda.set_device(dev)
        profiler = None
        runner_cfg = self.config.engine
        if runner_cfg.profile_dir:  # engine.profile_dir: a trace of a window of the serving steps
            from vlora.engine.step_profiler import StepProfiler

            profiler = StepProfiler(runner_cfg.profile_dir, *runner_cfg.profile_steps, dev)
        try:
            self._serve(eng, profiler)
        finally:
            if profiler is not None:
                profiler.finish()

    def _serve(self, eng: LLMEngine, profiler) -> None:
        while True:
            with self._cond:
                idle_since = None
                while (not self._inbox and not self._cancels and not self._control and not eng.has_work()
                       and not self._stopping):
                    self._idle = True
                    tuner = eng.tuner
                    if tuner is not None and tuner.paused:  # let the tuner go on once idle for a while
                        idle_since = idle_since or time.monotonic()
                        left = TUNER_IDLE_RESUME_S - (time.monotonic() - idle_since)
                        if left <= 0:
                            tuner.resume()
                        else:
                            self._cond.wait(left)
                        continue
                    self._cond.wait()
                if self._idle:
                    self._idle = False
                    self._beat = time.monotonic()
                while self._inbox:
                    self._admit(*self._inbox.popleft())
                self._note_queues(eng)  # moved from inbox to waiting: still counted against max_waiting
                for rid in self._cancels:
                    try:
                        eng.abort(rid)
                    except Exception:
                        log.exception("cancelling %s failed", rid)
                self._cancels.clear()
                control, self._control = self._control, deque()
                if self._cancel_all:
                    eng.fail_all("cancelled", "server shut down before the request finished")
                stop = self._stopping and not eng.has_work()
            if control:
                self._run_control(control)
                with self._cond:
                    self._beat = time.monotonic()
            self._outputs_done()  # admission failures and cancellations of this iteration
            if stop:
                with self._cond:
                    self._backlog = 0
                    for _, fut in self._control:
                        fut.set_exception(EngineOverloaded("server is shutting down"))
                    self._control.clear()
                    self._cond.notify_all()
                return
            if self._wedge_next:  # the injected fault "wedge": hang inside the step until shutdown
                self._unwedge.wait()
            if profiler is not None:
                profiler.before_step()
            try:
                ran = eng.step()
            except Exception as e:  # never let the loop die with requests in flight
                log.exception("engine step crashed")
                eng.fail_all("error", f"internal error: {e}")
                ran = None
            if profiler is not None:
                profiler.after_step(ran is not None)
            self._outputs_done()  # one wake-up for the whole step's events
            with self._cond:
                self._beat = time.monotonic()
                self._note_queues(eng)
                self._cond.notify_all()
                if ran is None and eng.has_work() and not (self._inbox or self._cancels or self._control):
                    self._cond.wait(IDLE_POLL_S)  # the waiting requests' adapters are still loading

    def _note_queues(self, eng: LLMEngine) -> None:
        """Under _cond: what submit() and the watchdog read of the engine's queues (its waiting requests, all it
        holds, and the batch's free places)."""
        self._backlog = len(eng.waiting)
        self._active = len(eng.waiting) + len(eng.running)
        self._free_slots = max(0, self.config.scheduler.max_batch_size - len(eng.running))

    def _admit(self, prepared: PreparedRequest, callback: OutputCallback, fault: Optional[str]) -> None:
        """Under _cond: hand one request to the engine; a request it cannot take fails alone."""
        if fault == "kill":
            raise InjectedFault("vlora_test_fault=kill: the engine loop raised")
        if fault == "wedge":
            self._wedge_next = True
        try:
            self.engine.add_request(prepared, callback)
        except Exception as e:
            log.exception("admitting request %s failed", prepared.request_id)
            callback(GenerationOutput(prepared.request_id, "", "", True, finish_reason="error",
                                      error=f"request refused by the engine: {type(e).__name__}: {e}",
                                      num_input_tokens=len(prepared.prompt_ids)))

    def _run_control(self, control: deque) -> None:
        for fn, fut in control:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(self.engine)
            except BaseException as e:  # the caller gets it; the loop goes on
                result, error = None, e
            else:
                error = None
            try:
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)
            except InvalidStateError:  # the watchdog failed it meanwhile
                pass


def _releasing(callback: OutputCallback, charge: ImageCharge) -> OutputCallback:
    """``callback`` that gives the request's image bytes back with its final event (finished, failed,
    cancelled, or failed by the watchdog: every final event goes through it)."""
    def deliver(out: GenerationOutput) -> None:
        try:
            callback(out)
        finally:
            if out.finished:
                charge.release()
    return deliver
