"""Moving adapters between residency tiers without making the engine thread wait: AdapterLoader runs the
reads from disk (or memory) on daemon loader threads, SlotCopies issues the host-to-device copies into
adapter slots on a side CUDA stream with one event per slot. LoraManager (manager.py) drives both."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Optional

import torch


class SlotCopies:
    """Host-to-device copies into adapter slots: on a side CUDA stream with one event per slot.

    ``issue`` queues a slot's copy; ``ready`` says (without blocking) whether it has completed;
    ``wait`` makes the compute stream wait for the copies into some slots. Off CUDA a copy runs at
    once and every slot is always ready.
    """

    def __init__(self, device: Optional[torch.device], num_slots: int) -> None:
        self.device = device
        self.cuda = device is not None and device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._events: list[Optional[Any]] = [None] * num_slots
        self._sources: list[Any] = [None] * num_slots  # the host copy stays referenced until its copy is done

    def issue(self, slot: int, copy: Callable[[], None], source: Any) -> None:
        if not self.cuda:
            copy()
            return
        # The side stream first waits for work already queued on the compute stream: a step that
        # read this slot's previous adapter is ordered before the copy that overwrites it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copy()
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[slot] = event
        self._sources[slot] = source

    def ready(self, slot: int) -> bool:
        event = self._events[slot]
        if event is None:
            return True
        if not event.query():
            return False
        self._events[slot] = None
        self._sources[slot] = None
        return True

    def synchronize(self) -> None:
        """Block until every copy issued so far has completed (the blocking ``acquire``)."""
        for slot, event in enumerate(self._events):
            if event is not None:
                event.synchronize()
                self.ready(slot)

    @property
    def in_flight(self) -> bool:
        return any(e is not None for e in self._events)

    def wait(self, slots: Iterable[int]) -> None:
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        for slot in set(slots):
            event = self._events[slot] if slot is not None and slot >= 0 else None
            if event is not None:
                compute.wait_event(event)


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
            with self._lock:
                self._idle += 1

