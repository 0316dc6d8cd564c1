"""Adapter administration over the Triton model's own endpoint.

A request whose parameters (or sampling_parameters) carry ``adapter_action`` ("list", "load" or "unload",
with ``lora_name`` for the last two) is answered with one response whose text_output is JSON. It runs on
an admin thread of the Triton model (a load reads from disk there, an unload waits there for the
adapter's requests to finish) and touches the engine's state only on the engine thread. ``load`` and
``unload`` must carry ``admin_token``, the token of the file ``lora.admin_token_file`` names
(``vlora serve --admin-token-file``); without that setting they are refused. ``list`` is open.
"""
from __future__ import annotations

import hmac
import json
import threading
import time
import traceback
from typing import Any, Optional

from vlora.errors import EngineOverloaded, InvalidRequest
from vlora.server.wire import ADMIN_KEY, ADMIN_TOKEN_KEY, Wire

ADMIN_ACTIONS = ("list", "load", "unload")
# ``list`` answers from a snapshot of at most this age: a flood of list requests costs the engine thread at
# most one round trip per LIST_MAX_AGE_S (they wait for one in progress and share it), not one each. A load
# or unload answered here makes the next list ask the engine again.
LIST_MAX_AGE_S = 0.25


def admin_request(wire: Wire, request) -> Optional[tuple[str, Optional[str], Any]]:
    """(action, lora_name, admin_token) when the request is an adapter_action, else None. Raises
    InvalidRequest. The token is checked on the admin thread (:meth:`AdminActions.check_token`)."""
    options = wire.options(request)
    if ADMIN_KEY not in options:
        return None
    action = options.pop(ADMIN_KEY)
    if action not in ADMIN_ACTIONS:
        raise InvalidRequest(f"{ADMIN_KEY} must be one of {list(ADMIN_ACTIONS)}, got {action!r}")
    name = options.pop("lora_name", None)
    token = options.pop(ADMIN_TOKEN_KEY, None)
    if options:
        raise InvalidRequest(f"an {ADMIN_KEY} request takes only lora_name and {ADMIN_TOKEN_KEY}, not {sorted(options)}")
    if action == "list":
        if name is not None:
            raise InvalidRequest(f"{ADMIN_KEY} \"list\" takes no lora_name")
    elif not isinstance(name, str) or not name:
        raise InvalidRequest(f"{ADMIN_KEY} {action!r} needs lora_name, the adapter's folder name under the adapter root")
    return action, name, token


class AdminActions:
    """Runs one adapter action against the engine and answers it, on the caller's (admin) thread.

    ``engine`` needs ``adapters()``, ``load_adapter(name)`` and ``unload_adapter(name)`` (an AsyncEngine);
    ``admin_token`` is the configured token's bytes, or None when load and unload are off.
    """

    def __init__(self, wire: Wire, engine: Any, admin_token: Optional[bytes]) -> None:
        self._wire = wire
        self._engine = engine
        self._admin_token = admin_token
        self._list_lock = threading.Lock()  # one engine round trip for list at a time
        self._list_snapshot: Optional[tuple[float, int, Any]] = None  # (taken at, generation, adapters)
        self._generation = 0  # bumped by every load and unload

    def adapters(self) -> Any:
        """The engine's adapter list, from a snapshot younger than LIST_MAX_AGE_S and taken after the last
        load or unload, else asked from the engine (once for all the list requests waiting meanwhile)."""
        with self._list_lock:
            snap, generation = self._list_snapshot, self._generation
            if snap is not None and snap[1] == generation and time.monotonic() - snap[0] < LIST_MAX_AGE_S:
                return snap[2]
            adapters = self._engine.adapters()
            self._list_snapshot = (time.monotonic(), generation, adapters)
            return adapters

    def check_token(self, action: str, token: Any) -> None:
        """load/unload need the configured token; raises InvalidRequest saying why (never echoing a token)."""
        if action == "list":
            return
        if self._admin_token is None:
            raise InvalidRequest(
                f"{ADMIN_KEY} {action!r} is off on this server: start it with `vlora serve --admin-token-file FILE` "
                f"(engine setting lora.admin_token_file) and send that file's token as {ADMIN_TOKEN_KEY}")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self._admin_token):
            what = "missing" if token is None else "wrong"
            raise InvalidRequest(f"{ADMIN_KEY} {action!r} refused: {what} {ADMIN_TOKEN_KEY} "
                                 f"(send the token of the server's --admin-token-file)")

    def run(self, sender, action: str, name: Optional[str], token: Any = None) -> None:
        """One adapter action, answered with JSON in text_output (or a TritonError saying why not): every
        exception ends in an answer."""
        try:
            self._run(sender, action, name, token)
        except Exception as e:  # a fault of vlora's: still answered, logged in one line
            self._wire.pb.Logger.log_error(f"vlora: adapter_action {action} failed: {type(e).__name__}: {e}")
            self._wire.send_error(sender, f"internal error: {type(e).__name__}", internal=True)

    def _run(self, sender, action: str, name: Optional[str], token: Any) -> None:
        wire, log = self._wire, self._wire.pb.Logger
        try:
            self.check_token(action, token)
        except InvalidRequest as e:  # one line per refused request, no traceback, no token
            log.log_warn(f"vlora: {e}")
            wire.send_error(sender, str(e))
            return
        try:
            if action == "list":
                payload = {"adapters": self.adapters()}
            else:
                try:
                    if action == "load":
                        payload = {"loaded": self._engine.load_adapter(name)}
                    else:
                        payload = {"unloaded": self._engine.unload_adapter(name)}
                finally:
                    with self._list_lock:
                        self._generation += 1  # the next list asks the engine
        except InvalidRequest as e:  # unknown, malformed or busy adapter: the reason goes to the client
            wire.send_error(sender, str(e))
            return
        except EngineOverloaded as e:
            wire.send_error(sender, str(e), unavailable=True)
            return
        except Exception as e:
            log.log_error(f"vlora: adapter_action {action} failed: {traceback.format_exc()}")
            wire.send_error(sender, f"internal error: {type(e).__name__}: {e}", internal=True)
            return
        if action == "load":
            log.log_info(f"vlora: adapter {name} loaded")
        elif action == "unload":  # "unloading" when its running requests outlasted lora.unload_timeout_s
            state = payload["unloaded"].get("state", "unloaded") if isinstance(payload["unloaded"], dict) else "unloaded"
            log.log_info(f"vlora: adapter {name} {state}")
        tensors = [
            wire.string_tensor("text_output", json.dumps(payload)),
            wire.string_tensor("finish_reason", "stop"),
            wire.count_tensor("num_input_tokens", 0),
            wire.count_tensor("num_output_tokens", 0),
        ]
        try:
            wire.send_final(sender, tensors)
        except Exception as e:  # the client went away, or the answer could not be sent: one line
            log.log_error(f"vlora: sending an adapter_action answer failed: {type(e).__name__}: {e}")
