"""Sending one load-test request and timing it: gRPC streaming through tritonclient, or HTTP generate.

Every request ends as one ``RequestRecord`` with an outcome:

- ``ok``: answered in full (a generating request produced exactly ``max_tokens`` tokens, as it asks
  with ``ignore_eos``; a head request got its label);
- ``rejected``: the server refused it explicitly because it was full (the engine's queue or its image
  workers': "server overloaded"; a model config with Triton's queue policy: "Exceeds maximum queue size");
- ``incomplete``: answered, but shorter than asked or with an unexpected finish reason;
- ``timeout``: no final answer within the request timeout (the client gave up and cancelled);
- ``error``: anything else, with the server's message.

Why gRPC runs in a helper process: locust runs on gevent and monkey-patches the standard library;
grpcio's Python layer uses real threads that deadlock under the patched ``threading`` (gevent#786,
grpc#4629), and ``grpc.experimental.gevent.init_gevent()`` makes streaming work but delays responses
in steps of about 0.5 s here (measured with 8 concurrent streams on the tiny model), which would
corrupt every TTFT. So gRPC requests are sent by ``vlora_load.grpc_worker``, an unpatched
process with a pool of real threads running tritonclient's streaming client; it takes the timestamps
next to the gRPC calls and sends them back. HTTP uses geventhttpclient, which is gevent-native.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Optional

OUTCOMES = ("ok", "rejected", "incomplete", "timeout", "error")
REJECTION_MARKERS = ("exceeds maximum queue size", "server overloaded", "overloaded", "resource_exhausted")


@dataclass
class RequestRecord:
    """One request as the load generator saw it. Times are seconds; ``start_s`` is from the run's start."""

    index: int
    application: str
    task: str
    adapter: str  # "" for the base model
    protocol: str
    stream_id: int = -1
    scheduled_s: float = float("nan")  # when the schedule wanted it sent (open loop)
    start_s: float = float("nan")
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    tpot_s: float = float("nan")
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    expected_output_tokens: int = -1  # max_tokens (ignore_eos), or 1 for a task head's label
    finish_reason: str = ""
    outcome: str = "error"
    error: str = ""
    request_bytes: int = 0
    response_bytes: int = 0
    head_task: str = ""
    text: str = ""  # the answer (shortened), kept for a report's examples and for the smoke test

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def row(self) -> list[Any]:
        return [getattr(self, c) for c in self.columns()]

    @classmethod
    def from_row(cls, row: dict[str, str]) -> "RequestRecord":
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = row.get(f.name, "")
            if f.type in ("int",):
                kwargs[f.name] = int(float(raw)) if raw not in ("", "nan") else 0
            elif f.type in ("float",):
                kwargs[f.name] = float(raw) if raw != "" else float("nan")
            else:
                kwargs[f.name] = raw
        return cls(**kwargs)


def classify_error(message: str, status: Optional[int] = None) -> str:
    low = message.lower()
    if status in (429, 503) or any(m in low for m in REJECTION_MARKERS):
        return "rejected"
    if "timed out" in low or "deadline" in low or "no response within" in low:
        return "timeout"
    return "error"


def finish_timings(record: RequestRecord, t_start: float, t_first: Optional[float], t_end: float) -> None:
    """Fill e2e, TTFT and time per output token (after the first) from monotonic timestamps."""
    record.e2e_s = t_end - t_start
    record.ttft_s = (t_first if t_first is not None else t_end) - t_start
    if record.num_output_tokens > 1 and t_first is not None:
        record.tpot_s = (t_end - t_first) / (record.num_output_tokens - 1)


def judge(record: RequestRecord) -> None:
    """Decide ok / incomplete for an answered request."""
    if record.expected_output_tokens >= 0:
        full = record.num_output_tokens == record.expected_output_tokens and record.finish_reason in ("length", "stop")
    else:
        # Tokens whose text is empty (pieces of a character held back, as random weights give) still answered.
        full = record.finish_reason not in ("", "cancelled", "error") and bool(record.text or record.num_output_tokens)
    record.outcome = "ok" if full else "incomplete"
    if not full:
        record.error = (f"incomplete answer: {record.num_output_tokens} of {record.expected_output_tokens} tokens, "
                        f"finish_reason={record.finish_reason or 'none'}")


def record_grpc_result(record: RequestRecord, res: dict[str, Any]) -> RequestRecord:
    """Fill ``record`` from one gRPC worker result (grpc_worker's dict): tokens, text, bytes, then the
    error's outcome, or the timings and the ok / incomplete verdict."""
    record.num_input_tokens, record.num_output_tokens = res["n_in"], res["n_out"]
    record.finish_reason, record.text = res["finish_reason"], res["text"]
    record.response_bytes = res.get("response_bytes", 0)
    if res["error"]:
        record.e2e_s = res["t_end"] - res["t_start"]
        record.outcome = "timeout" if res.get("status") == "timeout" else classify_error(res["error"])
        record.error = res["error"]
        return record
    finish_timings(record, res["t_start"], res["t_first"], res["t_end"])
    judge(record)
    return record


def job_payload(spec, stream: bool) -> dict[str, Any]:
    """What the gRPC worker needs to send one request (JSON-serialisable)."""
    return {
        "id": spec.index,
        "prompt": spec.prompt,
        "images": list(spec.images),
        "params": spec.sampling_parameters(),
        "stream": stream,
    }


def http_body(spec, stream: bool) -> bytes:
    body: dict[str, Any] = {"text_input": spec.prompt, "stream": stream,
                            "sampling_parameters": json.dumps(spec.sampling_parameters())}
    if spec.images:
        body["image"] = list(spec.images)
    return json.dumps(body).encode("utf-8")


def new_record(spec, protocol: str, run_start: float) -> RequestRecord:
    return RequestRecord(
        index=spec.index, application=spec.application, task=spec.task, adapter=spec.adapter or "",
        protocol=protocol, stream_id=-1 if spec.stream_id is None else spec.stream_id,
        scheduled_s=spec.send_at if spec.send_at is not None else float("nan"),
        start_s=time.monotonic() - run_start,
        expected_output_tokens=spec.expected_output_tokens,
        head_task=spec.head_task or "",
    )


class HttpTransport:
    """``/generate`` (one answer) or ``/generate_stream`` (server-sent events) over geventhttpclient."""

    def __init__(self, http_url: str, model: str, timeout_s: float, concurrency: int = 64) -> None:
        from geventhttpclient import HTTPClient

        host, _, port = http_url.replace("http://", "").rstrip("/").partition(":")
        self._client = HTTPClient(host, int(port or 80), concurrency=concurrency,
                                  connection_timeout=10.0, network_timeout=timeout_s)
        self._model = model

    def send(self, spec, streaming: bool, run_start: float) -> RequestRecord:
        protocol = "http-stream" if streaming else "http"
        record = new_record(spec, protocol, run_start)
        body = http_body(spec, stream=streaming)
        record.request_bytes = len(body)
        path = f"/v2/models/{self._model}/{'generate_stream' if streaming else 'generate'}"
        t0 = time.monotonic()
        t_first = None
        try:
            response = self._client.post(path, body=body, headers={"Content-Type": "application/json"})
            try:
                if response.status_code != 200:
                    raw = response.read()
                    record.response_bytes = len(raw)
                    message = _error_text(raw) or f"HTTP {response.status_code}"
                    record.outcome, record.error = classify_error(message, response.status_code), message
                    record.e2e_s = time.monotonic() - t0
                    return record
                if streaming:
                    parts = []
                    while True:
                        line = response.readline(b"\n")  # SSE lines end in \n, not \r\n
                        if not line:
                            break
                        record.response_bytes += len(line)
                        text = line.decode("utf-8", errors="replace").strip()
                        if not text.startswith("data:"):
                            continue
                        payload = json.loads(text[5:].strip())
                        if "error" in payload:
                            message = str(payload["error"])
                            record.outcome, record.error = classify_error(message), message
                            record.e2e_s = time.monotonic() - t0
                            return record
                        _accumulate(record, payload, parts)
                        if t_first is None and record.num_output_tokens:  # a token, whatever its text
                            t_first = time.monotonic()
                        if _first(payload, "finish_reason"):
                            break
                    record.text = "".join(parts)[:200]
                else:
                    raw = response.read()
                    record.response_bytes = len(raw)
                    payload = json.loads(raw)
                    if "error" in payload:
                        message = str(payload["error"])
                        record.outcome, record.error = classify_error(message), message
                        record.e2e_s = time.monotonic() - t0
                        return record
                    parts: list[str] = []
                    _accumulate(record, payload, parts)
                    record.text = "".join(parts)[:200]
            finally:
                response.release()
        except Exception as e:  # connection refused, reset, timeout
            record.e2e_s = time.monotonic() - t0
            message = f"{type(e).__name__}: {e}"
            record.outcome = "timeout" if "timeout" in type(e).__name__.lower() else classify_error(message)
            record.error = message
            return record
        finish_timings(record, t0, t_first, time.monotonic())
        judge(record)
        return record


def _first(payload: dict, key: str, default=None):
    value = payload.get(key, default)
    return value[0] if isinstance(value, list) and value else value


def _accumulate(record: RequestRecord, payload: dict, parts: list[str]) -> None:
    parts.append(_first(payload, "text_output", "") or "")
    record.num_input_tokens = int(_first(payload, "num_input_tokens", 0) or 0) or record.num_input_tokens
    record.num_output_tokens += int(_first(payload, "num_output_tokens", 0) or 0)
    reason = _first(payload, "finish_reason")
    if reason:
        record.finish_reason = str(reason)


def _error_text(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    try:
        return str(json.loads(text).get("error", text))
    except (json.JSONDecodeError, AttributeError):
        return text.strip()
