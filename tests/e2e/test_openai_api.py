"""The OpenAI-compatible API of `vlora serve` (issue 39), through the official `openai` package, against a real
server: its answers equal the generate endpoint's, streaming joins to the same text with usage, errors come in
OpenAI's shape with the matching status, concurrent clients are all answered. One server for the whole file.
"""
from __future__ import annotations

import base64
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_helpers import MODEL, png_bytes, start_server
from vlora_client import VloraClient

openai = pytest.importorskip("openai", reason="the openai package (the dev extra) is not installed")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MAX_BODY_MIB = 1  # small, so that a body over it is cheap to send


@pytest.fixture(scope="module")
def oa_server(tmp_path_factory, vlora_cache, demo_adapter_root):
    srv = start_server(tmp_path_factory.mktemp("e2e-openai"), vlora_cache, openai=True,
                       extra_args=["--openai-max-body-mib", str(MAX_BODY_MIB)])
    assert srv.openai_port and srv.adapters, srv.launcher_output()
    yield srv
    code = srv.stop()
    assert code == 0, f"`vlora serve` did not stop cleanly (exit {code}):\n{srv.launcher_output()[-3000:]}"


@pytest.fixture(scope="module")
def client(oa_server):
    return openai.OpenAI(base_url=oa_server.openai_url, api_key="unused", max_retries=0, timeout=120)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_messages(text: str, png: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def reference(oa_server):
    """The generate endpoint's greedy answer (gRPC streaming) to an image, an adapter and the chat template."""
    adapter = oa_server.adapters[0]
    text, png = "What is in this picture?", png_bytes(7)
    ref = VloraClient(oa_server.grpc_url).generate(text, images=[png], lora_name=adapter, max_tokens=10,
                                                   temperature=0, apply_chat_template=True)
    return dict(adapter=adapter, text=text, png=png, ref=ref)


def test_models_lists_the_base_model_and_every_adapter(client, oa_server):
    models = {m.id: m for m in client.models.list()}
    assert MODEL in models and models[MODEL].model_extra["kind"] == "base"
    for name in oa_server.adapters:
        extra = models[name].model_extra
        assert extra["kind"] == "adapter" and extra["parent"] == MODEL
        assert extra["tier"] in ("gpu", "cpu-slot", "cpu", "disk") and isinstance(extra["loaded"], bool)
    assert client.models.retrieve(oa_server.adapters[0]).id == oa_server.adapters[0]


def test_chat_with_an_image_and_an_adapter_equals_generate(client, reference):
    ref = reference["ref"]
    answer = client.chat.completions.create(model=reference["adapter"], temperature=0, max_tokens=10,
                                            messages=image_messages(reference["text"], reference["png"]))
    assert answer.choices[0].message.content == ref.text
    assert answer.choices[0].finish_reason == ref.finish_reason
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (ref.num_input_tokens, ref.num_output_tokens)
    assert answer.usage.total_tokens == ref.num_input_tokens + ref.num_output_tokens
    assert answer.model == reference["adapter"]


def test_streaming_deltas_join_to_the_same_text_with_usage(client, reference):
    ref = reference["ref"]
    chunks = list(client.chat.completions.create(
        model=reference["adapter"], temperature=0, max_tokens=10, stream=True, stream_options={"include_usage": True},
        messages=image_messages(reference["text"], reference["png"])))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) >= 2, "streaming sent the answer in one piece"
    assert "".join(deltas) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.num_output_tokens
    assert chunks[-1].usage.prompt_tokens == ref.num_input_tokens


def test_completions_equal_generate(client, oa_server):
    prompt = "USER: Tell me about the sea. ASSISTANT:"
    ref = VloraClient(oa_server.grpc_url).generate(prompt, max_tokens=8, temperature=0)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert answer.choices[0].text == ref.text and answer.usage.completion_tokens == ref.num_output_tokens
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text


def test_vlora_extras_as_extra_body(client):
    answer = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}],
                                            extra_body={"latency_target": 5.0})
    assert answer.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"latency_target": -1})
    assert "latency_target" in e.value.message


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-adapter", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-adapter")
    assert e.value.code == "model_not_found"


def test_bad_requests_are_400_in_openai_shape(client, oa_server):
    cases = [
        dict(messages=image_messages("What is it?", b"not an image at all")),  # the model cannot decode it
        dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]),
        dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}]}]),
        dict(messages=[{"role": "user", "content": "Hi"}], n=2),
        dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                       {"role": "user", "content": "Again"}]),
        dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=0),
    ]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, **{"max_tokens": 4, **case})
        assert e.value.status_code == 400 and e.value.message and "Traceback" not in e.value.message, case
    # the same for a stream: refused before it starts, with its status
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, max_tokens=4, stream=True,
                                       messages=image_messages("What is it?", b"not an image at all"))


def test_body_over_the_limit_is_413(oa_server):
    """Refused from the Content-Length, before the body is read: only the headers are sent (a client that
    goes on uploading may see the connection closed under it, which is the point)."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(oa_server.openai_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.putrequest("POST", f"{url.path}/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(MAX_BODY_MIB * 1024 * 1024 + 10))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413
        assert json.loads(resp.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()


def test_concurrent_clients_are_all_answered(client, oa_server):
    names = [MODEL] + oa_server.adapters

    def ask(i: int):
        model = names[i % len(names)]
        messages = (image_messages(f"Request {i}: what is it?", png_bytes(i)) if i % 2 else
                    [{"role": "user", "content": f"Request {i}: tell me a story."}])
        if i % 3 == 0:
            parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=model, messages=messages, max_tokens=6, temperature=0, stream=True) if c.choices]
            return model, messages, "".join(parts)
        return model, messages, client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                                               temperature=0).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    assert len(results) == 8 and all(text for _, _, text in results)
    # greedy answers do not depend on what ran beside them
    for model, messages, text in results[:2]:
        again = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        assert again.choices[0].message.content == text
