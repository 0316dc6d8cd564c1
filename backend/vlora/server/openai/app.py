"""The front end's ASGI app (Starlette): the routes ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``
(and ``/v1/models/{id}``) and ``/health``; the body's size limit, answers and server-sent-event streams in
OpenAI's shape, a client's disconnect cancelling its Triton request, and every error as an ``APIError`` body
(no traceback).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from json.encoder import encode_basestring
from typing import Any, Optional

from vlora.server.openai.errors import APIError, bad_request
from vlora.server.openai.metrics import MetricsProxy
from vlora.server.openai.requests import _model, chat_messages, sampling_parameters
from vlora.server.openai.triton import Frontend

log = logging.getLogger("vlora.openai")

_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


# Answer ids: unique per process start (a random base, then a counter), with no system call per request.
_ID_BASE = secrets.token_hex(12)
_ID_COUNTER = itertools.count(1)
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class EventStream:
    """A ``text/event-stream`` answer (an ASGI app) from an async iterator of ``(bytes, last)``: each piece sent as it
    comes, the last one closing the body (no separate empty message). A client that disconnects cancels ``stream``
    (its Triton request); what the iterator does then is not sent. Lighter than Starlette's StreamingResponse,
    which runs a task group per answer and an empty closing message."""

    def __init__(self, chunks, stream) -> None:
        self.chunks, self.stream = chunks, stream

    async def __call__(self, scope, receive, send) -> None:
        gone = False

        async def watch():
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            self.stream.cancel()  # the pending read of the Triton stream ends, and Triton cancels the request

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            last = False
            async for chunk, last in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if gone:
                    break
            if not last and not gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (asyncio.CancelledError, APIError):
            if not gone:
                raise
        finally:
            watcher.cancel()
            await self.chunks.aclose()
            self.stream.cancel()  # a no-op once answered; else (a failure here) Triton cancels the request


# -- the ASGI app ------------------------------------------------------------------------------------------------

def build_app(front: Frontend, metrics: Optional[MetricsProxy] = None):
    """The Starlette app serving ``front``; with ``metrics``, ``GET /metrics`` too (tritonserver's metrics)."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
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
        messages = None
        if chat:  # the whole conversation goes to the model, which renders it through the chat template
            prompt = None
            messages, urls = chat_messages(body.get("messages"), front.family)
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
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{_ID_BASE}{next(_ID_COUNTER):08x}"
        responses = front.triton(prompt, images, params, stream, rid, model, messages=messages)
        if stream:
            return await streamed(responses, rid, model, chat, include_usage)
        return await until_disconnect(request, answered(responses, rid, model, chat))

    async def answered(responses, rid: str, model: str, chat: bool) -> JSONResponse:
        out = None
        try:
            async for out in responses:
                pass
        finally:
            responses.cancel()  # a no-op once answered; else (the client went away) Triton cancels the request
        finish = _FINISH_REASONS.get(out.finish_reason, out.finish_reason)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": finish, "logprobs": None}
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                  "model": model, "choices": [choice], "usage": _usage(out.num_input_tokens, out.num_output_tokens)}
        if out.head is not None:
            answer["vlora"] = out.head
        return JSONResponse(answer)

    async def streamed(responses, rid: str, model: str, chat: bool, include_usage: bool):
        # The first response is awaited here: a refused request gets its real status, not a 200 stream.
        first = await responses.next()
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

        # A text event is the same bytes as _sse(chunk(text, None)) but for the text: written from a template, so
        # that a token costs one string escape, not a JSON dump of the whole chunk.
        head, _, tail = _sse(chunk("\x00", None)).decode("utf-8").rpartition('"\\u0000"')  # the text: last of the chunk
        head, tail = head.encode("utf-8"), tail.encode("utf-8")

        async def events():
            prompt_tokens = completion_tokens = 0
            out = first
            pieces = [_sse(chunk("", None, role=True))] if chat else []
            try:
                while True:
                    prompt_tokens = out.num_input_tokens or prompt_tokens
                    completion_tokens += out.num_output_tokens
                    if out.text:
                        pieces.append(head + encode_basestring(out.text).encode("utf-8") + tail)
                    finish = out.finish_reason
                    if finish is not None:
                        last = chunk(None, _FINISH_REASONS.get(finish, finish))
                        if out.head is not None:
                            last["vlora"] = out.head
                        pieces.append(_sse(last))
                        break
                    if pieces:
                        yield b"".join(pieces), False
                        pieces = []
                    out = await responses.next()
                if include_usage:
                    u = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                         "usage": _usage(prompt_tokens, completion_tokens)}
                    pieces.append(_sse(u))
            except APIError as e:  # after the stream started: an error event, as OpenAI's clients read it
                pieces.append(_sse(e.body()))
            pieces.append(_DONE)
            yield b"".join(pieces), True  # the last answer's text, the finish, the usage and [DONE]: one write

        return EventStream(events(), responses)

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
    if metrics is not None:
        routes.append(metrics.route())
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})
