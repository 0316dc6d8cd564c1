"""The Qwen2-VL family on CUDA: tiny random Qwen2-VL and Qwen2.5-VL (vlora.models.tiny_qwen) with three
PEFT-made adapters (ranks 8/16/32, attention and MLP targets), and the kernels at Qwen2-VL-7B's shapes.

- Engine against transformers + PEFT on the same device: one mixed batch (the base model and the three
  adapters; images of different sizes, so different numbers of visual tokens; a 4-frame video; text-only
  requests; prefills beside decodes). fp32: prefill logits within 1e-4 and greedy tokens identical;
  bf16: prefill logits within a bf16 tolerance. Decode steps replay the CUDA graphs (counted), with
  positions shifted by each request's M-RoPE ``rope_delta`` (nonzero for every image or video request).
- The fast path (CUDA graphs, Triton paged attention, the LoRA backend's per-row path) against the eager
  reference path (SDPA reference attention, segment LoRA path) for 64 greedy tokens: fp32 tokens identical
  and logits within 1e-4 in unmerged, merged and mixture steps; bf16 logits of the first two steps.
- Kernels at Qwen2-7B's attention shape (28 query heads over 4 KV heads: 7 per group, not a power of
  two; head_dim 128): paged decode and prefill against the reference, and the fused rotary + cache write
  against transformers' apply_rotary_pos_emb with cos/sin from Qwen2-VL's own M-RoPE rotary embedding,
  for prompt positions (three different axes) and decode positions (index + rope_delta on all three).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
peft = pytest.importorskip("peft")
tiny_qwen = pytest.importorskip("vlora.models.tiny_qwen")

from vlora.config import EngineConfig  # noqa: E402
from vlora.engine.api import GenerationRequest  # noqa: E402
from vlora.engine.builder import build_engine  # noqa: E402
from vlora.models.qwen2_vl import VISION_PLACEHOLDER  # noqa: E402
from vlora.orchestrator.policies import MERGE, MIXTURE, UNMERGE  # noqa: E402
from engine_parity import QWEN_SPECS, ScriptedPolicy, _png, add_greedy, check_fast_against_eager, rel_err, step_recording  # noqa: E402
from helpers import peft_greedy, peft_with_adapters, qwen_processor_inputs, shuffled_block_tables, with_adapter  # noqa: E402

DEV = torch.device("cuda")
ADAPTERS = tiny_qwen.QWEN_ADAPTER_NAMES  # qwen-r8-qv, qwen-r16-attn, qwen-r32-mlp
CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


# request id -> (adapter, text, images); the first two are prefilled alone, the rest join their decodes.
SPECS = {rid: spec for rid, spec in QWEN_SPECS.items() if rid != "video-r16"}
SPECS["img-large-r32"] = ("qwen-r32-mlp", f"{VISION_PLACEHOLDER}Tell me about it.", [_png(5, 224, 168)])
SPECS["video-r16"] = QWEN_SPECS["video-r16"]


@pytest.fixture(scope="module", params=sorted(CLASSES))
def qwen(request, vlora_cache):
    """(variant, model folder, adapter root)."""
    model_dir = tiny_qwen.ensure_tiny_qwen(vlora_cache, variant=request.param)
    root = tiny_qwen.ensure_tiny_qwen_adapters(model_dir, vlora_cache / f"qwen-adapters-{request.param}")
    return request.param, model_dir, root


def make_engine(model_dir, root, dtype: str, fast: bool = True, policy: str = "vlora"):
    cfg = EngineConfig().with_overrides({
        "model.path": str(model_dir), "lora.adapter_root": str(root), "model.device": "cuda", "model.dtype": dtype,
        "lora.max_rank": "32", "lora.max_gpu_adapters": "4", "cache.num_blocks": "256", "scheduler.max_batch_size": "8",
        "orchestrator.policy": policy, "atmm.tune_at_load": "never",
        "engine.cuda_graphs": "auto" if fast else "off", "engine.attention": "triton" if fast else "torch"})
    return build_engine(cfg)


def make_reference(variant: str, model_dir, root, dtype: torch.dtype):
    import transformers

    base = getattr(transformers, CLASSES[variant]).from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    ref = peft_with_adapters(base.to(DEV).eval(), root, ADAPTERS)
    return ref.to(DEV).eval(), tiny_qwen.load_qwen_processor(model_dir)


def reference_inputs(processor, text: str, images: list[bytes], dtype: torch.dtype) -> dict:
    """The model inputs as the processor builds them (images first where the text has no placeholder), on DEV."""
    inputs = qwen_processor_inputs(processor, text, images)
    return {k: (v.to(DEV, dtype) if k.startswith("pixel_values") else v.to(DEV)) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}


class GraphCounter:
    """Wraps runner.graphs.run: counts replayed decode rows, and those with a nonzero rope_delta."""

    def __init__(self, graphs) -> None:
        self.rows = self.shifted = 0
        self._run = graphs.run
        graphs.run = self

    def __call__(self, seqs, prev_tokens=None):
        self.rows += len(seqs)
        self.shifted += sum(1 for s in seqs if s.rope_delta != 0)
        return self._run(seqs, prev_tokens)


def run_mixed(engine, specs: dict, max_new: int, check_mixed: bool = True):
    """The first two requests prefill alone, the rest join their decode (a step with prefills beside
    decodes, checked with ``check_mixed``), then every step to the end. Returns (request id -> output ids,
    (request id, output index) -> that step's logits)."""
    seqs, logits = {}, {}

    def add(rid):
        seqs[rid] = add_greedy(engine, rid, *specs[rid], max_new=max_new)

    for name in ADAPTERS:  # in their slots first: on CUDA a slot copy completes asynchronously
        engine.loras.release(engine.loras.acquire(name))
    ids = list(specs)
    for rid in ids[:2]:
        add(rid)
    step_recording(engine, seqs, logits)
    for rid in ids[2:]:
        add(rid)
    mixed = False
    while engine.has_work():
        ran = step_recording(engine, seqs, logits)
        mixed |= ran is not None and bool(ran.num_prefill) and bool(ran.num_decode)
    if check_mixed:  # the scheduler may spread the joiners' prefills over steps (memory, slots); one must mix
        assert mixed, "no step ran prefills beside decodes"
    return {rid: s.output_ids for rid, s in seqs.items()}, logits


# -- the engine against transformers + PEFT --------------------------------------------------------------

MAX_NEW = 8


@pytest.mark.parametrize("dtype, torch_dtype, rtol, exact", [
    ("float32", torch.float32, 1e-4, True),
    ("bfloat16", torch.bfloat16, 5e-2, False),
])
def test_engine_matches_transformers_peft_on_cuda(qwen, dtype, torch_dtype, rtol, exact):
    variant, model_dir, root = qwen
    engine = make_engine(model_dir, root, dtype)
    ref, processor = make_reference(variant, model_dir, root, torch_dtype)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "no decode graph was captured"
    deltas = {rid: engine.inputs.prepare(GenerationRequest(rid, t, images=list(im))).rope_delta
              for rid, (_, t, im) in SPECS.items()}
    assert all(deltas[rid] != 0 for rid, (_, _, im) in SPECS.items() if im), deltas  # M-RoPE shifts them all
    counter = GraphCounter(engine.runner.graphs)
    tokens, logits = run_mixed(engine, SPECS, MAX_NEW)
    assert counter.shifted >= MAX_NEW // 2, "decode steps of image and video requests did not replay a graph"

    for rid, (adapter, text, images) in SPECS.items():
        inputs = reference_inputs(processor, text, images, torch_dtype)
        want = with_adapter(ref, adapter, lambda: ref(**inputs).logits[0, -1].float())
        err = rel_err(logits[(rid, 0)], want)
        assert err <= rtol, f"{variant} {rid}: prefill logits relative error {err:.2e} > {rtol:.0e}"
        if exact:
            assert tokens[rid] == peft_greedy(ref, adapter, inputs, MAX_NEW), f"{variant} {rid}"
    assert len({tuple(t) for t in tokens.values()}) > 1, "the tiny model answers everything alike"


# -- the fast path against the eager reference path ------------------------------------------------------

LONG_NEW = 64
SCRIPTS = {
    "unmerge": [(UNMERGE, None)],
    "merge": [(MERGE, "qwen-r8-qv")],
    "mixture": [(MIXTURE, "qwen-r32-mlp")],
}


def run_scripted(engine, script):
    engine.orchestrator.policy = ScriptedPolicy(script)
    try:
        return run_mixed(engine, SPECS, LONG_NEW, check_mixed=False)  # the script picks each step's batch
    finally:
        engine.orchestrator.enter(UNMERGE, None)


@pytest.mark.parametrize("dtype, rtol, exact", [("float32", 1e-4, True), ("bfloat16", 6e-2, False)])
def test_graphs_and_paged_attention_match_the_eager_reference(qwen, dtype, rtol, exact):
    _, model_dir, root = qwen
    fast = make_engine(model_dir, root, dtype, fast=True)
    ref = make_engine(model_dir, root, dtype, fast=False)
    assert fast.runner.graphs is not None and fast.runner.graphs.graphs and ref.runner.graphs is None
    counter = GraphCounter(fast.runner.graphs)
    check_fast_against_eager(fast, ref, SCRIPTS, run_scripted, LONG_NEW, rtol, exact)
    assert counter.shifted > 0 and counter.rows > counter.shifted  # image/video rows (shifted) and text rows
    assert {v for _, v in fast.runner.graphs.graphs} >= {"base", "lora", "mixture"}


def test_grid_graphs_match_the_eager_tower(qwen):
    """The vision tower's grid graphs (fp32) against its eager forward on the same pixels: a grid captured at
    load (engine.vision_graph_grids, the bucket of 4 serving 3 images: the padding item dropped), a grid met for
    the first time (eager) and the second (captured then, at one item), a run of two grids in one call (two items
    of that grid replay its one-item graph twice), and a video; the counters say which ran."""
    from vlora.models.qwen_vision import vision_forward

    _, model_dir, root = qwen
    engine = make_engine(model_dir, root, "float32", fast=True)
    runner = engine.runner
    gg, loaded = runner.grid_graphs, runner.loaded
    assert gg is not None
    visual = loaded.model.model.visual
    eager = vision_forward(visual)
    grid448 = loaded.family.item_grid(loaded, 448, 448)
    assert (grid448, 4) in gg.graphs  # captured at load, every bucket

    def pixels(grids, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        rows = sum(t * h * w for t, h, w in grids)
        return torch.randn(rows, gg.patch_dim, generator=g, device=DEV)

    def check(grids, seed):
        pv = pixels(grids, seed)
        grid_t = torch.tensor(grids, dtype=torch.int64)
        with torch.inference_mode():
            got = torch.cat(runner.encode(pv, grid_t))
            want = eager(pv, grids)
        assert got.shape == want.shape
        assert rel_err(got, want) <= 1e-4, grids

    replays, eager0 = gg.replays, gg.eager_items  # the warm start's image and video ran before
    check([grid448] * 3, 1)
    assert gg.replays == replays + 1 and gg.eager_items == eager0
    other = (1, grid448[1] // 2, grid448[2] // 2 + 2)  # a size nobody captured
    check([other], 2)
    assert gg.eager_items == eager0 + 1 and (other, 1) not in gg.graphs
    check([other], 3)
    assert (other, 1) in gg.graphs and gg.captures >= len(gg.sizes) + 1
    replays = gg.replays
    check([other, other, grid448], 4)  # two runs: other's one-item graph twice (no bucket 2 captured), grid448's
    assert gg.eager_items == eager0 + 1 and gg.replays == replays + 3 and (other, 2) not in gg.graphs
    check([(2, 4, 8)], 5)  # a 4-frame video's grid of the tiny model's frames
    check([(2, 4, 8)], 6)
    assert ((2, 4, 8), 1) in gg.graphs


def test_fused_tower_ops_give_the_eager_bits(qwen):
    """The engine's tower runs its rotary and MLP activation as fused kernels (QwenVisionForward.use_ops,
    vlora.engine.fused_ops); in bf16 its features are the eager forward's bit for bit, for an image and a video."""
    from vlora.models.qwen_vision import QwenVisionForward, vision_forward

    _, model_dir, root = qwen
    engine = make_engine(model_dir, root, "bfloat16", fast=False)
    loaded = engine.runner.loaded
    visual = loaded.model.model.visual
    fused = vision_forward(visual)
    assert fused.rotary is not QwenVisionForward(visual).rotary  # the engine switched the ops on
    assert set(fused.mlp_kind) != {"module"}
    eager = QwenVisionForward(visual)
    pe = visual.patch_embed
    patch_dim = int(pe.in_channels * pe.temporal_patch_size * pe.patch_size ** 2)
    grid448 = loaded.family.item_grid(loaded, 448, 448)
    for grids in ([grid448], [(2, 4, 8), grid448]):
        rows = sum(t * h * w for t, h, w in grids)
        pv = torch.randn(rows, patch_dim, generator=torch.Generator(device=DEV).manual_seed(rows), device=DEV)
        with torch.inference_mode():
            got = fused(pv.to(torch.bfloat16), grids)
            want = eager(pv.to(torch.bfloat16), grids)
        assert torch.equal(got, want), grids


# -- kernels at Qwen2-7B's attention shape ---------------------------------------------------------------

HQ, HKV, D, BS = 28, 4, 128, 16


def _pools(lens, dtype, seed):
    tables, num_blocks = shuffled_block_tables(lens, BS, torch.Generator().manual_seed(seed), spare=3)
    rows = num_blocks * BS
    gd = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(rows, HKV, D, generator=gd, device=DEV).to(dtype)
    v = torch.randn(rows, HKV, D, generator=gd, device=DEV).to(dtype)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return k, v, bt.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_paged_attention_at_qwen2_7b_heads(dtype):
    from vlora.engine import attention as attn

    if not attn.triton_available():
        pytest.skip("triton is not installed")
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    scale = D ** -0.5
    lens = [1, 37, 700, 2049] + [300 + 13 * i for i in range(28)]  # 32 rows, split-K for the long ones
    k, v, bt = _pools(lens, dtype, seed=1)
    q = torch.randn(len(lens), HQ, D, device=DEV, generator=torch.Generator(device=DEV).manual_seed(2)).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    torch.testing.assert_close(attn.paged_decode(q, k, v, bt, sl, scale, BS).float(),
                               attn.paged_decode_reference(q.float(), k.float(), v.float(), bt, sl, scale, BS), **tol)
    # prefill: a fresh prompt and a continued one (cached prefix) in one launch
    q_lens, seq_lens = [300, 45], [300, 700]
    k, v, bt = _pools(seq_lens, dtype, seed=3)
    q = torch.randn(sum(q_lens), HQ, D, device=DEV, generator=torch.Generator(device=DEV).manual_seed(4)).to(dtype)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    got = attn.paged_prefill(q, k, v, cu, sl, bt, max(q_lens), scale, BS)
    want = attn.paged_prefill_reference(q.float(), k.float(), v.float(), cu, sl, bt, max(q_lens), scale, BS)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_rotary_with_mrope_positions(dtype):
    """cos/sin from Qwen2-VL's own rotary embedding (mrope_section 16/24/24): for a prompt's three axes and
    for decode positions (index + rope_delta, the same on all three axes: the runner expands 1-D positions
    so); the fused kernel equals transformers' apply_rotary_pos_emb and writes k and v to the pools."""
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    from vlora.engine import fused_ops as fo

    if not fo.triton_available():
        pytest.skip("triton is not installed")
    cfg = Qwen2VLTextConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HKV,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    rot = Qwen2VLRotaryEmbedding(cfg).to(DEV)
    T = 300
    g = torch.Generator(device=DEV).manual_seed(5)
    axes = torch.stack([torch.randint(0, 64, (T,), device=DEV, generator=g) for _ in range(3)])  # [3, T], axes differ
    delta = -183
    decode = (torch.arange(400, 400 + 32, device=DEV) + delta).expand(3, -1)  # as the runner passes 1-D positions
    x = torch.empty(1, dtype=dtype, device=DEV)
    for positions in (axes, decode):
        cos, sin = rot(x, positions[:, None])  # [3, batch 1, T]
        cos, sin = cos[0], sin[0]
        n = cos.shape[0]
        buf = torch.randn(n, (HQ + 2 * HKV) * D, device=DEV, generator=g).to(dtype)
        q = buf[:, :HQ * D].view(n, HQ, D)  # strided head views of one fused qkv output, as in the runner
        k = buf[:, HQ * D:(HQ + HKV) * D].view(n, HKV, D)
        v = buf[:, (HQ + HKV) * D:].view(n, HKV, D)
        slots = torch.randperm(4 * n, device=DEV, generator=g)[:n]
        kp = torch.zeros(4 * n, HKV, D, dtype=dtype, device=DEV)
        vp = torch.zeros_like(kp)
        got = fo.rotary_and_cache(q, k, v, cos, sin, kp, vp, slots)
        qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
        want_q, want_k = qh[0].transpose(0, 1), kh[0].transpose(0, 1)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want_q, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(kp[slots], want_k, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want_q) and torch.equal(kp[slots], want_k)
        assert torch.equal(vp[slots], v)
