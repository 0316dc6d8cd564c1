"""Every enumerated engine setting on a GPU: an engine built with it serves a request with an image and
an adapter, or is refused at load with an error that names the setting (never a crash while serving).

``engine.attention: torch`` reads the sequence lengths on the host, so it cannot be captured in a CUDA
graph: the engine serves it with its graphs off (and says so in model_info)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine_parity import ADAPTERS, _png  # noqa: E402
from vlora.config import ConfigError, EngineConfig  # noqa: E402
from vlora.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from vlora.engine.async_engine import AsyncEngine  # noqa: E402

MAX_NEW = 6
SETTINGS = [("engine.attention", v) for v in ("auto", "flash", "triton", "torch")] + \
           [("engine.cuda_graphs", v) for v in ("auto", "off")] + \
           [("engine.overlap", v) for v in ("auto", "on", "off")] + \
           [("orchestrator.policy", v) for v in ("vlora", "merge-only", "unmerge-only", "dlora")] + \
           [("cache.prefix_caching", "false"), ("cache.encoder_cache_mb", "0"), ("engine.gemv_max_rows", "0"),
            ("engine.prefill_graph_tokens", "0")]


def _config(tiny_model_dir, demo_adapter_root, key, value, dtype):
    return EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cuda",
        "model.dtype": dtype, "lora.max_gpu_adapters": "4", "lora.max_rank": "32", "cache.num_blocks": "512",
        "orchestrator.cost_model": "default", key: value})


def _serve(engine: AsyncEngine) -> dict:
    import threading

    done, finished = threading.Event(), {}

    def collect(out):
        if out.finished:
            finished[out.request_id] = out
            if len(finished) == 2:
                done.set()

    for rid, adapter, prompt, images in [("img", ADAPTERS[0], "<image>\nWhat is in the picture?", [_png(7)]),
                                         ("text", None, "Count the circles.", [])]:
        req = GenerationRequest(request_id=rid, prompt=prompt, images=images, lora_name=adapter,
                                sampling=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        engine.submit(engine.prepare(req), collect)
    assert done.wait(120), f"only {sorted(finished)} finished"
    return finished


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("key, value", SETTINGS, ids=[f"{k}={v}" for k, v in SETTINGS])
def test_every_setting_serves_or_is_refused_at_load(tiny_model_dir, demo_adapter_root, key, value, dtype):
    cfg = _config(tiny_model_dir, demo_adapter_root, key, value, dtype)
    try:
        engine = AsyncEngine(cfg)
    except ConfigError as e:  # the documented refusal: only a backend this GPU cannot run
        assert key == "engine.attention" and value == "flash" and key in str(e), e
        return
    try:
        finished = _serve(engine)
        for rid, out in finished.items():
            assert out.error is None and out.finish_reason == "length" and out.num_output_tokens == MAX_NEW, (rid, out)
        graphs = engine.engine.model_info.get("cuda_graphs", {})
        if (key, value) in (("engine.attention", "torch"), ("engine.cuda_graphs", "off")):
            assert engine.engine.runner.graphs is None, graphs
        else:
            assert engine.engine.runner.graphs is not None and graphs.get("batch_sizes"), graphs
    finally:
        engine.shutdown()
