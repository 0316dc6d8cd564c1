"""Adapter tiers: asynchronous slot copies (a request waits only for its own adapter), host-tier
misses read off the engine thread, runtime load/unload/list with stable ids, refusals with the reason,
and the metrics of it all. On the tiny model (CPU, fp32); the side stream is stood in for by copies
that complete only when the test says so."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from adapter_edit import clone_adapter

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, InvalidRequest, SamplingParams
from vlora.engine.async_engine import AsyncEngine
from vlora.engine.builder import build_engine
from vlora.engine.metrics import NullMetrics
from vlora.lora.adapter import AdapterError
from vlora.lora.manager import AdapterBusy, SlotCopies

A, B, C = "demo-r8-qv", "demo-r16-attn", "demo-r4-pattern"


class DeferredCopies(SlotCopies):
    """The side stream's stand-in on a CPU: a copy is queued, and runs only at ``complete``."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(torch.device("cpu"), num_slots)
        self.queued: dict[int, object] = {}
        self.waited: list[list[int]] = []

    def issue(self, slot, copy, source):
        self.queued[slot] = copy

    def ready(self, slot):
        return slot not in self.queued

    def complete(self):
        for copy in self.queued.values():
            copy()
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


def _drain(engine, outs, n, timeout=30.0):
    deadline = time.monotonic() + timeout
    while len(outs) < n:
        assert time.monotonic() < deadline, f"only {len(outs)} of {n} finished"
        if engine.step() is None:
            time.sleep(0.001)


def test_a_request_waits_only_for_its_own_adapter_copy(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    copies = DeferredCopies(2)
    engine.loras.copies = copies
    outs = {}
    _add(engine, _req("base", max_tokens=12), outs)
    engine.step()
    _add(engine, _req("late", lora=A), outs)
    for _ in range(3):  # the copy of A is in flight: the base request decodes alone, "late" waits
        engine.step()
        assert engine.last_step["request_ids"] == ["base"]
        assert [e["ready"] for e in engine.loras.describe([A])] == [False]
    slot = engine.loras.resident[A]
    copies.complete()
    engine.step()
    assert engine.last_step["admitted"] == ["late"]
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
    loras.copies = copies
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
    engine.loras.copies = DeferredCopies(2)
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
    engine.add_request(prepared, lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    engine.step()  # A's read started on the loader thread; the step went on without it
    assert engine.last_step["request_ids"] == ["base"]
    _drain(engine, outs, 2)
    assert outs["a"].finish_reason == "length" and not outs["a"].error


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
    assert [e["tier"] for e in engine.describe_adapters(["added-later"])] == ["gpu"]
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


def test_unload_is_refused_while_requests_use_the_adapter(tiny_model_dir, root):
    engine = build_engine(_cfg(tiny_model_dir, root))
    outs = {}
    _add(engine, _req("long", lora=A, max_tokens=20), outs)
    _add(engine, _req("queued", lora=A, max_tokens=4), outs)
    engine.step()
    with pytest.raises(AdapterBusy, match=r"2 running and 0 waiting"):
        engine.unload_adapter(A)
    _drain(engine, outs, 2)
    # Validated, then unloaded before the engine admits it: the request fails with the reason.
    prepared = engine.inputs.prepare(_req("raced", lora=A))
    engine.unload_adapter(A)
    assert engine.loras.resident == {} and all(p == 0 for p in engine.loras._pins)
    engine.add_request(prepared, lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    engine.step()
    assert outs["raced"].finish_reason == "error" and "unloaded" in outs["raced"].error
    with pytest.raises(AdapterError, match="unknown adapter"):
        engine.unload_adapter("no-such-adapter")


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
        assert unloaded["loaded"] is False and unloaded["id"] == 4
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


def test_cpu_slot_copies_are_synchronous():
    copies = SlotCopies(torch.device("cpu"), 2)
    ran = []
    copies.issue(0, lambda: ran.append(0), None)
    assert ran == [0] and copies.ready(0) and not copies.in_flight
    copies.wait([0, 1])  # nothing to wait for off CUDA
