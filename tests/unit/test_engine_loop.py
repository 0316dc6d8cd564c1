"""The iteration loop and its thread: batching, streaming, stop conditions, cancellation,
back-pressure, adapter slots and shutdown, on the tiny model (CPU, fp32)."""
from __future__ import annotations

import threading
import time

import pytest

from vlora.engine.api import EngineOverloaded, GenerationRequest, InvalidRequest, SamplingParams
from vlora.engine.async_engine import AsyncEngine
from vlora.engine.builder import build_engine

from helpers import Collector, tiny_config


def req(rid, prompt="Count the circles.", lora=None, **sp):
    sp.setdefault("max_tokens", 8)
    return GenerationRequest(request_id=rid, prompt=prompt, lora_name=lora, sampling=SamplingParams(**sp))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, demo_adapter_root):
    eng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root, **{"lora.max_gpu_adapters": 2}))
    yield eng
    eng.shutdown()


def run_all(engine, reqs, stream=False):
    col = Collector()
    for r in reqs:
        r.stream = stream
        engine.submit(engine.prepare(r), col)
    col.wait(len(reqs))
    return col


def test_concurrent_equals_sequential_with_slot_pressure(engine):
    """Three adapters through two slots, plus base requests: batched answers equal one-at-a-time answers."""
    names = [None, "demo-r8-qv", "demo-r16-attn", "demo-r32-mlp"]
    reqs = [req(f"c{i}", prompt=f"Question {i}: how many?", lora=names[i % 4], ignore_eos=True) for i in range(8)]
    together = run_all(engine, reqs).done
    for i in range(8):
        alone = run_all(engine, [req(f"s{i}", prompt=f"Question {i}: how many?", lora=names[i % 4], ignore_eos=True)]).done
        assert alone[f"s{i}"].text == together[f"c{i}"].text
        assert together[f"c{i}"].num_output_tokens == 8 and together[f"c{i}"].finish_reason == "length"
    assert engine.engine.runner.kv.allocator.num_free == engine.engine.runner.kv.num_blocks  # every block came back


def test_streaming_deltas_add_up(engine):
    col = run_all(engine, [req("st", max_tokens=12, ignore_eos=True)], stream=True)
    events = col.events["st"]
    assert len(events) >= 2 and events[-1].finished and not any(e.finished for e in events[:-1])
    assert "".join(e.text_delta for e in events) == events[-1].text
    plain = run_all(engine, [req("st2", max_tokens=12, ignore_eos=True)]).done["st2"]
    assert plain.text == events[-1].text


def test_stop_string_cuts_text(engine):
    full = run_all(engine, [req("f", max_tokens=16, ignore_eos=True)]).done["f"].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    cut = run_all(engine, [req("g", max_tokens=16, ignore_eos=True, stop=[stop])]).done["g"]
    assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    a = run_all(engine, [req("t1", temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)]).done["t1"].text
    many = run_all(engine, [req(f"t{i}", temperature=1.0, top_p=0.9, seed=7 if i == 2 else i, max_tokens=10, ignore_eos=True)
                            for i in range(2, 6)]).done
    assert many["t2"].text == a


def test_cancel_mid_generation(engine):
    col = Collector()
    long = req("long", max_tokens=400, ignore_eos=True)
    long.stream = True
    engine.submit(engine.prepare(long), col)
    col.wait_running("long")
    engine.cancel("long")
    col.wait(1)
    assert col.done["long"].finish_reason == "cancelled" and col.done["long"].num_output_tokens < 400


@pytest.mark.parametrize("bad, message", [
    (dict(lora="no-such-adapter"), "unknown adapter"),
    (dict(lora="../x"), "adapter"),
    (dict(prompt="   "), "empty"),
    (dict(prompt="word " * 5000), "context"),
])
def test_bad_requests_are_refused_before_queueing(engine, bad, message):
    kw = {"prompt": "hi"} | bad
    with pytest.raises(InvalidRequest, match=message):
        engine.prepare(req("bad", **{k: v for k, v in kw.items() if k in ("prompt", "lora")}))


def test_bad_images_are_refused(engine):
    with pytest.raises(InvalidRequest, match="image 0"):
        engine.prepare(GenerationRequest(request_id="img", prompt="<image> what?", images=[b"\x89PNG\r\n\x1a\nnot really"]))
    with pytest.raises(InvalidRequest, match="too many images"):
        engine.prepare(GenerationRequest(request_id="img", prompt="what?", images=[b"x"] * 9))


def test_back_pressure_rejects_when_full(tiny_model_dir, demo_adapter_root):
    eng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root, **{"scheduler.max_batch_size": 1, "scheduler.max_waiting": 1}))
    try:
        col = Collector()
        # "a" runs until it is cancelled below: it fills the batch of one for as long as the context allows.
        a = req("a", max_tokens=900, ignore_eos=True)
        a.stream = True
        eng.submit(eng.prepare(a), col)
        col.wait_running("a")
        eng.submit(eng.prepare(req("b", max_tokens=4)), col)  # waits in the engine
        with pytest.raises(EngineOverloaded):
            eng.submit(eng.prepare(req("c", max_tokens=4)), col, timeout=0.2)
        eng.cancel("a")
        col.wait(2)
        assert col.done["b"].finish_reason in ("length", "stop")
    finally:
        eng.shutdown()


def test_a_burst_into_an_idle_engine_fills_the_batch_then_the_queue(tiny_model_dir, demo_adapter_root):
    """The queue bound (scheduler.max_waiting) counts what waits beyond the batch's free places: a burst sent
    without waiting (as the Triton model sends) into an idle engine takes max_batch_size + max_waiting requests
    before the engine has moved any into its batch, and refuses the rest at once."""
    eng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root, **{"scheduler.max_batch_size": 2, "scheduler.max_waiting": 1}))
    try:
        col = Collector()
        taken, refused = [], []
        prepared = [eng.prepare(req(f"r{i}", max_tokens=64, ignore_eos=True)) for i in range(6)]
        for p in prepared:
            try:
                eng.submit(p, col, timeout=0)
                taken.append(p.request_id)
            except EngineOverloaded:
                refused.append(p.request_id)
        assert len(taken) == 3 and len(refused) == 3, (taken, refused)
        col.wait(3)
        assert all(col.done[r].finish_reason == "length" for r in taken)
    finally:
        eng.shutdown()


def test_shutdown_drains_in_flight(tiny_model_dir, demo_adapter_root):
    eng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root))
    col = Collector()
    for i in range(4):
        eng.submit(eng.prepare(req(f"d{i}", max_tokens=20, ignore_eos=True)), col)
    eng.shutdown(timeout=60)
    assert len(col.done) == 4 and all(o.finish_reason == "length" for o in col.done.values())
    with pytest.raises(EngineOverloaded, match="shutting down"):
        eng.submit(eng.prepare(req("late")), col)


def test_prompt_longer_than_budget_still_runs(tiny_model_dir, demo_adapter_root):
    eng = build_engine(tiny_config(tiny_model_dir, demo_adapter_root, **{"scheduler.max_num_batched_tokens": 16}))
    col = Collector()
    eng.add_request(eng.inputs.prepare(req("big", prompt="many words " * 20, max_tokens=2)), col)
    while eng.has_work():
        eng.step()
    assert col.done["big"].num_output_tokens == 2


def test_after_outputs_wakes_a_buffering_consumer_once_per_step(tiny_model_dir, demo_adapter_root):
    """With ``after_outputs`` (the Triton model's response thread) the consumer is woken on the engine thread
    after each iteration's events, not per event: fewer wake-ups than events, at most one event per request
    between two wake-ups, and none left without a wake-up after it."""
    log: list[tuple[str, str]] = []  # ("event", request id) or ("wake", ""), in order
    threads: set[str] = set()
    lock = threading.Lock()

    def wake():
        with lock:
            log.append(("wake", ""))
            threads.add(threading.current_thread().name)

    eng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root), after_outputs=wake)
    col = Collector()

    def callback(out):
        with lock:
            log.append(("event", out.request_id))
        col(out)

    try:
        for i in range(4):
            r = req(f"w{i}", max_tokens=6, ignore_eos=True)
            r.stream = True
            eng.submit(eng.prepare(r), callback)
        col.wait(4)
        deadline = time.monotonic() + 10
        while True:
            with lock:
                if log[-1][0] == "wake":
                    break
            assert time.monotonic() < deadline, "the last events were never followed by a wake-up"
            time.sleep(0.01)
    finally:
        eng.shutdown()
    events = [rid for kind, rid in log if kind == "event"]
    wakes = sum(1 for kind, _ in log if kind == "wake")
    assert threads == {"vlora-engine"}
    assert len(events) >= 4 * 6 and wakes < len(events)
    since_wake: set[str] = set()
    biggest = 0
    for kind, rid in log:
        if kind == "wake":
            biggest, since_wake = max(biggest, len(since_wake)), set()
        else:
            assert rid not in since_wake, "two events of one request without a wake-up between them"
            since_wake.add(rid)
    assert biggest >= 2, "no wake-up covered the events of a batched step"


def test_preparing_counts_requests_on_the_image_workers(tiny_model_dir, demo_adapter_root, monkeypatch):
    """AsyncEngine.preparing (what the routing board adds to an engine's waiting requests): a request whose image
    is decoded on the image workers counts from generate() until it is submitted, and not after."""
    import io

    from PIL import Image

    aeng = AsyncEngine(tiny_config(tiny_model_dir, demo_adapter_root, **{"limits.inline_image_pixels": 0}))
    try:
        gate = threading.Event()
        real = aeng.inputs.preprocess

        def slow(checked):
            gate.wait(30)
            return real(checked)

        monkeypatch.setattr(aeng.inputs, "preprocess", slow)
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), (10, 200, 30)).save(buf, format="PNG")
        col, refused = Collector(), []
        aeng.generate(GenerationRequest("img", "USER: <image>\nWhat? ASSISTANT:", images=[buf.getvalue()],
                                        sampling=SamplingParams(max_tokens=2)), col, refused.append)
        assert aeng.preparing() == 1 and not refused
        gate.set()
        col.wait(1)
        assert aeng.preparing() == 0 and not refused
    finally:
        aeng.shutdown()
