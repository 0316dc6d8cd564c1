"""The routing board: one fixed-size record per engine model in a small file that every process of the server
maps into memory. Each engine writes its own record a few times a second (:class:`BoardWriter`, driven by
:class:`vlora.server.routing.engine_side.BoardPublisher`); the router instances read all of them
(:class:`BoardReader`) before each placement.

A record is a sequence lock and a JSON payload: ``seq`` (u64), ``length`` (u64), then ``length`` bytes of JSON.
The writer makes ``seq`` odd, writes the payload and its length, and makes ``seq`` even again; a reader takes a
record only when it read the same even ``seq`` before and after the payload, so it never parses a half-written
one, and it parses a record again only when its ``seq`` moved. The payload's time is ``time.monotonic()``, the
same clock in every process of one host: a record older than the reader's ``stale_s`` belongs to an engine that
stopped publishing, and the policy skips it.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

RECORD_BYTES = 64 * 1024  # per engine; a multiple of the page size (mmap offsets must be)
HEADER = struct.Struct("<QQ")  # seq, length
MAX_PAYLOAD = RECORD_BYTES - HEADER.size
MAX_NAMES = 256  # adapter names listed per field: the payload stays far below MAX_PAYLOAD (names are <= 128 chars)


@dataclass(frozen=True)
class EngineLoad:
    """What one engine published: its time, its adapters and its load."""

    t: float  # time.monotonic() when published
    resident: frozenset = frozenset()  # adapters in device slots
    loading: frozenset = frozenset()  # adapters with requests here that are not in a slot yet (or just admitted)
    active: int = 0  # adapters with running or waiting requests here
    running: int = 0
    waiting: int = 0
    kv: float = 0.0  # KV cache blocks held, 0 to 1
    slots: int = 0  # device slots (lora.max_gpu_adapters)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def depth(self) -> int:
        """Queue depth: requests running or waiting in this engine."""
        return self.running + self.waiting

    def has(self, adapter: str) -> bool:
        return adapter in self.resident or adapter in self.loading

    def to_payload(self) -> bytes:
        body = {"t": self.t, "resident": sorted(self.resident)[:MAX_NAMES], "loading": sorted(self.loading)[:MAX_NAMES],
                "active": self.active, "running": self.running, "waiting": self.waiting, "kv": round(self.kv, 4),
                "slots": self.slots}
        return json.dumps(body, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_payload(cls, data: bytes) -> "EngineLoad":
        body = json.loads(data)
        return cls(t=float(body["t"]), resident=frozenset(body.get("resident", ())),
                   loading=frozenset(body.get("loading", ())), active=int(body.get("active", 0)),
                   running=int(body.get("running", 0)), waiting=int(body.get("waiting", 0)),
                   kv=float(body.get("kv", 0.0)), slots=int(body.get("slots", 0)))


def create_board(path: Path, engines: int) -> Path:
    """A zeroed board for ``engines`` records, readable and writable by this user only."""
    if engines < 1:
        raise ValueError("a routing board needs at least one engine")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, engines * RECORD_BYTES)
    finally:
        os.close(fd)
    return path


class BoardWriter:
    """One engine's record on the board (one writer per record)."""

    def __init__(self, path: Path, slot: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if slot < 0 or (slot + 1) * RECORD_BYTES > size:
                raise ValueError(f"routing board {path} has no record {slot} ({size} bytes)")
            self._map = mmap.mmap(fd, RECORD_BYTES, offset=slot * RECORD_BYTES)
        finally:
            os.close(fd)
        self._seq = HEADER.unpack_from(self._map, 0)[0] & ~1

    def publish(self, load: EngineLoad) -> None:
        payload = load.to_payload()
        if len(payload) > MAX_PAYLOAD:  # never with MAX_NAMES names; keep the load, drop the names
            payload = EngineLoad(t=load.t, active=load.active, running=load.running, waiting=load.waiting,
                                 kv=load.kv, slots=load.slots).to_payload()
        m = self._map
        struct.pack_into("<Q", m, 0, self._seq + 1)  # odd: being written
        m[HEADER.size:HEADER.size + len(payload)] = payload
        struct.pack_into("<Q", m, 8, len(payload))
        self._seq += 2
        struct.pack_into("<Q", m, 0, self._seq)

    def close(self) -> None:
        self._map.close()


class BoardReader:
    """Every engine's latest record, parsed again only when it changed."""

    def __init__(self, path: Path, engines: int, stale_s: float = 2.0) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = engines * RECORD_BYTES
            if os.fstat(fd).st_size < size:
                raise ValueError(f"routing board {path} is smaller than {engines} records")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.engines = engines
        self.stale_s = stale_s
        self._cache: list[tuple[int, Optional[EngineLoad]]] = [(0, None)] * engines

    def read(self, now: Optional[float] = None) -> list[Optional[EngineLoad]]:
        """One entry per engine: its load, or None when it has not published, is being written right now and
        was never read before, or stopped publishing ``stale_s`` ago."""
        now = time.monotonic() if now is None else now
        out: list[Optional[EngineLoad]] = []
        for i in range(self.engines):
            load = self._record(i)
            out.append(load if load is not None and now - load.t <= self.stale_s else None)
        return out

    def _record(self, i: int) -> Optional[EngineLoad]:
        base = i * RECORD_BYTES
        cached_seq, cached = self._cache[i]
        for _ in range(3):
            seq, length = HEADER.unpack_from(self._map, base)
            if seq == cached_seq:
                return cached
            if seq & 1 or length > MAX_PAYLOAD:  # being written: try again, else keep the last one read
                continue
            data = bytes(self._map[base + HEADER.size:base + HEADER.size + length])
            if HEADER.unpack_from(self._map, base)[0] != seq:
                continue
            try:
                load = EngineLoad.from_payload(data)
            except (ValueError, KeyError, TypeError):
                return cached
            self._cache[i] = (seq, load)
            return load
        return cached

    def close(self) -> None:
        self._map.close()
