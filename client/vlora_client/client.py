"""A client for the vlora model on Triton: gRPC streaming through tritonclient, or HTTP generate.

Only the documented wire names are used (the Triton vLLM backend's): inputs ``text_input`` (or vlora's
``messages``, a conversation as JSON), ``image`` (base64), ``stream``, ``sampling_parameters`` (JSON, carrying
``lora_name`` too);
outputs ``text_output``, ``finish_reason``, ``num_input_tokens``, ``num_output_tokens``.
Anything that speaks KServe v2 to Triton can send the same requests.

Adapters are listed, loaded and unloaded through the same model: ``sampling_parameters`` carries
``adapter_action`` (``list``, ``load``, ``unload``) and ``lora_name``; the answer's ``text_output`` is JSON.
``load`` and ``unload`` also carry ``admin_token`` (the token of the server's ``--admin-token-file``).
"""
from __future__ import annotations

import base64
import json
import os
import queue
import re
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

ImageInput = Union[str, os.PathLike, bytes]
# A prompt as the model takes it (``text_input``), or a whole conversation (the ``messages`` input): a list of
# {"role": "system"|"user"|"assistant", "content": text or [{"type": "text", "text": ...}, {"type": "image"},
# {"type": "video"}]}, rendered by the server through the checkpoint's chat template; the k-th image part is
# the k-th of ``images``.
Prompt = Union[str, Sequence[Mapping[str, Any]]]
DEFAULT_MODEL = "vlora"
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}


# What the server's error codes are called here (vlora's, as its messages start: "[UNAVAILABLE] ..."),
# from gRPC status names and HTTP statuses.
_CODE_PREFIX = re.compile(r"^\[([A-Z_]+)\] ")
_GRPC_CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "UNAVAILABLE": "UNAVAILABLE", "CANCELLED": "CANCELLED",
               "INTERNAL": "INTERNAL", "UNIMPLEMENTED": "UNSUPPORTED", "NOT_FOUND": "NOT_FOUND",
               "RESOURCE_EXHAUSTED": "UNAVAILABLE", "UNKNOWN": "UNKNOWN"}
_HTTP_CODES = {400: "INVALID_ARG", 404: "NOT_FOUND", 500: "INTERNAL", 501: "UNSUPPORTED", 503: "UNAVAILABLE"}
# Triton's own rejections of a request it could not queue (its queue full, or its timeout there).
_TRITON_UNAVAILABLE = ("Exceeds maximum queue size", "Request timeout expired")


class VloraClientError(RuntimeError):
    """The server refused or failed a request; the message is the server's (without its code prefix).

    ``code`` is the server's error code when it is known: ``INVALID_ARG`` (a bad request: do not retry
    it as is), ``UNAVAILABLE`` (the server is overloaded, stopping, or its engine failed: ``retryable``),
    ``INTERNAL``, ``CANCELLED``; None when the error says nothing of it (a client-side timeout)."""

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        m = _CODE_PREFIX.match(message or "")
        if m:
            code, message = m.group(1), message[m.end():]
        elif code is None and any(s in (message or "") for s in _TRITON_UNAVAILABLE):
            code = "UNAVAILABLE"
        super().__init__(message)
        self.code = code

    @property
    def retryable(self) -> bool:
        """The request was fine and the server could not take it now: send it again later."""
        return self.code == "UNAVAILABLE"


class VloraConnectionError(VloraClientError):
    """No server answered at the client's address (nothing listens there, or it cannot be reached)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="UNAVAILABLE")


@dataclass(frozen=True)
class GenerationResult:
    """The whole answer. A request with a ``task`` answered by a vision task head also carries ``label``
    and ``scores`` (label name -> probability, in the head's label order); ``text`` is then the label."""

    text: str
    finish_reason: Optional[str]
    num_input_tokens: int
    num_output_tokens: int
    label: Optional[str] = None
    scores: Optional[dict] = None


@dataclass(frozen=True)
class StreamDelta:
    """One streamed piece. ``finish_reason`` is set on the last one."""

    text: str
    finish_reason: Optional[str] = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    label: Optional[str] = None
    scores: Optional[dict] = None


def encode_image(image: ImageInput) -> str:
    """A path or encoded image bytes (PNG, JPEG...) -> base64 text, as the ``image`` input expects."""
    data = image if isinstance(image, (bytes, bytearray)) else Path(image).read_bytes()
    return base64.b64encode(bytes(data)).decode("ascii")


def sampling_parameters(
    max_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    seed: Optional[int] = None,
    stop: Optional[Union[str, Sequence[str]]] = None,
    lora_name: Optional[str] = None,
    ignore_eos: bool = False,
    apply_chat_template: bool = False,
    task: Optional[str] = None,
    latency_target: Optional[float] = None,
) -> dict:
    """The ``sampling_parameters`` JSON object, with vLLM's names; unset values are left out.
    ``latency_target``: seconds, this request's latency target for the server's scheduler."""
    params: dict = {}
    for key, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            params[key] = value
    if stop:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if lora_name:
        params["lora_name"] = lora_name
    if ignore_eos:
        params["ignore_eos"] = True
    if apply_chat_template:
        params["apply_chat_template"] = True
    if task:
        params["task"] = task
    if latency_target is not None:
        params["latency_target"] = latency_target
    return params


class VloraClient:
    """``VloraClient("localhost:8001")`` (gRPC) or ``VloraClient("localhost:8000", protocol="http")``.

    Each call opens its own stream or HTTP request, so one client may be used from several threads.
    """

    def __init__(self, url: Optional[str] = None, protocol: str = "grpc", model: str = DEFAULT_MODEL,
                 timeout_s: float = 300.0, admin_token: Optional[str] = None) -> None:
        """``admin_token``: sent with adapter load/unload (the server refuses them without its token)."""
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
        self.protocol = protocol
        self.url = url or DEFAULT_URLS[protocol]
        self.model = model
        self.timeout_s = timeout_s
        self.admin_token = admin_token
        if protocol == "grpc":
            import tritonclient.grpc  # noqa: F401  (fail early with a clear ImportError)

    # -- public API ----------------------------------------------------------------------------
    def generate(self, prompt: Prompt, images: Sequence[ImageInput] = (), lora_name: Optional[str] = None,
                 max_tokens: Optional[int] = None, temperature: Optional[float] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None, stop: Optional[Union[str, Sequence[str]]] = None,
                 ignore_eos: bool = False, apply_chat_template: bool = False,
                 stream: bool = False, task: Optional[str] = None,
                 latency_target: Optional[float] = None) -> GenerationResult:
        """One answer. ``stream=True`` asks the server to stream and joins the pieces here.

        ``prompt`` is the model's prompt as it is, or a conversation (a list of messages, see ``Prompt``),
        which the server renders through the checkpoint's chat template.

        ``apply_chat_template`` wraps the prompt in the model's chat template on the server. ``task`` asks
        the adapter's vision task head of that name: the result then has ``label`` and ``scores``.
        """
        params = sampling_parameters(max_tokens, temperature, top_p, seed, stop, lora_name, ignore_eos,
                                     apply_chat_template, task, latency_target)
        encoded = [encode_image(i) for i in images]
        if stream:
            return _join(self._stream(prompt, encoded, params, stream=True))
        if self.protocol == "http":
            return self._http_generate(prompt, encoded, params)
        return _join(self._stream(prompt, encoded, params, stream=False))

    def generate_stream(self, prompt: Prompt, images: Sequence[ImageInput] = (), lora_name: Optional[str] = None,
                        max_tokens: Optional[int] = None, temperature: Optional[float] = None,
                        top_p: Optional[float] = None, seed: Optional[int] = None,
                        stop: Optional[Union[str, Sequence[str]]] = None,
                        ignore_eos: bool = False, apply_chat_template: bool = False,
                        task: Optional[str] = None, latency_target: Optional[float] = None) -> Iterator[StreamDelta]:
        """Stream the answer as it is generated. Closing the iterator early cancels the request."""
        params = sampling_parameters(max_tokens, temperature, top_p, seed, stop, lora_name, ignore_eos,
                                     apply_chat_template, task, latency_target)
        return self._stream(prompt, [encode_image(i) for i in images], params, stream=True)

    # -- adapters ------------------------------------------------------------------------------
    def list_adapters(self) -> list[dict]:
        """Every adapter the server knows: ``name``, ``id`` (stable across unload/load), ``tier``
        (``gpu``, or ``cpu-slot`` on a CPU server: a device slot; ``cpu``: host memory; ``disk``), ``loaded``, ``rank``, ``target_modules``, ``heads``,
        ``running`` and ``waiting`` requests."""
        return self._adapter_action("list")["adapters"]

    def load_adapter(self, name: str) -> dict:
        """Load the folder ``name`` of the server's adapter root (one added after start, or one
        unloaded before). Raises VloraClientError with the reason when the server refuses it."""
        return self._adapter_action("load", name)["loaded"]

    def unload_adapter(self, name: str) -> dict:
        """Drop ``name`` from the server's memory; requests for it are refused until it is loaded
        again. New requests are refused at once; the server unloads it when those in flight have
        finished, waiting for that up to its lora.unload_timeout_s: the answer's ``state`` is
        ``unloaded``, or ``unloading`` when that wait timed out (the unload still completes)."""
        return self._adapter_action("unload", name)["unloaded"]

    def _adapter_action(self, action: str, name: Optional[str] = None) -> dict:
        params: dict = {"adapter_action": action}
        if name is not None:
            params["lora_name"] = name
        if action != "list" and self.admin_token is not None:
            params["admin_token"] = self.admin_token
        if self.protocol == "http":
            result = self._http_generate("", [], params)
        else:
            result = _join(self._stream("", [], params, stream=False))
        try:
            return json.loads(result.text)
        except json.JSONDecodeError:
            raise VloraClientError(f"adapter_action {action}: the server's answer is not JSON: {result.text[:200]!r}") from None

    def is_ready(self) -> bool:
        try:
            if self.protocol == "http":
                with urllib.request.urlopen(f"{self._http_base()}/v2/models/{self.model}/ready", timeout=5) as r:
                    return r.status == 200
            import tritonclient.grpc as grpcclient

            with grpcclient.InferenceServerClient(self.url) as c:
                return bool(c.is_model_ready(self.model))
        except Exception:
            return False

    # -- transports ----------------------------------------------------------------------------
    def _stream(self, prompt: Prompt, images: list[str], params: dict, stream: bool) -> Iterator[StreamDelta]:
        if self.protocol == "http":
            return self._http_stream(prompt, images, params, stream)
        return self._grpc_stream(prompt, images, params, stream)

    def _grpc_stream(self, prompt: Prompt, images: list[str], params: dict, stream: bool) -> Iterator[StreamDelta]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        inputs = build_grpc_inputs(prompt, images, params, stream)
        events: "queue.Queue" = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        finished = False
        try:
            # Not the header triton_grpc_error (the error's code as the stream's gRPC status): Triton 2.51
            # crashes (SIGSEGV) after a few such streams end in errors. The code is the message's prefix.
            client.start_stream(callback=lambda result, error: events.put((result, error)))
            try:
                client.async_stream_infer(self.model, inputs, request_id=uuid.uuid4().hex,
                                          enable_empty_final_response=True)
            except InferenceServerException as e:  # the stream broke before the request went out
                finished = True
                try:  # its cause comes through the callback
                    _, cause = events.get(timeout=2.0)
                except queue.Empty:
                    cause = None
                raise _grpc_error(self.url, cause if cause is not None else e, connecting=True) from None
            received = False
            while True:
                try:
                    result, error = events.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise VloraClientError(f"no response within {self.timeout_s}s") from None
                if error is not None:
                    finished = True
                    raise _grpc_error(self.url, error, connecting=not received)
                received = True
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                if response.outputs:
                    yield _delta_from(result.as_numpy)
                if final:
                    finished = True
                    return
        finally:
            try:
                client.stop_stream(cancel_requests=not finished)
            finally:
                client.close()

    def _http_base(self) -> str:
        return self.url if self.url.startswith(("http://", "https://")) else f"http://{self.url}"

    def _http_body(self, prompt: Prompt, images: list[str], params: dict, stream: bool) -> bytes:
        name, text = _prompt_input(prompt)
        body: dict = {name: text, "stream": stream}
        if images:
            body["image"] = images
        if params:
            body["sampling_parameters"] = json.dumps(params)
        return json.dumps(body).encode("utf-8")

    def _http_generate(self, prompt: Prompt, images: list[str], params: dict) -> GenerationResult:
        url = f"{self._http_base()}/v2/models/{self.model}/generate"
        req = urllib.request.Request(url, data=self._http_body(prompt, images, params, False),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise VloraClientError(_http_error_message(e), _HTTP_CODES.get(e.code)) from None
        except urllib.error.URLError as e:
            raise _unreachable(self.url, "HTTP", e.reason) from None
        if "error" in payload:
            raise VloraClientError(payload["error"])
        d = _delta_from_json(payload)
        return GenerationResult(d.text, d.finish_reason, d.num_input_tokens, d.num_output_tokens, d.label, d.scores)

    def _http_stream(self, prompt: Prompt, images: list[str], params: dict, stream: bool) -> Iterator[StreamDelta]:
        url = f"{self._http_base()}/v2/models/{self.model}/generate_stream"
        req = urllib.request.Request(url, data=self._http_body(prompt, images, params, stream),
                                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            message = _http_error_message(e)
            if message.startswith("data:"):  # /generate_stream's refusal is one event
                try:
                    message = json.loads(message[5:].strip()).get("error", message)
                except (ValueError, AttributeError):
                    pass
            raise VloraClientError(message, _HTTP_CODES.get(e.code)) from None
        except urllib.error.URLError as e:
            raise _unreachable(self.url, "HTTP", e.reason) from None
        with resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = json.loads(line[5:].strip())
                if "error" in payload:
                    raise VloraClientError(payload["error"])
                delta = _delta_from_json(payload)
                yield delta
                if delta.finish_reason is not None:
                    return


def _prompt_input(prompt: Prompt) -> tuple[str, str]:
    """(input name, its text): ``text_input`` for a prompt, ``messages`` (JSON) for a conversation."""
    if isinstance(prompt, str):
        return "text_input", prompt
    if isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be a string or a list of messages, not {type(prompt).__name__}")
    return "messages", json.dumps([dict(m) for m in prompt])


def build_grpc_inputs(prompt: Prompt, images: Sequence[str], params: dict, stream: bool) -> list:
    """tritonclient.grpc InferInputs for one request (images already base64)."""
    import tritonclient.grpc as grpcclient

    def tensor(name: str, array: np.ndarray, dtype: str):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    name, text = _prompt_input(prompt)
    inputs = [
        tensor(name, np.array([text.encode("utf-8")], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([stream], dtype=bool), "BOOL"),
    ]
    if images:
        inputs.append(tensor("image", np.array([i.encode("ascii") for i in images], dtype=np.object_), "BYTES"))
    if params:
        inputs.append(tensor("sampling_parameters", np.array([json.dumps(params).encode("utf-8")], dtype=np.object_), "BYTES"))
    return inputs


def _scalar(value, default=None):
    if value is None:
        return default
    arr = np.asarray(value).reshape(-1)
    if arr.size == 0:
        return default
    item = arr[0]
    return item.decode("utf-8") if isinstance(item, bytes) else item.item() if isinstance(item, np.generic) else item


def _head_answer(label, scores, names) -> tuple[Optional[str], Optional[dict]]:
    """(label, {name: score}) of a task head's answer; (None, None) for a generated one."""
    if label is None:
        return None, None
    label = label.decode("utf-8") if isinstance(label, bytes) else str(label)
    if scores is None or names is None:
        return label, None
    names = [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in np.asarray(names).reshape(-1)]
    values = [float(v) for v in np.asarray(scores, dtype=np.float64).reshape(-1)]
    return label, dict(zip(names, values))


def _delta_from(as_numpy) -> StreamDelta:
    text = _scalar(as_numpy("text_output"), "")
    label, scores = _head_answer(_scalar(as_numpy("label")), as_numpy("scores"), as_numpy("label_names"))
    return StreamDelta(
        text=text,
        finish_reason=_scalar(as_numpy("finish_reason")),
        num_input_tokens=int(_scalar(as_numpy("num_input_tokens"), 0)),
        num_output_tokens=int(_scalar(as_numpy("num_output_tokens"), 0)),
        label=label,
        scores=scores,
    )


def _delta_from_json(payload: dict) -> StreamDelta:
    def first(key, default=None):
        value = payload.get(key, default)
        return value[0] if isinstance(value, list) and value else value

    label, scores = _head_answer(first("label"), payload.get("scores"), payload.get("label_names"))
    return StreamDelta(
        text=first("text_output", "") or "",
        finish_reason=first("finish_reason"),
        num_input_tokens=int(first("num_input_tokens", 0) or 0),
        num_output_tokens=int(first("num_output_tokens", 0) or 0),
        label=label,
        scores=scores,
    )


def _join(deltas: Iterator[StreamDelta]) -> GenerationResult:
    parts, finish, n_in, n_out, label, scores = [], None, 0, 0, None, None
    for d in deltas:
        parts.append(d.text)
        n_in = d.num_input_tokens or n_in
        n_out += d.num_output_tokens
        if d.finish_reason is not None:
            finish = d.finish_reason
        if d.label is not None:
            label, scores = d.label, d.scores
    return GenerationResult("".join(parts), finish, n_in, n_out, label, scores)


def _unreachable(url: str, protocol: str, reason) -> VloraConnectionError:
    return VloraConnectionError(f"cannot reach a vlora server at {url} ({protocol}): {reason}; "
                                "is `vlora serve` running there, with this port?")


def _grpc_error(url: str, error, connecting: bool) -> VloraClientError:
    """The client error for a gRPC stream error: a transport failure before any answer (gRPC status
    UNAVAILABLE: no server there) is a VloraConnectionError; anything else is the server's message."""
    message = error.message() if hasattr(error, "message") and callable(error.message) else str(error)
    status = error.status() if hasattr(error, "status") and callable(error.status) else None
    name = str(status).rsplit(".", 1)[-1] if status is not None else None
    answered = bool(_CODE_PREFIX.match(message or "")) or any(s in (message or "") for s in _TRITON_UNAVAILABLE)
    if connecting and name == "UNAVAILABLE" and not answered:  # the server's own UNAVAILABLE carries a code
        return _unreachable(url, "gRPC", message)
    if connecting and status is None and "no longer in valid state" in (message or ""):
        return _unreachable(url, "gRPC", "the stream could not be opened")
    return VloraClientError(message, _GRPC_CODES.get(name) if name else None)


def _http_error_message(e: urllib.error.HTTPError) -> str:
    body = e.read().decode("utf-8", errors="replace")
    try:
        return json.loads(body).get("error", body)
    except (json.JSONDecodeError, AttributeError):
        return body or str(e)
