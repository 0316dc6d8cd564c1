"""The image workers: a bounded pool of threads for the costly part of admission (decoding and
preprocessing a request's images), so that Triton's request thread returns at once and a heavy request
delays only itself.

Threads, not processes: Pillow's decoders and the image processor's array work release the GIL (a thread
that wakes every millisecond next to a 4096x4096 PNG decode saw gaps of at most 8 ms, one switch
interval), and the results (PIL images, tensors) stay in this process with no copy. A decode cannot be
interrupted, so each request's decode time is bounded by ``limits.image_decode_timeout_s`` checked
between its images (``vlora.models.images.decode_images``), and the number of decodes at once by the
number of workers.

A bounded queue stands in front of the workers: ``submit`` refuses with EngineOverloaded (the engine's
own back-pressure error, which the Triton model answers as UNAVAILABLE) when it is full; nothing is
dropped silently. ``shutdown`` refuses what still waits (each job's ``refuse`` gets the reason) and
joins the workers, which finish the job they hold.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from typing import Callable, Sequence

from vlora.engine.api import EngineOverloaded
from vlora.models.images import drop_image_blocks

log = logging.getLogger(__name__)


class PreprocessPool:
    def __init__(self, workers: int, max_queued: int, name: str = "vlora-images") -> None:
        if workers < 1 or max_queued < 1:
            raise ValueError(f"PreprocessPool: workers={workers} and max_queued={max_queued} must be >= 1")
        self.max_queued = max_queued
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], None], Callable[[str], None]]] = deque()
        self._busy = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    def load(self) -> tuple[int, int]:
        """(jobs running, jobs queued)."""
        with self._cond:
            return self._busy, len(self._jobs)

    def submit(self, run: Callable[[], None], refuse: Callable[[str], None]) -> None:
        """Queue ``run()`` for a worker; ``refuse(reason)`` is called instead if the pool shuts down before
        it starts. Raises EngineOverloaded when ``max_queued`` jobs already wait, or after shutdown."""
        with self._cond:
            if self._closed:
                raise EngineOverloaded("server is shutting down")
            if len(self._jobs) >= self.max_queued:
                raise EngineOverloaded(f"server overloaded: {len(self._jobs)} image requests already wait for "
                                       f"decoding (limits.image_queue_size={self.max_queued})")
            self._jobs.append((run, refuse))
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse the queued jobs ("server is shutting down"), let the running ones finish (``timeout`` for
        all), and join the workers."""
        with self._cond:
            self._closed = True
            queued, self._jobs = list(self._jobs), deque()
            self._cond.notify_all()
        for _, refuse in queued:
            try:
                refuse("server is shutting down")
            except Exception:
                log.exception("refusing a queued image request failed")
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                run, _ = self._jobs.popleft()
                self._busy += 1
            try:
                run()
            except Exception:  # a job answers its own client; what escapes it must not end the worker
                log.exception("an image request's job failed")
            finally:
                run = None  # the job holds its request's images: not kept while this worker waits for the next
                with self._cond:
                    self._busy -= 1


def image_bytes(encoded: Sequence, probed: Sequence) -> int:
    """What a request's images count against limits.max_inflight_image_bytes: each image's encoded bytes as
    sent (base64) and once decoded from it, plus 4 bytes per pixel of its header's size (the decoded image)."""
    sent = sum(len(item) for item in encoded)
    return sent + sum(len(p.data) + 4 * p.pixels for p in probed)


class ImageBudget:
    """The bytes of images in flight (limits.max_inflight_image_bytes): ``take`` charges a request's images
    when it is admitted, or refuses it with EngineOverloaded when the total would pass the budget (a request
    is always taken when nothing else is charged, so a request within the other limits can run); the
    :class:`ImageCharge` it returns gives them back once (``release``).

    After a burst, once nothing is charged, glibc is asked to return freed memory to the system
    (``malloc_trim``, which trims every arena, the image workers' too; on a timer thread, at most once a
    second, and once more ``TRIM_AGAIN_S`` later for what the last requests' threads let go of after their
    final answer): the decoded images of a flood are freed into the allocator's arenas, which otherwise keep
    the process's resident memory at its peak; so are the image blocks that Pillow keeps for the next images
    (vlora.models.images.keep_image_blocks). With ``collect`` (the Triton model sets it once it has frozen its
    startup objects out of the collector, so a full collection is cheap) Python's cyclic garbage collector
    runs first: memory that only it can free (objects in reference cycles) is then trimmed too."""

    TRIM_AFTER_BYTES = 32 << 20  # released since the last trim
    TRIM_DELAY_S = 0.2
    TRIM_AGAIN_S = 2.0

    def __init__(self, limit: int, collect: bool = False) -> None:
        self.limit = limit
        self.collect = collect
        self._lock = threading.Lock()
        self._used = 0
        self._released = 0  # since the last trim
        self._trim_pending = False
        self._last_trim = 0.0

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def take(self, n: int) -> "ImageCharge":
        if n <= 0:
            return ImageCharge(self, 0)
        with self._lock:
            if self._used and self._used + n > self.limit:
                raise EngineOverloaded(f"server overloaded: {self._used / 2**20:.0f} MiB of images are in flight and "
                                       f"this request's take {n / 2**20:.1f} MiB more "
                                       f"(limits.max_inflight_image_bytes={self.limit})")
            self._used += n
        return ImageCharge(self, n)

    def refused(self, n: int) -> None:
        """``n`` bytes of a request's images that were never charged (the request was refused before it was
        admitted: a bad request, or the budget was full): freed all the same, they count toward the trim."""
        if n > 0:
            self._give_back(n, charged=False)

    def _give_back(self, n: int, charged: bool = True) -> None:
        with self._lock:
            if charged:
                self._used -= n
            self._released += n
            trim = (not self._used and self._released >= self.TRIM_AFTER_BYTES and not self._trim_pending)
            if trim:
                self._trim_pending = True
        if trim:
            delay = max(self.TRIM_DELAY_S, self._last_trim + 1.0 - time.monotonic())
            timer = threading.Timer(delay, self._trim)
            timer.daemon = True
            timer.start()

    def _trim(self, again: bool = True) -> None:
        with self._lock:
            if again:
                self._trim_pending = False
            elif self._trim_pending:  # another burst has ended meanwhile: its own trim follows
                return
            if self._used:  # another burst began: trim after it
                return
            self._released = 0
            self._last_trim = time.monotonic()
        if self.collect:
            gc.collect()
        drop_image_blocks()  # the blocks Pillow keeps for the next images (keep_image_blocks), then the heap
        malloc_trim()
        if again:
            timer = threading.Timer(self.TRIM_AGAIN_S, self._trim, kwargs={"again": False})
            timer.daemon = True
            timer.start()


class ImageCharge:
    """One request's images on an ImageBudget; ``release`` is idempotent and thread-safe."""

    def __init__(self, budget: ImageBudget, n: int) -> None:
        self._budget = budget
        self.bytes = n
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            n, self.bytes = self.bytes, 0
        if n:
            self._budget._give_back(n)


def malloc_trim() -> bool:
    """glibc's malloc_trim(0): give freed heap memory back to the system. False where there is no glibc."""
    global _LIBC
    try:
        if _LIBC is None:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
        return bool(_LIBC.malloc_trim(0))
    except (OSError, AttributeError):
        return False


_LIBC = None
