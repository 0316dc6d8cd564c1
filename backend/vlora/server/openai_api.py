"""The OpenAI-compatible front end of ``vlora serve`` (issue 39): a thin ASGI app that speaks to tritonserver.

``vlora serve`` starts it as a process of its own (``python -m vlora.server.openai_api``, on ``--openai-port``,
default 9000, on the launcher's ``--host``), once tritonserver is ready, waits for its ``/health``, and stops it
with the server. It holds no engine, tokenizer or model state: every request becomes one request to the Triton
model ``vlora`` over Triton's gRPC streaming API (``ModelStreamInfer``, through ``tritonclient.grpc.aio``, one
channel shared by all requests, one stream per request), so Triton's queue, scheduling, limits, metrics and the
model's own checks apply unchanged. Endpoints:

- ``GET /v1/models`` (and ``/v1/models/{id}``): the base model (``vlora``, the Triton model's name; the
  checkpoint's folder name is accepted as an alias and shown as ``root``) and every adapter with its ``tier`` and
  ``loaded``, from the model's open ``adapter_action: list`` request.
- ``POST /v1/chat/completions``: one user message (text and ``image_url`` parts; ``system``/``developer``
  messages before it are prepended to its text), wrapped in the checkpoint's chat template by the model
  (``apply_chat_template``); ``model`` is an adapter's name or the base model's. Several images are a video for a
  family that takes one (Qwen2-VL, Qwen2.5-VL). Images are ``data:`` URLs; ``http(s)`` URLs only with
  ``--allow-image-urls`` (then fetched here, within a size and a time limit).
- ``POST /v1/completions``: a raw prompt, used as given.
- ``GET /health``: 200 when tritonserver's model is ready, else 503.

Errors come in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, from the model's error prefixes
(``[INVALID_ARG]`` 400, or 404 ``model_not_found`` for an unknown adapter; ``[UNAVAILABLE]`` and Triton's full
queue 503; ``[INTERNAL]`` 500), never with a traceback. Request bodies are bounded (``--max-body-bytes``).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import json
import logging
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, AsyncIterator, Optional

import numpy as np

log = logging.getLogger("vlora.openai")

MODEL_NAME = "vlora"  # the Triton model (vlora.server.repository.MODEL_NAME); also the base model's OpenAI name
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
IMAGE_URL_MAX_BYTES = 16 * 1024 * 1024  # one fetched image (the engine's limits.max_image_bytes default)
IMAGE_URL_TIMEOUT_S = 10.0  # one fetch, connection to last byte
MAX_IMAGE_URLS = 16  # http(s) images fetched for one request
# vlora.engine.api.MAX_TOKENS_LIMIT (not imported: the front end stays free of the engine). Without
# max_tokens an answer may run to the context's end, as OpenAI's API defines it.
MAX_TOKENS_LIMIT = 2**20
MAX_ERROR_CHARS = 2000

# Where images go in a prompt, per checkpoint family (config.json model_type): the placeholders of
# vlora.models.loader (IMAGE_PLACEHOLDER) and vlora.models.qwen2_vl (VISION_PLACEHOLDER, VIDEO_PLACEHOLDER).
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PLACEHOLDERS = {"llava": "<image>", "qwen2_vl": _QWEN_IMAGE, "qwen2_5_vl": _QWEN_IMAGE}
VIDEO_PLACEHOLDERS = {"qwen2_vl": _QWEN_VIDEO, "qwen2_5_vl": _QWEN_VIDEO}  # families that take a video

_CODE_PREFIX = re.compile(r"^\[([A-Z_]+)\] ")
_TRITON_UNAVAILABLE = ("Exceeds maximum queue size", "Request timeout expired")
_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}


class APIError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def error_from_triton(message: str, model: Optional[str] = None) -> APIError:
    """The model's (or Triton's) error message -> the OpenAI error with the matching status."""
    message = (message or "").split("\n\nAt:")[0][:MAX_ERROR_CHARS]  # never a Python traceback
    m = _CODE_PREFIX.match(message)
    code, text = (m.group(1), message[m.end():]) if m else (None, message)
    if code == "INVALID_ARG":
        if text.startswith("unknown adapter"):
            return APIError(404, f"The model '{model}' does not exist: {text}", "invalid_request_error", "model",
                            "model_not_found")
        pm = re.match(r"(max_tokens|temperature|top_p|seed|stop|latency_target|task|ignore_eos)\b", text)
        return bad_request(text, pm.group(1) if pm else None)
    if code == "UNAVAILABLE" or any(s in text for s in _TRITON_UNAVAILABLE):
        return APIError(503, text, "server_error", None, "service_unavailable")
    if code == "CANCELLED":
        return APIError(503, text, "server_error", None, "cancelled")
    if code == "INTERNAL":
        return APIError(500, text, "server_error", None, "internal_error")
    return APIError(500, text or "the inference server failed the request", "server_error", None, "internal_error")


# -- requests: OpenAI bodies -> the vlora model's request ---------------------------------------------------------

def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", "messages")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{where} holds a lone UTF-16 surrogate, not valid text", "messages") from None
    return value


def _parts(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        return []
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", "messages")
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{where}[{i}] must be an object with a type", "messages")
    return content


def _system_text(content: Any, where: str) -> str:
    texts = []
    for i, part in enumerate(_parts(content, where)):
        if part["type"] != "text":
            raise bad_request(f"{where}[{i}]: a system message takes text only", "messages")
        texts.append(_text(part.get("text"), f"{where}[{i}].text"))
    return "\n".join(texts)


def chat_prompt(messages: Any, family: str) -> tuple[str, list[Any]]:
    """``messages`` -> (the user turn's text, its images as ``image_url`` values). The model wraps the text in the
    checkpoint's chat template (one user turn). Images placed before all of the text need no placeholder (the
    model puts them first); images between text parts get the family's placeholder where they stand; several
    images are one video in a family that takes videos."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    system: list[str] = []
    user: Optional[list[dict]] = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        where = f"messages[{i}].content"
        if role in ("system", "developer"):
            if user is not None:
                raise bad_request(f"messages[{i}]: a system message must come before the user message", "messages")
            system.append(_system_text(message.get("content"), where))
        elif role == "user":
            if user is not None:
                raise bad_request("multi-turn conversations are not supported yet: send one user message "
                                  "(system messages before it are prepended to its text)", "messages")
            user = _parts(message.get("content"), where)
            base = i
        elif role in ("assistant", "tool", "function"):
            raise bad_request(f"messages[{i}]: {role} messages (multi-turn conversations) are not supported yet: "
                              "send one user message", "messages")
        else:
            raise bad_request(f"messages[{i}].role must be system, developer or user, got {role!r}", "messages")
    if user is None:
        raise bad_request("messages has no user message", "messages")
    pieces: list[tuple[str, Any]] = []  # ("text", str) or ("image", url)
    for j, part in enumerate(user):
        where = f"messages[{base}].content[{j}]"
        if part["type"] == "text":
            pieces.append(("text", _text(part.get("text"), f"{where}.text")))
        elif part["type"] == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise bad_request(f"{where}.image_url.url must be a string", "messages")
            pieces.append(("image", url))
        else:
            raise bad_request(f"{where}: content parts of type {part['type']!r} are not supported "
                              "(text and image_url are)", "messages")
    images = [v for k, v in pieces if k == "image"]
    texts = [v for k, v in pieces if k == "text"]
    first_text = next((n for n, (k, _) in enumerate(pieces) if k == "text"), len(pieces))
    images_first = all(k == "text" for k, _ in pieces[first_text:])
    video = VIDEO_PLACEHOLDERS.get(family) if len(images) > 1 else None
    if video:
        text = video + "\n".join(texts)
    elif images_first:
        text = "\n".join(texts)
    else:
        placeholder = IMAGE_PLACEHOLDERS.get(family, "<image>")
        text = "\n".join(v if k == "text" else placeholder for k, v in pieces)
    if system:
        text = "\n\n".join(system + [text]) if not video else video + "\n\n".join(system + ["\n".join(texts)])
    return text, images


def _data_url(url: str) -> str:
    """The base64 payload of a ``data:`` URL (what the model's ``image`` input takes)."""
    head, sep, data = url.partition(",")
    if not sep:
        raise bad_request("an image data: URL has no ',': expected data:image/png;base64,...", "messages",
                          "invalid_image_url")
    if head.lower().endswith(";base64"):
        payload = re.sub(r"\s+", "", urllib.parse.unquote(data) if "%" in data else data)
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("an image data: URL is not valid base64", "messages", "invalid_image_url") from None
        return payload
    return base64.b64encode(urllib.parse.unquote_to_bytes(data)).decode("ascii")


def _fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET ``url`` (http or https), at most ``max_bytes`` within ``timeout_s``; APIError saying why not."""
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "vlora"}),
                                    timeout=timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise bad_request(f"the image at an image_url is larger than {max_bytes} bytes", "messages")
            chunks, size = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise bad_request(f"fetching an image_url took more than {timeout_s:g}s", "messages")
                chunk = resp.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise bad_request(f"the image at an image_url is larger than {max_bytes} bytes", "messages")
                chunks.append(chunk)
            return b"".join(chunks)
    except APIError:
        raise
    except urllib.error.HTTPError as e:
        raise bad_request(f"fetching an image_url failed: HTTP {e.code}", "messages", "invalid_image_url") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or type(e).__name__
        raise bad_request(f"fetching an image_url failed: {reason}", "messages", "invalid_image_url") from None


# -- the front end ---------------------------------------------------------------------------------------------

class Frontend:
    """The app's state: where Triton is and the settings; the gRPC client is made on the app's loop."""

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
        self.client = None
        self._drains: set = set()

    async def open(self) -> None:
        import tritonclient.grpc.aio as grpcaio
        from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE

        # The default options plus no proxy (Triton is this host's, or the launcher's --host).
        self.client = grpcaio.InferenceServerClient(self.grpc_url, channel_args=[
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.enable_http_proxy", 0),
        ])

    async def close(self) -> None:
        if self._drains:
            await asyncio.wait(list(self._drains), timeout=5)
        if self.client is not None:
            await self.client.close()

    def is_base(self, model: str) -> bool:
        return model == self.model or (self.checkpoint is not None and model == self.checkpoint)

    # Triton.
    async def triton(self, prompt: str, images: list[str], params: dict, stream: bool,
                     request_id: str, model: Optional[str] = None) -> AsyncIterator[dict]:
        """The model's responses to one request, each as a dict (text, finish_reason, counts, head answer);
        the last one has ``finish_reason``. Raises APIError for the model's errors. Leaving early cancels."""
        from tritonclient.grpc import InferInput

        def tensor(name, array, dtype):
            t = InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            return t

        inputs = [tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
                  tensor("stream", np.array([stream]), "BOOL"),
                  tensor("sampling_parameters", np.array([json.dumps(params).encode("utf-8")], dtype=np.object_), "BYTES")]
        if images:
            inputs.append(tensor("image", np.array([i.encode("ascii") for i in images], dtype=np.object_), "BYTES"))

        async def one():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        import grpc

        call = self.client.stream_infer(one())
        finished = False
        try:
            while True:
                try:
                    result, error = await call.__anext__()
                except StopAsyncIteration:
                    finished = True
                    raise APIError(500, "the inference server ended the request without an answer",
                                   "server_error", None, "internal_error") from None
                except grpc.RpcError as e:
                    finished = True
                    raise APIError(503, f"the inference server is unavailable ({_rpc_code(e)})",
                                   "server_error", None, "service_unavailable") from None
                if error is not None:
                    finished = True
                    raise error_from_triton(error.message() if callable(getattr(error, "message", None)) else str(error),
                                            model)
                out = _decode(result)
                if "finish_reason" in out:
                    finished = True
                    self._drain(call)
                    yield out
                    return
                yield out
        finally:
            if not finished:  # the client went away or the caller stopped: Triton cancels the request
                call.cancel()

    def _drain(self, call) -> None:
        """After the final response, let the stream end by itself (the server's OK status follows at once);
        cancelling a finished stream is not needed."""
        async def drain():
            try:
                await asyncio.wait_for(_exhaust(call), 30)
            except Exception:
                call.cancel()

        task = asyncio.get_running_loop().create_task(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def adapters(self) -> list[dict]:
        params = {"adapter_action": "list"}
        answer = None
        async for out in self.triton("", [], params, False, uuid.uuid4().hex):
            answer = out
        try:
            return json.loads(answer["text"])["adapters"]
        except (TypeError, KeyError, ValueError):
            raise APIError(500, "the model's adapter list could not be read", "server_error", None, "internal_error") from None

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model))
        except Exception:
            return False

    async def images(self, urls: list[str]) -> list[str]:
        """``image_url`` values -> base64 payloads."""
        out, fetch = [], []
        for url in urls:
            scheme = url.split(":", 1)[0].lower() if ":" in url else ""
            if scheme == "data":
                out.append(_data_url(url))
            elif scheme in ("http", "https"):
                if not self.allow_image_urls:
                    raise bad_request("http(s) image URLs are off on this server (vlora serve --allow-image-urls "
                                      "turns them on): send the image as a data: URL", "messages", "image_url_not_allowed")
                out.append(None)
                fetch.append((len(out) - 1, url))
            else:
                raise bad_request("an image_url must be a data: URL (or http(s) with --allow-image-urls)",
                                  "messages", "invalid_image_url")
        if len(fetch) > MAX_IMAGE_URLS:
            raise bad_request(f"at most {MAX_IMAGE_URLS} http(s) image URLs per request", "messages")
        if fetch:
            data = await asyncio.gather(*(asyncio.to_thread(_fetch, u, IMAGE_URL_MAX_BYTES, IMAGE_URL_TIMEOUT_S)
                                          for _, u in fetch))
            for (i, _), d in zip(fetch, data):
                out[i] = base64.b64encode(d).decode("ascii")
        return out


async def _exhaust(call) -> None:
    try:
        while True:
            await call.__anext__()
    except StopAsyncIteration:
        pass


def _rpc_code(e) -> str:
    try:
        return str(e.code()).rsplit(".", 1)[-1]
    except Exception:
        return type(e).__name__


def _decode(result) -> dict:
    out: dict[str, Any] = {}
    text = result.as_numpy("text_output")
    out["text"] = b"".join(bytes(x) for x in text.reshape(-1)).decode("utf-8", "replace") if text is not None else ""
    for name in ("num_input_tokens", "num_output_tokens"):
        a = result.as_numpy(name)
        out[name] = int(a.reshape(-1)[0]) if a is not None and a.size else 0
    finish = result.as_numpy("finish_reason")
    if finish is not None and finish.size:
        out["finish_reason"] = bytes(finish.reshape(-1)[0]).decode("utf-8", "replace")
        label = result.as_numpy("label")
        if label is not None and label.size:
            names = [bytes(x).decode("utf-8", "replace") for x in result.as_numpy("label_names").reshape(-1)]
            scores = [float(s) for s in result.as_numpy("scores").reshape(-1)]
            out["head"] = {"label": bytes(label.reshape(-1)[0]).decode("utf-8", "replace"),
                           "scores": dict(zip(names, scores))}
    return out


# -- the body's fields -------------------------------------------------------------------------------------------

_UNSUPPORTED_TRUTHY = ("tools", "functions", "logit_bias", "logprobs", "top_logprobs", "echo", "suffix", "audio",
                       "prediction", "web_search_options")
_UNSUPPORTED_NONZERO = ("frequency_penalty", "presence_penalty")


def sampling_parameters(body: dict, chat: bool) -> dict:
    """The model's ``sampling_parameters`` from an OpenAI body; the model checks the values' ranges."""
    for key in _UNSUPPORTED_TRUTHY:
        if body.get(key):
            raise bad_request(f"{key} is not supported by this server", key, "unsupported_parameter")
    for key in _UNSUPPORTED_NONZERO:
        if body.get(key) not in (None, 0, 0.0):
            raise bad_request(f"{key} is not supported by this server (only 0)", key, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("response_format is not supported by this server (only {\"type\": \"text\"})",
                          "response_format", "unsupported_parameter")
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            raise bad_request(f"{key} must be 1 on this server", key)
    params: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
    params["max_tokens"] = MAX_TOKENS_LIMIT if max_tokens is None else max_tokens
    for key in ("temperature", "top_p", "seed", "ignore_eos", "task", "latency_target"):
        if body.get(key) is not None:
            params[key] = body[key]
    stop = body.get("stop")
    if stop is not None and stop != []:
        params["stop"] = stop
    if chat:
        params["apply_chat_template"] = True
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return params


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required: the base model's name or an adapter's name (GET /v1/models)", "model")
    return model


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


# -- the ASGI app ------------------------------------------------------------------------------------------------

def build_app(front: Frontend):
    """The Starlette app serving ``front``."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error_response(e: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        too_large = APIError(413, f"the request body is larger than {front.max_body_bytes} bytes",
                             "invalid_request_error", None, "request_too_large")
        if length is not None and length.isdigit() and int(length) > front.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > front.max_body_bytes:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(400, "the client disconnected", "invalid_request_error") from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON ({type(e).__name__})") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    async def until_disconnect(request: Request, coro):
        """Run ``coro``; if the client disconnects first, cancel it (which cancels the Triton request)."""
        task = asyncio.ensure_future(coro)

        async def disconnected():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watch = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if task not in done:
            task.cancel()
            return Response(status_code=499)
        return task.result()

    async def completion(request: Request, chat: bool):
        body = await read_json(request)
        model = _model(body)
        params = sampling_parameters(body, chat)
        if chat:
            prompt, urls = chat_prompt(body.get("messages"), front.family)
            images = await front.images(urls)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise bad_request("prompt must be a string (one prompt; token ids are not accepted)", "prompt")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("prompt holds a lone UTF-16 surrogate, not valid text", "prompt") from None
            images = []
        if not front.is_base(model):
            params["lora_name"] = model
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise bad_request("stream must be true or false", "stream")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        responses = front.triton(prompt, images, params, stream, rid, model)
        if stream:
            return await streamed(responses, rid, model, chat, include_usage)
        return await until_disconnect(request, answered(responses, rid, model, chat))

    async def answered(responses, rid: str, model: str, chat: bool) -> JSONResponse:
        out = None
        async for out in responses:
            pass
        finish = _FINISH_REASONS.get(out["finish_reason"], out["finish_reason"])
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]},
                      "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": out["text"], "finish_reason": finish, "logprobs": None}
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                  "model": model, "choices": [choice], "usage": _usage(out["num_input_tokens"], out["num_output_tokens"])}
        if "head" in out:
            answer["vlora"] = out["head"]
        return JSONResponse(answer)

    async def streamed(responses, rid: str, model: str, chat: bool, include_usage: bool):
        # The first response is awaited here: a refused request gets its real status, not a 200 stream.
        try:
            first = await responses.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "no answer", "server_error", None, "internal_error") from None
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: Optional[str], finish: Optional[str], role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            c = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return c

        async def events():
            prompt_tokens = completion_tokens = 0
            out = first
            try:
                if chat:
                    yield _sse(chunk("", None, role=True))
                while True:
                    prompt_tokens = out["num_input_tokens"] or prompt_tokens
                    completion_tokens += out["num_output_tokens"]
                    finish = out.get("finish_reason")
                    if out["text"]:
                        yield _sse(chunk(out["text"], None))
                    if finish is not None:
                        last = chunk(None, _FINISH_REASONS.get(finish, finish))
                        if "head" in out:
                            last["vlora"] = out["head"]
                        yield _sse(last)
                        break
                    out = await responses.__anext__()
                if include_usage:
                    u = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                         "usage": _usage(prompt_tokens, completion_tokens)}
                    yield _sse(u)
            except APIError as e:  # after the stream started: an error event, as OpenAI's clients read it
                yield _sse(e.body())
            except StopAsyncIteration:
                yield _sse(APIError(500, "the answer ended early", "server_error", None, "internal_error").body())
            finally:
                await responses.aclose()  # a client that went away cancels the Triton request
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def guarded(handler):
        async def endpoint(request: Request):
            try:
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except Exception as e:  # one log line with its traceback; the client gets no traceback
                log.exception("vlora openai: %s %s failed: %s", request.method, request.url.path, type(e).__name__)
                return error_response(APIError(500, f"internal error ({type(e).__name__})", "server_error", None,
                                               "internal_error"))
        return endpoint

    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    async def completions(request: Request):
        return await completion(request, chat=False)

    def model_entries(adapters: list[dict]) -> list[dict]:
        base = {"id": front.model, "object": "model", "created": front.created, "owned_by": "vlora",
                "root": front.checkpoint or front.model, "parent": None, "kind": "base", "tier": None, "loaded": True}
        entries = [base]
        for a in adapters:
            entries.append({"id": a.get("name"), "object": "model", "created": front.created, "owned_by": "vlora",
                            "root": a.get("name"), "parent": front.model, "kind": "adapter",
                            "tier": a.get("tier"), "loaded": bool(a.get("loaded"))})
        return entries

    async def list_models(request: Request):
        return JSONResponse({"object": "list", "data": model_entries(await front.adapters())})

    async def get_model(request: Request):
        wanted = request.path_params["model_id"]
        for entry in model_entries(await front.adapters()):
            if entry["id"] == wanted or (entry["kind"] == "base" and front.is_base(wanted)):
                return JSONResponse(entry)
        raise APIError(404, f"The model '{wanted}' does not exist", "invalid_request_error", "model", "model_not_found")

    async def health(request: Request):
        ok = await front.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, code))

    async def server_error(request: Request, exc: Exception):
        log.error("vlora openai: %s %s failed: %s", request.method, request.url.path, type(exc).__name__)
        return error_response(APIError(500, "internal error", "server_error", None, "internal_error"))

    @asynccontextmanager
    async def lifespan(app):
        await front.open()
        try:
            yield
        finally:
            await front.close()

    routes = [
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/models", guarded(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", guarded(get_model), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})


# -- the process -------------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlora.server.openai_api",
                                 description="vlora's OpenAI-compatible front end (vlora serve starts it)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    ap.add_argument("--model", default=MODEL_NAME, help="the Triton model (also the base model's OpenAI name)")
    ap.add_argument("--checkpoint", help="the checkpoint folder's name: accepted as the base model's name too")
    ap.add_argument("--family", default="llava", help="the checkpoint's config.json model_type")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    ap.add_argument("--allow-image-urls", action="store_true")
    ap.add_argument("--graceful-timeout", type=float, default=30.0, help="seconds in-flight requests get at SIGTERM")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    import uvicorn

    front = Frontend(args.grpc_url, args.model, args.checkpoint, args.family, args.max_body_bytes, args.allow_image_urls)
    config = uvicorn.Config(build_app(front), host=args.host, port=args.port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=args.graceful_timeout,
                            server_header=False, date_header=False)
    server = uvicorn.Server(config)
    log.info("vlora openai: serving on http://%s:%d/v1 (Triton gRPC %s, model %s)", args.host, args.port,
             args.grpc_url, args.model)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
