"""The Qwen2-VL family through the real server: `vlora serve --model DIR --adapters DIR` serving a tiny
random Qwen2-VL folder (CPU, float32) with three PEFT adapters.

Requests mix the base model and the adapters, text-only requests and images of different sizes (so
different numbers of visual tokens), with Qwen's placeholder in the text and without it (images first).
Greedy answers are the same one at a time and all at once, over HTTP generate and gRPC streaming, and
the same as transformers + PEFT on the same weights. Bad input gets the clear 400s that LLaVA gets.
"""
from __future__ import annotations

import io
import json
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_helpers import MODEL, assert_refused, b64, post_json, start_server
from helpers import peft_greedy, peft_with_adapters, qwen_processor_inputs
from vlora_client import VloraClient, VloraClientError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # a safety net: nothing here may hang CI

tiny_qwen = pytest.importorskip("vlora.models.tiny_qwen")

VP = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen's image placeholder
MAX_TOKENS = 8
# Limits the server is started with (--set), small so that the refusals below are cheap to provoke.
MAX_IMAGES = 4
MAX_IMAGE_PIXELS = 1024 * 1024


def qwen_png(seed: int, width: int, height: int) -> bytes:
    """A deterministic noisy RGB PNG of the given size."""
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def solid_png(width: int, height: int) -> bytes:
    """A one-colour PNG: a few KB to send, width x height pixels to decode."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (40, 160, 90)).save(buf, format="PNG")
    return buf.getvalue()


def header_only_png(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming width x height, then IEND: no pixel data at all."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# (id, adapter or None, prompt, images (seed, width, height), apply_chat_template)
CASES = [
    ("text-base", None, "Hello there, how are you today?", [], False),
    ("img-placeholder-r8", "qwen-r8-qv", f"{VP}Describe this picture.", [(1, 56, 56)], False),
    ("two-img-placeholders-r16", "qwen-r16-attn", f"Left {VP} and right {VP}: which is brighter?",
     [(2, 112, 56), (3, 56, 84)], False),
    ("text-r32", "qwen-r32-mlp", "Count to ten, slowly, please.", [], False),
    ("img-first-base", None, "What do you see?", [(4, 84, 84)], False),
    ("two-img-first-r8", "qwen-r8-qv", "Compare the two pictures.", [(5, 112, 112), (6, 56, 56)], False),
    ("img-placeholder-r32", "qwen-r32-mlp", f"In {VP} there is", [(7, 140, 56)], False),
    ("img-chat-template-r16", "qwen-r16-attn", "What colours are in the picture?", [(8, 56, 112)], True),
]
CASE_IDS = [c[0] for c in CASES]


def request(case) -> dict:
    """VloraClient.generate keyword arguments for a case; greedy."""
    _, adapter, prompt, images, template = case
    return dict(prompt=prompt, images=[qwen_png(*spec) for spec in images], lora_name=adapter,
                max_tokens=MAX_TOKENS, temperature=0.0, apply_chat_template=template)


@pytest.fixture(scope="module")
def qwen_dirs(vlora_cache):
    model_dir = tiny_qwen.ensure_tiny_qwen(vlora_cache, variant="qwen2_vl")
    adapter_root = tiny_qwen.ensure_tiny_qwen_adapters(model_dir, vlora_cache / "qwen2-vl-adapters")
    return model_dir, adapter_root


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory, vlora_cache, qwen_dirs):
    model_dir, adapter_root = qwen_dirs
    ws = tmp_path_factory.mktemp("e2e-qwen-server")
    srv = start_server(ws, vlora_cache, extra_args=[
        "--model", str(model_dir), "--adapters", str(adapter_root), "--dtype", "float32",
        "--set", f"limits.max_images={MAX_IMAGES}", "--set", f"limits.max_image_pixels={MAX_IMAGE_PIXELS}"])
    assert srv.adapters == sorted(tiny_qwen.QWEN_ADAPTER_NAMES), srv.launcher_output()[-3000:]
    yield srv
    code = srv.stop()
    assert code == 0, f"`vlora serve` did not stop cleanly (exit {code}):\n{srv.launcher_output()[-3000:]}"


@pytest.fixture(scope="module")
def sequential(qwen_server):
    """Each case alone, over gRPC streaming: the reference answers."""
    client = VloraClient(qwen_server.grpc_url)
    return [client.generate(stream=True, **request(c)) for c in CASES]


def test_served_model_is_the_qwen_folder(qwen_server, qwen_dirs):
    banner = qwen_server.launcher_output()
    assert f"vlora is serving model '{MODEL}': {qwen_dirs[0]}\n" in banner, banner[-2000:]


def test_sequential_answers(qwen_server, sequential):
    for result, case_id in zip(sequential, CASE_IDS):
        assert result.finish_reason in ("length", "stop"), (case_id, result)
        assert 1 <= result.num_output_tokens <= MAX_TOKENS, (case_id, result)
        if result.finish_reason == "length":
            assert result.num_output_tokens == MAX_TOKENS, (case_id, result)
    assert len({r.text for r in sequential}) > 1, "the tiny model answers everything alike"
    # Qwen keeps each image's resolution: the same text with a bigger image takes more visual tokens.
    client = VloraClient(qwen_server.http_url, protocol="http")
    small = client.generate(f"{VP}Describe.", images=[qwen_png(9, 56, 56)], max_tokens=1)
    large = client.generate(f"{VP}Describe.", images=[qwen_png(9, 112, 112)], max_tokens=1)
    assert small.num_input_tokens + 12 == large.num_input_tokens, (small, large)  # 4 -> 16 visual tokens


def test_adapters_change_the_answer(qwen_server):
    client = VloraClient(qwen_server.grpc_url)
    args = dict(images=[qwen_png(11, 84, 56)], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    base = client.generate(f"{VP}Tell me a story.", **args).text
    adapted = [client.generate(f"{VP}Tell me a story.", lora_name=name, **args).text
               for name in tiny_qwen.QWEN_ADAPTER_NAMES]
    assert any(text != base for text in adapted), (base, adapted)


def test_http_generate_equals_grpc_streaming_one_at_a_time(qwen_server, sequential):
    client = VloraClient(qwen_server.http_url, protocol="http")
    for case, ref in zip(CASES, sequential):
        got = client.generate(**request(case))
        assert (got.text, got.finish_reason, got.num_input_tokens, got.num_output_tokens) == \
            (ref.text, ref.finish_reason, ref.num_input_tokens, ref.num_output_tokens), case[0]


def test_concurrent_http_generate_equals_sequential(qwen_server, sequential):
    client = VloraClient(qwen_server.http_url, protocol="http")
    with ThreadPoolExecutor(len(CASES)) as pool:
        results = list(pool.map(lambda c: client.generate(**request(c)), CASES))
    for got, ref, case_id in zip(results, sequential, CASE_IDS):
        assert (got.text, got.finish_reason, got.num_output_tokens) == \
            (ref.text, ref.finish_reason, ref.num_output_tokens), case_id


def test_concurrent_grpc_streams_equal_sequential(qwen_server, sequential):
    client = VloraClient(qwen_server.grpc_url)

    def run(case):
        parts = list(client.generate_stream(**request(case)))
        return "".join(p.text for p in parts), parts[-1].finish_reason

    with ThreadPoolExecutor(len(CASES)) as pool:
        results = list(pool.map(run, CASES))
    for (text, finish), ref, case_id in zip(results, sequential, CASE_IDS):
        assert (text, finish) == (ref.text, ref.finish_reason), case_id


def test_raw_json_generate_with_base64_images(qwen_server, sequential):
    """/generate as curl sends it: base64 PNGs in `image`, lora_name in sampling_parameters."""
    i = CASE_IDS.index("two-img-placeholders-r16")
    _, adapter, prompt, images, _ = CASES[i]
    body = {"text_input": prompt, "image": [b64(qwen_png(*spec)) for spec in images],
            "sampling_parameters": json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0, "lora_name": adapter})}
    status, payload = post_json(f"{qwen_server.http_url}/v2/models/{MODEL}/generate", body)
    assert status == 200, payload
    assert payload["text_output"] == sequential[i].text


@pytest.fixture(scope="module")
def reference(qwen_dirs):
    """transformers + PEFT on the same folder and adapters, and the folder's own processor."""
    import torch

    pytest.importorskip("peft")
    model_dir, adapter_root = qwen_dirs
    with torch.random.fork_rng(devices=[]):
        model = peft_with_adapters(tiny_qwen.load_tiny_qwen(model_dir, torch.float32), adapter_root,
                                   tiny_qwen.QWEN_ADAPTER_NAMES)
    return model.eval(), tiny_qwen.load_qwen_processor(model_dir)


def reference_answer(reference, adapter, prompt: str, images, template: bool = False) -> tuple[str, int]:
    """The greedy continuation of transformers + PEFT: (text, number of new tokens). ``images``: (seed, width,
    height) of each image, or with the video placeholder in the prompt of each frame (the processor's video
    path); ``template``: the chat template makes one user turn of the images, then the text."""
    model, processor = reference
    if template:
        assert VP not in prompt
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                               add_generation_prompt=True)
    inputs = qwen_processor_inputs(processor, prompt, [qwen_png(*spec) for spec in images])
    new = peft_greedy(model, adapter, inputs, MAX_TOKENS)
    eos = set(model.generation_config.eos_token_id or ())
    n = next((k + 1 for k, t in enumerate(new) if t in eos), len(new))  # generated tokens, EOS included
    return processor.tokenizer.decode(new, skip_special_tokens=True), n


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_answers_equal_transformers_peft(qwen_server, sequential, reference, case_id):
    i = CASE_IDS.index(case_id)
    _, adapter, prompt, images, template = CASES[i]
    text, n = reference_answer(reference, adapter, prompt, images, template)
    params = {"max_tokens": MAX_TOKENS, "temperature": 0, "apply_chat_template": template}
    if adapter:
        params["lora_name"] = adapter
    status, payload = post_json(f"{qwen_server.http_url}/v2/models/{MODEL}/generate", {
        "text_input": prompt, "image": [b64(qwen_png(*spec)) for spec in images],
        "sampling_parameters": json.dumps(params)})
    assert status == 200, payload
    assert payload["text_output"] == text, case_id
    assert payload["num_output_tokens"] == n, case_id
    assert sequential[i].text == text, case_id


# -- bad input ------------------------------------------------------------------------------------

GOOD = "Say something."


def long_prompt(tokenizer, max_model_len: int, max_chars: int) -> str:
    """A text over the model's context in tokens, within the server's limit in characters."""
    words = " ".join(f"token{i} zx{i * 7919 % 1000}" for i in range(6000))
    text = words[:max_chars]
    n = len(tokenizer(text)["input_ids"])
    assert n > max_model_len + 100, f"the long prompt has only {n} tokens; the context is {max_model_len}"
    return text


@pytest.fixture(scope="module")
def max_model_len(qwen_server, qwen_dirs):
    config = json.loads((qwen_dirs[0] / "config.json").read_text())
    m = re.search(r"'max_model_len': (\d+)", qwen_server.server_log(tail=100000))
    assert m, "the server log does not show the model's max_model_len"
    served = int(m.group(1))
    assert served == config["max_position_embeddings"], (served, config["max_position_embeddings"])
    return served


def bad_requests(max_model_len: int, tokenizer) -> list:
    """(id, /generate body, words the error must contain)."""
    img = b64(qwen_png(21, 56, 56))
    return [
        ("unknown-adapter", {"text_input": GOOD, "lora_name": "no-such-adapter"}, ["no-such-adapter"]),
        ("unknown-adapter-in-sampling", {"text_input": f"{VP}{GOOD}", "image": [img],
                                         "sampling_parameters": json.dumps({"lora_name": "qwen-r99"})}, ["qwen-r99"]),
        ("corrupt-image", {"text_input": f"{VP}{GOOD}", "image": [b64(qwen_png(22, 56, 56)[:60] + b"\x00" * 40)]},
         ["image 0", "corrupt"]),
        ("not-an-image", {"text_input": GOOD, "image": [b64(b"hello, this is text and not a picture")]}, ["image 0"]),
        ("too-many-images", {"text_input": GOOD, "image": [img] * (MAX_IMAGES + 1)},
         ["too many images", f"limit is {MAX_IMAGES}"]),
        ("too-many-placeholders-and-images",
         {"text_input": VP * (MAX_IMAGES + 1) + GOOD, "image": [img] * (MAX_IMAGES + 1)}, ["too many images"]),
        ("image-over-pixel-limit-solid", {"text_input": f"{VP}{GOOD}", "image": [b64(solid_png(1024, 1032))]},
         ["image 0", "1024x1032", f"limit of {MAX_IMAGE_PIXELS} pixels"]),
        ("image-over-pixel-limit-header-only", {"text_input": GOOD, "image": [img, b64(header_only_png(1025, 1024))]},
         ["image 1", "1025x1024", f"limit of {MAX_IMAGE_PIXELS} pixels"]),
        ("prompt-longer-than-context", {"text_input": long_prompt(tokenizer, max_model_len, 64 * 1024)},
         ["context", str(max_model_len)]),
        ("more-placeholders-than-images", {"text_input": f"{VP} and {VP}: {GOOD}", "image": [img]},
         ["2", "placeholder", "1 image"]),
        ("fewer-placeholders-than-images", {"text_input": f"{VP}{GOOD}", "image": [img, img, img]},
         ["1", "placeholder", "3 image"]),
        ("placeholder-without-image", {"text_input": f"{VP}{GOOD}"}, ["placeholder", "0 image"]),
        ("bare-image-pad", {"text_input": f"<|image_pad|>{GOOD}", "image": [img]}, ["<|image_pad|>"]),
    ]


BAD_IDS = ["unknown-adapter", "unknown-adapter-in-sampling", "corrupt-image", "not-an-image", "too-many-images",
           "too-many-placeholders-and-images", "image-over-pixel-limit-solid", "image-over-pixel-limit-header-only",
           "prompt-longer-than-context", "more-placeholders-than-images", "fewer-placeholders-than-images",
           "placeholder-without-image", "bare-image-pad"]


@pytest.fixture(scope="module")
def bad(max_model_len, qwen_dirs):
    tokenizer = tiny_qwen.load_qwen_processor(qwen_dirs[0]).tokenizer
    cases = {case_id: (body, words) for case_id, body, words in bad_requests(max_model_len, tokenizer)}
    assert list(cases) == BAD_IDS
    return cases


def healthy(server) -> None:
    assert server.is_ready(), "the server is no longer ready"
    status, payload = post_json(f"{server.http_url}/v2/models/{MODEL}/generate", {
        "text_input": f"{VP}{GOOD}", "image": [b64(qwen_png(23, 56, 56))],
        "sampling_parameters": json.dumps({"max_tokens": 2, "ignore_eos": True, "lora_name": "qwen-r8-qv"})})
    assert status == 200 and payload["num_output_tokens"] == 2, payload


@pytest.mark.parametrize("case_id", BAD_IDS)
def test_bad_request_is_refused_with_a_clear_error(qwen_server, bad, case_id):
    body, words = bad[case_id]
    message = assert_refused(qwen_server, body, words)
    assert "internal error" not in message.lower(), message
    healthy(qwen_server)


def test_errors_over_grpc_streaming(qwen_server):
    client = VloraClient(qwen_server.grpc_url)
    with pytest.raises(VloraClientError, match="no-such-adapter"):
        list(client.generate_stream(GOOD, lora_name="no-such-adapter", max_tokens=3))
    with pytest.raises(VloraClientError, match="placeholder"):
        list(client.generate_stream(f"{VP}{VP}{GOOD}", images=[qwen_png(24, 56, 56)], max_tokens=3))
    with pytest.raises(VloraClientError, match="too many images"):
        client.generate(GOOD, images=[qwen_png(25, 56, 56)] * (MAX_IMAGES + 1), max_tokens=3, stream=True)
    with pytest.raises(VloraClientError, match="image 0"):
        client.generate(GOOD, images=[b"\x89PNG\r\n\x1a\n broken"], max_tokens=3, stream=True)
    after = client.generate(f"{VP}{GOOD}", images=[qwen_png(26, 56, 56)], max_tokens=3, stream=True)
    assert after.num_output_tokens >= 1


# -- a video, and Qwen2.5-VL ------------------------------------------------------------------------------

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"  # once in the text: the request's images are its frames
FRAMES = [(40 + i, 64, 64) for i in range(4)]  # 4 frames: 2 temporal patches


def test_video_request_as_readme_sends_it(qwen_server, reference):
    """README's Qwen video curl: the video placeholder once, the frames as `image`, lora_name in
    sampling_parameters; the answer is transformers + PEFT's on the same frames."""
    prompt = f"{VIDEO}What happens in this clip?"
    body = {"text_input": prompt, "image": [b64(qwen_png(*spec)) for spec in FRAMES],
            "sampling_parameters": json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0, "lora_name": "qwen-r16-attn"})}
    status, payload = post_json(f"{qwen_server.http_url}/v2/models/{MODEL}/generate", body)
    assert status == 200, payload
    text, n = reference_answer(reference, "qwen-r16-attn", prompt, FRAMES)
    assert (payload["text_output"], payload["num_output_tokens"]) == (text, n)
    # Without the video placeholder the same frames are four images (4 tokens each), not one video (2 x 4).
    as_images = VloraClient(qwen_server.http_url, protocol="http").generate(
        "What happens in this clip?", images=[qwen_png(*spec) for spec in FRAMES], max_tokens=1)
    assert as_images.num_input_tokens > payload["num_input_tokens"], (as_images, payload)


@pytest.mark.parametrize("case_id", ["frames-of-two-sizes", "video-pad-beside-images"])
def test_bad_video_requests_are_a_400_naming_the_problem(qwen_server, case_id):
    """A video's frames of different sizes, or a stray <|video_pad|> in an image prompt: 400 naming it, through
    the real server (they reached the processor and came back as an internal error), and the server still serves."""
    if case_id == "frames-of-two-sizes":
        body = {"text_input": f"{VIDEO}What happens?",
                "image": [b64(qwen_png(60, 64, 64)), b64(qwen_png(61, 56, 84))]}
        words = ["same size", "frame 1"]
    else:
        body = {"text_input": f"{VP}What is it? <|video_pad|>", "image": [b64(qwen_png(62, 56, 56))]}
        words = ["video_pad"]
    message = assert_refused(qwen_server, {**body, "sampling_parameters": json.dumps({"max_tokens": 2})}, words)
    assert "internal" not in message.lower() and "traceback" not in message.lower(), message
    healthy(qwen_server)


Q25_CASES = [
    ("q25-text-r32", "qwen-r32-mlp", "Count to ten, slowly, please.", []),
    ("q25-two-img-r16", "qwen-r16-attn", f"Left {VP} and right {VP}: which is brighter?", [(2, 112, 56), (3, 56, 84)]),
    ("q25-wide-img-first-base", None, "Describe this picture.", [(12, 168, 56)]),  # three vision windows
    ("q25-video-r8", "qwen-r8-qv", f"{VIDEO}What happens in this clip?", FRAMES),
]


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory, vlora_cache):
    """`vlora serve` on a tiny random Qwen2.5-VL folder (windowed vision attention, second_per_grid_ts),
    and transformers + PEFT on the same folder."""
    import torch

    pytest.importorskip("peft")
    model_dir = tiny_qwen.ensure_tiny_qwen(vlora_cache, variant="qwen2_5_vl")
    adapter_root = tiny_qwen.ensure_tiny_qwen_adapters(model_dir, vlora_cache / "qwen2.5-vl-adapters")
    srv = start_server(tmp_path_factory.mktemp("e2e-qwen25-server"), vlora_cache, extra_args=[
        "--model", str(model_dir), "--adapters", str(adapter_root), "--dtype", "float32"])
    with torch.random.fork_rng(devices=[]):
        model = peft_with_adapters(tiny_qwen.load_tiny_qwen(model_dir, torch.float32), adapter_root,
                                   tiny_qwen.QWEN_ADAPTER_NAMES)
    yield srv, (model.eval(), tiny_qwen.load_qwen_processor(model_dir))
    code = srv.stop()
    assert code == 0, f"`vlora serve` did not stop cleanly (exit {code}):\n{srv.launcher_output()[-3000:]}"


def test_qwen25_concurrent_http_and_grpc_equal_transformers_peft(qwen25):
    """Qwen2.5-VL: all cases at once over HTTP generate and over gRPC streams; every answer is
    transformers + PEFT's (images of different sizes, one wider than a vision window, and a video)."""
    srv, reference = qwen25
    want = {case_id: reference_answer(reference, adapter, prompt, images)
            for case_id, adapter, prompt, images in Q25_CASES}
    http = VloraClient(srv.http_url, protocol="http")
    grpc = VloraClient(srv.grpc_url)

    def ask(client, case, stream):
        _, adapter, prompt, images = case
        kwargs = dict(images=[qwen_png(*spec) for spec in images], lora_name=adapter, max_tokens=MAX_TOKENS,
                      temperature=0.0)
        if stream:
            return "".join(p.text for p in client.generate_stream(prompt, **kwargs)), None
        got = client.generate(prompt, **kwargs)
        return got.text, got.num_output_tokens

    jobs = [(http, c, False) for c in Q25_CASES] + [(grpc, c, True) for c in Q25_CASES]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: ask(*j), jobs))
    assert len({w for w in want.values()}) > 1, "the tiny model answers everything alike"
    for (client, case, stream), (text, n) in zip(jobs, results):
        assert text == want[case[0]][0], (case[0], "grpc stream" if stream else "http")
        if not stream:
            assert n == want[case[0]][1], case[0]
