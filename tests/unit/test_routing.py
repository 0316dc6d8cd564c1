"""Adapter-aware routing (vlora.server.routing): the placement policy, the shared-memory board, the engine side's
publisher and cancellation index, the merge of adapter actions, and the repository a routed launch writes."""
from __future__ import annotations

import collections
import json
import multiprocessing
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vlora.server.repository import (
    ROUTER_MODEL_PY,
    engine_instance_group,
    prepare_routed_repository,
    render_config,
    routed_engines,
    router_instance_group,
    source_repository,
)
from vlora.server.routing import BOARD_PARAM, CANCEL_PREFIX, ROUTE_PREFIX, SLOT_PARAM
from vlora.server.routing.admin_merge import EngineError, merge_admin
from vlora.server.routing.board import RECORD_BYTES, BoardReader, BoardWriter, EngineLoad, create_board
from vlora.server.routing.engine_side import ADMITTED_HOLD_S, BoardPublisher, RouteIndex
from vlora.server.routing.policy import choose_engine, rendezvous, with_sent


def load(depth=0, resident=(), loading=(), active=0, kv=0.0, t=0.0) -> EngineLoad:
    return EngineLoad(t=t, resident=frozenset(resident), loading=frozenset(loading), active=active, running=depth,
                      waiting=0, kv=kv, slots=8)


# The policy.
def test_an_adapter_goes_where_it_is_resident_or_loading():
    assert choose_engine("a", [load(3), load(0), load(5, resident={"a"})]) == 2
    assert choose_engine("a", [load(3), load(4, loading={"a"}), load(0)]) == 1


def test_an_overloaded_holder_spreads_the_adapter_to_the_least_loaded():
    loads = [load(20, resident={"a"}), load(2), load(1, active=3)]
    assert choose_engine("a", loads, margin=8) in (1, 2)
    assert choose_engine("a", loads, margin=8) == 1  # the fewer active adapters
    assert choose_engine("a", loads, margin=30) == 0  # within the margin it stays


def test_a_popular_adapter_on_two_engines_uses_the_less_loaded():
    assert choose_engine("a", [load(6, resident={"a"}), load(2), load(4, resident={"a"})]) == 2


def test_a_full_kv_cache_counts_as_overloaded_when_another_has_room():
    assert choose_engine("a", [load(0, resident={"a"}, kv=0.99), load(1)]) == 1
    assert choose_engine("a", [load(0, resident={"a"}, kv=0.99), load(1, kv=0.99)]) == 0  # all full: affinity


def test_a_cold_adapter_goes_to_one_engine_the_same_from_every_router():
    loads = [load(1), load(1), load(2), load(1)]
    picks = {choose_engine("cold", loads) for _ in range(5)}
    assert len(picks) == 1
    (pick,) = picks
    assert pick == max((0, 1, 2, 3), key=lambda i: (-loads[i].active, rendezvous("cold", i)))


def test_cold_adapters_fill_the_engines_with_fewer_active_adapters():
    assert choose_engine("new", [load(0, active=5), load(3, active=1)], margin=8) == 1
    assert choose_engine("new", [load(0, active=5), load(30, active=1)], margin=8) == 0  # too loaded


def test_distinct_cold_adapters_spread_over_the_engines():
    loads = [load(0)] * 4
    counts = [0] * 4
    for k in range(400):
        counts[choose_engine(f"adapter-{k}", loads)] += 1
    assert min(counts) > 60, counts


def test_base_requests_go_to_the_least_loaded():
    assert choose_engine(None, [load(4), load(1), load(2)]) == 1
    spread = {choose_engine(None, [load(0), load(0)], key=str(k)) for k in range(40)}
    assert spread == {0, 1}


def test_stale_engines_are_skipped_and_none_fresh_falls_back_to_the_hash():
    assert choose_engine("a", [None, load(9), None]) == 1
    pick = choose_engine("a", [None, None, None])
    assert pick == max(range(3), key=lambda i: rendezvous("a", i))


def _burst(adapters, records, margin=8):
    """Where a burst lands when every placement reads the same records (published before the burst, at t=0) and the
    router's own requests since then (policy.with_sent): the requests per engine."""
    sent = []
    for k, adapter in enumerate(adapters):
        i = choose_engine(adapter, with_sent(records, sent), margin=margin, key=str(k))
        sent.append((i, adapter, 1.0 + k))
    return [sum(1 for i, _, _ in sent if i == e) for e in range(len(records))]


def test_a_burst_of_base_requests_is_split_evenly_though_the_records_do_not_move():
    assert _burst([None] * 64, [load(0), load(0)]) == [32, 32]
    assert _burst([None] * 128, [load(0)] * 4) == [32] * 4


def test_a_burst_for_resident_adapters_spreads_past_the_margin():
    """Eight adapters, resident five on one engine and three on the other, 128 requests at once (serve_burst's
    image64 on two GPUs): with the records alone every request went to its adapter's holder; counting what was
    sent, no engine gets more than the margin over the other."""
    five, three = {f"a{k}" for k in range(5)}, {f"a{k}" for k in range(5, 8)}
    counts = _burst([f"a{k % 8}" for k in range(128)], [load(0, resident=five), load(0, resident=three)])
    assert sum(counts) == 128 and abs(counts[0] - counts[1]) <= 8 + 1, counts
    without = [choose_engine(f"a{k % 8}", [load(0, resident=five), load(0, resident=three)]) for k in range(128)]
    assert without.count(0) == 80  # the records alone: 80 / 48


def test_a_cold_adapter_sent_once_counts_as_loading_there():
    """The second request for a cold adapter follows the first, before any record shows it loading."""
    records = [load(0), load(0), load(0)]
    first = choose_engine("new", records)
    sent = [(first, "new", 1.0)]
    assert with_sent(records, sent)[first].loading == {"new"} and with_sent(records, sent)[first].active == 1
    others = [(i, f"x{i}", 1.0) for i in range(3) if i != first] * 3  # the others got more base work meanwhile
    assert choose_engine("new", with_sent(records, sent + others)) == first


def test_an_adapter_answered_before_its_engines_next_record_still_draws_its_next_request():
    """A short request ends before its engine publishes again: the record (from before it) shows the adapter nowhere,
    and the engine it ran on has more active adapters than another. Its next request still goes there, and the
    answered request adds no work; a record newer than the answer shows the slot itself."""
    records = [load(0, active=0, t=1.0), load(0, active=2, t=1.0)]
    assert choose_engine("x", records) == 0  # cold: the fewer active adapters
    answered = [(1, "x", 2.0, False)]
    out = with_sent(records, answered)
    assert out[1].loading == {"x"} and out[1].waiting == 0 and out[1].active == 2
    assert choose_engine("x", out) == 1
    newer = [load(0, t=3.0), load(0, resident={"x"}, active=2, t=3.0)]
    assert with_sent(newer, answered) == newer


def test_requests_a_record_already_shows_are_not_counted_twice():
    records = [load(3, t=5.0), load(0, t=5.0)]
    out = with_sent(records, [(0, None, 4.0), (1, None, 6.0)])
    assert out[0] == records[0] and out[1].waiting == 1 and out[1].depth == 1


# The board.
def test_board_round_trip_and_staleness(tmp_path):
    path = create_board(tmp_path / "board", 3)
    assert path.stat().st_size == 3 * RECORD_BYTES and path.stat().st_mode & 0o777 == 0o600
    reader = BoardReader(path, 3, stale_s=2.0)
    assert reader.read() == [None, None, None]
    writer = BoardWriter(path, 1)
    now = time.monotonic()
    published = load(3, resident={"a", "b"}, loading={"c"}, active=2, kv=0.25, t=now)
    writer.publish(published)
    got = reader.read(now)
    assert got[0] is None and got[2] is None
    assert got[1] == published
    assert reader.read(now + 5.0)[1] is None  # stopped publishing: stale
    writer.publish(load(1, t=now + 1))
    assert reader.read(now + 1)[1].depth == 1


def _publish_many(path: str, n: int) -> None:
    writer = BoardWriter(Path(path), 0)
    for i in range(n):
        writer.publish(EngineLoad(t=float(i), resident=frozenset(f"adapter-{j}" for j in range(i % 50)), running=i))


def test_board_readers_never_see_a_torn_record(tmp_path):
    """A writer process publishes records of varying sizes while this one reads: every record read is whole."""
    path = create_board(tmp_path / "board", 1)
    proc = multiprocessing.get_context("fork").Process(target=_publish_many, args=(str(path), 20000))
    proc.start()
    reader = BoardReader(path, 1, stale_s=1e9)
    seen = 0
    while proc.is_alive() or seen == 0:
        got = reader.read(now=0.0)[0]
        if got is not None:
            seen += 1
            assert len(got.resident) == got.running % 50
    proc.join()
    assert proc.exitcode == 0 and seen


# The engine side.
class _Metrics:
    def __init__(self):
        self.calls = []
        self.closed = False

    def __getattr__(self, name):
        return lambda *a: self.calls.append((name, a))

    def close(self):
        self.closed = True


def test_board_publisher_forwards_and_publishes(tmp_path):
    path = create_board(tmp_path / "board", 2)
    inner = _Metrics()
    clock = [100.0]
    pub = BoardPublisher(inner, path, 1, slots=8, interval_s=3600, clock=lambda: clock[0])
    pub.request_admitted("a")
    pub.adapter_swap("gpu_load", "b")
    pub.adapter_swap("host_load", "c")
    pub.adapter_requests({"b": 1, None: 2}, {"a": 1})
    pub.queue_depth(3, 1)
    pub.kv_cache_usage(1, 4)
    pub.step(4, 0, 4, 0.01)  # forwarded untouched
    pub.publish()
    got = BoardReader(path, 2, stale_s=1e9).read(now=clock[0])[1]
    assert got.resident == {"b"} and got.loading == {"a"} and got.active == 2
    assert (got.running, got.waiting, got.kv, got.slots) == (3, 1, 0.25, 8)
    assert [c[0] for c in inner.calls] == ["request_admitted", "adapter_swap", "adapter_swap", "adapter_requests",
                                           "queue_depth", "kv_cache_usage", "step"]
    pub.adapter_swap("gpu_eviction", "b")
    pub.adapter_requests({}, {})
    clock[0] += ADMITTED_HOLD_S + 1
    pub.publish()
    got = BoardReader(path, 2, stale_s=1e9).read(now=clock[0])[1]
    assert got.resident == frozenset() and got.loading == frozenset() and got.active == 0
    pub.close()
    assert inner.closed


def test_requests_being_prepared_are_published_as_waiting(tmp_path):
    """AsyncEngine.preparing (requests on the image workers or in the loop's inbox) is added to the waiting ones: a
    burst of image requests counts on its engine while it is decoded, not only once it is queued."""
    path = create_board(tmp_path / "board", 1)
    pub = BoardPublisher(_Metrics(), path, 0, slots=8, interval_s=3600)
    pub.queue_depth(2, 1)
    preparing = [5]
    pub.preparing = lambda: preparing[0]
    assert (pub.snapshot().running, pub.snapshot().waiting) == (2, 6)
    preparing[0] = 0
    assert pub.snapshot().waiting == 1
    pub.close()


def test_board_publisher_wraps_only_routed_models(tmp_path):
    inner = _Metrics()
    assert BoardPublisher.wrap(inner, {"parameters": {}}, 8) is inner
    path = create_board(tmp_path / "board", 1)
    wrapped = BoardPublisher.wrap(inner, {"parameters": {BOARD_PARAM: {"string_value": str(path)},
                                                         SLOT_PARAM: {"string_value": "0"}}}, 8)
    assert isinstance(wrapped, BoardPublisher)
    wrapped.close()


class _Req:
    def __init__(self, rid):
        self._rid = rid

    def request_id(self):
        return self._rid


def test_route_index_cancels_routed_requests_only():
    cancelled = []
    index = RouteIndex(cancelled.append, size=2)
    route = "ab" * 16
    assert index.cancellation(_Req(CANCEL_PREFIX + route)) == route
    assert index.cancellation(_Req(ROUTE_PREFIX + route)) is None
    assert index.cancellation(_Req(CANCEL_PREFIX + "not-hex")) is None
    index.register(_Req("client-id"), "e0")
    index.register(_Req(ROUTE_PREFIX + route), "e1")
    assert index.cancel(route) and cancelled == ["e1"]
    assert not index.cancel(route)  # once
    for k in range(3):
        index.register(_Req(ROUTE_PREFIX + f"{k:032x}"), f"e{k}")
    assert not index.cancel(f"{0:032x}")  # bounded: the oldest went first
    assert index.cancel(f"{2:032x}")


# Adapter actions.
def _entry(name, tier, **kw):
    return {"name": name, "id": 1, "tier": tier, "loaded": True, "state": "loaded", "running": 0, "waiting": 0, **kw}


def test_list_is_the_union_with_per_engine_tiers():
    merged = merge_admin("list", {
        "vlora_gpu0": {"adapters": [_entry("a", "gpu", running=2, slot=0, ready=True), _entry("b", "disk")]},
        "vlora_gpu1": {"adapters": [_entry("a", "cpu", waiting=1), _entry("c", "gpu")]},
    })
    by_name = {e["name"]: e for e in merged["adapters"]}
    assert set(by_name) == {"a", "b", "c"}
    assert by_name["a"]["tier"] == "gpu" and by_name["a"]["tiers"] == {"vlora_gpu0": "gpu", "vlora_gpu1": "cpu"}
    assert (by_name["a"]["running"], by_name["a"]["waiting"]) == (2, 1)
    assert "slot" not in by_name["a"] and by_name["a"]["ready"] is True
    assert by_name["c"]["tiers"] == {"vlora_gpu1": "gpu"}
    assert "partial" not in merged


def test_load_everywhere_or_per_engine_errors():
    ok = merge_admin("load", {"g0": {"loaded": _entry("a", "cpu")}, "g1": {"loaded": _entry("a", "cpu")}})
    assert ok["loaded"]["tier"] == "cpu" and ok["engines"] == {"g0": "cpu", "g1": "cpu"} and "partial" not in ok
    refused = EngineError("[INVALID_ARG] unknown adapter 'x'", 3)
    assert merge_admin("load", {"g0": refused, "g1": EngineError("[INVALID_ARG] other", 3)}) is refused
    partial = merge_admin("load", {"g0": {"loaded": _entry("a", "cpu")}, "g1": EngineError("[UNAVAILABLE] down", 4)})
    assert partial["partial"] is True and partial["engines"]["g1"] == {"error": "[UNAVAILABLE] down"}


def test_unload_merges_states():
    merged = merge_admin("unload", {"g0": {"unloaded": _entry("a", "disk", loaded=False, state="unloaded")},
                                    "g1": {"unloaded": _entry("a", "cpu", loaded=False, state="unloading")}})
    assert merged["unloaded"]["state"] == "unloading" and merged["unloaded"]["loaded"] is False
    assert merged["engines"] == {"g0": "unloaded", "g1": "unloading"}


# The repository of a routed launch.
def test_routing_is_chosen_for_several_gpus_only():
    assert routed_engines("auto", "auto", 4) == 4
    assert routed_engines("adapter", "cuda", 2) == 2
    assert routed_engines("auto", "cuda", 1) == 0
    assert routed_engines("auto", "cuda:1", 4) == 0
    assert routed_engines("off", "cuda", 4) == 0
    assert routed_engines("auto", "cpu", 0) == 0
    assert routed_engines("auto", "cpu", 0, cpu_engines=2) == 2
    assert routed_engines("off", "cpu", 0, cpu_engines=2) == 0


def test_routed_repository_layout(tmp_path):
    source = source_repository()
    template = (source / "vlora" / "config.pbtxt").read_text()
    engines = [render_config(template, {BOARD_PARAM: "/b", SLOT_PARAM: str(i)}, instance_group=engine_instance_group(i, "cuda"))
               for i in range(2)]
    router = render_config(template, {"routing.engines": "vlora_gpu0,vlora_gpu1"}, instance_group=router_instance_group(3))
    dest = tmp_path / "repo"
    (dest / "vlora_gpu7").mkdir(parents=True)  # an earlier launch's engine: removed
    prepare_routed_repository(source, dest, engines, router)
    assert sorted(p.name for p in dest.iterdir()) == ["vlora", "vlora_gpu0", "vlora_gpu1"]
    assert "gpus: [ 1 ]" in (dest / "vlora_gpu1" / "config.pbtxt").read_text()
    assert (dest / "vlora_gpu0" / "1" / "model.py").read_text() == (source / "vlora" / "1" / "model.py").read_text()
    assert (dest / "vlora" / "1" / "model.py").read_text() == ROUTER_MODEL_PY
    text = (dest / "vlora" / "config.pbtxt").read_text()
    assert "count: 3" in text and "KIND_CPU" in text and "decoupled: true" in text
    # The committed repository holds no router.
    assert not any("routing.router" in p.read_text() for p in source.rglob("*.py"))


def test_serve_options_check_the_routing_flags():
    from vlora.config import ConfigError, EngineConfig
    from vlora.server.options import ServeOptions

    with pytest.raises(ConfigError, match="--routing"):
        ServeOptions(routing="sometimes")
    with pytest.raises(ConfigError, match="--device cpu"):
        ServeOptions(routing_cpu_engines=2)
    ServeOptions(engine=EngineConfig().with_overrides({"model.device": "cpu"}), routing_cpu_engines=2)
    assert json.dumps(ServeOptions().routing) == '"auto"'


def test_a_relayed_response_that_fails_ends_the_request_and_its_engine_work():
    """A streamed response the router cannot send: the engine's request is cancelled, and the client's request
    still gets a final flag (an error), since Triton holds a request and its model until one comes."""
    from fake_pb_utils import COMPLETE_FINAL, FakeRequest, FakeSender, InferenceResponse, Tensor, fake_pb_utils
    from vlora.server.routing.router import TritonPythonModel, _Relay
    from vlora.server.wire import Wire

    pb = fake_pb_utils()
    cancels = []

    class Request:
        def __init__(self, model_name, inputs, request_id, requested_output_names):
            self.request_id = request_id

        def exec(self, decoupled):
            cancels.append(self.request_id)
            return iter(())

    pb.InferenceRequest = Request

    class Flaky(FakeSender):  # the first response fails, as a send whose shared memory ran out would
        def send(self, response=None, flags=0):
            if not self.sent and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("Failed to increase the shared memory pool size")
            super().send(response, flags)

    class Bls:
        def exec(self, decoupled):
            text = lambda s: Tensor("text_output", np.array([s.encode()], dtype=np.object_))
            yield InferenceResponse([text("a")])
            yield InferenceResponse([text("b"), Tensor("finish_reason", np.array([b"stop"], dtype=np.object_))])

    router = TritonPythonModel()
    router._pb, router._wire = pb, Wire(pb)
    router._inflight, router._inflight_lock, router._answered = {}, threading.Lock(), collections.OrderedDict()
    request = FakeRequest()
    sender = request.sender = Flaky()
    router._relay(_Relay(Bls(), router._wire.sender(request), "vlora_gpu0", "r1"))
    assert cancels == [CANCEL_PREFIX + "r1"]
    ((response, flags),) = sender.sent
    assert flags == COMPLETE_FINAL and "relaying a response failed" in response.error().message()
    assert router._inflight == {}


def test_a_relay_silent_for_a_minute_is_named_in_the_log_once(monkeypatch):
    """A request whose engine has sent nothing for SILENT_WARN_S is named (its route, its engine, how many relays
    are in flight), once: a stuck engine or relay shows in the log instead of as a client that waits forever."""
    from fake_pb_utils import FakeRequest, fake_pb_utils
    from vlora.server.routing import router as router_module
    from vlora.server.routing.router import TritonPythonModel, _Relay
    from vlora.server.wire import Wire

    pb = fake_pb_utils()
    router = TritonPythonModel()
    router._pb, router._wire = pb, Wire(pb)
    router._inflight, router._inflight_lock, router._answered = {}, threading.Lock(), collections.OrderedDict()
    relay = _Relay(None, router._wire.sender(FakeRequest()), "vlora_gpu3", "r9")
    relay.heard_at = relay.sent_at = relay.sent_at - router_module.SILENT_WARN_S - 1
    router._inflight["r9"] = relay
    waits = iter([False, False, True])  # two passes of the watcher, then stop

    class Stop:
        def wait(self, _s):
            return next(waits)

    router._stop = Stop()
    router._watch_cancellations()
    warned = [line for line in pb.Logger.lines if "no response" in str(line)]
    assert len(warned) == 1 and "r9" in str(warned[0]) and "vlora_gpu3" in str(warned[0]), pb.Logger.lines


def test_a_relay_cancelled_before_its_thread_took_it_never_reaches_its_engine():
    """The cancellation watcher sees a relay from its placement on: one whose client left before a relay thread
    took it is answered as cancelled, and its request is never sent to the engine."""
    from fake_pb_utils import COMPLETE_FINAL, FakeRequest, fake_pb_utils
    from vlora.server.routing.router import TritonPythonModel, _Relay
    from vlora.server.wire import Wire

    pb = fake_pb_utils()
    router = TritonPythonModel()
    router._pb, router._wire = pb, Wire(pb)
    router._inflight, router._inflight_lock, router._answered = {}, threading.Lock(), collections.OrderedDict()
    sent = []

    class Bls:
        def exec(self, decoupled):
            sent.append(1)
            return iter(())

    request = FakeRequest()
    relay = _Relay(Bls(), router._wire.sender(request), "vlora_gpu0", "r2")
    relay.cancelled = True
    router._inflight["r2"] = relay
    router._relay(relay)
    ((response, flags),) = request.sender.sent
    assert not sent and flags == COMPLETE_FINAL and "cancelled" in response.error().message()
    assert router._inflight == {}
