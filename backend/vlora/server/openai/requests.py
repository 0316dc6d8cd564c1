"""OpenAI request bodies -> the vlora model's request: the prompt, its images and ``sampling_parameters``.

``chat_prompt`` turns ``messages`` (system/developer text, one user turn of text and ``image_url`` parts) into the
user turn's text with the family's image or video placeholders; ``image_payloads`` turns ``image_url`` values into
the base64 payloads of the model's ``image`` input (``data:`` URLs; ``http(s)`` fetched here, within a size and a
time limit, only when allowed); ``sampling_parameters`` maps the body's fields and refuses the unsupported ones.
Errors are ``APIError`` (400) naming the field.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

from vlora.server.openai.errors import APIError, bad_request

IMAGE_URL_MAX_BYTES = 16 * 1024 * 1024  # one fetched image (the engine's limits.max_image_bytes default)
IMAGE_URL_TIMEOUT_S = 10.0  # one fetch, connection to last byte
MAX_IMAGE_URLS = 16  # http(s) images fetched for one request
# vlora.engine.api.MAX_TOKENS_LIMIT (not imported: the front end stays free of the engine). Without
# max_tokens an answer may run to the context's end, as OpenAI's API defines it.
MAX_TOKENS_LIMIT = 2**20

# Where images go in a prompt, per checkpoint family (config.json model_type): the placeholders of
# vlora.models.loader (IMAGE_PLACEHOLDER) and vlora.models.qwen2_vl (VISION_PLACEHOLDER, VIDEO_PLACEHOLDER).
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PLACEHOLDERS = {"llava": "<image>", "qwen2_vl": _QWEN_IMAGE, "qwen2_5_vl": _QWEN_IMAGE}
VIDEO_PLACEHOLDERS = {"qwen2_vl": _QWEN_VIDEO, "qwen2_5_vl": _QWEN_VIDEO}  # families that take a video


# -- requests: OpenAI bodies -> the vlora model's request ---------------------------------------------------------

def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", "messages")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{where} holds a lone UTF-16 surrogate, not valid text", "messages") from None
    return value


def _parts(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        return []
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", "messages")
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{where}[{i}] must be an object with a type", "messages")
    return content


def _system_text(content: Any, where: str) -> str:
    texts = []
    for i, part in enumerate(_parts(content, where)):
        if part["type"] != "text":
            raise bad_request(f"{where}[{i}]: a system message takes text only", "messages")
        texts.append(_text(part.get("text"), f"{where}[{i}].text"))
    return "\n".join(texts)


def chat_prompt(messages: Any, family: str) -> tuple[str, list[Any]]:
    """``messages`` -> (the user turn's text, its images as ``image_url`` values). The model wraps the text in the
    checkpoint's chat template (one user turn). Images placed before all of the text need no placeholder (the
    model puts them first); images between text parts get the family's placeholder where they stand; several
    images are one video in a family that takes videos."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    system: list[str] = []
    user: Optional[list[dict]] = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        where = f"messages[{i}].content"
        if role in ("system", "developer"):
            if user is not None:
                raise bad_request(f"messages[{i}]: a system message must come before the user message", "messages")
            system.append(_system_text(message.get("content"), where))
        elif role == "user":
            if user is not None:
                raise bad_request("multi-turn conversations are not supported yet: send one user message "
                                  "(system messages before it are prepended to its text)", "messages")
            user = _parts(message.get("content"), where)
            base = i
        elif role in ("assistant", "tool", "function"):
            raise bad_request(f"messages[{i}]: {role} messages (multi-turn conversations) are not supported yet: "
                              "send one user message", "messages")
        else:
            raise bad_request(f"messages[{i}].role must be system, developer or user, got {role!r}", "messages")
    if user is None:
        raise bad_request("messages has no user message", "messages")
    pieces: list[tuple[str, Any]] = []  # ("text", str) or ("image", url)
    for j, part in enumerate(user):
        where = f"messages[{base}].content[{j}]"
        if part["type"] == "text":
            pieces.append(("text", _text(part.get("text"), f"{where}.text")))
        elif part["type"] == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise bad_request(f"{where}.image_url.url must be a string", "messages")
            pieces.append(("image", url))
        else:
            raise bad_request(f"{where}: content parts of type {part['type']!r} are not supported "
                              "(text and image_url are)", "messages")
    images = [v for k, v in pieces if k == "image"]
    texts = [v for k, v in pieces if k == "text"]
    first_text = next((n for n, (k, _) in enumerate(pieces) if k == "text"), len(pieces))
    images_first = all(k == "text" for k, _ in pieces[first_text:])
    video = VIDEO_PLACEHOLDERS.get(family) if len(images) > 1 else None
    if video:
        text = video + "\n".join(texts)
    elif images_first:
        text = "\n".join(texts)
    else:
        placeholder = IMAGE_PLACEHOLDERS.get(family, "<image>")
        text = "\n".join(v if k == "text" else placeholder for k, v in pieces)
    if system:
        text = "\n\n".join(system + [text]) if not video else video + "\n\n".join(system + ["\n".join(texts)])
    return text, images


def _data_url(url: str) -> str:
    """The base64 payload of a ``data:`` URL (what the model's ``image`` input takes)."""
    head, sep, data = url.partition(",")
    if not sep:
        raise bad_request("an image data: URL has no ',': expected data:image/png;base64,...", "messages",
                          "invalid_image_url")
    if head.lower().endswith(";base64"):
        payload = re.sub(r"\s+", "", urllib.parse.unquote(data) if "%" in data else data)
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("an image data: URL is not valid base64", "messages", "invalid_image_url") from None
        return payload
    return base64.b64encode(urllib.parse.unquote_to_bytes(data)).decode("ascii")


def _fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET ``url`` (http or https), at most ``max_bytes`` within ``timeout_s``; APIError saying why not."""
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "vlora"}),
                                    timeout=timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise bad_request(f"the image at an image_url is larger than {max_bytes} bytes", "messages")
            chunks, size = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise bad_request(f"fetching an image_url took more than {timeout_s:g}s", "messages")
                chunk = resp.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise bad_request(f"the image at an image_url is larger than {max_bytes} bytes", "messages")
                chunks.append(chunk)
            return b"".join(chunks)
    except APIError:
        raise
    except urllib.error.HTTPError as e:
        raise bad_request(f"fetching an image_url failed: HTTP {e.code}", "messages", "invalid_image_url") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or type(e).__name__
        raise bad_request(f"fetching an image_url failed: {reason}", "messages", "invalid_image_url") from None


async def image_payloads(urls: list[str], allow_image_urls: bool) -> list[str]:
    """``image_url`` values -> base64 payloads."""
    out, fetch = [], []
    for url in urls:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            out.append(_data_url(url))
        elif scheme in ("http", "https"):
            if not allow_image_urls:
                raise bad_request("http(s) image URLs are off on this server (vlora serve --allow-image-urls "
                                  "turns them on): send the image as a data: URL", "messages", "image_url_not_allowed")
            out.append(None)
            fetch.append((len(out) - 1, url))
        else:
            raise bad_request("an image_url must be a data: URL (or http(s) with --allow-image-urls)",
                              "messages", "invalid_image_url")
    if len(fetch) > MAX_IMAGE_URLS:
        raise bad_request(f"at most {MAX_IMAGE_URLS} http(s) image URLs per request", "messages")
    if fetch:
        data = await asyncio.gather(*(asyncio.to_thread(_fetch, u, IMAGE_URL_MAX_BYTES, IMAGE_URL_TIMEOUT_S)
                                      for _, u in fetch))
        for (i, _), d in zip(fetch, data):
            out[i] = base64.b64encode(d).decode("ascii")
    return out


# -- the body's fields -------------------------------------------------------------------------------------------

_UNSUPPORTED_TRUTHY = ("tools", "functions", "logit_bias", "logprobs", "top_logprobs", "echo", "suffix", "audio",
                       "prediction", "web_search_options")
_UNSUPPORTED_NONZERO = ("frequency_penalty", "presence_penalty")


def sampling_parameters(body: dict, chat: bool) -> dict:
    """The model's ``sampling_parameters`` from an OpenAI body; the model checks the values' ranges."""
    for key in _UNSUPPORTED_TRUTHY:
        if body.get(key):
            raise bad_request(f"{key} is not supported by this server", key, "unsupported_parameter")
    for key in _UNSUPPORTED_NONZERO:
        if body.get(key) not in (None, 0, 0.0):
            raise bad_request(f"{key} is not supported by this server (only 0)", key, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("response_format is not supported by this server (only {\"type\": \"text\"})",
                          "response_format", "unsupported_parameter")
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            raise bad_request(f"{key} must be 1 on this server", key)
    params: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
    params["max_tokens"] = MAX_TOKENS_LIMIT if max_tokens is None else max_tokens
    for key in ("temperature", "top_p", "seed", "ignore_eos", "task", "latency_target"):
        if body.get(key) is not None:
            params[key] = body[key]
    stop = body.get("stop")
    if stop is not None and stop != []:
        params["stop"] = stop
    if chat:
        params["apply_chat_template"] = True
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return params


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required: the base model's name or an adapter's name (GET /v1/models)", "model")
    return model
