"""A streamed request whose client goes away after a few responses: over HTTP (``/generate_stream``) the socket is
closed, over gRPC the stream is cancelled; the server must cancel the rest of the request. ``ok`` when a response
came before the client left (the record's ``num_output_tokens`` counts the responses read).
"""
from __future__ import annotations

import http.client
import json
import queue
import time
from typing import Iterator, Optional

from vlora_load.generators import RequestSpec
from vlora_load.runner import Target
from vlora_load.transport import RequestRecord, classify_error, finish_timings

Event = tuple[Optional[tuple[str, str]], bool, bool]  # ((message, outcome) of an error, a token came, the last response)


def leave_stream(target: Target, spec: RequestSpec, record: RequestRecord, http: bool, responses: int,
                 timeout_s: float) -> RequestRecord:
    """Send ``spec`` streamed (``http``: HTTP, else gRPC) and leave after ``responses`` responses; fills ``record``."""
    t0, t_first, received = time.monotonic(), None, 0
    events = _sse_events(target, spec, timeout_s) if http else _grpc_events(target, spec, timeout_s)
    try:
        for error, token, final in events:
            if error:
                record.error, record.outcome = error
                break
            if token:
                received += 1
                t_first = t_first or time.monotonic()
            if final or received >= responses:
                break
        record.num_output_tokens = received
        if not record.error:
            record.outcome = "ok" if received else "unexpected"
            record.error = "" if received else "the stream ended before any token"
    except OSError as e:
        record.outcome, record.error = "timeout" if "timed out" in str(e) else "error", f"{type(e).__name__}: {e}"
    except Exception as e:  # the gRPC channel failed, or an answer that is not JSON
        record.outcome, record.error = "error", f"{type(e).__name__}: {e}"
    finally:
        events.close()  # the disconnect
    finish_timings(record, t0, t_first, time.monotonic())
    return record


def _sse_events(target: Target, spec: RequestSpec, timeout_s: float) -> Iterator[Event]:
    host, _, port = target.http_url.partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        body = {"text_input": spec.prompt, "stream": True, "sampling_parameters": json.dumps(spec.sampling_parameters())}
        conn.request("POST", f"/v2/models/{target.model}/generate_stream", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            message = resp.read().decode(errors="replace")[:500]
            yield (message, classify_error(message, resp.status)), False, True
            return
        while line := resp.readline():
            text = line.decode(errors="replace").strip()
            if text.startswith("data:"):
                payload = json.loads(text[5:])
                error = str(payload["error"]) if "error" in payload else None
                yield (error, classify_error(error)) if error else None, True, bool(payload.get("finish_reason"))
    finally:
        conn.close()


def _grpc_events(target: Target, spec: RequestSpec, timeout_s: float) -> Iterator[Event]:
    import tritonclient.grpc as grpcclient

    from vlora_client.client import build_grpc_inputs

    responses: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(target.model, build_grpc_inputs(spec.prompt, [], spec.sampling_parameters(), True),
                                  request_id=f"{spec.application}-{spec.index}", enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result, error = responses.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                yield (f"no token within {timeout_s:g}s", "timeout"), False, True
                return
            if error is not None:
                yield (str(error), classify_error(str(error))), False, True
                return
            response = result.get_response()
            yield None, bool(response.outputs), response.parameters["triton_final_response"].bool_param
    finally:
        try:
            client.stop_stream(cancel_requests=True)
        finally:
            client.close()
