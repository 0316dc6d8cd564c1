"""The ATMM tuner sidecar shares the serving GPU: the engine stops it (SIGSTOP) while requests run and lets it
go on once the engine has been idle for a while. An H200 measured a one-image LLaVA-7B prefill step at 27.8 ms
beside a running tuner against 16.7 ms alone."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from vlora.atmm import tuner
from vlora.config import EngineConfig
from vlora.engine import async_engine
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.async_engine import AsyncEngine

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(sys.platform != "linux", reason="reads the process state from /proc")]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(") ")[1][0]


def _wait_state(pid: int, want: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while (got := _state(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def _sidecar(tmp_path) -> tuner.TunerSidecar:
    car = tuner.TunerSidecar(kernels=None, out=tmp_path / "t.json", tuner_args=[])
    car.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    return car


def test_pause_stops_the_child_resume_and_stop_end_it_cleanly(tmp_path):
    car = _sidecar(tmp_path)
    try:
        car.pause()
        car.pause()  # once is enough
        assert car.paused and car.pauses == 1 and _wait_state(car.proc.pid, "T") == "T"
        assert car.state().startswith("paused")
        car.resume()
        assert not car.paused and _wait_state(car.proc.pid, "S") == "S"
        car.pause()
        t0 = time.monotonic()
        car.stop()  # a stopped child still ends at once: SIGCONT, then SIGTERM
        assert car.proc.returncode is not None and time.monotonic() - t0 < 5
        car.pause()  # an ended child: nothing to do
        assert not car.paused
    finally:
        if car.proc.poll() is None:
            car.proc.kill()


def test_the_engine_holds_the_tuner_while_serving_and_lets_it_go_when_idle(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(async_engine, "TUNER_IDLE_RESUME_S", 0.3)
    aeng = AsyncEngine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": None, "model.device": "cpu"}))
    car = _sidecar(tmp_path)
    aeng.engine.tuner = car
    states: list[str] = []
    try:
        done = threading.Event()

        def on_output(out):
            states.append(_state(car.proc.pid))
            if out.finished:
                done.set()

        aeng.generate(GenerationRequest("p", "Hello there", sampling=SamplingParams(max_tokens=8, ignore_eos=True)),
                      on_output, lambda e: pytest.fail(str(e)))
        assert done.wait(60)
        assert states and set(states) == {"T"}, states  # stopped for every step of the request
        assert car.pauses == 1
        assert _wait_state(car.proc.pid, "S") == "S" and not car.paused  # idle 0.3 s: going on again
    finally:
        aeng.shutdown()
        car.stop()


def test_the_time_stopped_does_not_count_against_the_budget(tmp_path):
    """The child reads how long the engine held it stopped (written by resume()) and leaves it out of its
    atmm.tune_budget_s: a busy server stops it often, and a wall-clock budget would leave a partial table."""
    car = _sidecar(tmp_path)
    try:
        assert tuner.paused_seconds(car.paused_file) == 0.0  # nothing written yet
        car.pause()
        time.sleep(0.3)
        car.resume()
        first = tuner.paused_seconds(car.paused_file)
        assert 0.25 < first < 5 and first == pytest.approx(car.paused_s, abs=1e-3)
        car.pause()
        time.sleep(0.2)
        car.resume()
        assert tuner.paused_seconds(car.paused_file) > first + 0.15  # cumulative
        assert tuner.paused_seconds(None) == 0.0
        car.paused_file.write_text("garbage")
        assert tuner.paused_seconds(car.paused_file) == 0.0
    finally:
        car.stop()
