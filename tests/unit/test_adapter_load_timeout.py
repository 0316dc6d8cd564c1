"""Adapter reads run on the loader threads with lora.load_timeout_s: a read that hangs is refused with
a clear error within the bound (validate, load and the engine's own reads), callers share one read,
and the thread that asked is never the one reading."""
from __future__ import annotations

import shutil
import threading
import time

import pytest

from vlora.config import EngineConfig
from vlora.engine.builder import build_engine
from vlora.lora import manager as manager_module
from vlora.lora.adapter import AdapterError

pytestmark = pytest.mark.timeout(120)
SOURCE = "demo-r8-qv"


@pytest.fixture()
def setup(tiny_model_dir, demo_adapter_root, tmp_path, monkeypatch):
    root = tmp_path / "adapters"
    root.mkdir()
    for name in (SOURCE, "slow"):
        shutil.copytree(demo_adapter_root / SOURCE, root / name)
    cfg = EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "16", "lora.load_timeout_s": "0.5"})
    engine = build_engine(cfg)
    readers: list[str] = []
    release = threading.Event()
    original = manager_module.load_adapter

    def load_adapter(root, name, **kw):
        readers.append(threading.current_thread().name)
        if name == "slow":
            release.wait(10)  # a disk that does not answer
        return original(root, name, **kw)

    monkeypatch.setattr(manager_module, "load_adapter", load_adapter)
    yield engine, readers
    release.set()
    engine.loras.close()


def test_a_hanging_read_times_out_with_a_clear_error(setup):
    engine, readers = setup
    loras = engine.loras
    errors: list[Exception] = []

    def validate():
        try:
            loras.validate("slow")
        except AdapterError as e:
            errors.append(e)

    t0 = time.monotonic()
    callers = [threading.Thread(target=validate) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(5)
    assert time.monotonic() - t0 < 3
    assert len(errors) == 3 and all("'slow': loading timed out after 0.5 s" in str(e) for e in errors)
    assert readers.count(readers[0]) == len(readers) == 1  # one shared read
    with pytest.raises(AdapterError, match="timed out after 0.5 s"):
        loras.load("slow")
    # Another adapter is read meanwhile, on a loader thread, not on the caller's.
    assert loras.validate(SOURCE) is not None and loras.load(SOURCE) is False
    assert all(name.startswith("vlora-adapter-loader") for name in readers)


def test_the_engine_thread_gives_up_on_a_hanging_read(setup):
    engine, _ = setup
    loras = engine.loras
    assert loras.try_acquire("slow") is None  # the read started on a loader thread
    deadline = time.monotonic() + 5
    with pytest.raises(AdapterError, match="timed out after 0.5 s"):
        while time.monotonic() < deadline:
            assert loras.try_acquire("slow") is None
            time.sleep(0.05)
    assert loras.acquire(SOURCE) >= 0  # others still load


def test_the_server_admission_does_not_wait_for_a_cold_adapter(tiny_model_dir, demo_adapter_root, tmp_path, monkeypatch):
    """AsyncEngine.generate (what the Triton model calls in execute()) returns at once for a request whose adapter
    is being read; the read happens once the request is queued, and a base request sent after it is answered
    first. A broken adapter still fails its request with the reason (now at admission)."""
    from vlora.engine.api import GenerationRequest, SamplingParams
    from vlora.engine.async_engine import AsyncEngine

    root = tmp_path / "adapters"
    root.mkdir()
    for name in ("slow", "broken"):
        shutil.copytree(demo_adapter_root / SOURCE, root / name)
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    release = threading.Event()
    original = manager_module.load_adapter

    def load_adapter(root_, name, **kw):
        if name == "slow":
            release.wait(10)
        return original(root_, name, **kw)

    monkeypatch.setattr(manager_module, "load_adapter", load_adapter)
    aeng = AsyncEngine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "16", "lora.load_timeout_s": "30"}))
    try:
        done: dict = {}
        events = {k: threading.Event() for k in ("slow", "base", "broken")}

        def callback(key):
            def deliver(out):
                if out.finished:
                    done[key] = (time.monotonic(), out.error)
                    events[key].set()
            return deliver

        def refuse(e):
            raise AssertionError(f"refused: {e}")

        sampling = SamplingParams(max_tokens=2, ignore_eos=True)
        t0 = time.monotonic()
        aeng.generate(GenerationRequest("slow", "Hello", lora_name="slow", sampling=sampling), callback("slow"), refuse)
        assert time.monotonic() - t0 < 0.5, "generate() waited for the adapter's read"
        aeng.generate(GenerationRequest("base", "Hello", sampling=sampling), callback("base"), refuse)
        assert events["base"].wait(30) and done["base"][1] is None
        assert not events["slow"].is_set()  # still reading: it held up nothing
        release.set()
        assert events["slow"].wait(30) and done["slow"][1] is None
        aeng.generate(GenerationRequest("broken", "Hello", lora_name="broken", sampling=sampling), callback("broken"), refuse)
        assert events["broken"].wait(30)
        assert "broken" in (done["broken"][1] or "") and "safetensors" in done["broken"][1], done["broken"]
        unknown: list = []
        aeng.generate(GenerationRequest("nope", "Hello", lora_name="nope", sampling=sampling), callback("base"), unknown.append)
        assert unknown and "unknown adapter 'nope'" in str(unknown[0])  # still refused at once
    finally:
        release.set()
        aeng.shutdown()
