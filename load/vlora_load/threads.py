"""Open and closed loops on real threads, for clients that block (``benchmarks/soak.py``: gRPC cancels, admin
calls), where locust's gevent loop (``runner.py``, ``locustfile.py``) does not fit. Both drive a ``send(kind, rng,
index)`` callable over kinds drawn by ``pick(rng)``, and hand every result to ``on_done``.
"""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from vlora_load.summary import percentile

Send = Callable[[str, random.Random, int], Any]


def open_loop(rate: float, duration_s: float, t0: float, *, seed: int, workers: int, pick: Callable[[random.Random], str],
              send: Send, on_done: Callable[[Any, float], None], grace_s: float,
              tick: Optional[Callable[[float], None]] = None, tick_every_s: float = 30.0,
              at_end: Callable[[], Any] = lambda: None, should_stop: Callable[[], bool] = lambda: False) -> dict:
    """Poisson arrivals at ``rate`` from ``t0`` (monotonic) for ``duration_s``, each sent on a pool of ``workers``
    threads (``send(kind, Random(seed * 1_000_003 + index), index)``; ``on_done(result, t_done)``, seconds from
    ``t0``). ``tick(now)`` every ``tick_every_s``; ``at_end()`` once the window is over; then it waits up to
    ``grace_s`` for the requests in flight. Returns ``sent``, ``client_backlog_max`` (arrivals beyond the
    workers), ``send_lag_p99_ms`` and ``unfinished`` ({index: (kind, scheduled at)}: no result by the end)."""
    rng = random.Random(seed)
    pending: dict[int, tuple[str, float]] = {}
    lags: list[float] = []
    lock = threading.Lock()

    def one(kind: str, index: int, send_at: float) -> None:
        with lock:
            lags.append(time.monotonic() - t0 - send_at)
        on_done(send(kind, random.Random(seed * 1_000_003 + index), index), time.monotonic() - t0)
        with lock:
            pending.pop(index, None)

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="open-loop")
    index, t_next, next_tick, max_backlog = 0, rng.expovariate(rate), tick_every_s, 0
    while t_next < duration_s and not should_stop():
        now = time.monotonic() - t0
        if tick is not None and now >= next_tick:
            tick(now)
            next_tick += tick_every_s
        if t_next > now:
            time.sleep(min(t_next - now, 0.2))
            continue
        kind = pick(rng)
        with lock:
            pending[index] = (kind, t_next)
            max_backlog = max(max_backlog, len(pending) - workers)
        pool.submit(one, kind, index, t_next)
        index += 1
        t_next += rng.expovariate(rate)
    while time.monotonic() - t0 < duration_s and not should_stop():
        time.sleep(0.2)
    at_end()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        with lock:
            if not pending:
                break
        time.sleep(0.25)
    with lock:
        left = dict(pending)
    pool.shutdown(wait=False, cancel_futures=True)
    lag = percentile(lags, 99)
    return {"sent": index, "client_backlog_max": max(max_backlog, 0),
            "send_lag_p99_ms": None if lag is None else round(lag * 1000.0, 1), "unfinished": left}


def closed_loop(clients: int, seconds: float, *, seed: int, pick: Callable[[random.Random], str], send: Send,
                on_done: Callable[[Any, float], Any], join_s: float) -> list[tuple[float, Any]]:
    """``clients`` threads send back to back for ``seconds`` (client i: its own ``Random(seed * 1_000_003 + 17 i + 5)``
    for ``pick`` and ``send``, indices from ``10_000_000 + i * 100_000``). Returns (monotonic time, what
    ``on_done(result, seconds from the start)`` returned) per request, waiting up to ``join_s`` for each client."""
    t0 = time.monotonic()
    stop_at = t0 + seconds
    done: list[tuple[float, Any]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(seed * 1_000_003 + 17 * i + 5)
        n = 0
        while time.monotonic() < stop_at:
            result = send(pick(rng), rng, 10_000_000 + i * 100_000 + n)
            n += 1
            verdict = on_done(result, time.monotonic() - t0)
            with lock:
                done.append((time.monotonic(), verdict))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    with lock:
        return list(done)
