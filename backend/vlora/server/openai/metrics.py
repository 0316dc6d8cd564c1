"""``GET /metrics`` on the front end's port: tritonserver's Prometheus metrics (Triton's ``nv_*`` and the model's
``vlora_*``), fetched from Triton's metrics endpoint and answered as they are.

The Gateway API Inference Extension's endpoint picker scrapes a model server's metrics on the port its
InferencePool targets, which is this front end's (the OpenAI API); so the model server protocol's metrics
(queued and running requests, KV-cache use, the LoRA info gauge: deploy/kubernetes/README.md) are served here
too. The picker scrapes every 50 ms by default, and the model applies its metrics every 0.2 s: one fetch serves
every scrape for ``max_age_s``, and scrapes that come while a fetch runs wait for it rather than start their own.

One gauge is added to Triton's text: ``vlora_queued_requests``, the protocol's queued requests. A request waits in
two queues: Triton's, until the model's ``execute()`` takes it (``nv_inference_pending_request_count``; it holds
what arrives while ``execute()`` runs: ``execute()`` never waits for the engine, which refuses what it cannot
queue), then the engine's, until the scheduler runs it (``vlora_waiting_requests``; with adapter-aware routing,
every engine model's). The model sees only the second, so the sum is made here, from the
same fetch.
"""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from typing import Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format, as Triton sends it
MAX_AGE_S = 0.1  # how long one fetch of Triton's metrics serves scrapes
FETCH_TIMEOUT_S = 5.0
MAX_BYTES = 64 * 1024 * 1024
QUEUED = b"vlora_queued_requests"
_QUEUES = re.compile(rb"^(vlora_waiting_requests|nv_inference_pending_request_count)\{([^}\n]*)\}\s+(\S+)", re.M)
_LABEL = re.compile(rb'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsProxy:
    """Triton's metrics at ``url`` (its metrics endpoint, on this host) with the queued-requests gauge of the
    Triton model ``model``, cached for ``max_age_s``."""

    def __init__(self, url: str, model: str = "vlora", max_age_s: float = MAX_AGE_S,
                 timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.url = url
        self.model = model
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # Triton is local: no proxy
        self._text: Optional[bytes] = None
        self._fetched = 0.0  # time.monotonic() of the last fetch
        self._lock: Optional[asyncio.Lock] = None  # made on the app's loop

    async def text(self) -> bytes:
        """The metrics text, fetched now unless a fetch of the last ``max_age_s`` serves. Raises OSError when
        Triton's endpoint cannot be read."""
        if self._fresh():
            return self._text
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._fresh():  # nobody fetched while this scrape waited
                self._text = await asyncio.to_thread(self._fetch)
                self._fetched = time.monotonic()
            return self._text

    def route(self):
        """The Starlette route ``GET /metrics``: 200 with the text, 503 when Triton's endpoint cannot be read."""
        from starlette.responses import Response
        from starlette.routing import Route

        async def metrics(request):
            try:
                body = await self.text()
            except OSError as e:
                return Response(f"tritonserver's metrics are unavailable ({type(e).__name__})\n", status_code=503,
                                media_type="text/plain")
            return Response(body, media_type=CONTENT_TYPE)

        return Route("/metrics", metrics, methods=["GET"])

    def _fresh(self) -> bool:
        return self._text is not None and time.monotonic() - self._fetched < self.max_age_s

    def _fetch(self) -> bytes:
        with self._opener.open(self.url, timeout=self.timeout_s) as r:
            body = r.read(MAX_BYTES + 1)
        if len(body) > MAX_BYTES:
            raise OSError(f"{self.url} answered more than {MAX_BYTES} bytes")
        return with_queued(body, self.model)


def with_queued(text: bytes, model: str) -> bytes:
    """``text`` (Triton's metrics) with ``vlora_queued_requests`` of ``model`` added: its requests in Triton's queue
    plus those waiting in its engines (every instance's, and with adapter-aware routing every engine model's,
    ``<model>_gpu<i>``: the pod's sum, labelled ``model``); unchanged while no engine has a waiting gauge yet."""
    waiting = pending = 0.0
    labels_of = None
    ours = re.compile(re.escape(model.encode()) + rb"(_gpu\d+)?")
    for m in _QUEUES.finditer(text):
        labels = dict(_LABEL.findall(m.group(2)))
        if not ours.fullmatch(labels.get(b"model", b"")):
            continue
        if m.group(1) == b"vlora_waiting_requests":
            waiting += float(m.group(3))
            labels_of = labels_of or labels
        else:
            pending += float(m.group(3))
    if labels_of is None:
        return text
    labels_of = {**labels_of, b"model": model.encode()}
    label_text = b",".join(b'%s="%s"' % (k, labels_of[k]) for k in (b"model", b"version") if k in labels_of)
    return b"".join([text if text.endswith(b"\n") or not text else text + b"\n",
                     b"# HELP " + QUEUED + b" Requests waiting: in Triton's queue and in the engine\n",
                     b"# TYPE " + QUEUED + b" gauge\n",
                     QUEUED + b"{" + label_text + b"} " + b"%g" % (waiting + pending) + b"\n"])
