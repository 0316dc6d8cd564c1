"""Task heads through the real server: the trained demo adapters answer head requests with a label,
its scores and the label names, in one output token, next to generating requests."""
from __future__ import annotations

import io
import json
import queue

import numpy as np
import pytest

from e2e_helpers import MODEL, b64, post_json
from vlora.fusion.datasets import generate

pytestmark = pytest.mark.e2e


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def head_body(ds, sample, lora, task=None, **extra):
    params = {"lora_name": lora, "task": task or ds.name, **extra}
    return {"text_input": ds.prompt_for(len(sample.images)), "image": [b64(png(i)) for i in sample.images],
            "sampling_parameters": json.dumps(params)}


def test_counting_head_over_http(server):
    assert {"demo-count-circles", "demo-shapes"} <= set(server.adapters)
    ds = generate("count-circles", seed=11, sizes={"train": 0, "val": 0, "test": 3})
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    for sample in ds.split("test"):
        code, body = post_json(url, head_body(ds, sample, "demo-count-circles"))
        assert code == 200, body
        assert body["label"] in ds.labels and body["text_output"] == body["label"]
        assert body["label_names"] == list(ds.labels)
        scores = body["scores"]
        assert len(scores) == 6 and abs(sum(scores) - 1) < 1e-4
        assert body["label"] == ds.labels[int(np.argmax(scores))]
        assert body["num_output_tokens"] == 1 and body["finish_reason"] == "stop"
        assert body["num_input_tokens"] > 64  # the image's tokens are in the prompt


def test_fused_adapter_heads_and_unknown_task(server):
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    for task in ("color", "shape", "presence-red-triangle"):
        ds = generate(task, seed=12, sizes={"train": 0, "val": 0, "test": 1})
        code, body = post_json(url, head_body(ds, ds.split("test")[0], "demo-shapes"))
        assert code == 200 and body["label"] in ds.labels and body["label_names"] == list(ds.labels), body
    ds = generate("color", seed=12, sizes={"train": 0, "val": 0, "test": 1})
    code, body = post_json(url, head_body(ds, ds.split("test")[0], "demo-shapes", task="count-circles"))
    assert code == 400 and "unknown task 'count-circles'" in body.get("error", ""), body


def test_head_and_generating_requests_together_over_grpc(server):
    import tritonclient.grpc as grpcclient

    ds = generate("count-circles", seed=13, sizes={"train": 0, "val": 0, "test": 1})
    sample = ds.split("test")[0]
    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        def send(rid, text, params, images=(), stream=False):
            inputs = [grpcclient.InferInput("text_input", [1], "BYTES"),
                      grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
                      grpcclient.InferInput("stream", [1], "BOOL")]
            inputs[0].set_data_from_numpy(np.array([text.encode()], dtype=object))
            inputs[1].set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
            inputs[2].set_data_from_numpy(np.array([stream]))
            if images:
                img = grpcclient.InferInput("image", [len(images)], "BYTES")
                img.set_data_from_numpy(np.array([b64(png(i)).encode() for i in images], dtype=object))
                inputs.append(img)
            client.async_stream_infer(MODEL, inputs, request_id=rid, enable_empty_final_response=True)

        send("head", ds.prompt_for(1), {"lora_name": "demo-count-circles", "task": "count-circles"}, sample.images, stream=True)
        send("gen", ds.prompt_for(1), {"lora_name": "demo-count-circles", "max_tokens": 6, "ignore_eos": True}, sample.images)
        send("base", "USER: Say something. ASSISTANT:", {"max_tokens": 4, "ignore_eos": True})
        final, tokens = {}, {}
        while len(final) < 3:
            result, error = results.get(timeout=120)
            assert error is None, error
            resp = result.get_response()
            rid = resp.id
            if any(o.name == "num_output_tokens" for o in resp.outputs):
                tokens[rid] = tokens.get(rid, 0) + int(result.as_numpy("num_output_tokens")[0])
            if resp.parameters["triton_final_response"].bool_param:
                final[rid] = result
        head = final["head"]
        label = head.as_numpy("label")[0].decode()
        assert label in ds.labels and head.as_numpy("text_output")[0].decode() == label
        assert [x.decode() for x in head.as_numpy("label_names")] == list(ds.labels)
        assert head.as_numpy("scores").shape == (6,) and abs(float(head.as_numpy("scores").sum()) - 1) < 1e-4
        assert tokens["head"] == 1 and tokens["gen"] == 6 and tokens["base"] == 4
        assert final["gen"].as_numpy("label") is None
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_client_library_and_cli_show_a_head_answer(server, protocol, tmp_path, capsys):
    """`vlora-client --task` (and VloraClient(..., task=)) return the label and every label's score."""
    from vlora_client import cli
    from vlora_client.client import VloraClient

    ds = generate("count-circles", seed=17, sizes={"train": 0, "val": 0, "test": 1})
    sample = ds.split("test")[0]
    frame = tmp_path / "frame.png"
    frame.write_bytes(png(sample.images[0]))
    url = server.grpc_url if protocol == "grpc" else server.http_url
    client = VloraClient(url, protocol=protocol)
    result = client.generate(ds.prompt_for(1), images=[frame], lora_name="demo-count-circles", task="count-circles")
    assert result.label in ds.labels and result.text == result.label and result.num_output_tokens == 1
    assert list(result.scores) == list(ds.labels) and abs(sum(result.scores.values()) - 1) < 1e-4
    assert result.label == max(result.scores, key=result.scores.get)
    plain = client.generate("USER: Say something. ASSISTANT:", max_tokens=2, ignore_eos=True)
    assert plain.label is None and plain.scores is None

    rc = cli.main(["--url", url, "--protocol", protocol, "--prompt", ds.prompt_for(1), "--image", str(frame),
                   "--lora", "demo-count-circles", "--task", "count-circles"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and out[0] == result.label
    shown = {line.split()[0]: float(line.split()[1].rstrip("%")) / 100 for line in out[1:]}
    assert set(shown) == set(ds.labels) and abs(shown[result.label] - result.scores[result.label]) < 1e-3
