"""The engine model's side of routing (model_repository/vlora/1/model.py uses both, when the launcher made it one
of several engine models):

- :class:`BoardPublisher` wraps the model's EngineMetrics: every report goes on to the real metrics unchanged,
  and the few the router needs (queue depth, KV use, requests per adapter, adapters in and out of device slots,
  admissions) are also kept, in plain Python under one short lock; a thread writes them to this engine's
  record on the routing board every ``interval_s``.
- :class:`RouteIndex` maps the router's request ids to the engine's own, so that the router can cancel a
  request whose client went away: Triton 2.51's BLS API cannot cancel a request it sent, so the router sends
  a second request whose id names the first (``vlora-cancel-<id>``), answered here at once.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from vlora.server.routing import BOARD_PARAM, CANCEL_PREFIX, ROUTE_PREFIX, SLOT_PARAM
from vlora.server.routing.board import BoardWriter, EngineLoad

PUBLISH_INTERVAL_S = 0.1  # how often an engine writes its record (the router skips records older than 2 s)
ADMITTED_HOLD_S = 2.0  # an adapter just admitted counts as loading here for this long, until it shows in a slot
ROUTE_INDEX_SIZE = 65536  # routed requests remembered for cancellation (far above any engine's concurrency)


def routing_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The routing settings among a model config's parameters (empty when this model is not routed to)."""
    params = model_config.get("parameters", {}) or {}
    return {k: v.get("string_value", "") for k, v in params.items() if k in (BOARD_PARAM, SLOT_PARAM)}


class BoardPublisher:
    """EngineMetrics that forwards everything to ``metrics`` and publishes what routing needs on the board."""

    def __init__(self, metrics: Any, board: Path, slot: int, slots: int, interval_s: float = PUBLISH_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._writer = BoardWriter(board, slot)
        self._slots = slots
        self._clock = clock
        self._lock = threading.Lock()
        self._depth = (0, 0)
        self._kv = 0.0
        self._resident: set[str] = set()
        self._adapters: tuple[dict, dict] = ({}, {})
        self._admitted: dict[str, float] = {}  # adapter -> when a request for it was last admitted here
        # Requests taken but not in the scheduler yet (AsyncEngine.preparing: image workers, the loop's inbox),
        # published as waiting: a burst of image requests is otherwise invisible here while it is decoded.
        self.preparing: Optional[Callable[[], int]] = None
        self._stop = threading.Event()
        self.publish()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="vlora-board", daemon=True)
        self._thread.start()

    @classmethod
    def wrap(cls, metrics: Any, model_config: Mapping[str, Any], slots: int) -> Any:
        """``metrics`` wrapped when the model config names a board, else ``metrics`` itself."""
        params = routing_parameters(model_config)
        if not params.get(BOARD_PARAM):
            return metrics
        return cls(metrics, Path(params[BOARD_PARAM]), int(params.get(SLOT_PARAM) or 0), slots)

    def __getattr__(self, name: str) -> Any:  # what the engine and model.py call that routing does not need
        return getattr(self._metrics, name)

    # EngineMetrics: kept here too, then forwarded.
    def request_admitted(self, lora_name: Optional[str]) -> None:
        if lora_name:
            with self._lock:
                self._admitted[lora_name] = self._clock()
        self._metrics.request_admitted(lora_name)

    def queue_depth(self, running: int, waiting: int) -> None:
        with self._lock:
            self._depth = (running, waiting)
        self._metrics.queue_depth(running, waiting)

    def adapter_requests(self, running, waiting) -> None:
        with self._lock:
            self._adapters = (dict(running), dict(waiting))
        self._metrics.adapter_requests(running, waiting)

    def adapter_swap(self, kind: str, lora_name: str) -> None:
        if kind in ("gpu_load", "gpu_eviction"):
            with self._lock:
                (self._resident.add if kind == "gpu_load" else self._resident.discard)(lora_name)
        self._metrics.adapter_swap(kind, lora_name)

    def kv_cache_usage(self, used_blocks: int, total_blocks: int) -> None:
        with self._lock:
            self._kv = used_blocks / total_blocks if total_blocks > 0 else 0.0
        self._metrics.kv_cache_usage(used_blocks, total_blocks)

    # Publishing.
    def snapshot(self) -> EngineLoad:
        now = self._clock()
        with self._lock:
            running, waiting = self._adapters
            busy = {name for name, n in running.items() if name and n} | {name for name, n in waiting.items() if name and n}
            for name, at in list(self._admitted.items()):
                if now - at > ADMITTED_HOLD_S:
                    del self._admitted[name]
            resident = frozenset(self._resident)
            loading = frozenset((busy | set(self._admitted)) - resident)
            depth = self._depth
        preparing = self.preparing() if self.preparing is not None else 0
        return EngineLoad(t=now, resident=resident, loading=loading, active=len(busy),
                          running=depth[0], waiting=depth[1] + preparing, kv=self._kv, slots=self._slots)

    def publish(self) -> None:
        self._writer.publish(self.snapshot())

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.publish()
            except Exception:  # never expected; the router skips this engine once its record is stale
                pass

    def close(self) -> None:
        """Stop publishing (the record goes stale), then close the wrapped metrics."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._metrics.close()


class RouteIndex:
    """Routed request ids (``vlora-route-<32 hex>``) to the engine's request ids, for the router's cancellations.
    Bounded: the oldest entries go first (a finished request's entry is harmless: cancelling it does nothing)."""

    def __init__(self, cancel: Callable[[str], Any], size: int = ROUTE_INDEX_SIZE) -> None:
        self._cancel = cancel
        self._size = size
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _route(request_id: str, prefix: str) -> Optional[str]:
        if not request_id.startswith(prefix):
            return None
        route = request_id[len(prefix):]
        return route if len(route) == 32 and all(c in "0123456789abcdef" for c in route) else None

    def cancellation(self, request) -> Optional[str]:
        """The route id a cancellation request names, else None (any other request)."""
        return self._route(_request_id(request), CANCEL_PREFIX)

    def register(self, request, engine_request_id: str) -> None:
        route = self._route(_request_id(request), ROUTE_PREFIX)
        if route is None:
            return
        with self._lock:
            self._ids[route] = engine_request_id
            while len(self._ids) > self._size:
                self._ids.popitem(last=False)

    def cancel(self, route: str) -> bool:
        """Cancel the routed request ``route`` in the engine; False when it is not known here."""
        with self._lock:
            engine_request_id = self._ids.pop(route, None)
        if engine_request_id is None:
            return False
        self._cancel(engine_request_id)
        return True


def _request_id(request) -> str:
    try:
        return request.request_id() or ""
    except Exception:
        return ""
