"""vlora.engine.graphs.capture_graph, the one capture sequence of every graph set (decode, prefill, vision), on a
CPU: torch.cuda's stream and graph calls are recorded instead of run. The body runs twice on a side stream before
the capture and once inside it; the compute stream waits for the warm-ups; the memory pool is made once and then
passed on; the capture is thread-local. (tests/gpu runs the graphs themselves.)"""
from __future__ import annotations

import contextlib

import torch

from vlora.engine import graphs


def test_the_body_warms_up_on_a_side_stream_then_is_captured_once_into_the_shared_pool(monkeypatch):
    events: list = []

    class Stream:
        def __init__(self, device=None):
            self.name = "side"

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    compute = Stream()
    compute.name = "compute"

    @contextlib.contextmanager
    def stream(s):
        events.append(("enter", s.name))
        yield
        events.append(("exit", s.name))

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        events.append(("capture", pool, capture_error_mode))
        yield
        events.append(("captured",))

    pools = iter(["pool-1", "pool-2"])
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    calls = iter(range(10))

    def body():
        n = next(calls)
        events.append(("body", n))
        return n

    g, out, pool = graphs.capture_graph(torch.device("cpu"), body, None)
    assert (g, out, pool) == ("graph", 2, "pool-1")  # the captured call's result, not a warm-up's
    assert events == [("wait", "side", "compute"), ("enter", "side"), ("body", 0), ("body", 1), ("exit", "side"),
                      ("wait", "compute", "side"), ("capture", "pool-1", "thread_local"), ("body", 2), ("captured",)]
    events.clear()
    assert graphs.capture_graph(torch.device("cpu"), body, pool)[2] == "pool-1"  # the pool is shared, not remade
    assert ("capture", "pool-1", "thread_local") in events
