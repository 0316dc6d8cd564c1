"""Chunked prefill on CUDA (fp32, the tiny LLaVA and Qwen2.5-VL models): the greedy tokens of prompts run in chunks
of a small token budget, beside decodes, equal those of the same engine with chunking off, on the fast path
(decode and prefill CUDA graphs, the Triton paged attention, the step overlap). Chunks without LoRA work replay
the prefill graphs (a chunk that starts past 0 reads its context from the cache; an M-RoPE chunk its slice of the
prompt's positions); chunks with LoRA work run eagerly. Images whose placeholders straddle chunks are encoded once.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vlora.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from vlora.engine.builder import build_engine  # noqa: E402
from vlora.models.qwen2_vl import VIDEO_PLACEHOLDER  # noqa: E402
from engine_parity import QWEN_SPECS, _png  # noqa: E402
from helpers import count_encodes, tiny_config  # noqa: E402

MAX_NEW = 24
LONG = "USER: Look at the traffic camera frame and count the cars in every lane, slowly. " * 4 + "ASSISTANT:"
# request id -> (adapter, text, images). The first two (base requests: their chunks replay prefill graphs) run
# alone first; the others join their decodes.
LLAVA = {"base-long": (None, LONG, []),
         "img-base": (None, "USER: Look at this frame: <image>\nand the next one <image>\nWhich is busier? ASSISTANT:",
                      [_png(31), _png(32)]),
         "r8": ("demo-r8-qv", "Count the circles.", []),
         "img-r16": ("demo-r16-attn", "USER: <image>\n" + LONG, [_png(33)]),
         "r32-long": ("demo-r32-mlp", LONG.replace("cars", "trucks"), [])}
QWEN = {"video-long": (None, f"Watch this clip closely: {VIDEO_PLACEHOLDER} What moves?",
                       [_png(50 + i, 112, 112) for i in range(4)]),
        **QWEN_SPECS}
QWEN = {"video-long": QWEN["video-long"], "img-base": QWEN["img-base"],
        **{k: v for k, v in QWEN.items() if k not in ("video-long", "img-base")}}


def _engine(model_dir, root, chunked: bool, budget: int = 2048):
    return build_engine(tiny_config(model_dir, root, **{
        "model.device": "cuda", "model.dtype": "float32", "lora.max_gpu_adapters": "4", "cache.num_blocks": "256",
        "scheduler.max_batch_size": "8", "engine.cuda_graphs": "auto", "engine.prefill_graph_tokens": "128",
        "engine.overlap": "on", "atmm.tune_at_load": "never",
        "scheduler.chunked_prefill": "on" if chunked else "off",
        "scheduler.max_num_batched_tokens": str(budget if chunked else 2048)}))


def _run(engine, specs: dict):
    """Two requests first, the rest once those decode; every request to the end. Returns (output ids, steps)."""
    seqs, steps = {}, []
    for i, (rid, (adapter, text, images)) in enumerate(specs.items()):
        if i == 2:
            while not all(s.prefilled for s in seqs.values()):
                steps.append(engine.step())
            steps.append(engine.step())
        req = GenerationRequest(rid, text, images=list(images), lora_name=adapter,
                                sampling=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        engine.add_request(engine.inputs.prepare(req), lambda out: None)
        seqs[rid] = engine.waiting[-1]
    while engine.has_work():
        steps.append(engine.step())
    assert engine.runner.kv.allocator.num_free == engine.runner.kv.num_blocks
    return {rid: s.output_ids for rid, s in seqs.items()}, [s for s in steps if s is not None]


def _check(model_dir, root, specs: dict, n_items: int, budget: int) -> None:
    ref, _ = _run(_engine(model_dir, root, chunked=False), specs)
    engine = _engine(model_dir, root, chunked=True, budget=budget)
    assert engine.runner.prefill_graphs is not None and engine.runner.graphs is not None
    encoded = count_encodes(engine.runner)
    got, steps = _run(engine, specs)
    assert got == ref
    assert all(len(t) == MAX_NEW for t in got.values())
    assert sum(encoded) == n_items  # each image and video once, whatever its chunks
    mixed = [s for s in steps if s.partial_prefills and s.num_decode]
    assert len(mixed) >= 3, "no step ran a prompt's chunk beside decodes"
    assert all(s.num_prefill_tokens + s.num_decode <= budget for s in steps)
    assert sum(engine.runner.prefill_graphs.replays.values()) > 0, "no chunk replayed a prefill graph"


def test_llava_chunked_prefill_matches_unchunked_on_cuda(tiny_model_dir, demo_adapter_root):
    _check(tiny_model_dir, demo_adapter_root, LLAVA, n_items=3, budget=40)


def test_qwen_chunked_prefill_matches_unchunked_on_cuda(vlora_cache):
    tiny_qwen = pytest.importorskip("vlora.models.tiny_qwen")
    model_dir = tiny_qwen.ensure_tiny_qwen(vlora_cache, variant="qwen2_5_vl")
    root = tiny_qwen.ensure_tiny_qwen_adapters(model_dir, vlora_cache / "qwen-adapters-qwen2_5_vl")
    # 24 tokens a step: the smallest prefill-graph bucket (graphs.prefill_buckets), so that chunks replay graphs,
    # and short enough that the video's and the images' placeholder runs span several chunks.
    _check(model_dir, root, QWEN, n_items=6, budget=24)
