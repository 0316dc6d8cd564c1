"""The front end's bridge to tritonserver: ``Frontend`` holds where Triton is and the settings, and sends every
request to the Triton model over Triton's gRPC streaming API (``ModelStreamInfer`` through
``tritonclient.grpc.aio``: one channel shared by all requests, one stream per request), decoding its responses
(text, token counts, finish reason, a task head's answer) and mapping its errors to ``APIError``. Leaving a
request early cancels it in Triton. Also the model's adapter list and readiness.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

import numpy as np

from vlora.server.openai.errors import APIError, error_from_triton
from vlora.server.openai.requests import image_payloads

MODEL_NAME = "vlora"  # the Triton model (vlora.server.repository.MODEL_NAME); also the base model's OpenAI name
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


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
        """``image_url`` values -> base64 payloads (vlora.server.openai.requests.image_payloads)."""
        return await image_payloads(urls, self.allow_image_urls)


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
