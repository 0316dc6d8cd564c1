"""Image decoding: every bad input is an InvalidRequest that names the image and the problem."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from vlora.config import InputLimits
from vlora.engine.api import InvalidRequest
from vlora.models.images import (
    MAX_ASPECT_RATIO,
    decode_base64_image,
    decode_image,
    image_bytes_from_input,
    pixel_values,
)

LIMITS = InputLimits()


def _encode(fmt: str, size=(40, 30), mode="RGB", color=(200, 20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode != "P" else 3).save(buf, fmt)
    return buf.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming width x height, with a token IDAT: cheap to build, and
    a decompression bomb if anything tried to allocate its pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_common_formats_decode_to_rgb(fmt):
    img = decode_image(_encode(fmt, mode="P" if fmt == "GIF" else "RGB"), LIMITS, index=1)
    assert img.mode == "RGB" and img.size == (40, 30)


def test_alpha_and_greyscale_become_rgb():
    assert decode_image(_encode("PNG", mode="RGBA", color=(1, 2, 3, 4)), LIMITS).mode == "RGB"
    assert decode_image(_encode("PNG", mode="L", color=128), LIMITS).mode == "RGB"


def test_empty_bytes():
    with pytest.raises(InvalidRequest, match="^image 2: empty$"):
        decode_image(b"", LIMITS, index=2)


def test_not_an_image():
    with pytest.raises(InvalidRequest, match=r"^image 2: not a decodable image \(cannot identify image file"):
        decode_image(b"this is plain text, not an image" * 4, LIMITS, index=2)


def test_truncated_png():
    data = _encode("PNG", size=(64, 64), color=(1, 2, 3))
    with pytest.raises(InvalidRequest, match="^image 1: corrupt or truncated PNG"):
        decode_image(data[: len(data) // 2], LIMITS, index=1)


def test_corrupted_png_checksum():
    data = bytearray(_encode("PNG", size=(64, 64)))
    idat = data.index(b"IDAT")
    data[idat + 8] ^= 0xFF  # flip a byte of compressed data; the chunk CRC no longer matches
    with pytest.raises(InvalidRequest, match="^image 3: corrupt or truncated"):
        decode_image(bytes(data), LIMITS, index=3)


def test_truncated_jpeg():
    data = _encode("JPEG", size=(64, 64))
    with pytest.raises(InvalidRequest, match="^image: "):
        decode_image(data[: len(data) // 3], LIMITS)


def test_decompression_bomb_is_refused_from_the_header():
    with pytest.raises(InvalidRequest, match=r"^image 1: .*(pixel limit|over the limit)"):
        decode_image(_png_header_only(20000, 20000), LIMITS, index=1)


def test_pixel_limit_is_per_call():
    data = _png_header_only(5000, 5000)  # 25 M pixels: under Pillow's own threshold, over ours
    with pytest.raises(InvalidRequest, match=r"5000x5000 pixels is over the limit of 16777216 pixels"):
        decode_image(data, LIMITS)
    small = InputLimits(max_image_pixels=64 * 64)
    with pytest.raises(InvalidRequest, match="over the limit of 4096 pixels"):
        decode_image(_encode("PNG", size=(65, 64)), small)
    assert decode_image(_encode("PNG", size=(64, 64)), small).size == (64, 64)


def test_pillow_global_settings_are_left_alone():
    from PIL import ImageFile

    before = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)
    decode_image(_encode("PNG"), InputLimits(max_image_pixels=64 * 64))
    with pytest.raises(InvalidRequest):
        decode_image(_png_header_only(20000, 20000), LIMITS)
    assert (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES) == before


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(InvalidRequest, match=f"aspect ratio over {MAX_ASPECT_RATIO}:1"):
        decode_image(_png_header_only(1, 5000), LIMITS)


def test_oversized_bytes():
    limits = InputLimits(max_image_bytes=2048)
    big = _encode("BMP", size=(40, 40))  # BMP is uncompressed: 40*40*3 + header > 2048 bytes
    with pytest.raises(InvalidRequest, match=rf"^image 4: {len(big)} bytes is over the limit of 2048 bytes"):
        decode_image(big, limits, index=4)


def test_formats_outside_the_allow_list_are_not_opened():
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(InvalidRequest, match="not a decodable image"):
        decode_image(eps, LIMITS)
    with pytest.raises(InvalidRequest, match="not a decodable image"):
        decode_image(_encode("TIFF"), LIMITS)


def test_base64_variants():
    raw = _encode("PNG")
    b64 = base64.b64encode(raw)
    for data in (raw, b64, b64.decode(), b"data:image/png;base64," + b64, "data:image/png;base64," + b64.decode(),
                 b64[:20] + b"\n" + b64[20:] + b"\n", b"DATA:image/PNG;base64," + b64[:10] + b"\r\n\t \x0b" + b64[10:]):
        assert image_bytes_from_input(data, LIMITS) == raw
        assert decode_base64_image(data, LIMITS, index=1).size == (40, 30)
    jpeg = _encode("JPEG")
    assert image_bytes_from_input(jpeg, LIMITS) == jpeg


def test_bad_base64():
    with pytest.raises(InvalidRequest, match="^image 2: neither an encoded image nor valid base64 text"):
        decode_base64_image(b"@@@ not base64 @@@", LIMITS, index=2)
    with pytest.raises(InvalidRequest, match="^image 1: empty"):
        decode_base64_image("", LIMITS, index=1)
    with pytest.raises(InvalidRequest, match="non-ASCII"):
        decode_base64_image("ümlaut", LIMITS)
    with pytest.raises(InvalidRequest, match="not a decodable image"):  # valid base64 of junk
        decode_base64_image(base64.b64encode(b"junk" * 10), LIMITS, index=1)


def test_base64_too_long_is_refused_before_decoding():
    limits = InputLimits(max_image_bytes=1024)
    with pytest.raises(InvalidRequest, match="of base64 is over the limit of 1024 decoded bytes"):
        image_bytes_from_input(b"A" * 4096, limits)


def test_pixel_values_shape():
    from vlora.models.tiny import preprocessor_config

    import transformers

    processor = transformers.CLIPImageProcessor(**{k: v for k, v in preprocessor_config().items()
                                                    if k != "image_processor_type"})
    images = [decode_image(_encode("PNG", size=(100, 50)), LIMITS), decode_image(_encode("JPEG", size=(30, 90)), LIMITS)]
    pv = pixel_values(images, processor)
    assert pv.shape == (2, 3, 64, 64) and pv.dtype.is_floating_point
    with pytest.raises(ValueError):
        pixel_values([], processor)


def test_an_rgb_image_is_decoded_into_one_image_and_sent_without_a_copy():
    """An RGB JPEG or PNG is decoded into one Pillow image (no convert("RGB") copy of its pixels), and its pixels
    go to a tensor without another Pillow image; other modes are still converted, once."""
    import numpy as np

    from vlora.models import pixels

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    for fmt in ("JPEG", "PNG"):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
        with Image.open(io.BytesIO(buf.getvalue())) as ref:
            expected = np.asarray(ref.convert("RGB"))
        Image.core.reset_stats()
        img = decode_image(buf.getvalue(), LIMITS)
        assert Image.core.get_stats()["new_count"] == 1, fmt  # the decode's own image, no copy of it
        t = pixels.to_device(img, pixels.torch.device("cpu"))
        assert Image.core.get_stats()["new_count"] == 1, fmt
        assert img.mode == "RGB" and t.shape == (48, 64, 3) and (t.numpy() == expected).all(), fmt
    grey = decode_image(_encode("PNG", mode="L", color=128), LIMITS)
    assert grey.mode == "RGB" and (pixels.to_device(grey, pixels.torch.device("cpu")) == 128).all()
    t = pixels.to_device(Image.new("L", (8, 4), 7), pixels.torch.device("cpu"))  # not RGB: converted here
    assert t.shape == (4, 8, 3) and (t == 7).all()
