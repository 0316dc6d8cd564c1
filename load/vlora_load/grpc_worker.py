"""The gRPC side of the load generator: an unpatched process that sends requests with tritonclient.

Locust's process runs on gevent, where grpcio cannot stream reliably (see ``transport.py``). This
process reads one JSON job per line on stdin, sends it on a pool of real threads through
``tritonclient.grpc`` streaming (one stream per request, one client per thread), and writes one JSON
result per line on stdout with ``time.monotonic()`` timestamps taken around the gRPC calls (the clock
is system-wide, so the locust process can place them on its own timeline).

    python -m vlora_load.grpc_worker --url 127.0.0.1:8001 --workers 256
"""
from __future__ import annotations

import argparse
import importlib
import json
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlora_client.client import build_grpc_inputs


class GrpcSender:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self._local = threading.local()

    def _client(self):
        import tritonclient.grpc as grpcclient

        client = getattr(self._local, "client", None)
        if client is None:
            client = grpcclient.InferenceServerClient(self.url)
            self._local.client = client
        return client

    def send(self, job: dict[str, Any]) -> dict[str, Any]:
        from tritonclient.utils import InferenceServerException

        result: dict[str, Any] = {"id": job["id"], "n_in": 0, "n_out": 0, "finish_reason": "", "text": "",
                                  "error": "", "status": "", "response_bytes": 0, "t_first": None}
        timeout = float(job.get("timeout", 300.0))
        events: "queue.Queue" = queue.Queue()
        client = self._client()
        finished = False
        parts: list[str] = []
        inputs = build_grpc_inputs(job["prompt"], job["images"], job["params"], bool(job["stream"]))
        result["t_start"] = time.monotonic()
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error)))
            client.async_stream_infer(self.model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
            deadline = result["t_start"] + timeout
            while True:
                try:
                    res, error = events.get(timeout=max(deadline - time.monotonic(), 0.001))
                except queue.Empty:
                    result["error"] = f"no response within {timeout:g}s"
                    result["status"] = "timeout"
                    break
                if error is not None:
                    finished = True
                    result["error"] = error.message() if isinstance(error, InferenceServerException) else str(error)
                    result["status"] = error.status() if isinstance(error, InferenceServerException) else ""
                    break
                response = res.get_response()
                result["response_bytes"] += response.ByteSize()
                if response.outputs:
                    text = _scalar(res.as_numpy("text_output"), "")
                    parts.append(text)
                    result["n_in"] = int(_scalar(res.as_numpy("num_input_tokens"), 0)) or result["n_in"]
                    result["n_out"] += int(_scalar(res.as_numpy("num_output_tokens"), 0))
                    # The first token, whatever its text: a token may decode to nothing yet (a byte of a
                    # character that later tokens complete), which random weights produce for many steps.
                    if result["t_first"] is None and (text or result["n_out"]):
                        result["t_first"] = time.monotonic()
                    reason = _scalar(res.as_numpy("finish_reason"), None)
                    if reason:
                        result["finish_reason"] = reason
                if response.parameters["triton_final_response"].bool_param:
                    finished = True
                    break
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            result["t_end"] = time.monotonic()
            try:
                client.stop_stream(cancel_requests=not finished)
            except Exception:
                self._local.client = None  # a broken client: the next request gets a fresh one
        result["text"] = "".join(parts)[:200]
        return result


def _scalar(array, default):
    if array is None or array.size == 0:
        return default
    item = array.reshape(-1)[0]
    if isinstance(item, bytes):
        return item.decode("utf-8", errors="replace")
    return item.item() if hasattr(item, "item") else item


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlora_load.grpc_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="Triton gRPC address, host:port")
    parser.add_argument("--model", default="vlora")
    parser.add_argument("--workers", type=int, default=256, help="requests in flight at once")
    args = parser.parse_args(argv)
    sender = GrpcSender(args.url, args.model)
    out_lock = threading.Lock()
    stdout = sys.stdout
    importlib.import_module("tritonclient.grpc")  # before "ready": the first request pays no import

    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()

    def run(job):
        try:
            res = sender.send(job)
        except Exception as e:  # never lose a job: answer it with the error
            now = time.monotonic()
            res = {"id": job.get("id"), "error": f"{type(e).__name__}: {e}", "t_start": now, "t_end": now,
                   "t_first": None, "n_in": 0, "n_out": 0, "finish_reason": "", "text": "", "status": "",
                   "response_bytes": 0}
        line = json.dumps(res) + "\n"
        with out_lock:
            stdout.write(line)
            stdout.flush()

    with ThreadPoolExecutor(max_workers=args.workers, thread_name_prefix="grpc-send") as pool:
        for raw in sys.stdin:
            raw = raw.strip()
            if raw:
                pool.submit(run, json.loads(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
