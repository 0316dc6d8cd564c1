"""Bad input gets a clear error that names the problem, and the server stays healthy afterwards."""
from __future__ import annotations

import base64
import json

import pytest

from e2e_helpers import MODEL, assert_refused, b64, png_bytes, post_json
from vlora_client import VloraClient, VloraClientError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI

GOOD_PROMPT = "USER: Say something. ASSISTANT:"
LONG_PROMPT = " ".join(f"token{i} zx{i * 7919 % 1000}" for i in range(3000))  # far more tokens than the context

# (case id, request body for /generate, words the error must contain)
BAD_REQUESTS = [
    ("unknown-adapter", {"text_input": GOOD_PROMPT, "lora_name": "no-such-adapter"}, ["no-such-adapter"]),
    ("adapter-path-traversal", {"text_input": GOOD_PROMPT, "lora_name": "../x"}, ["../x"]),
    ("adapter-absolute-path", {"text_input": GOOD_PROMPT, "lora_name": "/etc"}, ["/etc"]),
    ("corrupt-image", {"text_input": GOOD_PROMPT, "image": [b64(png_bytes(1)[:60] + b"\x00" * 40)]}, ["image"]),
    ("not-an-image", {"text_input": GOOD_PROMPT, "image": [b64(b"hello, this is text and not a picture")]}, ["image"]),
    ("not-base64", {"text_input": GOOD_PROMPT, "image": ["%%% not base64 %%%"]}, ["image"]),
    ("empty-prompt", {"text_input": ""}, ["empty"]),
    ("blank-prompt", {"text_input": "   "}, ["empty"]),
    ("bad-json", {"text_input": GOOD_PROMPT, "sampling_parameters": "{max_tokens: 5"}, ["sampling_parameters", "JSON"]),
    ("json-not-object", {"text_input": GOOD_PROMPT, "sampling_parameters": "[1, 2]"}, ["sampling_parameters"]),
    ("unknown-sampling-key", {"text_input": GOOD_PROMPT, "sampling_parameters": json.dumps({"max_tokenz": 4})}, ["max_tokenz"]),
    ("bad-max-tokens", {"text_input": GOOD_PROMPT, "sampling_parameters": json.dumps({"max_tokens": 0})}, ["max_tokens"]),
    ("bad-temperature", {"text_input": GOOD_PROMPT, "sampling_parameters": json.dumps({"temperature": -1})}, ["temperature"]),
    ("bad-top-p", {"text_input": GOOD_PROMPT, "sampling_parameters": json.dumps({"top_p": 2})}, ["top_p"]),
    ("unknown-parameter", {"text_input": GOOD_PROMPT, "colour": "blue"}, ["colour"]),
    ("prompt-longer-than-context", {"text_input": LONG_PROMPT}, ["context"]),
]


def _healthy(server) -> None:
    assert server.is_ready(), "the server is no longer ready"
    status, payload = post_json(f"{server.http_url}/v2/models/{MODEL}/generate",
                                {"text_input": GOOD_PROMPT, "sampling_parameters": json.dumps({"max_tokens": 3})})
    assert status == 200 and payload["num_output_tokens"] >= 1, payload


@pytest.mark.parametrize("body,words", [pytest.param(b, w, id=i) for i, b, w in BAD_REQUESTS])
def test_bad_request_is_refused_with_a_clear_error(server, body, words):
    assert_refused(server, body, words)
    _healthy(server)


def test_errors_over_grpc_streaming(server):
    client = VloraClient(server.grpc_url)
    with pytest.raises(VloraClientError, match="no-such-adapter"):
        client.generate(GOOD_PROMPT, lora_name="no-such-adapter", max_tokens=3)
    with pytest.raises(VloraClientError, match="image"):
        client.generate(GOOD_PROMPT, images=[b"\x89PNG\r\n\x1a\n broken"], max_tokens=3)
    with pytest.raises(VloraClientError, match="empty"):
        list(client.generate_stream("", max_tokens=3))
    assert client.generate(GOOD_PROMPT, max_tokens=3).num_output_tokens >= 1


def test_error_json_is_well_formed_for_every_case(server):
    """One more look: the error bodies are JSON objects with an `error` string (what curl users see)."""
    body = {"text_input": GOOD_PROMPT, "image": [base64.b64encode(b"GIF89a....").decode()]}
    status, payload = post_json(f"{server.http_url}/v2/models/{MODEL}/generate", body)
    assert status == 400 and isinstance(payload.get("error"), str) and payload["error"]
