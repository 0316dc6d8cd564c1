"""Decoding client images safely, and turning them into the vision tower's pixel values.

Images arrive from untrusted clients, so decoding is guarded, and every refusal is an
``InvalidRequest`` that names the image and the problem:

- size: the encoded bytes are bounded by ``InputLimits.max_image_bytes`` before anything is parsed;
- formats: only PNG, JPEG (with its MPO variant from cameras), WebP, GIF and BMP are opened. Pillow's
  other plugins are not reachable from a request (EPS, for one, would start Ghostscript);
- decompression bombs: ``width * height`` is read from the header, before any pixel is decoded, and
  checked against ``InputLimits.max_image_pixels``; so is the aspect ratio, because the processor
  resizes the *shortest* edge and a 1 x 10^6 strip would grow into a huge array;
- corruption: ``verify()`` on one parse (PNG checksums, structure), then a fresh parse and ``load()``
  decodes every pixel, so a truncated file fails here and not in the engine.

Pillow's process-wide settings (``Image.MAX_IMAGE_PIXELS``, ``ImageFile.LOAD_TRUNCATED_IMAGES``) are
left alone: other code in the process may rely on them, and changing them is not thread-safe. The
checks above are made per call instead, with this request's limits; Pillow's own bomb check (at 89 M
pixels by default) stays as a second line behind ours.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Optional, Sequence

import torch

from vlora.config import InputLimits
from vlora.engine.api import InvalidRequest

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # JPEG also opens cameras' MPO files
MAX_ASPECT_RATIO = 100  # longest edge / shortest edge

# Leading bytes of the formats above; anything else is taken to be base64 text.
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM")
_DATA_URL = re.compile(rb"^data:image/[A-Za-z0-9.+-]+;base64,", re.IGNORECASE)


def _label(index: Optional[int]) -> str:
    return "image" if index is None else f"image {index}"


def decode_image(data: bytes, limits: InputLimits, index: Optional[int] = None):
    """Decode encoded image bytes into an RGB ``PIL.Image.Image``, or raise InvalidRequest.

    ``index`` is the image's position as the client should read it in the message ("image 2: ...").
    """
    from PIL import Image, UnidentifiedImageError

    label = _label(index)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidRequest(f"{label}: expected encoded image bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise InvalidRequest(f"{label}: empty")
    if len(data) > limits.max_image_bytes:
        raise InvalidRequest(f"{label}: {len(data)} bytes is over the limit of {limits.max_image_bytes} bytes")
    fmt = "image"
    try:
        with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as probe:
            fmt = probe.format
            width, height = probe.size  # from the header; no pixel decoded yet
            _check_dimensions(label, width, height, limits)
            probe.verify()
        with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as img:
            if img.size != (width, height):
                raise InvalidRequest(f"{label}: inconsistent header")
            img.load()
            rgb = img.convert("RGB")
    except InvalidRequest:
        raise
    except UnidentifiedImageError:
        raise InvalidRequest(f"{label}: not a decodable image (cannot identify image file; "
                             f"accepted formats: {', '.join(ALLOWED_FORMATS)})") from None
    except Image.DecompressionBombError as e:
        raise InvalidRequest(f"{label}: over the pixel limit, refused as a possible decompression bomb ({e})") from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure inside a decoder means the bytes are bad
        raise InvalidRequest(f"{label}: corrupt or truncated {fmt} data ({e})") from None
    return rgb


def _check_dimensions(label: str, width: int, height: int, limits: InputLimits) -> None:
    if width < 1 or height < 1:
        raise InvalidRequest(f"{label}: invalid size {width}x{height}")
    if width * height > limits.max_image_pixels:
        raise InvalidRequest(f"{label}: {width}x{height} pixels is over the limit of {limits.max_image_pixels} pixels")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise InvalidRequest(f"{label}: {width}x{height} has an aspect ratio over {MAX_ASPECT_RATIO}:1")


def image_bytes_from_input(data: bytes | str, limits: InputLimits, index: Optional[int] = None) -> bytes:
    """The encoded image carried by one ``image`` input element.

    The Triton vLLM backend sends each image base64-encoded; clients that send the file's bytes as
    they are also work. Accepted: raw PNG/JPEG/GIF/BMP/WebP bytes, or base64 text (str or bytes, with
    or without a ``data:image/...;base64,`` prefix, whitespace ignored).
    """
    label = _label(index)
    if isinstance(data, str):
        try:
            data = data.encode("ascii")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{label}: base64 text has non-ASCII characters") from None
    elif isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    elif not isinstance(data, bytes):
        raise InvalidRequest(f"{label}: expected bytes or base64 text, got {type(data).__name__}")
    if not data:
        raise InvalidRequest(f"{label}: empty")
    if data.startswith(_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return data
    # base64 is 4/3 of the payload; refuse before decoding what cannot fit.
    if len(data) > limits.max_image_bytes * 4 // 3 + 1024:
        raise InvalidRequest(f"{label}: {len(data)} bytes of base64 is over the limit of "
                             f"{limits.max_image_bytes} decoded bytes")
    text = _DATA_URL.sub(b"", data.strip(), count=1)
    text = re.sub(rb"\s+", b"", text)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{label}: neither an encoded image nor valid base64 text") from None
    if not raw:
        raise InvalidRequest(f"{label}: empty")
    return raw


def decode_base64_image(data: bytes | str, limits: InputLimits, index: Optional[int] = None):
    """``decode_image`` for an ``image`` input element as Triton delivers it (see image_bytes_from_input)."""
    return decode_image(image_bytes_from_input(data, limits, index), limits, index)


def pixel_values(images: Sequence, image_processor) -> torch.Tensor:
    """The vision tower's input for RGB images, float32.

    Shape: [N, 3, H, W], H and W being the processor's crop size (the vision tower's image_size).
    """
    if len(images) == 0:
        raise ValueError("pixel_values: no images")
    out = image_processor(images=list(images), return_tensors="pt")
    return out["pixel_values"].to(torch.float32)
