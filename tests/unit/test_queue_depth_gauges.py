"""The running/waiting gauges follow the engine's queues when requests go away without another step
running: after every request of a full batch and its queue is cancelled, the last reported depth is
(0, 0) (the issue's cancel storm left 32 running and 7 waiting for minutes)."""
from __future__ import annotations

import threading
import time

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.async_engine import AsyncEngine
from vlora.metrics import NullMetrics


class DepthRecorder(NullMetrics):
    """Records every queue_depth report; the rest of EngineMetrics records nothing."""

    def __init__(self) -> None:
        self.depths: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def queue_depth(self, running: int, waiting: int) -> None:
        with self.lock:
            self.depths.append((running, waiting))

    def last(self):
        with self.lock:
            return self.depths[-1] if self.depths else None


def test_cancelling_everything_reports_an_empty_queue(tiny_model_dir, demo_adapter_root):
    config = EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "32", "scheduler.max_batch_size": "2"})
    metrics = DepthRecorder()
    engine = AsyncEngine(config, metrics=metrics)
    try:
        finished: dict[str, str] = {}
        done = threading.Condition()

        def collect(out):
            if out.finished:
                with done:
                    finished[out.request_id] = out.finish_reason
                    done.notify_all()

        ids = [f"r{i}" for i in range(5)]
        for rid in ids:
            req = GenerationRequest(request_id=rid, prompt="Count the circles.",
                                    sampling=SamplingParams(max_tokens=400, ignore_eos=True))
            engine.submit(engine.prepare(req), collect)
        deadline = time.monotonic() + 60
        while metrics.last() != (2, 3):  # a full batch of two runs, three wait
            assert time.monotonic() < deadline, f"depth never reached (2, 3): {metrics.depths[-5:]}"
            time.sleep(0.01)
        for rid in ids:
            engine.cancel(rid)
        with done:
            assert done.wait_for(lambda: len(finished) == len(ids), 60), finished
        assert set(finished.values()) == {"cancelled"}
        # No new request comes: the report of the step that processed the cancellations must be the last.
        deadline = time.monotonic() + 5
        while metrics.last() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metrics.last() == (0, 0), metrics.depths[-5:]
    finally:
        engine.shutdown()
