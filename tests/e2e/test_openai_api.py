"""The OpenAI-compatible API of `vlora serve` (issue 39), through the official `openai` package, against a real
server: its answers equal the generate endpoint's, streaming joins to the same text with usage, a multi-turn
conversation with images equals the generate endpoint's answer to the prompt the same chat template renders,
errors come in OpenAI's shape with the matching status, concurrent clients are all answered. One server for the
whole file.
"""
from __future__ import annotations

import base64
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_helpers import MODEL, b64, png_bytes, post_json, start_server
from vlora_client import VloraClient, VloraClientError

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


# -- multi-turn conversations: the whole `messages` list through the checkpoint's chat template, in the model ----

def conversation(first: bytes, second: bytes) -> list[dict]:
    """System, user (an image, then text), assistant, user (text, then an image): OpenAI's shape."""
    return [
        {"role": "system", "content": "You answer in few words."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(first)}},
                                     {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": "Colored stripes."},
        {"role": "user", "content": [{"type": "text", "text": "And in this one?"},
                                     {"type": "image_url", "image_url": {"url": data_url(second)}}]},
    ]


@pytest.fixture(scope="module")
def multi_turn(oa_server, tiny_model_dir):
    """The conversation, the prompt the checkpoint's chat template renders for it (transformers' own
    apply_chat_template on the served model's tokenizer, llava-hf parts), and the generate endpoint's greedy
    answer to that prompt with the two images, through an adapter."""
    from transformers import AutoTokenizer

    first, second = png_bytes(11), png_bytes(12)
    hf = [{"role": "system", "content": [{"type": "text", "text": "You answer in few words."}]},
          {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
          {"role": "assistant", "content": [{"type": "text", "text": "Colored stripes."}]},
          {"role": "user", "content": [{"type": "text", "text": "And in this one?"}, {"type": "image"}]}]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    prompt = tokenizer.apply_chat_template(hf, tokenize=False, add_generation_prompt=True)
    assert prompt.count("<image>") == 2 and prompt.index("picture") < prompt.index("Colored") < prompt.index("this one")
    adapter = oa_server.adapters[0]
    ref = VloraClient(oa_server.grpc_url).generate(prompt, images=[first, second], lora_name=adapter, max_tokens=10,
                                                   temperature=0)
    return dict(messages=conversation(first, second), hf=hf, prompt=prompt, images=[first, second], adapter=adapter,
                ref=ref, grpc_url=oa_server.grpc_url)


def test_a_multi_turn_chat_with_images_equals_generate_with_the_rendered_prompt(client, multi_turn):
    ref = multi_turn["ref"]
    answer = client.chat.completions.create(model=multi_turn["adapter"], temperature=0, max_tokens=10,
                                            messages=multi_turn["messages"])
    assert answer.choices[0].message.content == ref.text and answer.choices[0].finish_reason == ref.finish_reason
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (ref.num_input_tokens, ref.num_output_tokens)
    chunks = list(client.chat.completions.create(model=multi_turn["adapter"], temperature=0, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, messages=multi_turn["messages"]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.prompt_tokens == ref.num_input_tokens
    # the k-th image part is the k-th image: the images swapped in the conversation answer as swapped in generate
    swapped = client.chat.completions.create(model=multi_turn["adapter"], temperature=0, max_tokens=10,
                                             messages=conversation(*multi_turn["images"][::-1]))
    ref_swapped = VloraClient(multi_turn["grpc_url"]).generate(
        multi_turn["prompt"], images=multi_turn["images"][::-1], lora_name=multi_turn["adapter"], max_tokens=10,
        temperature=0)
    assert swapped.choices[0].message.content == ref_swapped.text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_vlora_client_sends_a_conversation(oa_server, multi_turn, protocol):
    """vlora_client takes the conversation in place of a prompt (the model's `messages` input), whole or streamed."""
    url = oa_server.grpc_url if protocol == "grpc" else oa_server.http_url
    c = VloraClient(url, protocol=protocol)
    kwargs = dict(images=multi_turn["images"], lora_name=multi_turn["adapter"], max_tokens=10, temperature=0)
    answer = c.generate(multi_turn["hf"], **kwargs)
    assert (answer.text, answer.num_input_tokens) == (multi_turn["ref"].text, multi_turn["ref"].num_input_tokens)
    assert "".join(d.text for d in c.generate_stream(multi_turn["hf"], **kwargs)) == multi_turn["ref"].text
    with pytest.raises(VloraClientError, match="last message must be a user message"):
        c.generate(multi_turn["hf"][:3], **kwargs)


def test_the_messages_input_works_through_tritons_generate_endpoint(oa_server, multi_turn):
    """The model's `messages` input (the conversation as JSON, image parts standing for the `image` input in
    order), sent straight to Triton's HTTP /generate: the same answer."""
    body = {"messages": json.dumps(multi_turn["hf"]), "image": [b64(i) for i in multi_turn["images"]],
            "lora_name": multi_turn["adapter"], "sampling_parameters": json.dumps({"max_tokens": 10, "temperature": 0})}
    status, payload = post_json(f"{oa_server.http_url}/v2/models/{MODEL}/generate", body)
    assert status == 200, payload
    assert payload["text_output"] == multi_turn["ref"].text
    assert payload["num_input_tokens"] == multi_turn["ref"].num_input_tokens
    for bad, words in [
        ({**body, "image": body["image"][:1]}, "2 image part(s) but the request carries 1 image"),
        ({**body, "text_input": "USER: hi ASSISTANT:"}, "text_input or messages, not both"),
        ({**body, "messages": json.dumps(multi_turn["hf"][:3])}, "last message must be a user message"),
        ({**body, "messages": "[]"}, "non-empty"),
    ]:
        status, payload = post_json(f"{oa_server.http_url}/v2/models/{MODEL}/generate", bad)
        assert status == 400 and words in payload["error"], (words, payload)


def test_bad_conversations_are_400_naming_the_message(client):
    png = png_bytes(3)
    image = {"type": "image_url", "image_url": {"url": data_url(png)}}
    user = {"role": "user", "content": "Hi"}
    cases = [
        ([user, {"role": "assistant", "content": [{"type": "text", "text": "Look:"}, image]}, user],
         "image_url parts go in user messages only"),
        ([{"role": "system", "content": [image]}, user], "image_url parts go in user messages only"),
        ([user, {"role": "assistant", "content": "Hello"}], "last message must be a user message"),
        ([{"role": "robot", "content": "Hi"}], "role must be system, developer, user or assistant"),
        ([user, {"role": "tool", "content": "42", "tool_call_id": "x"}], "tool messages are not supported"),
        ([], "messages must be a non-empty list"),
        ([{"role": "user", "content": [{"type": "text", "text": "What is <image> here?"}, image]}], "holds <image>"),
        ([{"role": "user", "content": [image] * 9}], "too many images: 9"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
         "'input_audio' are not supported"),
    ]
    for messages, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
        assert e.value.status_code == 400 and words in e.value.message, (words, e.value.message)
        assert e.value.body["param"] == "messages", (words, e.value.body)


def _cancelled(server) -> float:
    import re

    return sum(float(m.group(1)) for m in re.finditer(
        r'^vlora_requests_finished_total\{[^}]*finish_reason="cancelled"[^}]*\}\s+(\S+)$', server.metrics(), re.MULTILINE))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(oa_server, stream):
    """The front end closes the request's Triton stream when its client goes away (streamed: the event stream's
    watcher; whole answers: the request's task), and the engine finishes the request as cancelled, long before
    its 100,000 tokens."""
    import http.client
    import time
    from urllib.parse import urlsplit

    before = _cancelled(oa_server)
    url = urlsplit(oa_server.openai_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", f"{url.path}/chat/completions", json.dumps({
        "model": MODEL, "max_tokens": 100000, "ignore_eos": True, "stream": stream,
        "messages": [{"role": "user", "content": "Tell me a very long story."}]}), {"Content-Type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    else:
        time.sleep(1.0)  # the request is running in the engine
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 20
    while _cancelled(oa_server) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _cancelled(oa_server) > before, "the request was not cancelled after its client went away"
