"""The router model (``vlora`` when ``vlora serve`` routes over several engine models): a decoupled Python-backend
model on the CPU that forwards each request to one engine model over Triton's BLS API and relays its answers.

The launcher writes it into the launch's workspace (a ``model.py`` that imports this class), never into the
committed model_repository/, which keeps running unchanged in NVIDIA's Triton container.

- ``execute()`` only peeks at the request's adapter (request parameters, then ``sampling_parameters``), reads the
  routing board and picks the engine (:func:`vlora.server.routing.policy.choose_engine`), then hands the
  request to a relay thread and returns. A request the peek cannot read goes to the least loaded engine, which
  refuses it with the message a single engine gives.
- A relay thread sends the request with ``exec(decoupled=True)`` and sends every response on as it comes: tokens
  as they stream, the final answer, and errors with their code and their ``[CODE]`` prefix. A response is the
  last when it carries ``finish_reason`` or an error (the engine model's wire format: vlora.server.wire);
  Triton 2.51's BLS iterator does not expose the final flag.
- Cancellation: a watcher thread polls the clients of the relays in flight every ``CANCEL_POLL_S``; when one
  went away it sends the engine a request whose id names the relayed one (``vlora-cancel-<id>``, answered at once
  by model.py's RouteIndex), since Triton 2.51's BLS API cannot cancel a request it sent. The engine then ends
  the request as cancelled, which frees its batch slot and its KV blocks.
- ``adapter_action`` requests go to every engine, and their answers are merged (vlora.server.routing.admin_merge).
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vlora.server.routing import BOARD_PARAM, CANCEL_PREFIX, ENGINES_PARAM, MARGIN_PARAM, ROUTE_PREFIX
from vlora.server.routing.admin_merge import EngineError, merge_admin
from vlora.server.routing.board import BoardReader
from vlora.server.routing.policy import DEFAULT_MARGIN, choose_engine, with_sent
from vlora.server.wire import ADMIN_KEY, Wire

# How long an answered request's adapter counts as loading on its engine for the placements after it, unless a newer
# record of that engine shows it (the board's records go stale after 2 s; engines publish every 0.1 s).
ANSWERED_HOLD_S = 2.0
RELAY_THREADS = 2048  # relays at once per router instance (threads start on demand; each waits on its engine)
ADMIN_FANOUT_THREADS = 16
DRAIN_S = 30.0  # how long finalize() waits for the relays in flight
CANCEL_POLL_S = 0.25  # how often the relays' clients are checked for cancellation (one IPC each)
SILENT_WARN_S = 60.0  # a relay that has had nothing from its engine for this long is named in the log, once
FINAL_OUTPUT = "finish_reason"  # every final answer of the engine model carries it; errors are final too


class _Relay:
    """One routed request: its BLS request to the engine, and its client's response sender."""

    __slots__ = ("bls", "sender", "engine", "route", "cancelled", "index", "adapter", "sent_at", "heard_at", "warned")

    def __init__(self, bls, sender, engine: str, route: str, index: int = -1, adapter=None) -> None:
        self.bls, self.sender, self.engine, self.route, self.cancelled = bls, sender, engine, route, False
        self.index, self.adapter, self.sent_at = index, adapter, time.monotonic()  # for the placements after it
        self.heard_at, self.warned = self.sent_at, False  # the engine's last response; named once if silent


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils  # importable only in the stub

        self._pb = pb_utils
        self._wire = Wire(pb_utils)
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("vlora router: config.pbtxt must set model_transaction_policy { decoupled: true }")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self._engines = [e for e in params.get(ENGINES_PARAM, "").split(",") if e]
        if not self._engines or not params.get(BOARD_PARAM):
            raise pb_utils.TritonModelException(f"vlora router: parameters {ENGINES_PARAM} and {BOARD_PARAM} are required")
        self._margin = int(params.get(MARGIN_PARAM) or DEFAULT_MARGIN)
        self._board = BoardReader(Path(params[BOARD_PARAM]), len(self._engines))
        self._board_lock = threading.Lock()  # the reader's cache is not shared between threads without it
        self._outputs = [o["name"] for o in config.get("output", [])]
        self._relays = ThreadPoolExecutor(max_workers=RELAY_THREADS, thread_name_prefix="vlora-relay")
        self._fanout = ThreadPoolExecutor(max_workers=ADMIN_FANOUT_THREADS, thread_name_prefix="vlora-fanout")
        self._inflight: dict[str, _Relay] = {}
        # The adapters of requests answered in the last ANSWERED_HOLD_S: (engine index, adapter) -> answered at, oldest
        # first, for the placements until their engines' records show them in a slot (policy.with_sent); one entry
        # per engine and adapter, so a placement reads a few, whatever the request rate. Under _inflight_lock.
        self._answered: "OrderedDict[tuple[int, str], float]" = OrderedDict()
        self._inflight_lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="vlora-cancel-watch", daemon=True)
        self._watcher.start()
        pb_utils.Logger.log_info(f"vlora router: routing over {', '.join(self._engines)} "
                                 f"(board {params[BOARD_PARAM]}, margin {self._margin})")

    # Requests.
    def execute(self, requests):
        for request in requests:
            try:
                self._route(request)
            except Exception as e:  # never expected: answered all the same
                self._pb.Logger.log_error(f"vlora router: routing a request failed: {type(e).__name__}: {e}")
                self._wire.send_error(self._wire.sender(request), f"internal error: {type(e).__name__}", internal=True)
        return None

    def _route(self, request) -> None:
        sender = self._wire.sender(request)
        try:
            options = self._wire.options(request)
        except Exception:  # the engine refuses it, naming the problem as a single engine does
            options = {}
        if ADMIN_KEY in options:  # the BLS requests are built here: the request's tensors are read in execute()
            asks = {engine: self._bls(request, engine, "") for engine in self._engines}
            self._relays.submit(self._admin, asks, sender, str(options.get(ADMIN_KEY)))
            return
        adapter = options.get("lora_name")
        adapter = adapter if isinstance(adapter, str) and adapter else None
        route = uuid.uuid4().hex
        with self._board_lock:
            loads = self._board.read()
        with self._inflight_lock:  # what this instance sent that the records cannot show yet (policy.with_sent)
            old = time.monotonic() - ANSWERED_HOLD_S
            while self._answered and next(iter(self._answered.values())) < old:
                self._answered.popitem(last=False)
            sent = [(r.index, r.adapter, r.sent_at, True) for r in self._inflight.values()]
            sent += [(i, a, at, False) for (i, a), at in self._answered.items()]
        index = choose_engine(adapter, with_sent(loads, sent), margin=self._margin, key=route)
        engine = self._engines[index]
        relay = _Relay(self._bls(request, engine, ROUTE_PREFIX + route), sender, engine, route, index, adapter)
        with self._inflight_lock:
            self._inflight[route] = relay
        try:
            self._relays.submit(self._relay, relay)
        except BaseException:
            with self._inflight_lock:
                self._inflight.pop(route, None)
            raise

    def _bls(self, request, engine: str, request_id: str):
        raw = request.parameters()
        parameters = json.loads(raw) if raw else {}
        inputs = request.inputs()
        floats = {k: v for k, v in parameters.items() if isinstance(v, float)}
        if floats:  # Triton 2.51's BLS takes str, int and bool parameters (a float failed the request as INTERNAL)
            parameters = {k: v for k, v in parameters.items() if k not in floats}
            inputs = self._with_sampling(inputs, floats)
        return self._pb.InferenceRequest(model_name=engine, inputs=inputs, request_id=request_id,
                                         requested_output_names=self._outputs, parameters=parameters)

    def _with_sampling(self, inputs: list, under: dict[str, Any]) -> list:
        """``inputs`` with ``under`` merged into the ``sampling_parameters`` input, beneath what it already holds:
        the engine reads request parameters first and that input over them (Wire.options), so the answer is the
        same. An input that is not a JSON object stays as it is, and the engine refuses it as it would have."""
        import numpy as np

        current: Any = {}
        rest = []
        for tensor in inputs:
            if tensor.name() != "sampling_parameters":
                rest.append(tensor)
                continue
            values = tensor.as_numpy().reshape(-1)
            try:
                current = json.loads(values[0]) if len(values) else {}
            except (ValueError, TypeError, UnicodeDecodeError):
                current = None
            if not isinstance(current, dict):
                return inputs
        merged = json.dumps({**under, **current})
        return rest + [self._pb.Tensor("sampling_parameters", np.array([merged.encode("utf-8")], dtype=np.object_))]

    def _relay(self, relay: _Relay) -> None:
        """Send the request to its engine and every response on; the request gets exactly one final answer."""
        pb, sender = self._pb, relay.sender
        final = False  # the relay is in self._inflight from its placement (_route) to its end here
        try:
            if relay.cancelled:  # its client left before this thread took it: the engine never sees it
                final = True
                self._wire.send_cancelled(sender)
                return
            responses = relay.bls.exec(decoupled=True)
            for response in responses:
                relay.heard_at = time.monotonic()
                if final:  # nothing follows a final answer (or the client is gone); drain the iterator
                    continue
                try:
                    if response.has_error():
                        error = response.error()
                        final = True
                        sender.send(pb.InferenceResponse(error=pb.TritonError(error.message(), error.code())),
                                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                        continue
                    tensors = response.output_tensors()
                    if not tensors:
                        continue
                    final = any(t.name() == FINAL_OUTPUT for t in tensors)
                    sender.send(pb.InferenceResponse(output_tensors=tensors),
                                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
                except Exception as e:  # the client is gone, or the answer could not be sent: stop the engine's work
                    pb.Logger.log_warn(f"vlora router: relaying a response failed: {type(e).__name__}: {e}")
                    if not final:  # and end the request here: until a final flag, Triton holds it (and this model)
                        final = True
                        relay.cancelled = True
                        self._send_cancel(relay)
                        self._wire.send_error(sender, f"internal error: relaying a response failed ({type(e).__name__})",
                                              internal=True)
        except Exception as e:
            if not final:
                final = True
                self._answer_failure(sender, relay.engine, e)
        finally:
            with self._inflight_lock:
                self._inflight.pop(relay.route, None)
                if relay.adapter is not None:
                    self._answered[(relay.index, relay.adapter)] = time.monotonic()
                    self._answered.move_to_end((relay.index, relay.adapter))
        if not final:  # the engine ended without a final answer: never expected
            self._wire.send_error(sender, f"internal error: {relay.engine} ended the request without an answer",
                                  internal=True)

    def _answer_failure(self, sender, engine: str, error: Exception) -> None:
        """A BLS call that failed before any answer: Triton's own refusals (the engine model's queue is full,
        the model is not ready) are the server's state, not the request's."""
        message = str(error)
        if "Exceeds maximum queue size" in message or "not ready" in message or "unavailable" in message.lower():
            self._wire.send_error(sender, f"server overloaded: {engine}: {message}", unavailable=True)
        else:
            self._pb.Logger.log_error(f"vlora router: relaying to {engine} failed: {type(error).__name__}: {message}")
            self._wire.send_error(sender, f"internal error: relaying to {engine} failed ({type(error).__name__})",
                                  internal=True)

    # Cancellation.
    def _watch_cancellations(self) -> None:
        while not self._stop.wait(CANCEL_POLL_S):
            with self._inflight_lock:
                relays = [r for r in self._inflight.values() if not r.cancelled]
            now = time.monotonic()
            for relay in relays:
                if not relay.warned and now - relay.heard_at > SILENT_WARN_S:  # a stuck engine or relay, named
                    relay.warned = True
                    self._pb.Logger.log_warn(
                        f"vlora router: request {relay.route} on {relay.engine} has had no response for "
                        f"{now - relay.heard_at:.0f} s ({'none yet' if relay.heard_at == relay.sent_at else 'some'} "
                        f"before; {len(relays)} relays in flight)")
                if Wire.client_gone(relay.sender):
                    relay.cancelled = True
                    self._send_cancel(relay)

    def _send_cancel(self, relay: _Relay) -> None:
        try:
            cancel = self._pb.InferenceRequest(model_name=relay.engine, inputs=[], request_id=CANCEL_PREFIX + relay.route,
                                               requested_output_names=[FINAL_OUTPUT])
            for _ in cancel.exec(decoupled=True):
                pass
        except Exception as e:
            self._pb.Logger.log_warn(f"vlora router: cancelling a request on {relay.engine} failed: {type(e).__name__}: {e}")

    # Adapter actions.
    def _admin(self, asks: dict, sender, action: str) -> None:
        """Send the adapter action to every engine and answer with the merged answer (admin_merge)."""
        try:
            futures = {engine: self._fanout.submit(self._ask, bls, engine) for engine, bls in asks.items()}
            answers = {engine: f.result() for engine, f in futures.items()}
            merged = merge_admin(action, answers)
            if isinstance(merged, EngineError):
                code = merged.code if merged.code is not None else self._pb.TritonError.INTERNAL
                sender.send(self._pb.InferenceResponse(error=self._pb.TritonError(merged.message, code)),
                            flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            self._wire.send_final(sender, [
                self._wire.string_tensor("text_output", json.dumps(merged)),
                self._wire.string_tensor("finish_reason", "stop"),
                self._wire.count_tensor("num_input_tokens", 0),
                self._wire.count_tensor("num_output_tokens", 0),
            ])
        except Exception as e:
            self._pb.Logger.log_error(f"vlora router: adapter_action {action} failed: {type(e).__name__}: {e}")
            self._wire.send_error(sender, f"internal error: {type(e).__name__}", internal=True)

    def _ask(self, bls, engine: str) -> Any:
        """One engine's answer to an adapter action: its JSON, or an EngineError."""
        answer: Any = EngineError(f"[INTERNAL] {engine} sent no answer")
        try:
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    error = response.error()
                    answer = EngineError(error.message(), error.code())
                    continue
                text = self._pb.get_output_tensor_by_name(response, "text_output")
                if text is not None:
                    value = text.as_numpy().reshape(-1)[0]
                    answer = json.loads(value.decode("utf-8") if isinstance(value, bytes) else str(value))
        except Exception as e:
            return EngineError(f"[UNAVAILABLE] {engine}: {type(e).__name__}: {e}", self._pb.TritonError.UNAVAILABLE)
        return answer

    def finalize(self) -> None:
        # The relays end with their engines' answers (the engines drain, then answer what is left); bounded, so
        # that an engine that never answers cannot hold this stub.
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline:
            with self._inflight_lock:
                if not self._inflight:
                    break
            time.sleep(0.05)
        self._stop.set()
        self._watcher.join(timeout=5)
        self._relays.shutdown(wait=False, cancel_futures=False)
        self._fanout.shutdown(wait=False)
