"""Adapter-aware routing on real GPUs: `vlora serve --device cuda` on every visible GPU (two or more) runs the router
model `vlora` in front of one engine model per GPU (the CPU tests stand in for them with --routing-cpu-engines). Text, an adapter's request
and an image request are each answered through the router over HTTP, every engine model answers, and the answers
equal those of the engine model asked directly. Skips with fewer than two GPUs."""
from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs"), pytest.mark.timeout(600)]

ANSWER_TIMEOUT_S = 120  # a hang fails the test with the server's log, not the device call


def _generate(url: str, model: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=ANSWER_TIMEOUT_S) as r:
        return json.loads(r.read())


def test_the_router_answers_on_every_gpu(tmp_path):
    from e2e_helpers import b64, png_bytes, start_server

    from vlora.config import default_cache_dir

    srv = start_server(tmp_path, default_cache_dir(), ["--device", "cuda", "--routing", "adapter"])
    try:
        assert "adapter-aware routing: " in srv.launcher_output(), srv.launcher_output()[-2000:]
        cases = [{"text_input": "USER: Tell me about the sea. ASSISTANT:", "max_tokens": 6},
                 {"text_input": "USER: Count to five. ASSISTANT:", "max_tokens": 6, "lora_name": "demo-r16-attn"},
                 {"text_input": "USER: <image>\nWhat is this? ASSISTANT:", "max_tokens": 6, "lora_name": "demo-r8-qv",
                  "image": [b64(png_bytes(3))]}]
        for body in cases:
            try:
                routed = _generate(srv.http_url, "vlora", body)
            except Exception as e:  # a hang or an error: what the server logged
                pytest.fail(f"{body['text_input']!r}: {type(e).__name__}: {e}\n--- server log ---\n{srv.server_log(120)}")
            assert routed.get("finish_reason") == "length", routed
            for engine in (f"vlora_gpu{i}" for i in range(torch.cuda.device_count())):  # each answers alike, asked directly
                direct = _generate(srv.http_url, engine, body)
                assert direct["text_output"] == routed["text_output"], (engine, body)
    finally:
        code = srv.stop()
    assert code == 0, srv.launcher_output()[-3000:]
