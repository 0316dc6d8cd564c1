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

import logging
import threading
import time
from collections import deque
from typing import Callable

from vlora.engine.api import EngineOverloaded

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
                with self._cond:
                    self._busy -= 1
