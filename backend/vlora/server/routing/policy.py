"""Where a request goes: a pure function of the request's adapter and what each engine published.

1. An engine that has the adapter in a device slot or is loading it wins, unless it is overloaded: its queue
   depth (running + waiting) is more than ``margin`` over the least loaded engine's, or its KV cache is full
   while another's is not. Among several such engines (a popular adapter that spread), the least loaded.
2. Otherwise (a cold adapter, or every engine that has it is overloaded) the adapter goes to one of the engines
   within ``margin`` of the least loaded: the one with the fewest active adapters (adapters with requests), then
   the highest rendezvous hash of (adapter, engine). The hash makes every router instance pick the same engine
   for the same cold adapter while the engines' loads are alike, so a burst of requests for a new adapter loads
   it on one GPU, not on all; the active-adapter count spreads distinct adapters over the GPUs' slots. When the
   engines that have it are overloaded, this adds one more engine for the popular adapter (it spreads).
3. A request without an adapter goes to the least loaded engine (ties: the fewest KV blocks held, then the hash
   of ``key``, which the router varies per request).

Engines whose load is None (never published, or stale: see :class:`vlora.server.routing.board.BoardReader`) are
skipped; when none is fresh, the rendezvous hash alone decides, so placement stays affine without a board.

An engine publishes a few times a second, so a burst of arrivals would all read the same records: every request
for an adapter would go to its holder, however deep its queue grew. :func:`with_sent` adds what the router itself
sent since each record was published (its requests in flight, their adapters as loading there), so the placement
of the next request in a burst sees the ones before it.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Optional, Sequence

from vlora.server.routing.board import EngineLoad

DEFAULT_MARGIN = 8  # queue depth over the least loaded engine beyond which an engine counts as overloaded
KV_FULL = 0.97  # KV use at which an engine counts as full, when another has room


def rendezvous(key: str, engine: int) -> int:
    """A stable 64-bit score of (key, engine): the same on every router instance and every run."""
    digest = hashlib.blake2b(f"{key}\x00{engine}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def with_sent(loads: Sequence[Optional[EngineLoad]], sent: Iterable[tuple]) -> list[Optional[EngineLoad]]:
    """``loads`` with the router's own requests that each record cannot show yet: ``sent`` holds (engine index,
    adapter or None, time.monotonic()[, in flight]) of the requests it placed. One in flight (the time: when it was
    sent) sent after its engine's record was published counts as waiting there, and its adapter as loading there
    (one more active adapter when it was neither resident nor loading). One answered (in flight False; the time: when
    it was answered) after its engine's record adds no work, but its adapter counts as loading there: the engine
    holds it in a slot, which a record published before the answer may not show, and a short request's adapter
    would otherwise read as cold to the next request for it, which could go elsewhere."""
    count = [0] * len(loads)
    adapters: list[set] = [set() for _ in loads]  # of requests in flight
    answered: list[set] = [set() for _ in loads]  # of requests answered since the record
    for entry in sent:
        i, adapter, at = entry[0], entry[1], entry[2]
        in_flight = entry[3] if len(entry) > 3 else True
        load = loads[i] if 0 <= i < len(loads) else None
        if load is None or at <= load.t:
            continue
        if in_flight:
            count[i] += 1
            if adapter is not None:
                adapters[i].add(adapter)
        elif adapter is not None:
            answered[i].add(adapter)
    out: list[Optional[EngineLoad]] = []
    for i, load in enumerate(loads):
        if load is None or not (count[i] or answered[i]):
            out.append(load)
            continue
        new = adapters[i] - load.resident - load.loading
        out.append(dataclasses.replace(load, waiting=load.waiting + count[i],
                                       loading=load.loading | adapters[i] | (answered[i] - load.resident),
                                       active=load.active + len(new)))
    return out


def choose_engine(adapter: Optional[str], loads: Sequence[Optional[EngineLoad]], *, margin: int = DEFAULT_MARGIN,
                  key: str = "") -> int:
    """The index of the engine for a request with ``adapter`` (None: the base model), given each engine's
    published load (None: skip it). ``key`` breaks ties between equally loaded engines for base-model requests."""
    if not loads:
        raise ValueError("no engines to route to")
    fresh = [i for i, load in enumerate(loads) if load is not None]
    tie_key = adapter if adapter is not None else key
    if not fresh:
        return max(range(len(loads)), key=lambda i: rendezvous(tie_key, i))
    least = min(loads[i].depth for i in fresh)
    room = any(loads[i].kv < KV_FULL for i in fresh)

    def overloaded(i: int) -> bool:
        load = loads[i]
        return load.depth > least + margin or (room and load.kv >= KV_FULL)

    if adapter is None:
        return min(fresh, key=lambda i: (loads[i].depth, loads[i].kv, -rendezvous(tie_key, i)))
    holders = [i for i in fresh if loads[i].has(adapter) and not overloaded(i)]
    if holders:
        return min(holders, key=lambda i: (loads[i].depth, -rendezvous(adapter, i)))
    others = [i for i in fresh if not loads[i].has(adapter) and not overloaded(i)]
    candidates = others or [i for i in fresh if not overloaded(i)] or fresh
    return min(candidates, key=lambda i: (loads[i].active, -rendezvous(adapter, i)))
