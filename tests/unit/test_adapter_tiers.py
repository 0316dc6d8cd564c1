"""Adapter tiers: asynchronous slot copies (a request waits only for its own adapter), host-tier
misses read off the engine thread, runtime load/unload/list with stable ids, refusals with the reason,
and the metrics of it all. On the tiny model (CPU, fp32); the side stream is stood in for by copies
that complete only when the test says so."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from adapter_edit import clone_adapter

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, InvalidRequest, SamplingParams
from vlora.engine.async_engine import AsyncEngine
from vlora.engine.builder import build_engine
from vlora.metrics import NullMetrics
from vlora.lora.adapter import AdapterError
from vlora.lora.transfers import SlotCopies

A, B, C = "demo-r8-qv", "demo-r16-attn", "demo-r4-pattern"


class DeferredCopies(SlotCopies):
    """The side stream's stand-in on a CPU: a copy is queued, and runs only at ``complete``."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(torch.device("cpu"), num_slots)
        self.queued: dict[int, object] = {}
        self.waited: list[list[int]] = []

    def issue(self, slot, copy, source, note=None, done=None):
        self.queued[slot] = (copy, note, done)

    def ready(self, slot):
        return slot not in self.queued

    def complete(self):
        for copy, note, done in self.queued.values():
            copy()
            if note is not None:
                note()
            if done is not None:
                done()
        self.queued.clear()

    def synchronize(self):
        self.complete()

    @property
    def in_flight(self):
        return bool(self.queued)

    def wait(self, slots):
        self.waited.append(sorted(s for s in set(slots) if s >= 0))


class Recorder(NullMetrics):
    def __init__(self):
        self.swaps: list[tuple[str, str]] = []
        self.requests: list[tuple[dict, dict]] = []
        self.resident: list[tuple[int, int]] = []

    def adapter_swap(self, kind, lora_name):
        self.swaps.append((kind, lora_name))

    def adapter_requests(self, running, waiting):
        self.requests.append((dict(running), dict(waiting)))

    def adapters_resident(self, gpu, host):
        self.resident.append((gpu, host))


@pytest.fixture()
def root(demo_adapter_root, tmp_path) -> Path:
    """A private adapter root (three demo adapters) that a test may add folders to."""
    out = tmp_path / "adapters"
    out.mkdir()
    for name in (A, B, C):
        shutil.copytree(demo_adapter_root / name, out / name)
    return out


def _cfg(tiny_model_dir, root, **over):
    base = {"model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
            "model.dtype": "float32", "lora.max_rank": "16", "lora.max_gpu_adapters": "2", "lora.max_cpu_adapters": "2"}
    base.update({k: str(v) for k, v in over.items()})
    return EngineConfig().with_overrides(base)


def _req(rid, lora=None, max_tokens=6, prompt="How many circles?"):
    return GenerationRequest(rid, prompt, lora_name=lora, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _add(engine, r, outs):
    engine.add_request(engine.inputs.prepare(r), lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)


def _use_copies(engine, copies):
    """``copies`` in place of the engine's slot copies, wired to its LoRA manager as the manager wires its own."""
    engine.loras.copies = copies
    copies.on_failed = engine.loras._copy_failed
    copies.on_timed = engine.loras._copy_timed


def _drain(engine, outs, n, timeout=30.0):
    deadline = time.monotonic() + timeout
    while len(outs) < n:
        assert time.monotonic() < deadline, f"only {len(outs)} of {n} finished"
        if engine.step() is None:
            time.sleep(0.001)


def test_a_request_waits_only_for_its_own_adapter_copy(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    copies = DeferredCopies(2)
    _use_copies(engine, copies)
    outs = {}
    _add(engine, _req("base", max_tokens=12), outs)
    engine.step()
    _add(engine, _req("late", lora=A), outs)
    for _ in range(3):  # the copy of A is in flight: the base request decodes alone, "late" waits
        assert engine.step().request_ids == ["base"]
        assert [e["ready"] for e in engine.loras.describe([A])] == [False]
    slot = engine.loras.resident[A]
    copies.complete()
    assert engine.step().admitted == ["late"]
    assert slot in copies.waited[-1], "the step did not wait on the copy of the slot it reads"
    _drain(engine, outs, 2)
    # The same request once the adapter is resident: the deferred copy changed nothing.
    again = {}
    _add(engine, _req("again", lora=A), again)
    _drain(engine, again, 1)
    assert outs["late"].text == again["again"].text and outs["late"].finish_reason == "length"
    assert engine.loras.swaps_in == 1


def test_a_slot_being_filled_or_pinned_is_never_overwritten(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root, **{"lora.max_cpu_adapters": 4}))
    loras = engine.loras
    copies = DeferredCopies(2)
    _use_copies(engine, copies)
    for name in (A, B, C):
        loras.validate(name)
    assert loras.try_acquire(A) is None  # copy queued into one slot
    a_slot = loras.resident[A]
    assert loras.try_acquire(B) is None  # the other slot
    assert loras.try_acquire(C) is None and C not in loras.resident  # both slots busy filling: C waits
    copies.complete()
    assert loras.try_acquire(A) == a_slot  # pinned now
    assert loras.try_acquire(C) is None and loras.resident[C] != a_slot  # takes B's unpinned slot, not A's
    c_slot = loras.resident[C]
    copies.complete()
    assert loras.acquire(B) == c_slot  # blocking: C's slot was free, B's copy is waited for
    assert loras.try_acquire(C) is None and loras.acquire(C) is None  # every slot is pinned now
    loras.release(a_slot)
    loras.release(c_slot)


def test_blocking_acquire_waits_for_the_copy(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    _use_copies(engine, DeferredCopies(2))
    slot = engine.loras.acquire(A)
    assert slot is not None and engine.loras.copies.ready(slot)
    engine.loras.release(slot)


def test_host_tier_miss_is_read_off_the_engine_thread(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    outs = {}
    prepared = engine.inputs.prepare(_req("a", lora=A))
    engine.loras.validate(B)
    engine.loras.validate(C)  # host tier of 2: A, read first and in no slot, is evicted
    assert [e["tier"] for e in engine.loras.describe([A])] == ["disk"]
    _add(engine, _req("base", max_tokens=12), outs)
    engine.step()
    loras, read, readers = engine.loras, engine.loras._read, []
    release = threading.Event()

    def held_read(name, **kw):  # the disk read, held until the test lets it finish
        readers.append(threading.current_thread().name)
        assert release.wait(30)
        return read(name, **kw)

    loras._read = held_read
    engine.add_request(prepared, lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    ran = engine.step()  # A's read started on the loader thread when "a" arrived; the step went on without it
    assert ran.request_ids == ["base"]
    release.set()
    _drain(engine, outs, 2)
    assert outs["a"].finish_reason == "length" and not outs["a"].error
    assert len(readers) == 1 and readers[0].startswith("vlora-adapter-loader"), readers


def test_adapters_of_arriving_requests_are_read_before_their_admission(tiny_model_dir, root):
    """A request is validated (its adapter read into the host tier) when it is prepared; one whose adapter
    the host tier dropped meanwhile has it read again when it reaches the engine, not when a batch place
    frees up for it. The answers are the same."""
    engine = build_engine(_cfg(tiny_model_dir, root, **{"scheduler.max_batch_size": 1}))
    loras = engine.loras
    outs = {}
    _add(engine, _req("base", max_tokens=8), outs)
    engine.step()
    prepared = [engine.inputs.prepare(_req(rid, lora=name)) for rid, name in (("a", A), ("b", B), ("c", C))]
    assert [e["tier"] for e in loras.describe([A])] == ["disk"]  # the host tier holds 2: A was dropped
    before = loras.read_bytes
    for p in prepared:
        engine.add_request(p, lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    deadline = time.monotonic() + 30
    while [e["tier"] for e in loras.describe([A])] != ["cpu"]:
        assert time.monotonic() < deadline, loras.describe([A, B, C])
        time.sleep(0.01)
    assert loras.read_bytes > before and loras.read_seconds > 0
    assert not any(s.req.lora_name for s in engine.scheduler.running), "an adapter request was admitted"
    _drain(engine, outs, 4)
    assert all(o.finish_reason == "length" and not o.error for o in outs.values())
    again = {}
    _add(engine, _req("a2", lora=A), again)
    _drain(engine, again, 1)
    assert again["a2"].text == outs["a"].text


def test_ids_are_stable_across_unload_and_load(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    loras = engine.loras
    listed = engine.describe_adapters()
    assert [e["name"] for e in listed] == sorted((A, B, C))
    assert [e["id"] for e in listed] == [1, 2, 3]  # in name order at start
    assert all(e["tier"] == "disk" and e["loaded"] and e["rank"] is None for e in listed)

    shutil.copytree(root / A, root / "added-later")  # a folder added after start
    assert loras.load("added-later") is True
    assert loras.load("added-later") is False  # already loaded: not read again
    (entry,) = engine.describe_adapters(["added-later"])
    assert entry["id"] == 4 and entry["tier"] == "cpu" and entry["rank"] == 8
    assert entry["target_modules"] == ["q_proj", "v_proj"]

    outs = {}
    _add(engine, _req("x", lora="added-later"), outs)
    _drain(engine, outs, 1)
    assert [e["tier"] for e in engine.describe_adapters(["added-later"])] == ["cpu-slot"]  # a device slot of this CPU engine
    engine.unload_adapter("added-later")
    (entry,) = engine.describe_adapters(["added-later"])
    assert entry["loaded"] is False and entry["tier"] == "disk" and entry["id"] == 4
    with pytest.raises(InvalidRequest, match="unloaded"):
        engine.inputs.prepare(_req("y", lora="added-later"))
    assert loras.load("added-later") is True
    assert loras.adapter_id("added-later") == 4
    assert {e["name"]: e["id"] for e in engine.describe_adapters()} == {**{e["name"]: e["id"] for e in listed}, "added-later": 4}
    _add(engine, _req("z", lora="added-later"), outs)
    _drain(engine, outs, 2)
    assert outs["z"].text == outs["x"].text


def test_malformed_or_unsupported_adapters_are_refused_with_the_reason(tiny_model_dir, root, demo_adapter_root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    shutil.copytree(demo_adapter_root / "demo-r32-mlp", root / "rank-too-high")
    (root / "not-json").mkdir()
    (root / "not-json" / "adapter_config.json").write_text("{oops")
    shutil.copy(root / A / "adapter_model.safetensors", root / "not-json")
    vision_key = "base_model.model.model.vision_tower.layers.0.q_proj.lora_A.weight"
    clone_adapter(root, A, "vision-target", edit_tensors=lambda t: t.__setitem__(vision_key, torch.zeros(8, 8)))
    cases = {"rank-too-high": "rank 32", "not-json": "not valid JSON", "vision-target": "unsupported target module",
             "no-such-adapter": "unknown adapter", "../escape": "invalid adapter name"}
    for name, reason in cases.items():
        with pytest.raises(AdapterError, match=reason):
            engine.loras.load(name)
    listed = {e["name"]: e for e in engine.describe_adapters()}
    assert listed["rank-too-high"]["rank"] is None and listed["rank-too-high"]["tier"] == "disk"
    outs = {}  # ...and the engine goes on serving
    _add(engine, _req("ok", lora=A), outs)
    _drain(engine, outs, 1)
    assert outs["ok"].finish_reason == "length"


def test_unload_is_deferred_until_running_and_waiting_requests_finish(tiny_model_dir, root):
    """Unload under traffic: new requests and loads are refused at once, the admitted ones finish, and the
    last one to finish completes the unload."""
    engine = build_engine(_cfg(tiny_model_dir, root, **{"scheduler.max_batch_size": 1}))
    outs = {}
    _add(engine, _req("long", lora=A, max_tokens=20), outs)
    _add(engine, _req("queued", lora=A, max_tokens=4), outs)
    engine.step()
    prepared = engine.inputs.prepare(_req("raced", lora=A))  # validated before the unload, admitted after it
    done = []
    entry = engine.unload_adapter(A, on_unloaded=done.append)
    assert entry["state"] == "unloading" and entry["loaded"] and (entry["running"], entry["waiting"]) == (1, 1)
    assert not done
    with pytest.raises(InvalidRequest, match=f"adapter '{A}' is being unloaded"):
        engine.inputs.prepare(_req("new", lora=A))
    with pytest.raises(AdapterError, match="being unloaded: load it again once its unload has finished"):
        engine.loras.load(A)
    again = engine.unload_adapter(A)  # a second unload joins the first
    assert again["state"] == "unloading"
    engine.add_request(prepared, lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    _drain(engine, outs, 2)
    assert engine.describe_adapters([A])[0]["state"] == "unloading"  # "raced" still waits for a slot
    _drain(engine, outs, 3)
    for rid, n in (("long", 20), ("queued", 4), ("raced", 6)):
        assert outs[rid].finish_reason == "length" and not outs[rid].error and outs[rid].num_output_tokens == n
    assert len(done) == 1 and done[0]["state"] == "unloaded" and done[0]["loaded"] is False
    assert engine.describe_adapters([A])[0]["state"] == "unloaded"
    assert engine.loras.resident == {} and all(p == 0 for p in engine.loras._pins)
    # Validated, then unloaded before the engine admits it: the request fails with the reason.
    prepared = engine.inputs.prepare(_req("late", lora=B))
    assert engine.unload_adapter(B)["state"] == "unloaded"  # nothing used it: at once
    engine.add_request(prepared, lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    engine.step()
    assert outs["late"].finish_reason == "error" and "unloaded" in outs["late"].error
    with pytest.raises(AdapterError, match="unknown adapter"):
        engine.unload_adapter("no-such-adapter")
    assert engine.loras.load(A) is True  # loaded again once unloaded
    _add(engine, _req("back", lora=A, max_tokens=20), outs)
    _drain(engine, outs, 5)
    assert outs["back"].text == outs["long"].text


def test_cancelling_the_last_request_completes_the_unload(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    outs = {}
    _add(engine, _req("slow", lora=A, max_tokens=50), outs)
    engine.step()
    done = []
    assert engine.unload_adapter(A, on_unloaded=done.append)["state"] == "unloading"
    engine.abort("slow")
    engine.step()
    assert outs["slow"].finish_reason == "cancelled"
    assert [d["state"] for d in done] == ["unloaded"] and engine.loras.resident == {}


def test_unloading_a_merged_adapter_in_use_unmerges_it_when_its_requests_finish(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root, **{"orchestrator.policy": "merge-only"}))
    outs = {}
    for i in range(3):
        _add(engine, _req(f"m{i}", lora=A, max_tokens=10), outs)
    engine.step()
    assert engine.orchestrator.merged == A
    assert engine.unload_adapter(A)["state"] == "unloading"
    _drain(engine, outs, 3)
    assert all(o.finish_reason == "length" and not o.error for o in outs.values())
    assert engine.orchestrator.merged is None and all(p == 0 for p in engine.loras._pins)
    assert engine.describe_adapters([A])[0]["state"] == "unloaded"


def test_unloading_the_merged_adapter_unmerges_it_first(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root, **{"orchestrator.policy": "merge-only"}))
    outs = {}
    for i in range(3):
        _add(engine, _req(f"m{i}", lora=A), outs)
    _drain(engine, outs, 3)
    assert engine.orchestrator.merged == A
    engine.unload_adapter(A)
    assert engine.orchestrator.merged is None and all(p == 0 for p in engine.loras._pins)
    assert engine.loras.load(A) is True
    again = {}
    _add(engine, _req("m0", lora=A), again)
    _drain(engine, again, 1)
    assert again["m0"].text == outs["m0"].text


def test_registered_adapters_keep_working(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    weights = engine.loras.validate(A)
    engine.loras.register("in-memory", weights)
    (entry,) = engine.describe_adapters(["in-memory"])
    assert entry["source"] == "memory" and entry["tier"] == "cpu" and entry["id"] == 4
    outs = {}
    _add(engine, _req("mem", lora="in-memory"), outs)
    _add(engine, _req("disk", lora=A), outs)
    _drain(engine, outs, 2)
    assert outs["mem"].text == outs["disk"].text


def test_async_engine_adapter_actions_and_metrics(tiny_model_dir, root):
    rec = Recorder()
    engine = AsyncEngine(_cfg(tiny_model_dir, root), metrics=rec)
    try:
        assert [e["name"] for e in engine.adapters()] == sorted((A, B, C))
        shutil.copytree(root / B, root / "hot")
        loaded = engine.load_adapter("hot")
        assert loaded["name"] == "hot" and loaded["id"] == 4 and loaded["tier"] == "cpu" and loaded["rank"] == 16
        done = []
        for i, name in enumerate(("hot", A, C, "hot")):  # three adapters through two slots: evictions
            engine.submit(engine.prepare(_req(f"r{i}", lora=name)), lambda o: done.append(o) if o.finished else None)
        deadline = time.monotonic() + 30
        while len(done) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        eng = engine.engine
        assert len(done) == 4 and all(o.finish_reason == "length" for o in done), (
            [o.request_id for o in done], [s.req.request_id for s in eng.waiting], eng.loras.resident, eng.loras._pending)
        unloaded = engine.unload_adapter("hot")
        assert unloaded["loaded"] is False and unloaded["id"] == 4 and unloaded["state"] == "unloaded"
        with pytest.raises(AdapterError, match="unknown adapter"):
            engine.load_adapter("missing")
    finally:
        engine.shutdown()
    kinds = {k for k, _ in rec.swaps}
    assert {"gpu_load", "gpu_eviction", "host_load", "host_eviction"} <= kinds, rec.swaps
    assert ("host_load", "hot") in rec.swaps and ("gpu_load", "hot") in rec.swaps
    assert any(running.get("hot") for running, _ in rec.requests), rec.requests
    assert rec.requests[-1] == ({}, {}), "the per-adapter gauges did not go back to zero"
    assert rec.resident and max(g for g, _ in rec.resident) <= 2


def test_async_engine_unload_waits_for_its_requests_up_to_the_timeout(tiny_model_dir, root):
    engine = AsyncEngine(_cfg(tiny_model_dir, root, **{"lora.unload_timeout_s": 30}))
    try:
        done = []
        engine.submit(engine.prepare(_req("long", lora=A, max_tokens=150)), lambda o: done.append(o) if o.finished else None)
        deadline = time.monotonic() + 30
        while not any(e["running"] for e in engine.adapters() if e["name"] == A):
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
        t0 = time.monotonic()
        early = engine.unload_adapter(A, timeout=0.05)  # the wait times out: the answer says so
        assert early["state"] == "unloading" and time.monotonic() - t0 < 5
        assert [e["state"] for e in engine.adapters() if e["name"] == A] == ["unloading"]
        with pytest.raises(InvalidRequest, match="being unloaded"):
            engine.prepare(_req("new", lora=A))
        final = engine.unload_adapter(A)  # waits (lora.unload_timeout_s) for the request to finish
        assert final["state"] == "unloaded" and final["loaded"] is False
        assert len(done) == 1 and done[0].finish_reason == "length" and done[0].num_output_tokens == 150
        assert engine.unload_adapter(A, timeout=0)["state"] == "unloaded"  # twice: not an error
    finally:
        engine.shutdown()


def test_cpu_slot_copies_are_synchronous():
    copies = SlotCopies(torch.device("cpu"), 2)
    ran = []
    copies.issue(0, lambda: ran.append(0), None)
    assert ran == [0] and copies.ready(0) and not copies.in_flight
    copies.wait([0, 1])  # nothing to wait for off CUDA


def test_a_failed_slot_copy_leaves_no_slot_holding_half_an_adapter(tiny_model_dir, root):
    """A copy that fails on the copy thread (a CUDA error) empties its slot: the adapter is forgotten there, and
    its waiting request gets a slot filled again instead of reading half-copied weights."""
    engine = build_engine(_cfg(tiny_model_dir, root))
    copies = DeferredCopies(2)
    _use_copies(engine, copies)
    outs = {}
    _add(engine, _req("late", lora=A), outs)
    engine.step()
    slot = engine.loras.resident[A]
    del copies.queued[slot]  # the copy thread's copy raised: ready() reports it once
    copies.on_failed(slot, RuntimeError("CUDA error: an illegal memory access"))
    assert A not in engine.loras.resident and engine.loras.slot_identity(slot) == "None@"
    engine.step()  # "late" asks again: a slot is filled anew
    assert engine.loras.swaps_in == 2 and A in engine.loras.resident
    copies.complete()
    _drain(engine, outs, 1)
    assert outs["late"].finish_reason == "length" and not outs["late"].error


class FailingCopies(SlotCopies):
    """Copies that fail on the copy thread, seen through the real ``ready`` (the engine thread's only look)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(torch.device("cpu"), num_slots)
        self.issued = 0

    def issue(self, slot, copy, source, note=None, done=None):
        from vlora.lora.transfers import _Copy

        job = _Copy(copy, note, source, None)
        job.done = done
        job.error = RuntimeError("CUDA error: an illegal memory access")
        job.issued.set()
        self._jobs[slot] = job
        self.issued += 1


def test_a_request_never_runs_on_a_slot_whose_copy_failed(tiny_model_dir, root):
    """ready() reports a failed copy and empties the slot: try_acquire must not pin that slot for the adapter (its
    request would decode with no adapter, or another's). The request waits for a new copy, and after
    MAX_COPY_FAILURES failures in a row it is answered with the error; the next request tries again."""
    engine = build_engine(_cfg(tiny_model_dir, root))
    copies = FailingCopies(2)
    _use_copies(engine, copies)
    outs = {}
    _add(engine, _req("late", lora=A), outs)
    deadline = time.monotonic() + 30
    while "late" not in outs:
        assert time.monotonic() < deadline
        assert A not in engine.loras.resident or copies._jobs[engine.loras.resident[A]] is not None
        engine.step()
    assert outs["late"].error and "copying it into device memory failed 3 times" in outs["late"].error
    assert copies.issued == engine.loras.MAX_COPY_FAILURES and A not in engine.loras.resident
    _use_copies(engine, SlotCopies(torch.device("cpu"), 2))  # the device recovers: the next request is served
    _add(engine, _req("next", lora=A), outs)
    _drain(engine, outs, 2)
    assert outs["next"].finish_reason == "length" and not outs["next"].error


def test_pinned_landing_takes_first_fit_ranges_and_merges_them_back():
    from vlora.lora.transfers import PinnedLanding

    land = PinnedLanding(1024, pin_memory=False)
    a, b, c = land.take(256), land.take(512), land.take(256)
    assert (a, b, c) == (0, 256, 768) and land.take(1) is None and land.free_bytes == 0
    land.give(b, 512)
    assert land.take(768) is None and land.take(256) == 256  # first fit, inside the freed range
    land.give(a, 256)
    land.give(c, 256)
    land.give(256, 256)
    assert land.free_bytes == 1024 and land.take(1024) == 0  # coalesced back into one range
    land.give(0, 1024)
    src = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(5, dtype=torch.bfloat16)]
    start = land.take(PinnedLanding.size_of(src))
    views = land.land(start, src)
    assert PinnedLanding.size_of(src) == 512 and all(torch.equal(v, s) and v.dtype == s.dtype for v, s in zip(views, src))


def _with_landing(engine, nbytes):
    from vlora.lora.transfers import PinnedLanding

    engine.loras._landing = PinnedLanding(nbytes, pin_memory=False)  # what a CUDA engine makes at start, page-locked
    return engine.loras._landing


def test_a_cold_read_lands_for_its_first_slot_copy_and_gives_the_range_back(tiny_model_dir, root):
    """A read for a request lands in the landing memory; its slot copy reads the landed copy, gives the range back
    once complete, and the tokens equal those of a server without landing memory."""
    plain = build_engine(_cfg(tiny_model_dir, root))
    want = {}
    _add(plain, _req("ref", lora=A), want)
    _drain(plain, want, 1)

    engine = build_engine(_cfg(tiny_model_dir, root))
    copies = DeferredCopies(2)
    _use_copies(engine, copies)
    land = _with_landing(engine, 16 << 20)
    outs = {}
    _add(engine, _req("late", lora=A), outs)
    deadline = time.monotonic() + 30
    while A not in engine.loras.resident:
        assert time.monotonic() < deadline
        engine.step()
    assert engine.loras.landed_copies == 1 and land.free_bytes < land.nbytes  # held by the copy in flight
    copies.complete()
    assert land.free_bytes == land.nbytes
    _drain(engine, outs, 1)
    assert outs["late"].text == want["ref"].text and not outs["late"].error


def test_an_idle_loader_thread_holds_nothing_of_its_last_task():
    """A loader thread that waits for its next task holds neither its last task's arguments nor its result (an
    adapter's weights: they would outlive the host tier's eviction)."""
    import gc
    import weakref

    from vlora.lora.transfers import AdapterLoader

    class Weights:
        pass

    loader = AdapterLoader(max_workers=1)
    arg = Weights()
    fut = loader.submit(lambda a: Weights(), arg)
    result = weakref.ref(fut.result(timeout=10))
    passed = weakref.ref(arg)
    time.sleep(0.05)  # the worker is idle again, waiting for a task
    del fut, arg
    gc.collect()
    assert result() is None and passed() is None
    loader.shutdown()


def test_landing_memory_full_gives_back_the_oldest_unused_landing(tiny_model_dir, root):
    """Room for one adapter: a second read finds no room while the first landing is young, and takes its range once
    it has gone unused past lora.load_timeout_s. An unload gives back what it landed."""
    engine = build_engine(_cfg(tiny_model_dir, root, **{"lora.max_cpu_adapters": 4}))
    loras = engine.loras
    need = max(sum(-(-t.numel() * t.element_size() // 256) * 256 for p in loras.validate(n).pairs.values()
                   for t in (p.a, p.b)) for n in (A, B))
    land = _with_landing(engine, need + 256)  # room for either, not both
    loras._read_into_host(A, 0)
    assert list(loras._landed) == [A]
    loras._read_into_host(B, 0)
    assert list(loras._landed) == [A]  # A's landing is young: the next copy of a burst; B is served as before
    loras._landed[A] = loras._landed[A][:4] + (time.monotonic() - 3600,)  # unused for an hour: its request went away
    loras._read_into_host(B, 0)
    assert list(loras._landed) == [B]  # A's landing was given back for B's
    loras.unload(B)
    assert not loras._landed and land.free_bytes == land.nbytes


class InlineDeviceCopies(SlotCopies):
    """A CUDA server's slot copies, run inline on a CPU: the manager takes its device path (a copy plan per slot,
    the sources and scales in its order, landed sources copied as page-locked ones)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(torch.device("cpu"), num_slots)
        self.cuda = True
        self.put_calls: list[str] = []

    def put_many(self, dsts, srcs):
        self.put_calls.append("staged")
        torch._foreach_copy_(list(dsts), list(srcs))

    def put_pinned(self, dsts, srcs):
        self.put_calls.append("pinned")
        torch._foreach_copy_(list(dsts), list(srcs))

    def issue(self, slot, copy, source, note=None, done=None):
        copy()
        note()
        if done is not None:
            done()

    def wait(self, slots):  # every copy ran inline: nothing for a stream to wait on
        pass


def test_the_device_copy_path_plans_once_per_slot_and_ranks_and_matches_the_cpu_copies(tiny_model_dir, root):
    """The copy thread's path (LoraLinear.copy_plan, made on the engine thread, reused while a slot's ranks stay):
    adapters of different ranks in turn in one slot, the first read landed, the same tokens as the CPU copies."""
    plain = build_engine(_cfg(tiny_model_dir, root, **{"lora.max_gpu_adapters": 1}))
    engine = build_engine(_cfg(tiny_model_dir, root, **{"lora.max_gpu_adapters": 1}))
    copies = InlineDeviceCopies(1)
    _use_copies(engine, copies)
    _with_landing(engine, 16 << 20)
    for i, name in enumerate([A, B, A, A]):
        want, got = {}, {}
        _add(plain, _req(f"p{i}", lora=name), want)
        _drain(plain, want, 1)
        if i == 3:  # out of its slot: copied again from the host tier with the plan cached for its ranks
            engine.loras._empty_slot(0)
        _add(engine, _req(f"e{i}", lora=name), got)
        _drain(engine, got, 1)
        assert got[f"e{i}"].text == want[f"p{i}"].text and not got[f"e{i}"].error
    # A and B landed at their first reads; A's second and third copies came from the host tier (the second a new
    # plan, as B's ranks were in the slot, the third the cached one)
    assert copies.put_calls == ["pinned", "pinned", "staged", "staged"]
    assert engine.loras._copy_plans[0][0] == tuple(0 if p is None else p.rank for p in [
        engine.loras._host[A].pairs.get(k) for k in engine.loras.layers])


def _poisoned(root, name, edit):
    """A copy of demo adapter A under ``name`` whose safetensors ``edit`` changed (tensors by key, in place)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(root / A, root / name)
    path = root / name / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    return sorted(k for k in tensors if "lora_B" in k)


def _add_unread(engine, r, outs):
    """As the server admits a request: its adapter is read on a loader thread once queued, not at admission."""
    engine.add_request(engine.inputs.preprocess(engine.inputs.check(r, wait_adapter=False)),
                       lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)


def test_values_checked_on_the_device_after_the_copy(tiny_model_dir, root):
    """On CUDA a request's read leaves the checks of the values to its slot copy, which takes the norms of what it
    wrote (here forced on the CPU engine). A non-finite value or a gain past the bound is refused by layer and module
    before any step reads the slot: the request gets the error at once (no copy again), the slot and the host copy
    are dropped; the other requests are served with the tokens of host-checked weights."""
    from vlora.lora.adapter import MAX_LORA_GAIN

    keys = _poisoned(root, "nan-b", lambda t: t[sorted(k for k in t if "lora_B" in k)[3]].__setitem__((0, 0), float("nan")))
    _poisoned(root, "huge", lambda t: [t[k].fill_(MAX_LORA_GAIN) for k in t])
    bad_layer = int(keys[3].split(".layers.")[1].split(".")[0])
    bad_module = keys[3].split(".lora_B")[0].rsplit(".", 1)[1]

    def serve(on_device):
        engine = build_engine(_cfg(tiny_model_dir, root))
        engine.loras._check_on_device = on_device
        outs = {}
        for r in (_req("nan", lora="nan-b"), _req("huge", lora="huge"), _req("good", lora=A), _req("base")):
            _add_unread(engine, r, outs)
        _drain(engine, outs, 4)
        return engine, outs

    engine, outs = serve(True)
    assert engine.loras._host.get(A) is not None and not engine.loras._host[A].values_checked  # checked on the "device"
    assert outs["nan"].finish_reason == "error"
    assert f"adapter 'nan-b': module {bad_module} of layer {bad_layer}: lora_B holds non-finite values" in outs["nan"].error
    assert outs["huge"].finish_reason == "error" and f"exceeds {MAX_LORA_GAIN:g}" in outs["huge"].error
    assert engine.loras.swaps_in == 3  # one copy each: a refused adapter is not copied again for its request
    for name in ("nan-b", "huge"):
        assert name not in engine.loras.resident and name not in engine.loras._host
    host_checked, want = serve(False)
    assert "non-finite" in want["nan"].error and host_checked.loras._host[A].values_checked
    for rid in ("good", "base"):
        assert outs[rid].finish_reason == "length" and outs[rid].text == want[rid].text
    # a later request for the refused adapter reads it again and gets the same answer
    again = {}
    _add_unread(engine, _req("nan-again", lora="nan-b"), again)
    _drain(engine, again, 1)
    assert "lora_B holds non-finite values" in again["nan-again"].error
