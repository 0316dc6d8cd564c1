"""Per-request image budgets (total pixels from the headers, decode time) and the image workers' bounded
pool: refusals name the limit, nothing is decoded before the pixel check, a full queue is an explicit
overload, and shutdown refuses what still waits."""
from __future__ import annotations

import io
import struct
import threading
import time
import zlib

import pytest
from PIL import Image

from vlora.config import EngineConfig, InputLimits
from vlora.engine.api import EngineOverloaded, GenerationRequest, InvalidRequest
from vlora.engine.preprocess import PreprocessPool
from vlora.models.images import decode_images, probe_images


def _png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming width x height, with a token IDAT: decoding it fails."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _solid_png(size: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (20, 200, 40)).save(buf, "PNG")
    return buf.getvalue()


def test_total_pixels_are_checked_from_the_headers_before_any_decode():
    limits = InputLimits(max_total_pixels=3 * 1000 * 1000)
    # Header-only PNGs: decoding any of them would fail as truncated, so the refusal below proves that
    # the budget was checked from the headers alone.
    bombs = [_png_header_only(1000, 1000) for _ in range(4)]
    with pytest.raises(InvalidRequest, match=r"^images: 4000000 pixels in all \(1000x1000, 1000x1000, 1000x1000, "
                                             r"1000x1000\) is over the limit of 3000000 pixels per request "
                                             r"\(limits.max_total_pixels\)$"):
        probe_images(bombs, limits)
    probed = probe_images(bombs[:3], limits)  # at the limit: accepted, and not decoded yet
    assert [(p.width, p.height, p.format) for p in probed] == [(1000, 1000, "PNG")] * 3
    with pytest.raises(InvalidRequest, match="^image 0: corrupt or truncated PNG"):
        decode_images(probed, limits)


def test_per_image_checks_still_come_first():
    limits = InputLimits(max_total_pixels=10 ** 9)
    with pytest.raises(InvalidRequest, match="^image 1: 5000x5000 pixels is over the limit of 16777216 pixels"):
        probe_images([_solid_png(8), _png_header_only(5000, 5000)], limits)
    with pytest.raises(InvalidRequest, match="^image 0: neither an encoded image nor valid base64 text"):
        probe_images([b"@@@"], limits)


def test_decoding_past_the_time_budget_refuses_the_request():
    heavy = _solid_png(2048)  # 4 M pixels: tens of milliseconds to decode
    limits = InputLimits(image_decode_timeout_s=0.001)
    probed = probe_images([heavy] * 4, limits)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"^images: decoding took \d+\.\d s, over the limit of 0.001 s per "
                                             r"request \(limits.image_decode_timeout_s\); [0-3] of 4 image\(s\) were done$"):
        decode_images(probed, limits)
    one_image = time.monotonic() - t0
    decode_images(probed[:1], InputLimits())  # within the default budget
    assert [im.size for im in decode_images(probed, InputLimits())] == [(2048, 2048)] * 4
    assert one_image < 5, "the refusal came after more than the first image"


def test_the_input_processor_checks_budgets_before_decoding(tiny_model_dir, demo_adapter_root):
    from vlora.engine.builder import build_engine

    cfg = EngineConfig().with_overrides({"model.path": str(tiny_model_dir), "model.device": "cpu",
                                         "lora.adapter_root": str(demo_adapter_root), "lora.max_rank": "32",
                                         "limits.max_total_pixels": str(64 * 64 * 2)})
    inputs = build_engine(cfg).inputs
    small = _solid_png(64)
    checked = inputs.check(GenerationRequest("ok", "Describe <image> and <image>.", images=[small, small]))
    assert checked.pixels == 2 * 64 * 64
    prepared = inputs.preprocess(checked)
    assert prepared.pixel_values.shape[0] == 2 and len(prepared.image_keys) == 2
    with pytest.raises(InvalidRequest, match="limits.max_total_pixels"):
        inputs.check(GenerationRequest("big", "Describe these.", images=[small] * 3))


def test_the_pool_refuses_beyond_its_queue_and_at_shutdown():
    pool = PreprocessPool(workers=1, max_queued=2)
    gate = threading.Event()
    started = threading.Event()
    ran: list[str] = []
    refused: list[tuple[str, str]] = []

    def job(name, block=False):
        def run():
            started.set()
            if block:
                gate.wait(10)
            ran.append(name)
        return run, lambda reason: refused.append((name, reason))

    pool.submit(*job("running", block=True))
    assert started.wait(5)
    pool.submit(*job("q1"))
    pool.submit(*job("q2"))
    with pytest.raises(EngineOverloaded, match=r"server overloaded: 2 image requests already wait .*image_queue_size=2"):
        pool.submit(*job("q3"))
    assert pool.load() == (1, 2)
    closer = threading.Thread(target=pool.shutdown, args=(10.0,))
    closer.start()
    deadline = time.monotonic() + 10  # the shutdown refuses the queued jobs before it waits for the running one
    while len(refused) < 2:
        assert time.monotonic() < deadline, refused
        time.sleep(0.01)
    gate.set()  # the running job finishes; the queued ones were refused, none dropped silently
    closer.join(10)
    assert ran == ["running"]
    assert refused == [("q1", "server is shutting down"), ("q2", "server is shutting down")]
    with pytest.raises(EngineOverloaded, match="shutting down"):
        pool.submit(*job("late"))


def test_a_failing_job_does_not_end_its_worker():
    pool = PreprocessPool(workers=1, max_queued=4)
    done = threading.Event()

    def boom():
        raise RuntimeError("boom")

    pool.submit(boom, lambda reason: None)
    pool.submit(done.set, lambda reason: None)
    assert done.wait(5)
    pool.shutdown(5)


def test_a_worker_keeps_no_finished_job():
    """A job holds its request's images: an idle worker must not keep the last one (it kept 28 MB of base64 and
    decoded bytes after every image request, until the next one came)."""
    import weakref

    class Images:
        pass

    pool = PreprocessPool(workers=1, max_queued=4)
    images, ran = Images(), threading.Event()
    gone = weakref.ref(images)
    pool.submit(lambda held=images: ran.set(), lambda reason: None)
    del images
    assert ran.wait(5)
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone() is None, "the idle worker still holds its last job"
    pool.shutdown(5)


def test_frames_are_decoded_side_by_side_in_order(monkeypatch):
    """With several decode workers, a request's images come back in their order, equal to one-by-one
    decoding, and the first bad image (in the request's order) is the error raised."""
    import vlora.models.images as images

    frames = [_solid_png(64 + 8 * i) for i in range(6)]
    limits = InputLimits()
    probed = probe_images(frames, limits)
    monkeypatch.setattr(images, "frame_decode_workers", lambda: 1)
    serial = [im.tobytes() for im in decode_images(probed, limits)]
    monkeypatch.setattr(images, "frame_decode_workers", lambda: 3)
    monkeypatch.setattr(images, "_FRAME_POOL", None)
    assert [im.tobytes() for im in decode_images(probed, limits)] == serial
    bad = probe_images(frames[:2] + [_png_header_only(100, 100)] * 2 + frames[2:], limits)
    with pytest.raises(InvalidRequest, match="^image 2: corrupt or truncated PNG"):
        decode_images(bad, limits)


def test_the_in_flight_budget_charges_refuses_and_trims_after_a_burst(monkeypatch):
    """limits.max_inflight_image_bytes: a request that would pass the budget is refused unless nothing else is
    charged; once nothing is charged after a burst (admitted or refused bytes alike), the garbage collector
    (with ``collect``) and glibc's malloc_trim run on a timer, and once more a little later."""
    from vlora.engine import preprocess

    calls: list[str] = []
    monkeypatch.setattr(preprocess, "malloc_trim", lambda: calls.append("trim"))
    monkeypatch.setattr(preprocess.gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(preprocess.ImageBudget, "TRIM_DELAY_S", 0.01)
    monkeypatch.setattr(preprocess.ImageBudget, "TRIM_AGAIN_S", 0.05)
    mib = 1 << 20
    budget = preprocess.ImageBudget(40 * mib, collect=True)
    first = budget.take(30 * mib)
    with pytest.raises(EngineOverloaded, match="limits.max_inflight_image_bytes"):
        budget.take(20 * mib)
    budget.refused(20 * mib)
    time.sleep(0.2)
    assert calls == [] and budget.used == 30 * mib  # still charged: no trim inside a burst
    first.release()
    first.release()  # idempotent

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 5
        while len(calls) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)

    wait_for(4)
    assert budget.used == 0 and calls == ["collect", "trim"] * 2
    alone = budget.take(100 * mib)  # over the budget, but nothing else in flight: taken
    assert budget.used == 100 * mib
    alone.release()  # trimmed again, at most once a second
    wait_for(8)
    assert calls == ["collect", "trim"] * 4


def test_freed_image_blocks_are_kept_for_the_next_images_until_the_budget_trims(monkeypatch):
    """keep_image_blocks (the AsyncEngine's): a new image is decoded into the block of a freed one, where Pillow's
    default gives every block back to malloc (in the server an mmap of its own, faulted in again by each new image);
    the image budget's trim after a burst frees the kept blocks, and the setting is never lowered."""
    import numpy as np

    from vlora.engine import preprocess
    from vlora.models.images import decode_image, keep_image_blocks

    monkeypatch.setattr(preprocess, "malloc_trim", lambda: True)
    monkeypatch.setattr(preprocess.ImageBudget, "TRIM_DELAY_S", 0.01)
    monkeypatch.setattr(preprocess.ImageBudget, "TRIM_AGAIN_S", 60.0)
    rng = np.random.default_rng(1)
    jpegs = []
    for _ in range(3):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(480, 640, 3), dtype=np.uint8)).save(buf, "JPEG")
        jpegs.append(buf.getvalue())
    limits = InputLimits()
    before = Image.core.get_blocks_max()
    try:
        Image.core.set_blocks_max(0)
        Image.core.clear_cache()
        Image.core.reset_stats()
        for data in jpegs:
            assert decode_image(data, limits).size == (640, 480)  # freed at once
        stats = Image.core.get_stats()
        assert (stats["allocated_blocks"], stats["reused_blocks"], stats["blocks_cached"]) == (3, 0, 0)  # the default
        keep_image_blocks(4)
        keep_image_blocks(2)
        assert Image.core.get_blocks_max() == 4
        Image.core.reset_stats()
        for data in jpegs:
            assert decode_image(data, limits).size == (640, 480)
        stats = Image.core.get_stats()
        assert (stats["allocated_blocks"], stats["reused_blocks"], stats["blocks_cached"]) == (1, 2, 1)
        budget = preprocess.ImageBudget(64 << 20)
        budget.take(40 << 20).release()  # a burst's worth released with nothing in flight: the trim
        deadline = time.monotonic() + 5
        while Image.core.get_stats()["blocks_cached"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Image.core.get_stats()["blocks_cached"] == 0
    finally:
        Image.core.set_blocks_max(before)
        Image.core.clear_cache()
