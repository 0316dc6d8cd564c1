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
  decodes every pixel, so a truncated file fails here and not in the engine;
- cost: decoding costs CPU per pixel, not per byte (a 60 KB solid-colour 4096x4096 PNG takes most of a
  second to decode and preprocess). ``probe_images`` reads every image's header first (cheap: no pixel
  is decoded) and bounds the request's total in ``InputLimits.max_total_pixels``; ``decode_images`` then
  refuses the request once ``InputLimits.image_decode_timeout_s`` has passed, checked before each image
  (one image's decode runs to its end, bounded by ``max_image_pixels``).

Pillow's process-wide settings (``Image.MAX_IMAGE_PIXELS``, ``ImageFile.LOAD_TRUNCATED_IMAGES``) are
left alone: other code in the process may rely on them, and changing them is not thread-safe. The
checks above are made per call instead, with this request's limits; Pillow's own bomb check (at 89 M
pixels by default) stays as a second line behind ours. One exception, which changes no result: the engine
(AsyncEngine) has Pillow keep the memory blocks of freed images for the next ones (:func:`keep_image_blocks`).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from vlora.config import InputLimits
from vlora.errors import InvalidRequest

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # JPEG also opens cameras' MPO files
MAX_ASPECT_RATIO = 100  # longest edge / shortest edge

# Leading bytes of the formats above; anything else is taken to be base64 text.
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM")
_DATA_URL = re.compile(rb"^data:image/[A-Za-z0-9.+-]+;base64,", re.IGNORECASE)
_WHITESPACE = b" \t\n\r\x0b\x0c"  # what re's \s matches in bytes


def _label(index: Optional[int]) -> str:
    return "image" if index is None else f"image {index}"


@dataclass(frozen=True)
class ProbedImage:
    """Encoded image bytes whose header (format, size) and structure passed the checks; not decoded yet."""

    data: bytes
    width: int
    height: int
    format: str

    @property
    def pixels(self) -> int:
        return self.width * self.height


def probe_image(data: bytes, limits: InputLimits, index: Optional[int] = None) -> ProbedImage:
    """Check encoded image bytes from their header and structure, decoding no pixel; or raise InvalidRequest."""
    from PIL import Image

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
    except Exception as e:  # noqa: BLE001 - mapped to the client's error, see _refusal
        raise _refusal(label, fmt, e) from None
    return ProbedImage(data, width, height, fmt)


def decode_probed(image: ProbedImage, index: Optional[int] = None):
    """Decode a probed image into an RGB ``PIL.Image.Image``, or raise InvalidRequest."""
    from PIL import Image

    label = _label(index)
    try:
        with Image.open(io.BytesIO(image.data), formats=ALLOWED_FORMATS) as img:
            if img.size != (image.width, image.height):
                raise InvalidRequest(f"{label}: inconsistent header")
            img.load()
            # An RGB image (most JPEGs) as it was decoded: convert("RGB") would copy its pixels (a fresh block of
            # 4 bytes a pixel, 1.2 MB at 640x480) for nothing. Leaving the block closes only the file.
            return img if img.mode == "RGB" else img.convert("RGB")
    except Exception as e:  # noqa: BLE001
        raise _refusal(label, image.format, e) from None


def keep_image_blocks(blocks: int) -> None:
    """Have Pillow keep up to ``blocks`` memory blocks of freed images (each at most its block size, 16 MiB: one
    image of up to 4 M pixels) for the next images, instead of giving each back to malloc (Pillow's default).

    Why: an image's block is large (4 bytes a pixel: 1.2 MB at 640x480), and malloc gives such a block back to the
    system when it is freed (an mmap of its own above the server's fixed MALLOC_MMAP_THRESHOLD_ of 1 MiB; the
    trimmed top of an image worker's arena otherwise), so every new image's decode faulted its pages in again:
    about 300 page faults per image, 1.4 ms of a 640x480 JPEG's decode on a worker thread of the 2-core CPU (2.6
    ms with the block kept), and as much in the CPU's preprocessing. ``drop_image_blocks`` frees what is kept (the
    image budget's trim, once a burst is over). Process-wide, never lowered here."""
    from PIL import Image

    if blocks > Image.core.get_blocks_max():
        Image.core.set_blocks_max(blocks)


def drop_image_blocks() -> None:
    """Free the blocks that Pillow keeps for the next images (:func:`keep_image_blocks`)."""
    from PIL import Image

    Image.core.clear_cache()


def decode_image(data: bytes, limits: InputLimits, index: Optional[int] = None):
    """Decode encoded image bytes into an RGB ``PIL.Image.Image``, or raise InvalidRequest.

    ``index`` is the image's position as the client should read it in the message ("image 2: ...").
    """
    return decode_probed(probe_image(data, limits, index), index)


def probe_images(items: Sequence, limits: InputLimits) -> list[ProbedImage]:
    """Every ``image`` input element of a request probed (see probe_image), and their total pixels
    checked against ``limits.max_total_pixels``, before any pixel is decoded."""
    probed = [probe_image(image_bytes_from_input(data, limits, i), limits, i) for i, data in enumerate(items)]
    total = sum(p.pixels for p in probed)
    if total > limits.max_total_pixels:
        sizes = ", ".join(f"{p.width}x{p.height}" for p in probed)
        raise InvalidRequest(f"images: {total} pixels in all ({sizes}) is over the limit of {limits.max_total_pixels} "
                             f"pixels per request (limits.max_total_pixels)")
    return probed


def decode_images(images: Sequence[ProbedImage], limits: InputLimits, started: Optional[float] = None) -> list:
    """Decode probed images to RGB, refusing the request once ``limits.image_decode_timeout_s`` has passed
    since ``started`` (time.monotonic(); default: now). Checked before each image.

    A request's images (a video's frames) are decoded side by side on a process-wide pool of
    :func:`frame_decode_workers` threads (Pillow releases the GIL while it decodes and converts), in
    their order; with one worker, or one image, on the calling thread. The first image's error, in the
    request's order, is the one raised; images not started by then are not decoded."""
    started = time.monotonic() if started is None else started
    total = len(images)
    if total < 2 or frame_decode_workers() < 2:
        out = []
        for i, image in enumerate(images):
            check_decode_budget(limits, started, done=i, total=total)
            out.append(decode_probed(image, i))
        return out
    done, lock = [0], threading.Lock()

    def one(i: int, image: ProbedImage):
        with lock:
            finished = done[0]
        check_decode_budget(limits, started, done=finished, total=total)
        decoded = decode_probed(image, i)
        with lock:
            done[0] += 1
        return decoded

    pool = _frame_pool()
    futures = [pool.submit(one, i, image) for i, image in enumerate(images)]
    try:
        return [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()


def frame_decode_workers() -> int:
    """Threads that decode the images of one request side by side: half the CPU cores, at most 8 (one on
    a 2-core machine, where the image workers already use the other core)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


_FRAME_POOL: Optional[ThreadPoolExecutor] = None
_FRAME_POOL_LOCK = threading.Lock()


def _frame_pool() -> ThreadPoolExecutor:
    global _FRAME_POOL
    with _FRAME_POOL_LOCK:
        if _FRAME_POOL is None:
            _FRAME_POOL = ThreadPoolExecutor(frame_decode_workers(), thread_name_prefix="vlora-frame-decode")
        return _FRAME_POOL


def check_decode_budget(limits: InputLimits, started: float, done: int, total: int) -> None:
    """Raise InvalidRequest when ``limits.image_decode_timeout_s`` has passed since ``started``."""
    elapsed = time.monotonic() - started
    if elapsed > limits.image_decode_timeout_s:
        raise InvalidRequest(f"images: decoding took {elapsed:.1f} s, over the limit of {limits.image_decode_timeout_s:g} s "
                             f"per request (limits.image_decode_timeout_s); {done} of {total} image(s) were done")


def _refusal(label: str, fmt: str, e: Exception) -> Exception:
    """What a failure inside Pillow means for the client: an InvalidRequest naming the image and the
    problem (InvalidRequest and MemoryError pass as they are)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(e, (InvalidRequest, MemoryError)):
        return e
    if isinstance(e, UnidentifiedImageError):
        return InvalidRequest(f"{label}: not a decodable image (cannot identify image file; "
                              f"accepted formats: {', '.join(ALLOWED_FORMATS)})")
    if isinstance(e, Image.DecompressionBombError):
        return InvalidRequest(f"{label}: over the pixel limit, refused as a possible decompression bomb ({e})")
    # any failure inside a decoder means the bytes are bad
    return InvalidRequest(f"{label}: corrupt or truncated {fmt} data ({e})")


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
    text = data.strip()
    if text[:5].lower() == b"data:":
        text = _DATA_URL.sub(b"", text, count=1)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:  # whitespace inside (line-wrapped base64): dropped in one C pass, then strictly decoded
        try:
            raw = base64.b64decode(text.translate(None, _WHITESPACE), validate=True)
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
