"""The Triton model: a thin adapter between Triton's request objects and the vlora engine.

execute() parses each request off the wire and hands it to the engine's one request entry,
``AsyncEngine.generate``: it checks the request, defers heavy images to the image workers (a bounded pool;
when its queue is full the request is refused as UNAVAILABLE), preprocesses and submits; a request it
does not take comes back through ``refuse`` and is answered with the code its error stands for. The engine,
on its own thread, reports every event through a
callback that only appends it to the outbox, and wakes the response thread once per engine step
(AsyncEngine's ``after_outputs``), not once per token; the response thread sends the responses (what
queued up while it sent goes out together, each request's events merged into one response) and watches
for cancelled requests. Metric updates are accumulated and applied every 0.2 s (vlora.server.metrics):
the engine thread shares the stub's GIL with these threads, so they wake as rarely as they can.
finalize() drains the image workers and the engine, and joins the threads.

The wire format (the Triton vLLM backend's: inputs, outputs, sampling parameters, errors) is
vlora.server.wire; adapter administration through the same model (``adapter_action``: list, load, unload)
is vlora.server.admin, run on admin threads; the custom metrics are vlora.server.metrics. This file only
connects them to Triton's request objects and threads, and imports everything from the installed vlora
package, so this model repository runs unchanged in NVIDIA's Triton container after ``pip install vlora``.

Every request gets exactly one final answer, whatever fails: each path below ends in a response (an
error naming the cause when nothing better can be sent), and finalize() answers what it stops: admin
requests still queued, requests waiting for the image workers, and requests in flight.

When the engine fails (its thread died, or the watchdog saw it stall), every request in flight is
answered with the cause, the cause is logged (``vlora: ENGINE FAILED: ...``), and this stub process
exits: Triton does not restart a dead Python stub, so ``vlora serve`` sees it go and stops the server,
which takes readiness down with it.
"""
from __future__ import annotations

import gc
import json
import os
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Optional

import triton_python_backend_utils as pb_utils

from vlora.config import EngineConfig, read_admin_token
from vlora.engine import AsyncEngine
from vlora.engine.api import GenerationOutput, coalesce
from vlora.errors import EngineOverloaded, InvalidRequest, RequestCancelled
from vlora.server.admin import AdminActions, admin_request
from vlora.server.metrics import TritonModelMetrics
from vlora.server.routing import ROUTING_PARAMS
from vlora.server.routing.engine_side import BoardPublisher, RouteIndex
from vlora.server.wire import Wire

CANCEL_POLL_S = 0.5  # how often in-flight requests are checked for client cancellation (one IPC each)
MAX_DRAIN = 4096  # queued items the response thread takes at once (and merges per request) before sending
ADMIN_THREADS = 4  # adapter actions at once
ADMIN_DRAIN_S = 10.0  # how long finalize() waits for running adapter actions to answer
DEAD_FLUSH_S = 5.0  # how long a dead engine's errors may take to reach the clients before the stub exits
FINAL_RETRY_S = 60.0  # how long a final flag that could not be sent is tried again (every CANCEL_POLL_S)
STALE_ANSWER_S = 300.0  # a request with nothing sent for this long is logged (once), and it is checked every
STALE_CHECK_S = 30.0  # ... this often
ENGINE_FAILED = "vlora: ENGINE FAILED"  # the log line `vlora serve` looks for


@dataclass
class _InFlight:
    """What the response thread needs to answer one request."""

    request_id: str
    sender: Any
    stream: bool
    prefix: str  # prepended to a non-streaming answer when exclude_input_in_output is false
    sent_output_tokens: int = 0
    cancel_requested: bool = False


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self._model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self._model_config):
            raise pb_utils.TritonModelException(
                "vlora: config.pbtxt must set model_transaction_policy { decoupled: true }"
            )
        config = self._engine_config(args)
        self._fault_injection = config.scheduler.fault_injection  # tests only: the vlora_test_fault parameter
        # Read once, before the engine loads: an unreadable token file fails the model load, naming the file.
        token_file = config.lora.admin_token_file
        admin_token: Optional[bytes] = read_admin_token(token_file).encode("utf-8") if token_file else None
        self._wire = Wire(pb_utils)
        # A final answer that could not be sent: its request stays in flight for Triton, and a stopping server
        # waits for it (then exits 1 at its exit timeout, without finalize()). The response thread sends a bare
        # final flag again until it goes through (FINAL_RETRY_S).
        self._wire.on_lost_final = lambda sender: self._post(("final", sender))
        pb_utils.Logger.log_info(
            f"vlora: loading the engine (model {config.model.path or 'tiny default'}, device {config.model.device}, "
            f"dtype {config.model.dtype})"
        )
        pb_utils.Logger.log_verbose(f"vlora: engine config {json.dumps(config.to_dict(), default=str)}")
        gpu = args.get("model_instance_kind") == "GPU"
        self._metrics = TritonModelMetrics(pb_utils, args["model_name"], args["model_version"],
                                           args.get("model_instance_name", ""),
                                           f"cuda:{int(args['model_instance_device_id'])}" if gpu else "cpu",
                                           max_lora=config.lora.max_gpu_adapters)
        # One of several engine models behind the router (vlora.server.routing): also publish this engine's load
        # and adapters on the routing board. Otherwise the metrics themselves.
        self._metrics = BoardPublisher.wrap(self._metrics, self._model_config, config.lora.max_gpu_adapters)
        # Engine events and control items for the response thread, in order (deque appends are atomic);
        # _wake is set when the response thread should look: after each engine step's events, and by _post.
        self._outbox: deque = deque()
        self._wake = threading.Event()
        self._execute_tls = threading.local()  # .later: answers deferred until execute() returns
        self._engine = AsyncEngine(config, metrics=self._metrics, on_dead=self._engine_failed,
                                   after_outputs=self._wake.set)
        pb_utils.Logger.log_info(
            f"vlora: model {self._engine.model_info}; adapters {self._engine.list_adapters()}"
        )
        if isinstance(self._metrics, BoardPublisher):  # requests still being prepared count as waiting there
            self._metrics.preparing = self._engine.preparing
        self._routes = RouteIndex(self._engine.cancel)  # the router's cancellations of routed requests
        self._response_thread = threading.Thread(target=self._response_loop, name="vlora-responses", daemon=True)
        self._response_thread.start()
        # Several: an unload may wait (lora.unload_timeout_s) for its adapter's requests, and a list must not.
        self._admin = ThreadPoolExecutor(max_workers=ADMIN_THREADS, thread_name_prefix="vlora-admin")
        self._admin_actions = AdminActions(self._wire, self._engine, admin_token)
        self._admin_futures: set[Future] = set()  # queued or running; finalize() waits for the running ones
        self._admin_lock = threading.Lock()
        # What is built by now (the model, its tokenizer, the engine: about 380k objects with the tiny model)
        # lives as long as this process: frozen out of the cyclic garbage collector, a full collection looks
        # only at what came after (0.01 ms on an idle server instead of 0.3 s on a 2-core CPU, the GIL held).
        # Python's own full collections then never stall the engine thread, and the image budget runs one
        # after each burst of images, before it trims the heap (issue 37).
        gc.collect()
        gc.freeze()
        self._engine.image_budget.collect = True

    @staticmethod
    def _engine_config(args: dict[str, str]) -> EngineConfig:
        """Defaults, then `config_file` (YAML), then flat `section.field` parameters; Triton places the device."""
        params = {
            key: value.get("string_value", "")
            for key, value in json.loads(args["model_config"]).get("parameters", {}).items()
        }
        config_file = params.pop("config_file", "")
        for key in ROUTING_PARAMS:  # the routing board's settings, not the engine's
            params.pop(key, None)
        config = EngineConfig.from_yaml(config_file) if config_file else EngineConfig()
        config = config.with_overrides(params)
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{int(args['model_instance_device_id'])}"
            if config.model.device not in ("auto", device):
                pb_utils.Logger.log_warn(
                    f"vlora: model.device={config.model.device} ignored; Triton placed this instance on {device}"
                )
            config = config.with_overrides({"model.device": device})
        return config

    def execute(self, requests):
        # Answers decided here (refusals, adapter actions) go out only after execute() returns: a client
        # answered while execute() still runs may send its next request before Triton's scheduler sees this
        # model instance free again, and Triton 2.51's dynamic batcher then leaves that request waiting for
        # its default 500 ms wake-up (cheap refusals on an idle server took exactly 0.5 s, issue 37).
        later: list = []
        self._execute_tls.later = later
        try:
            for request in requests:
                try:
                    self._admit(request)
                except Exception as e:  # _admit answers its refusals; this is the last resort
                    pb_utils.Logger.log_error(f"vlora: admitting a request failed: {type(e).__name__}: {e}")
                    try:
                        sender = self._wire.sender(request)
                        later.append(lambda s=sender, n=type(e).__name__: self._wire.send_error(
                            s, f"internal error: {n}", internal=True))
                    except Exception:
                        pass
        finally:
            self._execute_tls.later = None
            if later:
                self._post(("later", later))  # the response thread runs them, after this call has returned
        return None

    def _later(self, action) -> None:
        """Run ``action`` (which answers a request) after execute() returns when called inside it, else now."""
        later = getattr(self._execute_tls, "later", None)
        if later is not None:
            later.append(action)
        else:
            action()

    def _admit(self, request) -> None:
        sender = self._wire.sender(request)
        route = self._routes.cancellation(request)
        if route is not None:  # the router's client went away: cancel the request it routed here
            sender.note = f"the router's cancellation of {route}"
            found = self._routes.cancel(route)
            self._later(lambda: self._wire.send_final(sender, [self._wire.string_tensor("text_output", str(found).lower()),
                                                               self._wire.string_tensor("finish_reason", "stop")]))
            return
        request_id = uuid.uuid4().hex
        try:
            admin = admin_request(self._wire, request)
            if admin is not None:
                sender.note = f"adapter_action {admin[0]!r}"
                self._later(lambda: self._submit_admin(sender, admin))
                return
            parsed = self._wire.parse(request, request_id, fault_injection=self._fault_injection)
        except Exception as e:  # InvalidRequest: 400; anything else an internal error
            self._refuse(sender, e)
            return
        gen = parsed.gen
        sender.note = (f"request {request_id} ({'streamed' if gen.stream else 'whole'}, {len(gen.images)} image(s), "
                       f"adapter {gen.lora_name or 'none'})")
        self._routes.register(request, request_id)
        state = _InFlight(request_id=request_id, sender=sender, stream=gen.stream,
                          prefix="" if parsed.exclude_input or gen.stream else gen.prompt)
        # Registered before the engine sees it: the outbox is FIFO, so the response thread knows the request
        # before its first output arrives (no wake-up needed: that output comes with one).
        self._outbox.append(("open", state))

        def refuse(error: Exception) -> None:  # it never reached the engine: answered here (or after execute()), once
            self._post(("close", request_id))
            self._refuse(sender, error)

        # Checks, defers heavy images to the image workers, preprocesses and submits; never waits: a request the
        # engine cannot queue now (scheduler.max_waiting) is refused (UNAVAILABLE), as Triton queues nothing for us.
        self._engine.generate(gen, self._outbox.append, refuse, is_cancelled=lambda: Wire.client_gone(sender),
                              fault=parsed.fault, wait=0)

    def _refuse(self, sender, error: Exception) -> None:
        """Answer a request the engine did not take, with the code its error stands for: after execute()
        returns when called inside it (``_later``), else now.

        The answer is decided here and only its text is kept, never ``error``: its traceback holds the frames
        of execute() and of the engine's admission, whose locals hold the request's images (base64 and
        decoded), and execute()'s frame holds the deferred answers. An answer that kept the error closed a
        reference cycle that only Python's cyclic garbage collector frees, which an idle server seldom runs:
        after a flood of refused image requests the stub kept about 160 MiB of their images (issue 37)."""
        if isinstance(error, RequestCancelled):
            self._later(lambda: self._wire.send_cancelled(sender))
            return
        unavailable = internal = False
        if isinstance(error, InvalidRequest):
            message = str(error)
        elif isinstance(error, EngineOverloaded):  # a full queue, the server stopping, a dead engine
            message, unavailable = str(error) or "server overloaded", True
        else:
            pb_utils.Logger.log_error("vlora: request refused by an internal error: "
                                      + "".join(traceback.format_exception(error)))
            message, internal = f"internal error: {type(error).__name__}: {error}", True
        self._later(lambda: self._wire.send_error(sender, message, unavailable=unavailable, internal=internal))

    def _submit_admin(self, sender, admin: tuple) -> None:
        """Run an adapter action on an admin thread. Answered there; if it never runs (the server stops
        first) or fails outside AdminActions.run, answered here."""
        try:
            future = self._admin.submit(self._admin_actions.run, sender, *admin)
        except RuntimeError:  # the executor is shut down: the server is stopping
            self._wire.send_error(sender, "server shutting down", unavailable=True)
            return
        with self._admin_lock:
            self._admin_futures.add(future)

        def done(f: Future) -> None:
            with self._admin_lock:
                self._admin_futures.discard(f)
            if f.cancelled():  # finalize() cancelled it before it ran
                self._wire.send_error(sender, "server shutting down", unavailable=True)
            elif f.exception() is not None:  # AdminActions.run answers everything; never expected
                pb_utils.Logger.log_error(f"vlora: adapter_action failed: {f.exception()!r}")
                self._wire.send_error(sender, "internal error", internal=True)

        future.add_done_callback(done)

    def _post(self, item: Any) -> None:
        """Queue a control item for the response thread and wake it."""
        self._outbox.append(item)
        self._wake.set()

    def _response_loop(self) -> None:
        """Send what the engine produced; cancel requests whose clients went away."""
        inflight: dict[str, _InFlight] = {}
        lost: list[tuple[Any, float]] = []  # (sender, give up at) of final flags still to send
        outbox, wake = self._outbox, self._wake
        last_poll = last_stale = time.monotonic()
        stop = more = False
        while not stop:
            if not more:  # a step's events are all in the outbox when it wakes us: one drain per step
                wake.wait(CANCEL_POLL_S)
            wake.clear()  # before draining: what is appended and woken for later is seen next time
            # Whatever queued up while the last sends ran goes out together: a request's events merge into
            # one response (the same text in fewer pieces), so a sender slower than the engine's token rate
            # sends less often instead of falling further behind.
            batch = []
            while outbox and len(batch) < MAX_DRAIN:
                batch.append(outbox.popleft())
            more = len(batch) == MAX_DRAIN and bool(outbox)  # else what came meanwhile comes with a wake-up
            try:
                items = coalesce(batch)
            except Exception as e:  # never expected: send the events one by one
                pb_utils.Logger.log_error(f"vlora: merging responses failed: {type(e).__name__}: {e}")
                items = batch
            for item in items:
                if item is _STOP:
                    stop = True
                    break
                if isinstance(item, tuple) and item[0] == "final":
                    lost.append((item[1], time.monotonic() + FINAL_RETRY_S))
                    continue
                try:
                    self._handle(item, inflight)
                except Exception as e:  # one item's fault must not end this thread (nothing would be answered)
                    pb_utils.Logger.log_error(f"vlora: the response thread failed on an item: {type(e).__name__}: {e}")
            now = time.monotonic()
            if (inflight or lost) and now - last_poll >= CANCEL_POLL_S:
                last_poll = now
                lost = self._send_lost_finals(lost, now)
                try:
                    self._poll_cancelled(inflight)
                except Exception as e:
                    pb_utils.Logger.log_error(f"vlora: polling for cancellations failed: {type(e).__name__}: {e}")
            if now - last_stale >= STALE_CHECK_S:
                last_stale = now
                self._wire.senders.report_stale(STALE_ANSWER_S)
        for state in inflight.values():
            self._wire.send_error(state.sender, "server shutting down", unavailable=True)
        while outbox:  # the final flags those errors could not carry, posted just now: one more try each
            item = outbox.popleft()
            if isinstance(item, tuple) and item[0] == "final":
                lost.append((item[1], 0.0))
        self._send_lost_finals(lost, time.monotonic())

    @staticmethod
    def _send_lost_finals(lost: list, now: float) -> list:
        """Send a bare final flag for each request whose final answer could not be sent; the ones still failing
        (until their time runs out) are returned."""
        left = []
        for sender, give_up in lost:
            try:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                pb_utils.Logger.log_warn("vlora: a request's final flag went through on a later try")
            except Exception as e:
                if now < give_up:
                    left.append((sender, give_up))
                else:
                    pb_utils.Logger.log_error(f"vlora: gave up sending a request's final flag after "
                                              f"{FINAL_RETRY_S:.0f} s: {type(e).__name__}: {e}")
        return left

    def _handle(self, item: Any, inflight: dict[str, _InFlight]) -> None:
        """One outbox item on the response thread."""
        if isinstance(item, GenerationOutput):
            state = inflight.get(item.request_id)
            if state is not None:
                if not self._send_output(state, item):  # could not be sent: answered with an error instead
                    del inflight[item.request_id]
                    if not item.finished:
                        self._engine.cancel(item.request_id)
                elif item.finished:
                    del inflight[item.request_id]
        elif isinstance(item, tuple):
            if item[0] == "later":  # answers decided inside execute(), which has returned
                for action in item[1]:
                    try:
                        action()
                    except Exception as e:
                        pb_utils.Logger.log_error(f"vlora: answering a refused request failed: {type(e).__name__}: {e}")
                # execute()'s frame holds this list, and a refused request's traceback holds that frame: emptied,
                # nothing an answer captured can keep the frame's requests alive in a cycle (see _refuse).
                item[1].clear()
            elif item[0] == "flushed":  # everything queued before it has been sent
                item[1].set()
            elif item[0] == "open":
                inflight[item[1].request_id] = item[1]
            elif item[0] == "close":
                inflight.pop(item[1], None)

    def _engine_failed(self, cause: str) -> None:
        """The engine is dead and has failed its requests (their errors are queued): log the cause, let
        the response thread send them, then end this stub process (see the module docstring)."""
        pb_utils.Logger.log_error(f"{ENGINE_FAILED}: {cause}; in-flight requests were failed; "
                                  "the model instance stops now")

        def exit_when_sent() -> None:
            flushed = threading.Event()
            self._post(("flushed", flushed))
            flushed.wait(DEAD_FLUSH_S)
            time.sleep(0.5)  # the last sends and the log line reach the server
            os._exit(1)

        threading.Thread(target=exit_when_sent, name="vlora-engine-failed", daemon=True).start()

    def _poll_cancelled(self, inflight: dict[str, _InFlight]) -> None:
        for state in inflight.values():
            # Once its client is gone, a request is cancelled again at every poll until its final event: a request
            # still on the image workers when the first one came was not known to the engine, which dropped it.
            if state.cancel_requested or Wire.client_gone(state.sender):
                state.cancel_requested = True
                self._engine.cancel(state.request_id)

    def _send_output(self, state: _InFlight, out: GenerationOutput) -> bool:
        """Send the response to one engine event. False when it failed: the request was then answered with
        an error (or its client is gone) and gets nothing more."""
        try:
            if out.finished and (out.error or out.finish_reason == "error"):
                # A dead engine's errors are "unavailable": the request was fine, the server is not.
                self._wire.send_error(state.sender, out.error or "generation failed", unavailable=self._engine.dead is not None)
                return True
            if out.finished and out.finish_reason == "cancelled" and state.cancel_requested:
                self._wire.send_cancelled(state.sender)
                return True
            tensors = self._wire.output_tensors(out, stream=state.stream, prefix=state.prefix,
                                                sent_output_tokens=state.sent_output_tokens)
            if tensors is None:
                return True
            if state.stream:
                state.sent_output_tokens = out.num_output_tokens
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
            state.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
            return True
        except Exception as e:  # one line; the client may be gone, else it gets the cause
            pb_utils.Logger.log_error(f"vlora: sending a response failed: {type(e).__name__}: {e}")
            self._wire.send_error(state.sender, f"internal error: sending the response failed ({type(e).__name__})",
                                  internal=True)
            return False

    def finalize(self) -> None:
        pb_utils.Logger.log_info("vlora: draining the engine")
        # Queued admin requests are cancelled, and answered "server shutting down" (_submit_admin).
        self._admin.shutdown(wait=False, cancel_futures=True)
        try:
            self._engine.shutdown()
        finally:
            with self._admin_lock:
                running = list(self._admin_futures)
            wait_futures(running, timeout=ADMIN_DRAIN_S)  # the running ones answer (the engine has stopped)
            self._post(_STOP)
            self._response_thread.join(timeout=30)
            left = len(self._wire.senders)
            if left:  # each holds its request, and this model, in the server (see wire.OpenSenders)
                pb_utils.Logger.log_warn(f"vlora: {left} request(s) had no final answer when the model stopped")
            self._metrics.close()
            gc.unfreeze()
        pb_utils.Logger.log_info("vlora: stopped")


_STOP = object()

