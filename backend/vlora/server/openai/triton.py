"""The front end's bridge to tritonserver: ``Frontend`` holds where Triton is and the settings, and sends every
request to the Triton model over Triton's gRPC streaming API (``ModelStreamInfer``, one ``grpc.aio`` channel shared
by all requests, one stream per request, so that closing a stream cancels its one request in Triton). The request
is built and the responses read as Triton's protobuf messages directly (tritonclient's generated stubs, not its
numpy layer): the per-token path reads the four small outputs straight from ``raw_output_contents``. Leaving a
request early cancels it in Triton. Also the model's adapter list and readiness.
"""
from __future__ import annotations

import asyncio
import json
import struct
import time
import uuid
from typing import Optional

import grpc

from vlora.server.openai.errors import APIError, error_from_triton
from vlora.server.openai.requests import image_payloads

MODEL_NAME = "vlora"  # the Triton model (vlora.server.repository.MODEL_NAME); also the base model's OpenAI name
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DRAIN_TIMEOUT_S = 30.0  # after the final answer, how long the stream may take to end before it is cancelled

_U32 = struct.Struct("<I")


class Answer:
    """One response of the model: ``text`` (the delta when streaming, else the whole answer), the token counts,
    and on the last one ``finish_reason`` (and a task head's ``head``: label and scores)."""

    __slots__ = ("text", "num_input_tokens", "num_output_tokens", "finish_reason", "head")

    def __init__(self) -> None:
        self.text = ""
        self.num_input_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: Optional[str] = None
        self.head: Optional[dict] = None


class TritonStream:
    """The answers to one request, read off its own gRPC stream: ``await next()`` (or ``async for``) until the one
    with ``finish_reason``; APIError for the model's errors and for a stream that fails or ends early. ``aclose()``
    before the last answer cancels the request in Triton; after it, the stream is left to end by itself (Triton's
    OK status follows at once)."""

    __slots__ = ("_front", "_call", "_model", "_done")

    def __init__(self, front: "Frontend", call, model: Optional[str]) -> None:
        self._front, self._call, self._model, self._done = front, call, model, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Answer:
        if self._done:
            raise StopAsyncIteration
        return await self.next()

    async def next(self) -> Answer:
        try:
            response = await self._call.read()
        except grpc.RpcError as e:
            self._done = True
            raise APIError(503, f"the inference server is unavailable ({_rpc_code(e)})", "server_error", None,
                           "service_unavailable") from None
        if response is grpc.aio.EOF:
            self._done = True
            raise APIError(500, "the inference server ended the request without an answer", "server_error", None,
                           "internal_error")
        if response.error_message:
            self._done = True
            raise error_from_triton(response.error_message, self._model)
        out = _decode(response.infer_response)
        if out.finish_reason is not None:
            self._done = True
            self._front._drain(self._call)
        return out

    def cancel(self) -> None:
        """Cancel the request in Triton, unless it is answered."""
        if not self._done:
            self._done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()


class Frontend:
    """The app's state: where Triton is and the settings; the gRPC channel is made on the app's loop."""

    def __init__(self, grpc_url: str, model: str = MODEL_NAME, checkpoint: Optional[str] = None,
                 family: str = "llava", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 allow_image_urls: bool = False) -> None:
        self.grpc_url = grpc_url
        self.model = model
        self.checkpoint = checkpoint
        self.family = family
        self.max_body_bytes = max_body_bytes
        self.allow_image_urls = allow_image_urls
        self.created = int(time.time())
        self._channel = None
        self._stream_infer = None
        self._drains: set = set()

    async def open(self) -> None:
        from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, service_pb2, service_pb2_grpc

        # tritonclient's default options plus no proxy (Triton is this host's, or the launcher's --host).
        self._channel = grpc.aio.insecure_channel(self.grpc_url, options=[
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.enable_http_proxy", 0),
        ])
        stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._pb = service_pb2
        self._stub = stub
        self._stream_infer = stub.ModelStreamInfer

    async def close(self) -> None:
        if self._drains:
            await asyncio.wait(list(self._drains), timeout=5)
        if self._channel is not None:
            await self._channel.close()

    def is_base(self, model: str) -> bool:
        return model == self.model or (self.checkpoint is not None and model == self.checkpoint)

    # Triton.
    def triton(self, prompt: Optional[str], images: list[str], params: dict, stream: bool, request_id: str,
               model: Optional[str] = None, messages: Optional[str] = None) -> TritonStream:
        """Send one request (``prompt`` as ``text_input``, or ``messages``: the conversation's JSON for the model's
        ``messages`` input) and return its answers as a :class:`TritonStream`."""
        pb = self._pb
        tensor = pb.ModelInferRequest.InferInputTensor
        inputs, raw = [], []
        if messages is not None:
            inputs.append(tensor(name="messages", datatype="BYTES", shape=[1]))
            raw.append(_bytes_element(messages.encode("utf-8")))
        else:
            inputs.append(tensor(name="text_input", datatype="BYTES", shape=[1]))
            raw.append(_bytes_element(prompt.encode("utf-8")))
        inputs.append(tensor(name="stream", datatype="BOOL", shape=[1]))
        raw.append(b"\x01" if stream else b"\x00")
        inputs.append(tensor(name="sampling_parameters", datatype="BYTES", shape=[1]))
        raw.append(_bytes_element(json.dumps(params).encode("utf-8")))
        if images:
            inputs.append(tensor(name="image", datatype="BYTES", shape=[len(images)]))
            raw.append(b"".join(_bytes_element(i.encode("ascii")) for i in images))
        request = pb.ModelInferRequest(model_name=self.model, id=request_id, inputs=inputs, raw_input_contents=raw)
        # The request goes from the iterator; its end half-closes the stream, as tritonclient's stream_infer does.
        return TritonStream(self, self._stream_infer((request,)), model)

    def _drain(self, call) -> None:
        """After the final response, let the stream end by itself (the server's OK status follows at once), so
        that Triton never sees a finished request cancelled; cancelled if it takes longer than DRAIN_TIMEOUT_S."""
        task = asyncio.get_running_loop().create_task(_exhaust(call))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def adapters(self) -> list[dict]:
        params = {"adapter_action": "list"}
        answer = None
        async for out in self.triton("", [], params, False, uuid.uuid4().hex):
            answer = out
        try:
            return json.loads(answer.text)["adapters"]
        except (AttributeError, TypeError, KeyError, ValueError):
            raise APIError(500, "the model's adapter list could not be read", "server_error", None, "internal_error") from None

    async def ready(self) -> bool:
        try:
            response = await self._stub.ModelReady(self._pb.ModelReadyRequest(name=self.model), timeout=10)
            return bool(response.ready)
        except Exception:
            return False

    async def images(self, urls: list[str]) -> list[str]:
        """``image_url`` values -> base64 payloads (vlora.server.openai.requests.image_payloads)."""
        return await image_payloads(urls, self.allow_image_urls)


def _bytes_element(data: bytes) -> bytes:
    """One element of a BYTES tensor in Triton's raw layout: its length (4 bytes, little-endian), then it."""
    return _U32.pack(len(data)) + data


async def _exhaust(call) -> None:
    timer = asyncio.get_running_loop().call_later(DRAIN_TIMEOUT_S, call.cancel)
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except (grpc.RpcError, asyncio.CancelledError):
        pass
    finally:
        timer.cancel()


def _rpc_code(e) -> str:
    try:
        return str(e.code()).rsplit(".", 1)[-1]
    except Exception:
        return type(e).__name__


def _strings(raw: bytes) -> list[str]:
    """A BYTES tensor's elements from Triton's raw layout (each: a 4-byte little-endian length, then the bytes)."""
    out, pos, end = [], 0, len(raw)
    while pos + 4 <= end:
        n = _U32.unpack_from(raw, pos)[0]
        out.append(raw[pos + 4:pos + 4 + n].decode("utf-8", "replace"))
        pos += 4 + n
    return out


def _decode(response) -> Answer:
    """A ModelInferResponse -> Answer, from ``raw_output_contents`` (where Triton puts every output); through
    tritonclient's InferResult for a response laid out otherwise."""
    out = Answer()
    raw = response.raw_output_contents
    outputs = response.outputs
    if len(raw) != len(outputs):
        return _decode_slow(response)
    head = None
    for i, tensor in enumerate(outputs):
        name = tensor.name
        data = raw[i]
        if name == "text_output":
            out.text = data[4:].decode("utf-8", "replace") if len(data) == 4 + _U32.unpack_from(data)[0] \
                else "".join(_strings(data))
        elif name == "num_output_tokens":
            out.num_output_tokens = _U32.unpack_from(data)[0] if len(data) >= 4 else 0
        elif name == "num_input_tokens":
            out.num_input_tokens = _U32.unpack_from(data)[0] if len(data) >= 4 else 0
        elif name == "finish_reason":
            values = _strings(data)
            out.finish_reason = values[0] if values else "stop"
        elif name in ("label", "label_names", "scores"):
            head = head or {}
            head[name] = data
    if head is not None and out.finish_reason is not None and "label" in head:
        labels = _strings(head.get("label_names", b""))
        scores = struct.unpack(f"<{len(head.get('scores', b'')) // 4}f", head.get("scores", b""))
        out.head = {"label": (_strings(head["label"]) or [""])[0], "scores": dict(zip(labels, map(float, scores)))}
    return out


def _decode_slow(response) -> Answer:
    from tritonclient.grpc import InferResult

    result = InferResult(response)
    out = Answer()
    text = result.as_numpy("text_output")
    out.text = b"".join(bytes(x) for x in text.reshape(-1)).decode("utf-8", "replace") if text is not None else ""
    for name in ("num_input_tokens", "num_output_tokens"):
        a = result.as_numpy(name)
        setattr(out, name, int(a.reshape(-1)[0]) if a is not None and a.size else 0)
    finish = result.as_numpy("finish_reason")
    if finish is not None and finish.size:
        out.finish_reason = bytes(finish.reshape(-1)[0]).decode("utf-8", "replace")
        label = result.as_numpy("label")
        if label is not None and label.size:
            names = [bytes(x).decode("utf-8", "replace") for x in result.as_numpy("label_names").reshape(-1)]
            scores = [float(s) for s in result.as_numpy("scores").reshape(-1)]
            out.head = {"label": bytes(label.reshape(-1)[0]).decode("utf-8", "replace"),
                        "scores": dict(zip(names, scores))}
    return out
