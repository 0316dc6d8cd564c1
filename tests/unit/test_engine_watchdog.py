"""The fail-safe engine: a request the engine cannot admit fails alone; a dead or stalled engine
thread fails every request in flight within a bounded time, refuses new ones, and tells its owner;
a long but progressing run is not a stall."""
from __future__ import annotations

import threading
import time

import pytest

from vlora.engine.api import GenerationRequest, InvalidRequest, SamplingParams
from vlora.engine.api import EngineDead
from vlora.engine.async_engine import AsyncEngine

from helpers import Collector, tiny_config

pytestmark = pytest.mark.timeout(300)


def _req(rid, max_tokens=8, **sp):
    return GenerationRequest(request_id=rid, prompt="Count the circles.",
                             sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp))


class _Dead:
    def __init__(self):
        self.causes: list[str] = []
        self.event = threading.Event()

    def __call__(self, cause):
        self.causes.append(cause)
        self.event.set()


@pytest.fixture()
def make_engine(tiny_model_dir, demo_adapter_root):
    engines = []

    def make(**over):
        dead = _Dead()
        eng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root, **over), on_dead=dead)
        engines.append(eng)
        return eng, dead

    yield make
    for eng in engines:
        eng.shutdown(timeout=5)


def test_a_request_the_engine_cannot_admit_fails_alone(make_engine, monkeypatch):
    eng, dead = make_engine()
    col = Collector()
    original = eng.engine.add_request

    def add_request(prepared, callback):
        if prepared.request_id == "bad":
            raise OverflowError("Python int too large to convert to C long")  # the old seed-overflow crash
        original(prepared, callback)

    monkeypatch.setattr(eng.engine, "add_request", add_request)
    for rid in ("a", "bad", "b"):
        eng.submit(eng.prepare(_req(rid)), col)
    col.wait(3, timeout=60)
    assert col.done["bad"].finish_reason == "error" and "OverflowError" in col.done["bad"].error
    assert col.done["a"].finish_reason == "length" and col.done["b"].finish_reason == "length"
    assert eng.dead is None and not dead.causes
    assert eng.adapters()  # control calls still run


@pytest.mark.parametrize("fault", ["kill", "wedge"])
def test_a_dead_or_stalled_engine_fails_everything_and_refuses(make_engine, fault):
    eng, dead = make_engine(**{"scheduler.fault_injection": "true", "scheduler.stall_timeout_s": 1.5})
    col = Collector()
    waiting = ["w0", "w1", "w2"]
    for rid in waiting:  # in flight (long) when the fault lands
        eng.submit(eng.prepare(_req(rid, max_tokens=2000)), col)
    t0 = time.monotonic()
    eng.submit(eng.prepare(_req("fault")), col, fault=fault)
    assert dead.event.wait(15), "the engine was not declared dead"
    col.wait(len(waiting) + 1, timeout=10)
    elapsed = time.monotonic() - t0
    assert elapsed < (3 if fault == "kill" else 8), elapsed
    for rid in waiting + ["fault"]:
        out = col.done[rid]
        assert out.finish_reason == "error" and "engine" in out.error, out
    assert ("died" if fault == "kill" else "no progress") in dead.causes[0]
    assert len(dead.causes) == 1
    with pytest.raises(EngineDead, match="failed"):
        eng.submit(eng.prepare(_req("late")), col)
    with pytest.raises(EngineDead):
        eng.adapters()


def test_faults_are_refused_unless_enabled(make_engine):
    eng, _ = make_engine()
    with pytest.raises(InvalidRequest, match="fault_injection"):
        eng.submit(eng.prepare(_req("x")), Collector(), fault="kill")


def test_long_steps_that_progress_are_not_a_stall(make_engine, monkeypatch):
    """Each step takes 0.4 s, the whole run several times the stall bound: progress, not a stall;
    and an idle engine is never a stall."""
    eng, dead = make_engine(**{"scheduler.stall_timeout_s": 0.8})
    step = eng.engine.step

    def slow_step():
        time.sleep(0.4)
        return step()

    monkeypatch.setattr(eng.engine, "step", slow_step)
    col = Collector()
    eng.submit(eng.prepare(_req("slow", max_tokens=8)), col)
    col.wait(1, timeout=60)
    assert col.done["slow"].finish_reason == "length"
    time.sleep(1.5)  # idle, longer than the bound
    assert eng.dead is None and not dead.causes
    eng.submit(eng.prepare(_req("after", max_tokens=2)), col)
    col.wait(2, timeout=30)
    assert col.done["after"].finish_reason == "length"


def test_a_dead_engine_wakes_the_output_consumer_after_failing_its_requests(tiny_model_dir, demo_adapter_root):
    """The watchdog fails the requests of a wedged engine on its own thread; a consumer that buffers events
    and waits for ``after_outputs`` (the Triton model's response thread) is woken after those failures."""
    col = Collector()
    wakes: list[tuple[str, int]] = []  # (thread, requests failed by then)

    def wake():
        with col.cv:
            wakes.append((threading.current_thread().name, len(col.done)))

    dead = _Dead()
    eng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root, **{"scheduler.fault_injection": "true",
                                                                  "scheduler.stall_timeout_s": 1.5}),
                      on_dead=dead, after_outputs=wake)
    try:
        eng.submit(eng.prepare(_req("long", max_tokens=2000)), col)
        eng.submit(eng.prepare(_req("fault")), col, fault="wedge")
        assert dead.event.wait(15), "the engine was not declared dead"
        col.wait(2, timeout=10)
        assert ("vlora-engine-watchdog", 2) in wakes, wakes
    finally:
        eng.shutdown(timeout=5)
