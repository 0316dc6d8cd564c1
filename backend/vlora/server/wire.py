"""The Triton vLLM backend's wire format, as the Triton model (model_repository/vlora/1/model.py) speaks it.

Inputs text_input, image (base64, one or more), stream, sampling_parameters (JSON), exclude_input_in_output;
or, instead of text_input, messages (a whole conversation as JSON, rendered by the model through the
checkpoint's chat template: vlora.engine.chat);
lora_name and the sampling options in the request parameters or in sampling_parameters (the latter wins).
Outputs text_output, finish_reason, num_input_tokens, num_output_tokens; a task head's answer adds label,
scores and label_names. Errors go back as a TritonError: INVALID_ARG for a bad request, UNAVAILABLE for a
server that cannot take it now (overloaded, stopping, its engine failed), INTERNAL for a fault of vlora's,
CANCELLED for a request its client cancelled. Each error's message starts with its code, ``[UNAVAILABLE]
server overloaded: ...``: Triton's HTTP generate endpoints answer any error a decoupled model sends with
400 (Triton 2.51; later releases map the code), and a gRPC stream's error carries no status (only with
the header ``triton_grpc_error: true``, which crashes Triton 2.51); the prefix reaches every client.

Every string a request carries (text_input, the sampling_parameters JSON and each string in it, request
parameters) must be UTF-8 without lone surrogates or NULs; anything else is refused naming the field.

Everything here goes through the ``pb_utils`` module a :class:`Wire` is given: Triton's
``triton_python_backend_utils`` in the stub (importable only there), a small fake in the unit tests.
"""
from __future__ import annotations

import json
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from vlora.engine.api import GenerationOutput, GenerationRequest, SamplingParams, check_text, parse_sampling_json
from vlora.engine.chat import parse_messages
from vlora.errors import InvalidRequest

# Request parameters that are not sampling options; accepted and ignored (clients of the vLLM
# backend send "stream" there, and the input tensor decides).
IGNORED_PARAMETERS = ("stream",)
SAMPLING_KEYS = SamplingParams.KEYS + SamplingParams.EXTRA_KEYS
ADMIN_KEY = "adapter_action"  # vlora.server.admin answers these requests
ADMIN_TOKEN_KEY = "admin_token"  # load/unload carry it; checked against lora.admin_token_file's token
# Tests only: a request parameter that injects a fault into the engine (accepted when the engine
# setting scheduler.fault_injection is on; see vlora.engine.async_engine.FAULTS).
FAULT_KEY = "vlora_test_fault"


@dataclass(frozen=True)
class ParsedRequest:
    """A generation request as it came off the wire, before the engine checks it."""

    gen: GenerationRequest
    exclude_input: bool  # exclude_input_in_output (default true): a non-streaming answer without the prompt
    fault: Optional[str]  # FAULT_KEY's value, for the engine's fault injection (tests only)


class Sender:
    """A request's response sender, shared safely between threads: a send and an ``is_cancelled()`` never
    overlap, and once a final flag has been sent (or its send tried) ``is_cancelled()`` answers False without
    asking Triton.

    The Python backend frees a request's response factory in the server process as soon as a final flag
    reaches it, whatever the send's outcome, and its ``is_cancelled()`` asks the server about that factory:
    asked after the final flag, it reads freed memory. Triton 2.51 crashed so (SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled): the router's cancellation watcher polled a request that its
    relay thread had just answered. Sends themselves pass through: the backend's own sender refuses a second
    final flag before it reaches the server, and one that failed before that can still be sent again.

    Until its final flag a sender is listed in its :class:`OpenSenders`; ``note`` says what the request is
    (the model sets it), for the log lines about requests left without an answer."""

    __slots__ = ("_sender", "_final_flag", "_lock", "_state", "_registry", "__weakref__")

    def __init__(self, sender: Any, final_flag: int, registry: "OpenSenders") -> None:
        self._sender, self._final_flag, self._registry = sender, final_flag, registry
        self._lock = threading.Lock()
        self._state = _SenderState()
        registry.add(self)

    @property
    def note(self) -> str:
        return self._state.note

    @note.setter
    def note(self, text: str) -> None:
        self._state.note = text

    def send(self, response: Any = None, flags: int = 0) -> None:
        with self._lock:
            state = self._state
            state.last = time.monotonic()
            if flags & self._final_flag and not state.final:
                state.final = True
                self._registry.closed(state)
            self._sender.send(response, flags=flags)

    def is_cancelled(self) -> bool:
        with self._lock:
            return False if self._state.final else bool(self._sender.is_cancelled())


class _SenderState:
    """What OpenSenders knows of one sender; it outlives the sender (its finalizer reads it)."""

    __slots__ = ("note", "created", "last", "final", "reported")

    def __init__(self) -> None:
        self.note = "a request"
        self.created = self.last = time.monotonic()
        self.final = self.reported = False


class OpenSenders:
    """The response senders whose final flag has not been sent. Until it is, Triton holds the request's response
    factory and, through it, the model: a stopping server waits for every one before it unloads the model (and
    calls finalize()), and gives up at its exit timeout (exit code 1). Two log lines name such a request: a sender
    garbage-collected without a final flag (the backend frees its factory then), and, from :meth:`report_stale`,
    one with nothing sent for a long time. Weak: being listed keeps no sender alive."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._open: dict[int, _SenderState] = {}  # id(state) -> state, while its final flag is unsent

    def add(self, sender: Sender) -> None:
        state = sender._state
        with self._lock:
            self._open[id(state)] = state
        weakref.finalize(sender, self._dropped, state).atexit = False  # a stub that exits says nothing more

    def closed(self, state: _SenderState) -> None:
        with self._lock:
            self._open.pop(id(state), None)

    def _dropped(self, state: _SenderState) -> None:
        self.closed(state)
        if not state.final:
            self._log(f"vlora: {state.note} ended without a final answer "
                      f"({time.monotonic() - state.created:.1f} s after it came); Triton frees it now")

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def report_stale(self, older_than_s: float) -> int:
        """Log each open sender with nothing sent for ``older_than_s`` seconds, once; how many there are."""
        now = time.monotonic()
        with self._lock:
            stale = [s for s in self._open.values() if now - s.last >= older_than_s]
        for s in stale:
            if not s.reported:
                s.reported = True
                self._log(f"vlora: {s.note} has had no answer for {now - s.last:.0f} s "
                          f"(it came {now - s.created:.0f} s ago)")
        return len(stale)


class Wire:
    """Requests in and responses out, through one ``pb_utils`` module."""

    def __init__(self, pb_utils: Any) -> None:
        self.pb = pb_utils
        # Called with a response sender whose final answer (an error or a cancellation) could not be sent: Triton
        # counts its request in flight until the sender sends the final flag (the model sends it again later).
        self.on_lost_final: Optional[Callable[[Any], None]] = None
        self.senders = OpenSenders(lambda line: self.pb.Logger.log_warn(line))

    # Requests.
    def sender(self, request) -> Sender:
        """The request's response sender, as every answer and cancellation check must use it (see Sender)."""
        return Sender(request.get_response_sender(), self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, self.senders)

    def single(self, request, name: str):
        """The first element of an optional input tensor, or None when the client did not send it."""
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        values = tensor.as_numpy().reshape(-1)
        if values.size == 0:
            return None
        value = values[0]
        return value.item() if isinstance(value, np.generic) else value

    def options(self, request) -> dict[str, Any]:
        """Request parameters first, then the sampling_parameters input over them. Raises InvalidRequest,
        also for a string value that is not clean text (see :func:`check_text`), naming its key."""
        options = request_parameters(request)
        raw = self.single(request, "sampling_parameters")
        if isinstance(raw, bytes):
            raw = decode_text("sampling_parameters", raw, allow_nul=True)  # a NUL in JSON text is a syntax error
        sampling = parse_sampling_json(raw)
        for key, value in sampling.items():
            check_text("sampling_parameters", key)
            check_value(key, value)
        options.update(sampling)
        return options

    def parse(self, request, request_id: str, *, fault_injection: bool) -> ParsedRequest:
        """Triton tensors and parameters -> GenerationRequest. Raises InvalidRequest naming the problem."""
        text = self.single(request, "text_input")
        raw_messages = self.single(request, "messages")
        conversation = None
        if raw_messages is not None:  # a whole chat, rendered by the model through the chat template
            raw_messages = decode_text("messages", raw_messages) if isinstance(raw_messages, bytes) else str(raw_messages)
            if text is not None and (text.strip() if isinstance(text, bytes) else str(text).strip()):
                raise InvalidRequest("send text_input or messages, not both")
            conversation = parse_messages(raw_messages)
            prompt = ""
        elif text is None:
            raise InvalidRequest("text_input is required (or messages, a conversation)")
        else:
            prompt = decode_text("text_input", text) if isinstance(text, bytes) else check_text("text_input", str(text))

        # Base64 as sent (the vLLM backend's convention); engine.prepare decodes and checks them.
        tensor = self.pb.get_input_tensor_by_name(request, "image")
        images = [bytes(item) for item in tensor.as_numpy().reshape(-1)] if tensor is not None else []

        stream = bool(self.single(request, "stream") or False)
        exclude = self.single(request, "exclude_input_in_output")
        exclude_input = True if exclude is None else bool(exclude)

        options = self.options(request)
        fault = options.pop(FAULT_KEY, None)
        if fault is not None and not fault_injection:
            raise InvalidRequest(f"unknown request parameter(s) {[FAULT_KEY]}; accepted: {sorted(SAMPLING_KEYS + (ADMIN_KEY,))}")
        extras = {k: options.pop(k) for k in SamplingParams.EXTRA_KEYS if k in options}
        sampling = SamplingParams.from_dict(options)
        lora_name = extras.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise InvalidRequest(f"lora_name must be a string, got {lora_name!r}")
        apply_chat_template = extras.get("apply_chat_template", False)
        if not isinstance(apply_chat_template, bool):
            raise InvalidRequest("apply_chat_template must be true or false")
        if conversation is not None:
            if extras.get("apply_chat_template") is False:
                raise InvalidRequest("apply_chat_template cannot be false with messages: a conversation always "
                                     "goes through the chat template")
            if not exclude_input:
                raise InvalidRequest("exclude_input_in_output cannot be false with messages (there is no "
                                     "text_input to return)")
            apply_chat_template = False
        task = extras.get("task")
        if task is not None and not isinstance(task, str):
            raise InvalidRequest("task must be a string")
        gen = GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            images=images,
            lora_name=lora_name or None,
            sampling=sampling,
            stream=stream,
            apply_chat_template=apply_chat_template,
            task=task,
            messages=conversation,
        )
        return ParsedRequest(gen, exclude_input, fault)

    # Responses.
    def string_tensor(self, name: str, text: str):
        return self.pb.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))

    def count_tensor(self, name: str, value: int):
        return self.pb.Tensor(name, np.array([value], dtype=np.uint32))

    def head_tensors(self, answer: dict[str, Any]) -> list:
        """``label``, ``scores`` (one per label, softmax) and ``label_names`` (in the same order)."""
        return [
            self.string_tensor("label", answer["label"]),
            self.pb.Tensor("scores", np.asarray(answer["scores"], dtype=np.float32)),
            self.pb.Tensor("label_names", np.array([x.encode("utf-8") for x in answer["labels"]], dtype=np.object_)),
        ]

    def output_tensors(self, out: GenerationOutput, *, stream: bool, prefix: str, sent_output_tokens: int) -> Optional[list]:
        """The tensors of the response to one engine event, or None when it sends nothing (a streaming event
        without new text, or an unfinished event of a non-streaming request). A streamed response counts the
        tokens since ``sent_output_tokens``; a non-streaming one gets ``prefix`` (the prompt, when
        exclude_input_in_output is false) before its text. A finished one ends with finish_reason, and a
        task head's answer with its label and scores."""
        if stream:
            if not out.finished and not out.text_delta:
                return None
            tensors = [
                self.string_tensor("text_output", out.text_delta),
                self.count_tensor("num_input_tokens", out.num_input_tokens),
                self.count_tensor("num_output_tokens", max(out.num_output_tokens - sent_output_tokens, 0)),
            ]
        elif out.finished:
            tensors = [
                self.string_tensor("text_output", prefix + out.text),
                self.count_tensor("num_input_tokens", out.num_input_tokens),
                self.count_tensor("num_output_tokens", out.num_output_tokens),
            ]
        else:
            return None
        if out.finished:
            tensors.append(self.string_tensor("finish_reason", out.finish_reason or "stop"))
            if "label" in out.extra:  # a task head's answer
                tensors += self.head_tensors(out.extra)
        return tensors

    def send_final(self, sender, tensors: list) -> None:
        sender.send(self.pb.InferenceResponse(output_tensors=tensors), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def send_error(self, sender, message: str, unavailable: bool = False, internal: bool = False) -> bool:
        """Answer with a TritonError: INVALID_ARG; UNAVAILABLE when the server (not the request) is the cause;
        INTERNAL for a fault of vlora's. False (and one log line) when it could not be sent."""
        code = "UNAVAILABLE" if unavailable else "INTERNAL" if internal else "INVALID_ARG"
        return self._send_error(sender, message, code, self.pb.Logger.log_error, "an error")

    @staticmethod
    def client_gone(sender) -> bool:
        """Whether the client of ``sender`` (a response sender) cancelled or went away; False when it cannot tell."""
        try:
            return bool(sender.is_cancelled())
        except Exception:
            return False

    def send_cancelled(self, sender) -> bool:
        return self._send_error(sender, "request cancelled", "CANCELLED", self.pb.Logger.log_warn, "a cancellation")

    def _send_error(self, sender, message: str, code_name: str, log, what: str) -> bool:
        try:
            code = getattr(self.pb.TritonError, code_name, None)  # older Triton releases lack some codes
            text = error_message(code_name, message)
            error = self.pb.TritonError(text) if code is None else self.pb.TritonError(text, code)
            sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return True
        except Exception as e:  # one line: the sender is gone (client disconnected) or already answered
            log(f"vlora: sending {what} failed: {type(e).__name__}: {e}")
            if self.on_lost_final is not None:
                self.on_lost_final(sender)
            return False


def error_message(code_name: str, message: str) -> str:
    """``[CODE] message``, as text Triton can carry: a lone surrogate (from a client's string quoted in
    the message) is escaped, and a NUL (which would cut the C string) is shown as ``\\x00``."""
    text = f"[{code_name}] {message}".encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00")


def decode_text(field: str, raw: bytes, allow_nul: bool = False) -> str:
    """``raw`` as text; InvalidRequest naming ``field`` when it is not UTF-8 (encoded surrogates included)
    or holds a NUL."""
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"{field} is not valid UTF-8 (byte {e.start})") from None
    return text if allow_nul else check_text(field, text)


def check_value(field: str, value: Any, depth: int = 0) -> None:
    """:func:`check_text` on every string in ``value`` (lists and objects too, e.g. ``stop``)."""
    if isinstance(value, str):
        check_text(field, value)
    elif isinstance(value, list) and depth < 4:
        for item in value:
            check_value(field, item, depth + 1)
    elif isinstance(value, dict) and depth < 4:
        for key, item in value.items():
            check_text(field, key)
            check_value(field, item, depth + 1)


def request_parameters(request) -> dict[str, Any]:
    """Request parameters (JSON keys of /generate that are not inputs, or gRPC parameters). Raises
    InvalidRequest for a string that is not clean text, naming its key."""
    try:
        raw = request.parameters()
        params = json.loads(raw) if raw else {}
    except UnicodeDecodeError as e:  # Triton passes the client's bytes as they came; the stub cannot decode them
        raise InvalidRequest(f"request parameter {_undecodable_key(e)} is not valid UTF-8") from None
    except ValueError as e:
        raise InvalidRequest(f"the request parameters could not be read: {e}") from None
    if not isinstance(params, dict):
        raise InvalidRequest("the request parameters could not be read")
    for key, value in params.items():
        check_text("a request parameter name", key)
        check_value(key, value)
    for key in IGNORED_PARAMETERS:
        params.pop(key, None)
    unknown = sorted(set(params) - set(SAMPLING_KEYS) - {ADMIN_KEY, ADMIN_TOKEN_KEY, FAULT_KEY})
    if unknown:
        raise InvalidRequest(
            f"unknown request parameter(s) {unknown}; accepted: {sorted(SAMPLING_KEYS + (ADMIN_KEY,))}"
        )
    return params


def _undecodable_key(error: UnicodeDecodeError) -> str:
    """The name of the parameter whose value broke the stub's decoding of the parameters' JSON, when it
    can be told (the JSON decoded with the bad bytes escaped), else a description."""
    try:
        params = json.loads(bytes(error.object).decode("utf-8", "surrogateescape"))
        for key, value in params.items():
            if isinstance(value, str) and any("\udc80" <= ch <= "\udcff" for ch in value):
                return repr(key.encode("utf-8", "backslashreplace").decode("utf-8"))
    except Exception:
        pass
    return "(one of them)"
