"""Adapter-aware routing over the GPUs of one host (issue 40, part 1).

With several GPUs, ``vlora serve`` writes one engine model per GPU (``vlora_gpu0`` ... ``vlora_gpu{N-1}``: the
committed model_repository/vlora model, one instance pinned to its GPU) and a router model under the public name
``vlora``, a few CPU instances of :mod:`vlora.server.routing.router` that forward each request over Triton's BLS
API to one engine model and relay its responses. Each engine publishes its load and its adapters on a small
shared-memory board (:mod:`.board`, written by :mod:`.engine_side`); the router reads it and picks the engine with
:func:`.policy.choose_engine`. Adapter administration reaches every engine, and the answers are merged
(:mod:`.admin_merge`). Each GPU keeps its own stub process (no GIL shared between engines), and the router keeps
no state of its own, so it can run as several instances.
"""
from __future__ import annotations

ENGINE_PREFIX = "vlora_gpu"  # engine model i is f"{ENGINE_PREFIX}{i}"
ROUTE_PREFIX = "vlora-route-"  # the request id of a routed request: this prefix and 32 hex digits
CANCEL_PREFIX = "vlora-cancel-"  # the request id of the router's cancellation of a routed request
# Model config parameters that carry the routing settings (not engine settings: model.py pops them before
# EngineConfig reads the rest).
BOARD_PARAM = "routing.board"  # the board file
SLOT_PARAM = "routing.slot"  # the engine's record on the board
ENGINES_PARAM = "routing.engines"  # the router: the engine models, comma-separated, in board order
MARGIN_PARAM = "routing.margin"  # the router: requests of queue depth over the least loaded engine that count as overloaded
ROUTING_PARAMS = (BOARD_PARAM, SLOT_PARAM, ENGINES_PARAM, MARGIN_PARAM)


def engine_model_name(index: int) -> str:
    return f"{ENGINE_PREFIX}{index}"
