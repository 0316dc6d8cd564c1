"""OpenAI request bodies -> the vlora model's request: the conversation, its images and ``sampling_parameters``.

``chat_messages`` turns ``messages`` (system, developer, user and assistant turns; text and ``image_url`` parts)
into the model's ``messages`` input, which the model renders through the checkpoint's chat template
(vlora.engine.chat's format, written here without importing it); ``image_payloads`` turns ``image_url`` values into
the base64 payloads of the model's ``image`` input (``data:`` URLs; ``http(s)`` fetched here, within a size and a
time limit, only when allowed); ``sampling_parameters`` maps the body's fields and refuses the unsupported ones.
Errors are ``APIError`` (400) naming the field.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from vlora.server.openai.errors import APIError, bad_request

IMAGE_URL_MAX_BYTES = 16 * 1024 * 1024  # one fetched image (the engine's limits.max_image_bytes default)
IMAGE_URL_TIMEOUT_S = 10.0  # one fetch, connection to last byte
MAX_IMAGE_URLS = 16  # http(s) images fetched for one request
# vlora.engine.api.MAX_TOKENS_LIMIT (not imported: the front end stays free of the engine). Without
# max_tokens an answer may run to the context's end, as OpenAI's API defines it.
MAX_TOKENS_LIMIT = 2**20

# Families (config.json model_type) that take a video: several images in one user message are its frames there.
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


# -- requests: OpenAI bodies -> the vlora model's request ---------------------------------------------------------

def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", "messages")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{where} holds a lone UTF-16 surrogate, not valid text", "messages") from None
    return value


def chat_messages(messages: Any, family: str) -> tuple[str, list[str]]:
    """``messages`` -> (the model's ``messages`` input: the conversation as JSON, vlora.engine.chat's format; the
    ``image_url`` values in order). Every message goes to the model, which renders the whole conversation through
    the checkpoint's chat template. ``system`` and ``developer`` messages are system messages; ``image_url`` parts
    go in user messages only, each an image part standing for the next image; on a family that takes videos
    (Qwen2-VL, Qwen2.5-VL) several images in one user message are one video's frames (a video part where the
    first stood), which then goes without other images. The model checks the rest (the last message is a user
    message, the sizes, the template's own rules)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict] = []
    urls: list[str] = []
    video_at, video_frames = None, 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role in ("tool", "function"):
            raise bad_request(f"messages[{i}]: {role} messages are not supported (this server has no tools)",
                              "messages", "unsupported_parameter")
        if role not in _ROLES:
            raise bad_request(f"messages[{i}].role must be system, developer, user or assistant, got {role!r}"[:200],
                              "messages")
        if role == "assistant" and (message.get("tool_calls") or message.get("function_call")):
            raise bad_request(f"messages[{i}]: tool calls are not supported (this server has no tools)",
                              "messages", "unsupported_parameter")
        where = f"messages[{i}].content"
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            out.append({"role": _ROLES[role], "content": _text(content, where)})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where} must be a string or a list of content parts", "messages")
        parts: list[dict] = []
        images = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise bad_request(f"{where}[{j}] must be an object with a type", "messages")
            if kind == "text" or (kind == "refusal" and role == "assistant"):
                parts.append({"type": "text", "text": _text(part.get(kind), f"{where}[{j}].{kind}")})
            elif kind == "image_url":
                if role != "user":
                    raise bad_request(f"{where}[{j}]: image_url parts go in user messages only, not in a "
                                      f"{role} message", "messages")
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise bad_request(f"{where}[{j}].image_url.url must be a string", "messages")
                images.append(len(parts))
                parts.append({"type": "image"})
                urls.append(url)
            else:
                raise bad_request(f"{where}[{j}]: content parts of type {kind!r} are not supported "
                                  "(text and image_url are)"[:300], "messages")
        if len(images) > 1 and family in VIDEO_FAMILIES:  # one video: its frames are this message's images
            if video_at is not None:
                raise bad_request("several images in one message are one video's frames on this model, and a "
                                  "request carries at most one video", "messages")
            video_at, video_frames = i, len(images)
            first = images[0]
            parts = [p for n, p in enumerate(parts) if n not in images[1:]]
            parts[first] = {"type": "video"}
        out.append({"role": _ROLES[role], "content": parts})
    if video_at is not None and len(urls) > video_frames:
        raise bad_request("several images in one message are one video's frames on this model, and a video goes "
                          "without other images: send the other images in a request of their own", "messages")
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")), urls


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
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return params


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required: the base model's name or an adapter's name (GET /v1/models)", "model")
    return model
