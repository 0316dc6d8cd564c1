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
