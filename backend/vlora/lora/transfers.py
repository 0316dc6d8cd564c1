"""Moving adapters between residency tiers without making the engine thread wait: AdapterLoader runs the
reads from disk (or memory) on daemon loader threads, SlotCopies runs the host-to-device copies into
adapter slots on a copy thread and a side CUDA stream, with one event per slot. LoraManager (manager.py)
drives both."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from vlora.lora.carve import aligned, carve_bytes


class _Copy:
    """One slot's copy on the copy thread: its data moves (``copy``) once the compute stream has passed
    ``after``; ``note`` (the slot's host-side bookkeeping) runs on the engine thread once it is complete."""

    __slots__ = ("copy", "note", "source", "after", "event", "issued", "error", "queued_at", "started_at", "enqueued_at",
                 "host_s", "wait_s", "h2d_s", "done")

    def __init__(self, copy: Callable[[], None], note: Optional[Callable[[], None]], source: Any, after: Any) -> None:
        self.copy, self.note, self.source, self.after = copy, note, source, after
        self.event: Optional[Any] = None  # recorded on the side stream after the copy
        self.issued = threading.Event()  # set once ``event`` is recorded (or the copy failed)
        self.error: Optional[BaseException] = None
        # perf_counter: queued by the engine thread, taken by the copy thread, every copy enqueued on the stream
        self.queued_at = time.perf_counter()
        self.started_at = self.enqueued_at = self.queued_at
        # of the enqueueing: the CPU copies into page-locked buffers, the waits for one, the calls that enqueue the
        # host-to-device copies
        self.host_s = self.wait_s = self.h2d_s = 0.0
        self.done: Optional[Callable[[], None]] = None  # on the engine thread once it completed or failed


class PinnedStager:
    """Host-to-device copies from pageable memory through a few page-locked buffers allocated once and reused,
    on the copy thread: each source is copied into the current buffer on the CPU, then from there to the device
    asynchronously on the side stream; a buffer is reused once the copies out of it have completed. A copy
    straight from pageable memory ran at 6.8 GB/s on an H200's host when alone, and at about 2 GB/s beside a
    serving engine and reading loaders; from page-locked memory at 55 GB/s. Sources larger than a buffer, and
    page-locked ones, are copied directly.

    SlotCopies sizes the buffers to hold a whole adapter (``nbytes``: a slot's bytes, up to its MAX_STAGE_BYTES),
    two of them: one adapter is then one CPU copy and one batch of device copies, and the next adapter fills the
    other buffer while the first one's copies run (with four 32 MiB buffers a rank-64 q/k/v/o adapter of 134 MB
    took about 25 calls that release the GIL; fewer calls did not shorten the copy thread's work, ~90 ms an
    adapter on an H200's busy host: benchmarks/NOTES.md)."""

    def __init__(self, buffers: int = 2, nbytes: int = 32 << 20) -> None:
        self.nbytes = nbytes
        self._bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
        self._done: list[Optional[Any]] = [None] * buffers  # the event after the last copy out of each buffer
        self._i = 0
        self._used = 0
        # seconds so far in the CPU copies into the buffers, in waits for a buffer's copies to leave it, and in the
        # calls that enqueue host-to-device copies (the copy thread's, through SlotCopies.put_pinned too)
        self.host_s = self.wait_s = self.h2d_s = 0.0

    def put_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """``dsts[i].copy_(srcs[i])`` for every i on the current (side) stream, sources on the host: a few batched
        calls per buffer filled (its views carved at once, the CPU copies into it, then the asynchronous copies
        out of it), not a few per tensor. Each call releases and takes back the GIL once; beside a busy engine
        thread a thread waits for it at every call, and an adapter's slot copy is 256 tensors (rank-64 q/k/v/o,
        32 layers). Whether a source is page-locked is asked once per storage (``is_pinned`` is such a call)."""
        direct: tuple[list, list] = ([], [])
        staged: tuple[list, list, list] = ([], [], [])  # destinations, sources, (offset, dtype, shape) in the buffer
        pinned: dict[int, bool] = {}  # storage address -> page-locked
        for dst, src in zip(dsts, srcs):
            n = src.numel() * src.element_size()
            if n == 0 or n > self.nbytes or src.device.type != "cpu" or not src.is_contiguous():
                direct[0].append(dst)
                direct[1].append(src)
                continue
            storage = src.untyped_storage().data_ptr()
            locked = pinned.get(storage)
            if locked is None:
                locked = pinned[storage] = src.is_pinned()
            if locked:
                direct[0].append(dst)
                direct[1].append(src)
                continue
            if self._used + n > self.nbytes:
                self._flush(*staged)
                self._next()
            staged[2].append((self._used, src.dtype, src.shape))
            staged[0].append(dst)
            staged[1].append(src)
            self._used += aligned(n)
        self._flush(*staged)
        if direct[0]:
            self.put_direct(direct[0], direct[1])

    def put_direct(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """The copies in one call, not staged (page-locked sources: asynchronous), timed as ``h2d_s``."""
        t0 = time.perf_counter()
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
        self.h2d_s += time.perf_counter() - t0

    def _flush(self, dsts: list, srcs: list, places: list) -> None:
        """The staged copies of the current buffer: into it on the CPU, then out of it to the device."""
        if places:
            views = carve_bytes(self._bufs[self._i], places)
            t0 = time.perf_counter()
            torch._foreach_copy_(views, srcs)
            self.host_s += time.perf_counter() - t0
            self.put_direct(dsts, views)
            for lst in (dsts, srcs, places):
                lst.clear()

    def _next(self) -> None:
        self.close_buffer()
        self._i = (self._i + 1) % len(self._bufs)
        done = self._done[self._i]
        if done is not None:
            t0 = time.perf_counter()
            done.synchronize()  # its copies have left it: it may be overwritten
            self.wait_s += time.perf_counter() - t0
            self._done[self._i] = None
        self._used = 0

    def close_buffer(self, event: Optional[Any] = None) -> None:
        """After the copies of one job: an event marks when the current buffer may be written again (``event``:
        one just recorded on the current stream, after those copies; None: one is recorded here)."""
        if self._used:
            if event is None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream())
            self._done[self._i] = event


class PinnedLanding:
    """Page-locked host memory where an adapter read from disk lands, on its loader thread, before its first copy
    into a slot: one range per adapter, taken by ``take`` and given back once that copy has completed.

    The host tier keeps its copies in pageable memory (SlotCopies says why), so a slot copy from it goes through
    the copy thread's staging: one CPU copy of the whole adapter on that one thread (about 80 ms for a 134 MB
    rank-64 q/k/v/o adapter on an H200's busy host), adapter after adapter; 32 cold adapters queued behind each
    other for a second. A landed copy is made by the loader threads, side by side, and its slot copy is
    asynchronous from page-locked memory. Allocated and page-locked once, at start (``nbytes``): page-locking
    fresh memory later would stall the engine's launches. A read that finds no room is served as before."""

    def __init__(self, nbytes: int, pin_memory: bool = True) -> None:
        self.nbytes = nbytes
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (start, size), sorted, coalesced
        self._lock = threading.Lock()

    @staticmethod
    def size_of(tensors: Sequence[torch.Tensor]) -> int:
        """The bytes ``land`` takes for ``tensors``: each starts aligned (vlora.lora.carve.ALIGN)."""
        return sum(aligned(t.numel() * t.element_size()) for t in tensors)

    def take(self, nbytes: int) -> Optional[int]:
        """The start of a free range of ``nbytes`` (first fit), or None when there is no room."""
        with self._lock:
            for i, (start, size) in enumerate(self._free):
                if size >= nbytes:
                    if size == nbytes:
                        del self._free[i]
                    else:
                        self._free[i] = (start + nbytes, size - nbytes)
                    return start
        return None

    def give(self, start: int, nbytes: int) -> None:
        """The range back, merged with its free neighbours."""
        with self._lock:
            free = self._free
            i = next((k for k, (s, _) in enumerate(free) if s > start), len(free))
            free.insert(i, (start, nbytes))
            if i + 1 < len(free) and start + nbytes == free[i + 1][0]:
                free[i] = (start, nbytes + free[i + 1][1])
                del free[i + 1]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
                free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
                del free[i]

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def land(self, start: int, srcs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``srcs`` (host tensors) in the range at ``start`` (``size_of(srcs)`` bytes), in a few calls
        (the views carved at once, then one copy)."""
        places, at = [], start
        for t in srcs:
            places.append((at, t.dtype, t.shape))
            at += aligned(t.numel() * t.element_size())
        some = [i for i, t in enumerate(srcs) if t.numel()]
        views: list[Optional[torch.Tensor]] = [None] * len(srcs)
        for i, v in zip(some, carve_bytes(self.buf, [places[i] for i in some])):
            views[i] = v
        for i, t in enumerate(srcs):
            if views[i] is None:
                views[i] = torch.empty(t.shape, dtype=t.dtype)
        if some:
            torch._foreach_copy_([views[i] for i in some], [srcs[i] for i in some])
        return views  # type: ignore[return-value]


class SlotCopies:
    """Host-to-device copies into adapter slots, off the engine thread: on CUDA a copy thread runs each
    slot's copies on a side stream and records an event; the engine thread only queues them and asks.

    ``issue`` queues a slot's copy (``copy``: the data; ``note``: the slot's host-side bookkeeping, run on the
    engine thread when the copy is complete); ``ready`` says (without blocking) whether it has completed;
    ``wait`` makes the compute stream wait for the copies into some slots. Off CUDA a copy and its note run
    at once and every slot is always ready.

    Why a thread: the host tier holds adapters in pageable memory (page-locking fresh memory ran at 1.7-2.2 GB/s
    on an H200's host, did not scale with threads, and stalled other threads' kernel launches for 17 ms at the
    median while it ran: 32 cold adapters took 6.9 s to their first tokens). A copy from pageable memory blocks
    the thread that issues it, at 6.8 GB/s there: that is the copy thread, never the engine's.
    """

    # The page-locked staging of the copy thread: two buffers, each a slot's bytes (one adapter) up to this.
    MAX_STAGE_BYTES = 256 << 20

    def __init__(self, device: Optional[torch.device], num_slots: int, stage_bytes: int = 32 << 20) -> None:
        """``stage_bytes``: what one adapter's copy stages (a slot's bytes; LoraManager says), for the size of the
        page-locked buffers, made here on CUDA (page-locking them at start, not at the first cold adapter)."""
        self.cuda = device is not None and device.type == "cuda"
        if self.cuda and device.index is None:  # the copy thread sets it as its device: it needs the index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._jobs: list[Optional[_Copy]] = [None] * num_slots
        self._queue: "queue.SimpleQueue[_Copy]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        # The copy thread's staging buffers (only that thread uses them).
        self.stager: Optional[PinnedStager] = (
            PinnedStager(buffers=2, nbytes=min(max(stage_bytes, 1 << 20), self.MAX_STAGE_BYTES))
            if self.cuda and num_slots > 0 else None)
        # Called on the engine thread with (slot, error) when a slot's copy failed: the slot holds nothing usable.
        self.on_failed: Optional[Callable[[int, BaseException], None]] = None
        # Called on the engine thread when a copy has completed, with its seconds in the copy thread's queue and the
        # seconds the thread took to enqueue it, and of those the CPU copies into the staging buffers, the waits for
        # one, and the calls enqueueing the host-to-device copies (the rest: the thread's own Python, GIL waits).
        self.on_timed: Optional[Callable[[float, float, float, float, float], None]] = None

    def put_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Inside an issued ``copy``: copy the host tensors ``srcs`` into the slot tensors ``dsts``, in a few batched
        calls (through the copy thread's page-locked buffers on CUDA: :meth:`PinnedStager.put_many`)."""
        if self.stager is None:
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
        else:
            self.stager.put_many(dsts, srcs)

    def put_pinned(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Inside an issued ``copy``: :meth:`put_many` for sources known to be page-locked and contiguous (a landed
        adapter, vlora.lora.transfers.PinnedLanding): asynchronous copies in one call, nothing staged."""
        if self.stager is None:
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
        else:
            self.stager.put_direct(dsts, srcs)

    def issue(self, slot: int, copy: Callable[[], None], source: Any, note: Optional[Callable[[], None]] = None,
              done: Optional[Callable[[], None]] = None) -> None:
        """``done``: run on the engine thread once the copy has completed or failed (what its sources may be
        given back to)."""
        if not self.cuda:
            try:
                copy()
                if note is not None:
                    try:
                        note()
                    except Exception as e:  # noqa: BLE001 - the copied values failed their check: as on CUDA,
                        # ready() reports it to on_failed, once the owner has recorded what the slot holds
                        failed = self._jobs[slot] = _Copy(copy, None, None, None)
                        failed.error = e
                        failed.issued.set()
            finally:
                if done is not None:
                    done()
            return
        # The side stream waits for work already queued on the compute stream: a step that read this slot's
        # previous adapter is ordered before the copy that overwrites it.
        after = torch.cuda.Event()
        after.record(torch.cuda.current_stream(self.device))
        job = _Copy(copy, note, source, after)
        job.done = done
        self._jobs[slot] = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="vlora-adapter-copies", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def _work(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            job = self._queue.get()
            job.started_at = time.perf_counter()
            stager = self.stager
            before = (stager.host_s, stager.wait_s, stager.h2d_s) if stager is not None else (0.0, 0.0, 0.0)
            try:
                self.stream.wait_event(job.after)
                with torch.cuda.stream(self.stream):
                    job.copy()
                job.event = self._mark(stager)
            except BaseException as e:  # the engine thread raises it from ready()
                job.error = e
                try:  # copies enqueued before the failure still read their sources and a staging buffer: ready()
                    # waits for them before the sources are given back (job.done), and the buffer is not reused sooner
                    job.event = self._mark(stager)
                except BaseException:  # a device that fails this too fails everything: nothing left to protect
                    pass
            job.enqueued_at = time.perf_counter()
            if stager is not None:
                job.host_s, job.wait_s, job.h2d_s = (stager.host_s - before[0], stager.wait_s - before[1],
                                                     stager.h2d_s - before[2])
            job.issued.set()

    def _mark(self, stager: Optional[PinnedStager]) -> Any:
        """Copy thread: an event on the side stream after everything enqueued so far; ``stager``'s current buffer
        may be written again once it has passed."""
        event = torch.cuda.Event()
        event.record(self.stream)
        if stager is not None:
            stager.close_buffer(event)
        return event

    def ready(self, slot: int) -> bool:
        job = self._jobs[slot]
        if job is None:
            return True
        if not job.issued.is_set() or (job.event is not None and not job.event.query()):
            return False
        self._jobs[slot] = None
        if job.done is not None:
            job.done()
        if self.on_timed is not None and self.cuda:
            self.on_timed(job.started_at - job.queued_at, job.enqueued_at - job.started_at, job.host_s, job.wait_s,
                          job.h2d_s)
        if job.error is not None:  # the slot is free again, and holds nothing: its owner forgets it
            if self.on_failed is None:
                raise RuntimeError(f"copying an adapter into slot {slot} failed: {job.error}") from job.error
            self.on_failed(slot, job.error)
            return True
        if job.note is not None:
            try:
                job.note()
            except Exception as e:  # noqa: BLE001 - the copied values failed their check: as a failed copy's error
                if self.on_failed is None:
                    raise
                self.on_failed(slot, e)
        return True

    def synchronize(self) -> None:
        """Block until every copy issued so far has completed (the blocking ``acquire``)."""
        for slot, job in enumerate(self._jobs):
            if job is not None:
                job.issued.wait()
                if job.event is not None:
                    job.event.synchronize()
                self.ready(slot)

    @property
    def in_flight(self) -> bool:
        return any(j is not None for j in self._jobs)

    def wait(self, slots: Iterable[int]) -> None:
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        for slot in set(slots):
            job = self._jobs[slot] if slot is not None and slot >= 0 else None
            if job is not None:  # a step reads only ready slots; never reached, kept for safety
                job.issued.wait()
                if job.event is not None:
                    compute.wait_event(job.event)


class AdapterLoader:
    """Adapter reads on daemon worker threads, at most ``max_workers`` of them, started as needed.

    A worker that never comes back (a hung disk, a check that runs away) holds only itself: the next
    read starts another worker while fewer than ``max_workers`` are busy, and no worker keeps the
    process from exiting (a ThreadPoolExecutor joins its threads at exit).
    """

    def __init__(self, max_workers: int = 4, name: str = "vlora-adapter-loader") -> None:
        self.max_workers = max_workers
        self.name = name
        self._lock = threading.Lock()
        self._tasks: "queue.SimpleQueue[Optional[tuple[Future, Callable, tuple]]]" = queue.SimpleQueue()
        self._workers = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the adapter loader is closed")
            self._tasks.put((fut, fn, args))
            if self._idle == 0 and self._workers < self.max_workers:
                self._workers += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._workers}", daemon=True).start()
            else:
                self._idle = max(0, self._idle - 1)
        return fut

    def shutdown(self) -> None:
        """Drop queued reads (their futures are cancelled); reads in progress finish."""
        with self._lock:
            self._closed = True
            workers = self._workers
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(workers):
            self._tasks.put(None)

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)
            # An idle worker holds nothing of its last task: its future's result is an adapter's weights, which the
            # host tier may evict meanwhile.
            item = fut = fn = args = None
            with self._lock:
                self._idle += 1

