"""Multi-turn conversations (issue 39): the model's ``messages`` input (vlora.engine.chat) as the wire reads it,
the OpenAI front end's conversion to it (vlora.server.openai.requests.chat_messages), and the families rendering it
through the checkpoint's chat template (ModelFamily.chat_prompt) on the tiny LLaVA and Qwen2-VL models: the same
token ids, vision inputs and positions as the prompt the template renders, images in the conversation's order,
and a 400 naming the problem for what a template or the engine cannot take. The front end's decoding of
Triton's protobuf answers and its server-sent events are checked here too."""
from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch
from PIL import Image

from fake_pb_utils import FakeRequest
from vlora.config import InputLimits
from vlora.engine.api import GenerationRequest
from vlora.engine.chat import MAX_MESSAGES, MAX_PARTS, Conversation, parse_messages
from vlora.errors import InvalidRequest
from vlora.server.openai.errors import APIError, error_from_triton
from vlora.server.openai.requests import chat_messages

USER_IMAGE = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
CHAT = [{"role": "system", "content": "Be brief."}, USER_IMAGE, {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image"}]}]


# -- the messages input ------------------------------------------------------------------------------------------

def test_a_conversation_is_parsed_and_normalised():
    conv = parse_messages(json.dumps(CHAT))
    assert conv.images == 2 and not conv.video and conv.chars == len("Be brief.What is it?A cat.And this?")
    assert conv.messages[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert conv.messages[3]["content"] == [{"type": "text", "text": "And this?"}, {"type": "image"}]
    assert list(conv.texts())[1] == ("messages[1].content[1]", "What is it?")
    video = parse_messages(json.dumps([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}]))
    assert video.video and video.images == 0


@pytest.mark.parametrize("messages,words", [
    ("not json", "not valid JSON"),
    ("{}", "non-empty JSON array"),
    ("[]", "non-empty JSON array"),
    ([{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1), f"the limit is {MAX_MESSAGES}"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_PARTS + 1)}], f"the limit is {MAX_PARTS}"),
    ([{"role": "tool", "content": "42"}], "messages[0].role must be one of ['system', 'user', 'assistant']"),
    ([{"role": "user", "content": "hi", "name": "bob"}], "messages[0]: unknown key(s) ['name']"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or an array of parts"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0] must be an object with type"),
    ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "the pixels go in the image input"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text must be a string"),
    ([{"role": "user", "content": "a\u0000b"}], "messages[0].content holds a NUL"),
    ([{"role": "user", "content": "\ud800"}], "lone UTF-16 surrogate"),
    ([{"role": "system", "content": [{"type": "image"}]}, USER_IMAGE], "images go in user messages only, not in a system"),
    ([USER_IMAGE, {"role": "assistant", "content": [{"type": "image"}]}, USER_IMAGE], "not in a assistant message"),
    ([USER_IMAGE, {"role": "assistant", "content": "A cat."}], "messages[1]: the last message must be a user message"),
    ([{"role": "user", "content": [{"type": "video"}, {"type": "video"}]}], "at most one video"),
    ([{"role": "user", "content": [{"type": "video"}, {"type": "image"}]}], "so it goes alone"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "extra": [[1]]}]}], "nests 6 levels deep"),
])
def test_bad_conversations_are_refused_naming_the_message(messages, words):
    with pytest.raises(InvalidRequest) as e:
        parse_messages(messages if isinstance(messages, str) else json.dumps(messages))
    assert words in str(e.value)


def test_the_json_is_bounded_before_it_is_parsed():
    with pytest.raises(InvalidRequest, match="bytes of JSON; the limit is"):
        parse_messages(json.dumps([{"role": "user", "content": "x" * (3 << 20)}]))


def test_the_wire_takes_messages_instead_of_text_input(wire):
    parsed = wire.parse(FakeRequest({"messages": json.dumps(CHAT), "image": ["aGVsbG8=", "d29ybGQ="],
                                     "sampling_parameters": json.dumps({"max_tokens": 3})}), "rid", fault_injection=False)
    gen = parsed.gen
    assert gen.prompt == "" and isinstance(gen.messages, Conversation) and gen.messages.images == 2
    assert gen.apply_chat_template is False and gen.sampling.max_tokens == 3 and len(gen.images) == 2
    ok = wire.parse(FakeRequest({"text_input": "", "messages": json.dumps(CHAT),
                                 "sampling_parameters": json.dumps({"apply_chat_template": True})}), "r", fault_injection=False)
    assert ok.gen.messages is not None  # an empty text_input beside it and a redundant true are accepted
    for inputs, words in [
        ({}, "text_input is required (or messages"),
        ({"text_input": "hi", "messages": json.dumps(CHAT)}, "text_input or messages, not both"),
        ({"messages": json.dumps(CHAT), "sampling_parameters": json.dumps({"apply_chat_template": False})},
         "apply_chat_template cannot be false"),
        ({"messages": json.dumps(CHAT), "exclude_input_in_output": False}, "exclude_input_in_output cannot be false"),
        ({"messages": b"\xff"}, "messages is not valid UTF-8"),
        ({"messages": "[{]"}, "messages is not valid JSON"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            wire.parse(FakeRequest(inputs), "rid", fault_injection=False)
        assert words in str(e.value), inputs


# -- the OpenAI front end's conversion ------------------------------------------------------------------------

def _url(n: int) -> str:
    return f"data:image/png;base64,{n}"


def image(n: int) -> dict:
    return {"type": "image_url", "image_url": {"url": _url(n)}}


def test_openai_messages_become_the_models_conversation_with_the_images_in_order():
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [image(1), {"type": "text", "text": "What is it?"}], "name": "ann"},
                {"role": "assistant", "content": None},
                {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": [{"type": "text", "text": "And?"}, image(2)]}]
    wire_json, urls = chat_messages(messages, "llava")
    assert urls == [_url(1), _url(2)]
    assert json.loads(wire_json) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "no"}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}, {"type": "image"}]}]
    conv = parse_messages(wire_json[:-1] + ',{"role":"user","content":"x"}]')  # what the model reads of it
    assert conv.images == 2


def test_several_images_in_one_message_are_a_video_where_the_family_takes_one():
    frames = {"role": "user", "content": [{"type": "text", "text": "What happens?"}, image(1), image(2), image(3)]}
    wire_json, urls = chat_messages([frames], "qwen2_vl")
    assert urls == [_url(1), _url(2), _url(3)]
    assert json.loads(wire_json)[0]["content"] == [{"type": "text", "text": "What happens?"}, {"type": "video"}]
    assert json.loads(chat_messages([frames], "llava")[0])[0]["content"].count({"type": "image"}) == 3
    # images in separate messages stay images
    two = [{"role": "user", "content": [image(1)]}, {"role": "assistant", "content": "x"}, {"role": "user", "content": [image(2)]}]
    assert "video" not in chat_messages(two, "qwen2_5_vl")[0]
    with pytest.raises(APIError, match="a video goes without other images"):
        chat_messages([{"role": "user", "content": [image(0)]}, {"role": "assistant", "content": "x"}, frames], "qwen2_vl")
    with pytest.raises(APIError, match="at most one video"):
        chat_messages([frames, {"role": "assistant", "content": "x"}, frames], "qwen2_vl")


@pytest.mark.parametrize("messages,words", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [image(1)]}], "user messages only, not in a assistant"),
    ([{"role": "system", "content": [image(1)]}], "user messages only, not in a system"),
    ([{"role": "tool", "content": "1", "tool_call_id": "a"}], "tool messages are not supported"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}], "tool calls are not supported"),
    ([{"role": "bot", "content": "hi"}], "role must be system, developer, user or assistant"),
    ([{"role": "user", "content": None}], "must be a string or a list"),
    ([{"role": "user", "content": [{"type": "file", "file": {}}]}], "'file' are not supported"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url.url must be a string"),
    ([{"role": "user", "content": "\ud800"}], "lone UTF-16 surrogate"),
])
def test_the_front_end_refuses_what_it_can_see(messages, words):
    with pytest.raises(APIError) as e:
        chat_messages(messages, "llava")
    assert e.value.status == 400 and e.value.param == "messages" and words in e.value.message


def test_the_models_conversation_errors_name_messages():
    assert error_from_triton("[INVALID_ARG] messages[2]: the last message must be a user message").param == "messages"
    assert error_from_triton("[INVALID_ARG] too many images: 9 (the limit is 8)").param == "messages"
    assert error_from_triton("[INVALID_ARG] max_tokens must be ...").param == "max_tokens"


# -- the families: the conversation through the checkpoint's chat template --------------------------------------

@pytest.fixture(scope="module")
def llava(tiny_model_dir):
    from vlora.models.family import load_model

    return load_model(tiny_model_dir, torch.float32, "cpu")


@pytest.fixture(scope="module")
def qwen(vlora_cache):
    from vlora.models.family import load_model
    from vlora.models.tiny_qwen import ensure_tiny_qwen

    return load_model(ensure_tiny_qwen(vlora_cache), torch.float32, "cpu")


def _images(*sizes):
    return [Image.new("RGB", size, (40 * i, 90, 200 - 30 * i)) for i, size in enumerate(sizes)]


def test_llava_renders_the_whole_conversation_as_its_template_does(llava):
    conv = parse_messages(json.dumps(CHAT))
    text = llava.tokenizer.apply_chat_template([dict(m) for m in conv.messages], chat_template=llava.chat_template,
                                               tokenize=False, add_generation_prompt=True)
    assert text == "Be brief. USER: <image>\nWhat is it? ASSISTANT: A cat. USER: <image>\nAnd this? ASSISTANT:"
    images = _images((64, 64), (80, 64))
    got = llava.family.chat_prompt(llava, conv, images)
    want = llava.family.prompt(llava, text, images, False)
    assert got.ids == want.ids and torch.equal(got.pixel_values, want.pixel_values)
    # the k-th image part is the k-th image
    assert not torch.equal(got.pixel_values, llava.family.chat_prompt(llava, conv, images[::-1]).pixel_values)
    # one user turn equals the one-turn path (apply_chat_template on text_input)
    one = parse_messages(json.dumps([USER_IMAGE]))
    assert llava.family.chat_prompt(llava, one, images[:1]).ids == llava.family.prompt(llava, "What is it?", images[:1], True).ids


def test_qwen_renders_images_where_they_stand_and_a_video(qwen):
    conv = parse_messages(json.dumps(CHAT))
    text = qwen.image_processor.apply_chat_template([dict(m) for m in conv.messages], tokenize=False,
                                                    add_generation_prompt=True)
    assert text.index("<|image_pad|>") < text.index("What is it?") and text.rindex("And this?") < text.rindex("<|image_pad|>")
    images = _images((56, 56), (84, 56))
    got = qwen.family.chat_prompt(qwen, conv, images)
    want = qwen.family.prompt(qwen, text, images, False)
    assert got.ids == want.ids and torch.equal(got.mrope_positions, want.mrope_positions)
    assert got.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 6]]  # the images' own sizes, in order
    video = parse_messages(json.dumps([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}]))
    clip = qwen.family.chat_prompt(qwen, video, _images(*[(56, 56)] * 4))
    assert clip.video and clip.image_grid_thw.tolist() == [[2, 4, 4]]


@pytest.mark.parametrize("text,marker", [("a <image> b", "<image>")])
def test_a_text_part_holding_a_placeholder_is_refused(llava, qwen, text, marker):
    conv = parse_messages(json.dumps([{"role": "user", "content": text}]))
    with pytest.raises(InvalidRequest, match=f"messages\\[0\\].content\\[0\\].text holds {marker}"):
        llava.family.chat_prompt(llava, conv, [])
    conv = parse_messages(json.dumps([{"role": "user", "content": "x <|vision_start|> y"}]))
    with pytest.raises(InvalidRequest, match="holds <\\|vision_start\\|>"):
        qwen.family.chat_prompt(qwen, conv, [])


def test_a_template_that_drops_images_or_refuses_the_conversation_is_a_400(llava):
    import dataclasses

    conv = parse_messages(json.dumps([USER_IMAGE]))
    text_only = dataclasses.replace(llava, chat_template="{% for m in messages %}{% for p in m['content'] %}"
                                                         "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
                                                         "{% endfor %}{% endfor %}")
    with pytest.raises(InvalidRequest, match="template wrote 0 <image> placeholder\\(s\\) for 1 part"):
        llava.family.chat_prompt(text_only, conv, _images((64, 64)))
    strict = dataclasses.replace(llava, chat_template="{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(InvalidRequest, match="refused the conversation: Conversation roles must alternate"):
        llava.family.chat_prompt(strict, conv, _images((64, 64)))
    with pytest.raises(InvalidRequest, match="has none"):
        llava.family.chat_prompt(dataclasses.replace(llava, chat_template=""), conv, _images((64, 64)))


def test_the_engine_checks_the_conversation_before_anything_is_decoded(llava, qwen):
    from vlora.engine.inputs import InputProcessor

    def check(loaded, messages, images, **limits):
        proc = InputProcessor(loaded, InputLimits(**limits), None, 1024)
        return proc.check(GenerationRequest("r", "", images=images, messages=parse_messages(json.dumps(messages))))

    png = _png()
    check(llava, CHAT, [png, png])
    for loaded, messages, images, limits, words in [
        (llava, CHAT, [png], {}, "2 image part(s) but the request carries 1 image(s)"),
        (llava, CHAT, [png, png], {"max_prompt_chars": 10}, "characters of text; the limit is 10"),
        (llava, [{"role": "user", "content": [{"type": "video"}]}], [png, png], {}, "takes no video"),
        (qwen, [{"role": "user", "content": [{"type": "video"}]}], [], {}, "carries no images"),
        (llava, [{"role": "user", "content": [{"type": "image"}] * 3}], [png] * 3, {"max_images": 2}, "too many images: 3"),
    ]:
        with pytest.raises(InvalidRequest, match=words.replace("(", "\\(").replace(")", "\\)")):
            check(loaded, messages, images, **limits)


def _png() -> bytes:
    import io

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


# -- the front end's answers: Triton's protobuf in, server-sent events out ---------------------------------------

def _response(**outputs):
    from tritonclient.grpc import service_pb2

    r = service_pb2.ModelInferResponse(model_name="vlora", id="x")
    for name, (dtype, raw) in outputs.items():
        n = len(raw) // 4 if dtype != "BYTES" else 0
        pos = 0
        while dtype == "BYTES" and pos < len(raw):
            pos, n = pos + 4 + struct.unpack_from("<I", raw, pos)[0], n + 1
        r.outputs.add(name=name, datatype=dtype, shape=[n])
        r.raw_output_contents.append(raw)
    return r


def _b(*values: str) -> bytes:
    return b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)


def test_answers_are_read_from_the_raw_outputs():
    from vlora.server.openai.triton import _decode, _decode_slow

    u32 = struct.Struct("<I").pack
    r = _response(text_output=("BYTES", _b("héllo")), num_input_tokens=("UINT32", u32(9)),
                  num_output_tokens=("UINT32", u32(2)))
    out = _decode(r)
    assert (out.text, out.num_input_tokens, out.num_output_tokens, out.finish_reason) == ("héllo", 9, 2, None)
    last = _response(text_output=("BYTES", _b("red")), num_input_tokens=("UINT32", u32(9)),
                     num_output_tokens=("UINT32", u32(1)), finish_reason=("BYTES", _b("stop")),
                     label=("BYTES", _b("red")), scores=("FP32", struct.pack("<2f", 0.75, 0.25)),
                     label_names=("BYTES", _b("red", "blue")))
    for decode in (_decode, _decode_slow):
        out = decode(last)
        assert (out.text, out.finish_reason) == ("red", "stop")
        assert out.head == {"label": "red", "scores": {"red": 0.75, "blue": 0.25}}


class _FakeStream:
    """TritonStream's interface over a list of answers."""

    def __init__(self, answers):
        self.answers, self.cancelled, self.done = list(answers), False, False

    async def next(self):
        if not self.answers:
            raise APIError(500, "ended", "server_error")
        out = self.answers.pop(0)
        self.done = out.finish_reason is not None
        return out

    def cancel(self):  # as TritonStream's: a no-op once the last answer came
        self.cancelled = self.cancelled or not self.done


def _answer(text, n, finish=None):
    from vlora.server.openai.triton import Answer

    a = Answer()
    a.text, a.num_input_tokens, a.num_output_tokens, a.finish_reason = text, 7, n, finish
    return a


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_events_are_openais_chunks(chat):
    from vlora.server.openai.app import build_app
    from vlora.server.openai.triton import Frontend

    front = Frontend("127.0.0.1:1")
    stream = _FakeStream([_answer("Hel", 1), _answer("", 0), _answer('lo "wörld"\n', 2), _answer("!", 1, "length")])
    front.triton = lambda *a, **k: stream
    sent = asyncio.run(_post(build_app(front), "/v1/chat/completions" if chat else "/v1/completions", {
        "model": "vlora", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4,
        **({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})}))
    start, bodies = sent[0], sent[1:]
    assert start["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert [m["more_body"] for m in bodies] == [True, True, False]  # the last answer, finish, usage and [DONE]: one
    raw = b"".join(m["body"] for m in bodies)
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [(c["choices"][0]["delta"].get("content") if chat else c["choices"][0]["text"]) for c in chunks if c["choices"]]
    assert "".join(t or "" for t in texts) == 'Hello "wörld"\n!'
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4,
                                                                  "total_tokens": 11}
    first = chunks[0]
    assert set(first) == {"id", "object", "created", "model", "choices", "usage"} and first["usage"] is None
    assert first["object"] == ("chat.completion.chunk" if chat else "text_completion") and first["model"] == "vlora"
    if chat:
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # a text chunk from the template is byte for byte what a JSON dump of the chunk gives
    text_chunk = next(c for c in chunks if c["choices"] and (c["choices"][0].get("delta", {}).get("content") or
                                                              c["choices"][0].get("text")) == 'lo "wörld"\n')
    from vlora.server.openai.app import _sse

    assert _sse(text_chunk) in raw
    assert not stream.cancelled


async def _post(app, path: str, body: dict) -> list[dict]:
    """One request through the ASGI app; the messages it sends (the lifespan is not run: no Triton)."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 9000)}
    messages = [{"type": "http.request", "body": data, "more_body": False}]
    done = asyncio.Event()
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    await app(scope, receive, send)
    return sent


def test_an_error_after_the_stream_started_is_one_error_event_then_done():
    from vlora.server.openai.app import build_app
    from vlora.server.openai.triton import Frontend

    front = Frontend("127.0.0.1:1")
    stream = _FakeStream([_answer("Hel", 1)])  # then the stream fails
    front.triton = lambda *a, **k: stream
    sent = asyncio.run(_post(build_app(front), "/v1/completions", {"model": "vlora", "prompt": "Hi", "stream": True}))
    raw = b"".join(m["body"] for m in sent[1:])
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e]
    assert json.loads(events[0])["choices"][0]["text"] == "Hel"
    assert json.loads(events[1])["error"]["code"] is None and events[-1] == b"[DONE]" and len(events) == 3
    assert stream.cancelled  # the request did not end: the front end closed its stream
