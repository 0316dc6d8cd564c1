"""Conversations: the Triton model's ``messages`` input, a whole chat that the model renders through the
checkpoint's chat template (:meth:`vlora.models.base.ModelFamily.chat_prompt`). Parsed and checked here, before
anything is queued; the standard library and :mod:`vlora.errors` only, like :mod:`vlora.engine.api`.

The wire format: one string, a JSON array of messages (instead of ``text_input``; the images stay in the
``image`` input)::

    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
     {"role": "assistant", "content": "A cat."},
     {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image"}]}]

- ``role``: ``system``, ``user`` or ``assistant``; the last message is a user message (the one answered).
- ``content``: a string, or a list of parts: ``{"type": "text", "text": ...}``, ``{"type": "image"}``,
  ``{"type": "video"}``; no other keys (the parts of Hugging Face's chat templates, without the pixels).
- Image parts stand for the request's images in order: over the whole conversation, message by message and
  part by part, the k-th image part is the k-th image of the ``image`` input, and their numbers must be equal.
  That is the order in which both families' templates write their placeholders (LLaVA-1.5 writes a turn's
  images before its text; Qwen2-VL where they stand), so the k-th placeholder is the k-th image.
- A video part takes all of the request's images as its frames: at most one per request, with no image part
  beside it, on a family that takes videos (Qwen2-VL, Qwen2.5-VL).
- Images and videos go in user messages only (OpenAI's API takes them nowhere else, and LLaVA's template
  would write a system message's image without a role).

Bounds: the JSON at most :data:`MAX_MESSAGES_JSON_BYTES` and nested as the format is (no deeper),
:data:`MAX_MESSAGES` messages, :data:`MAX_PARTS` parts per message; the text of all messages at most
``limits.max_prompt_chars`` characters (:class:`vlora.engine.inputs.InputProcessor` checks it, as for
``text_input``); the images ``limits.max_images``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vlora.engine.api import _json_depth, check_text  # the same scan and text check as sampling_parameters'
from vlora.errors import InvalidRequest

MAX_MESSAGES_JSON_BYTES = 2 * 1024 * 1024
MAX_MESSAGES = 1024
MAX_PARTS = 64  # parts of one message
MAX_JSON_DEPTH = 4  # the array, a message, its parts, a part
ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "image", "video")


@dataclass(frozen=True)
class Conversation:
    """A checked ``messages`` input. ``messages``: each message with its content as a list of parts (a string
    content becomes one text part), as chat templates take them; ``images``: its image parts; ``video``: it has
    a video part; ``chars``: the characters of its text."""

    messages: tuple[dict, ...]
    images: int
    video: bool
    chars: int

    def texts(self):
        """(where, text) of every text part, ``where`` as ``messages[i].content[j]``."""
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message["content"]):
                if part["type"] == "text":
                    yield f"messages[{i}].content[{j}]", part["text"]


def parse_messages(text: str) -> Conversation:
    """The ``messages`` input (JSON text) as a :class:`Conversation`; InvalidRequest naming the message and part
    at fault. Lone surrogates and NULs in strings are refused (as in every string a request carries)."""
    if not isinstance(text, str):
        raise InvalidRequest("messages must be a string holding a JSON array")
    data = text.encode("utf-8", "surrogatepass")
    if len(data) > MAX_MESSAGES_JSON_BYTES:
        raise InvalidRequest(f"messages is {len(data)} bytes of JSON; the limit is {MAX_MESSAGES_JSON_BYTES}")
    depth = _json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequest(f"messages nests {depth} levels deep; the format has {MAX_JSON_DEPTH} "
                             "(an array of messages, each with a content array of parts)")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"messages is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty JSON array of messages")
    if len(raw) > MAX_MESSAGES:
        raise InvalidRequest(f"messages has {len(raw)} messages; the limit is {MAX_MESSAGES}")
    out: list[dict] = []
    images = videos = chars = 0
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise InvalidRequest(f"messages[{i}]: unknown key(s) {_names(extra)}; a message has role and content")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {list(ROLES)}, got {_shown(role)}")
        parts = _parts(message.get("content"), i)
        for j, part in enumerate(parts):
            if part["type"] == "text":
                chars += len(part["text"])
            elif role != "user":
                raise InvalidRequest(f"messages[{i}].content[{j}]: {part['type']}s go in user messages only, "
                                     f"not in a {role} message")
            elif part["type"] == "image":
                images += 1
            else:
                videos += 1
        out.append({"role": role, "content": parts})
    if out[-1]["role"] != "user":
        raise InvalidRequest(f"messages[{len(out) - 1}]: the last message must be a user message (the one the "
                             f"model answers), not {out[-1]['role']}")
    if videos > 1:
        raise InvalidRequest(f"messages has {videos} video parts; a request carries at most one video")
    if videos and images:
        raise InvalidRequest("messages has a video part and image parts; a video takes all of the request's "
                             "images as its frames, so it goes alone")
    return Conversation(tuple(out), images, bool(videos), chars)


def _parts(content: Any, i: int) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": check_text(f"messages[{i}].content", content)}]
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{i}].content must be a string or an array of parts")
    if len(content) > MAX_PARTS:
        raise InvalidRequest(f"messages[{i}].content has {len(content)} parts; the limit is {MAX_PARTS}")
    parts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise InvalidRequest(f"{where} must be an object with type one of {list(PART_TYPES)}"
                                 + (f", got {_shown(kind)}" if isinstance(part, dict) else ""))
        allowed = {"type", "text"} if kind == "text" else {"type"}
        extra = sorted(set(part) - allowed)
        if extra:
            raise InvalidRequest(f"{where}: unknown key(s) {_names(extra)} in a {kind} part"
                                 + ("; the pixels go in the image input" if kind != "text" else ""))
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.text must be a string")
            parts.append({"type": "text", "text": check_text(f"{where}.text", part["text"])})
        else:
            parts.append({"type": kind})
    return parts


def _names(keys: list) -> str:
    return str([k if len(k) <= 40 else k[:37] + "..." for k in keys[:5]])


def _shown(x: Any) -> str:
    text = repr(x) if isinstance(x, (str, int, float, bool, type(None))) else f"<{type(x).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."
