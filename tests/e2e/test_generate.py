"""Answers through the real server: gRPC streaming, HTTP generate and generate_stream, and requests
built without vlora_client (plain tritonclient, raw JSON) all agree, and concurrency changes nothing.
"""
from __future__ import annotations

import json
import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from e2e_helpers import MODEL, b64, png_bytes, post_json, post_sse
from vlora_client import VloraClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI


def make_cases(adapters: list[str]) -> list[dict]:
    """Base and several adapters, with and without images (two frames in one), of different lengths."""
    assert len(adapters) >= 2, f"the demo adapters are missing: {adapters}"
    names = [None] + adapters
    cases = []
    for i in range(8):
        images = [png_bytes(i)] if i % 3 == 0 else []
        if i == 4:
            images = [png_bytes(40), png_bytes(41)]  # video frames
        # Placeholders mark where the images go; without them the images come first.
        placeholders = "<image>" * len(images) + "\n" if images and i % 2 == 0 else ""
        prompt = "USER: " + placeholders + "Tell me about request number " + "seven " * i + "ASSISTANT:"
        cases.append(dict(prompt=prompt, images=images, lora_name=names[i % len(names)], max_tokens=6 + 2 * i))
    cases[5].update(temperature=0.9, top_p=0.9, seed=1234)  # seeded sampling is reproducible too
    return cases


@pytest.fixture(scope="module")
def cases(server):
    return make_cases(server.adapters)


@pytest.fixture(scope="module")
def sequential(server, cases):
    """Each case alone, over gRPC streaming: the reference answers."""
    client = VloraClient(server.grpc_url)
    return [client.generate(stream=True, **c) for c in cases]


def test_sequential_answers_are_complete(sequential, cases):
    for result, case in zip(sequential, cases):
        assert result.finish_reason in ("length", "stop"), result
        assert result.num_output_tokens >= 1
        assert result.num_input_tokens > 0
        if result.finish_reason == "length":
            assert result.num_output_tokens == case["max_tokens"]


def test_adapters_change_the_answer(server, sequential):
    client = VloraClient(server.grpc_url)
    prompt = "USER: Tell me a story about the sea. ASSISTANT:"
    base = client.generate(prompt, max_tokens=12).text
    with_adapters = [client.generate(prompt, lora_name=name, max_tokens=12).text for name in server.adapters]
    assert any(text != base for text in with_adapters), "no demo adapter changed the base model's answer"


def test_concurrent_grpc_streams_equal_sequential(server, cases, sequential):
    client = VloraClient(server.grpc_url)

    def run(case):
        parts = list(client.generate_stream(**case))
        return "".join(p.text for p in parts), parts[-1].finish_reason, len(parts)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for (text, finish, n_parts), ref, case in zip(results, sequential, cases):
        assert text == ref.text, f"concurrent answer differs for {case['lora_name']}"
        assert finish == ref.finish_reason
        assert n_parts >= 2, "streaming sent a single response"


def test_http_generate_and_generate_stream(server, cases, sequential):
    client = VloraClient(server.http_url, protocol="http")
    for case, ref in list(zip(cases, sequential))[:4]:
        result = client.generate(**case)
        assert (result.text, result.finish_reason) == (ref.text, ref.finish_reason)
        assert result.num_output_tokens == ref.num_output_tokens
        streamed = list(client.generate_stream(**case))
        assert "".join(d.text for d in streamed) == ref.text
        assert streamed[-1].finish_reason == ref.finish_reason


def test_raw_json_like_curl(server, cases, sequential):
    """/generate and /generate_stream with our documented names only; lora_name as a top-level key."""
    case, ref = cases[3], sequential[3]
    body = {"text_input": case["prompt"], "sampling_parameters": json.dumps({"max_tokens": case["max_tokens"]})}
    if case["images"]:
        body["image"] = [b64(i) for i in case["images"]]
    if case["lora_name"]:
        body["lora_name"] = case["lora_name"]
    status, payload = post_json(f"{server.http_url}/v2/models/{MODEL}/generate", body)
    assert status == 200, payload
    assert payload["text_output"] == ref.text
    assert payload["finish_reason"] == ref.finish_reason

    events = post_sse(f"{server.http_url}/v2/models/{MODEL}/generate_stream", {**body, "stream": True})
    assert len(events) >= 2 and all("error" not in e for e in events), events
    assert "".join(e["text_output"] for e in events) == ref.text
    assert events[-1]["finish_reason"] == ref.finish_reason


def test_plain_tritonclient_grpc(server, cases, sequential):
    """tritonclient alone, lora_name as a request parameter, images in the `image` input."""
    import tritonclient.grpc as grpcclient

    case, ref = cases[0], sequential[0]
    assert case["images"]
    inputs = []

    def add(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        inputs.append(t)

    add("text_input", np.array([case["prompt"].encode()], dtype=np.object_), "BYTES")
    add("image", np.array([b64(i).encode() for i in case["images"]], dtype=np.object_), "BYTES")
    add("stream", np.array([False]), "BOOL")
    add("sampling_parameters", np.array([json.dumps({"max_tokens": case["max_tokens"]}).encode()], dtype=np.object_), "BYTES")
    params = {"lora_name": case["lora_name"]} if case["lora_name"] else None

    responses: "queue.Queue" = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(MODEL, inputs, request_id="plain-1", parameters=params)
        result, error = responses.get(timeout=120)
        client.stop_stream()
    assert error is None, error
    assert result.as_numpy("text_output")[0].decode() == ref.text
    assert result.as_numpy("finish_reason")[0].decode() == ref.finish_reason
    assert int(result.as_numpy("num_output_tokens")[0]) == ref.num_output_tokens


def test_exclude_input_in_output_false_prepends_prompt(server, sequential, cases):
    case, ref = cases[1], sequential[1]
    body = {"text_input": case["prompt"], "exclude_input_in_output": False,
            "sampling_parameters": json.dumps({"max_tokens": case["max_tokens"], "lora_name": case["lora_name"]})}
    status, payload = post_json(f"{server.http_url}/v2/models/{MODEL}/generate", body)
    assert status == 200, payload
    assert payload["text_output"] == case["prompt"] + ref.text


def test_cli_client(server, tmp_path, capsys):
    from vlora_client.cli import main

    img = tmp_path / "frame.png"
    img.write_bytes(png_bytes(3))
    code = main(["--url", server.grpc_url, "--prompt", "USER: <image> What is this? ASSISTANT:", "--image", str(img),
                 "--max-tokens", "5", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_output_tokens"] >= 1 and out["finish_reason"] in ("length", "stop")


def test_apply_chat_template_option(server):
    """The option wraps the prompt in the model's chat template: more input tokens, same prompt text."""
    client = VloraClient(server.http_url, protocol="http")
    plain = client.generate("What is in the picture?", images=[png_bytes(5)], max_tokens=4)
    status, payload = post_json(f"{server.http_url}/v2/models/{MODEL}/generate", {
        "text_input": "What is in the picture?", "image": [b64(png_bytes(5))],
        "sampling_parameters": json.dumps({"max_tokens": 4, "apply_chat_template": True})})
    assert status == 200, payload
    assert payload["num_input_tokens"] > plain.num_input_tokens
    templated = client.generate("What is in the picture?", images=[png_bytes(5)], max_tokens=4, apply_chat_template=True)
    assert (templated.text, templated.num_input_tokens) == (payload["text_output"], payload["num_input_tokens"])


def test_stop_string_ends_the_answer(server, sequential, cases):
    case, ref = cases[7], sequential[7]
    assert len(ref.text) >= 8, ref.text
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    cut = ref.text.index(stop)  # the answer ends before the stop string's first occurrence
    result = VloraClient(server.grpc_url).generate(**case, stop=[stop])
    assert result.finish_reason == "stop", result
    assert result.text == ref.text[:cut]


def test_requests_sent_at_once_are_not_held_by_triton(server):
    """Requests that arrive while execute() runs go straight on. Triton 2.51's dynamic batcher held them until its
    500 ms wake-up (16 at once: first tokens at 0.5, 1.0 and 1.5 s on a 2-core CPU); the model config has none."""
    import threading
    import time
    import uuid

    import tritonclient.grpc as grpcclient

    from vlora_client.client import build_grpc_inputs

    n = 16
    barrier = threading.Barrier(n)
    firsts: list = []

    def one(i: int) -> None:
        events: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
            inputs = build_grpc_inputs(f"USER: arrival {i} " + "word " * i + "ASSISTANT:", [],
                                       {"max_tokens": 2, "ignore_eos": True}, True)
            barrier.wait()
            t0 = time.perf_counter()
            client.async_stream_infer(MODEL, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
            first = None
            while True:
                result, error, t = events.get(timeout=120)
                assert error is None, error
                response = result.get_response()
                if response.outputs and first is None:
                    first = t - t0
                if response.parameters["triton_final_response"].bool_param:
                    break
            client.stop_stream()
        firsts.append(first)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(firsts) == n and None not in firsts, firsts
    # The engine prefills them in one or two steps: no first token a whole wake-up after the others.
    assert max(firsts) - min(firsts) < 0.45, sorted(round(f, 3) for f in firsts)
