"""Scale: 1,000 registered adapters, 64 device slots and a 128-adapter host tier, under a
Zipf-distributed stream through the real engine thread (tiny model, CPU). No request fails, the
tiers stay within their bounds, and memory does not grow without bound."""
from __future__ import annotations

import json
import random
import resource
import threading

import pytest

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.async_engine import AsyncEngine
from vlora.lora.demo import DemoAdapter, write_adapter

N_ADAPTERS = 1000
N_REQUESTS = 240


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters-1000")
    text_config = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]
    for i in range(N_ADAPTERS):
        out = root / f"z{i:04d}"
        out.mkdir()
        write_adapter(DemoAdapter(out.name, r=4, alpha=8, modules=("q_proj", "v_proj"), seed=i), tiny_model_dir, text_config, out)
    return root


def zipf_names(n: int, alpha: float, rng: random.Random) -> list[str]:
    weights = [1.0 / (k + 1) ** alpha for k in range(N_ADAPTERS)]
    return [f"z{k:04d}" for k in rng.choices(range(N_ADAPTERS), weights=weights, k=n)]


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_zipf_stream_over_1000_adapters(tiny_model_dir, many_adapters):
    cfg = EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(many_adapters), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "8", "lora.max_gpu_adapters": "64", "lora.max_cpu_adapters": "128",
        "scheduler.max_batch_size": "16", "scheduler.max_waiting": "32", "orchestrator.policy": "vlora"})
    engine = AsyncEngine(cfg)
    try:
        assert len(engine.list_adapters()) == N_ADAPTERS
        names = zipf_names(N_REQUESTS, 1.1, random.Random(0))
        done, lock = {}, threading.Lock()
        all_done = threading.Event()
        rss = []

        def cb(out):
            if out.finished:
                with lock:
                    done[out.request_id] = out
                    if len(done) == N_REQUESTS:
                        all_done.set()

        for i, name in enumerate(names):
            req = GenerationRequest(f"z{i}", "How many circles?", lora_name=name, sampling=SamplingParams(max_tokens=3, ignore_eos=True))
            engine.submit(engine.prepare(req), cb)
            if i in (N_REQUESTS // 2, N_REQUESTS - 1):
                rss.append(rss_mb())
        assert all_done.wait(300), f"{N_REQUESTS - len(done)} requests never finished"
        bad = [o for o in done.values() if o.finish_reason != "length" or o.error]
        assert not bad, bad[:3]
        loras = engine.loras
        assert len(loras._host) <= 128 and len(loras.resident) <= 64
        assert loras.swaps_in > 64  # the stream touched more adapters than fit on the device
        kv = engine.engine.runner.kv
        assert kv.allocator.num_free == kv.num_blocks
        assert rss[1] - rss[0] < 200, f"resident memory grew {rss[1] - rss[0]:.0f} MB over the second half"
    finally:
        engine.shutdown()
