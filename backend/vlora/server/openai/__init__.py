"""The OpenAI-compatible front end of ``vlora serve`` (issue 39): a thin ASGI app that speaks to tritonserver.

``vlora serve`` starts it as a process of its own (``python -m vlora.server.openai``, on ``--openai-port``,
default 9000, on the launcher's ``--host``), once tritonserver is ready, waits for its ``/health``, and stops it
with the server. It holds no engine, tokenizer or model state: every request becomes one request to the Triton
model ``vlora`` over Triton's gRPC streaming API (``ModelStreamInfer``, through ``grpc.aio`` and tritonclient's
generated stubs, one channel shared by all requests, one stream per request), so Triton's queue, scheduling,
limits, metrics and the model's own checks apply unchanged. Endpoints:

- ``GET /v1/models`` (and ``/v1/models/{id}``): the base model (``vlora``, the Triton model's name; the
  checkpoint's folder name is accepted as an alias and shown as ``root``) and every adapter with its ``tier`` and
  ``loaded``, from the model's open ``adapter_action: list`` request.
- ``POST /v1/chat/completions``: the whole conversation (``system``/``developer``, ``user`` and ``assistant``
  messages; text, and ``image_url`` parts in user messages), sent as the model's ``messages`` input and rendered
  by the model through the checkpoint's chat template; ``model`` is an adapter's name or the base model's. Several
  images in one user message are a video for a family that takes one (Qwen2-VL, Qwen2.5-VL). Images are ``data:``
  URLs; ``http(s)`` URLs only with
  ``--allow-image-urls`` (then fetched here, within a size and a time limit).
- ``POST /v1/completions``: a raw prompt, used as given.
- ``GET /health``: 200 when tritonserver's model is ready, else 503.
- ``GET /metrics``: tritonserver's Prometheus metrics (``--metrics-url``; the Inference Extension's endpoint
  picker scrapes them on the port its InferencePool targets: vlora.server.openai.metrics).

Errors come in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, from the model's error prefixes
(``[INVALID_ARG]`` 400, or 404 ``model_not_found`` for an unknown adapter; ``[UNAVAILABLE]`` and Triton's full
queue 503; ``[INTERNAL]`` 500), never with a traceback. Request bodies are bounded (``--max-body-bytes``).

The modules: ``requests`` (OpenAI bodies -> the model's ``messages`` input or prompt, images and sampling
parameters), ``errors``
(OpenAI's error shape and the mapping from the model's ``[CODE]`` prefixes), ``triton`` (``Frontend``: the gRPC
bridge to tritonserver), ``metrics`` (``/metrics``: Triton's metrics, fetched and cached), ``app`` (the Starlette
routes); ``main`` here is the process's entry point. The package
imports nothing of vlora outside itself (vlora.server.frontend, the launcher's side, starts and stops it).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from vlora.server.openai.app import build_app
from vlora.server.openai.metrics import MetricsProxy
from vlora.server.openai.triton import DEFAULT_MAX_BODY_BYTES, MODEL_NAME, Frontend

log = logging.getLogger("vlora.openai")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlora.server.openai",
                                 description="vlora's OpenAI-compatible front end (vlora serve starts it)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    ap.add_argument("--metrics-url", help="tritonserver's metrics endpoint, served as GET /metrics (default: none)")
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
    metrics = MetricsProxy(args.metrics_url, args.model) if args.metrics_url else None
    config = uvicorn.Config(build_app(front, metrics), host=args.host, port=args.port, log_level="warning",
                            access_log=False, lifespan="on", timeout_graceful_shutdown=args.graceful_timeout,
                            server_header=False, date_header=False)
    server = uvicorn.Server(config)
    log.info("vlora openai: serving on http://%s:%d/v1 (Triton gRPC %s, model %s)", args.host, args.port,
             args.grpc_url, args.model)
    server.run()
    return 0 if server.started else 1

