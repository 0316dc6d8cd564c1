"""Vision-side LoRA on CUDA (bf16), tiny LLaVA and Qwen2-VL with adapters made by PEFT: one batched vision
forward over the images of two vision-side adapters and the base model (through the ATMM extension
where it is built, per-image segments) equals each image encoded alone through the PyTorch reference
LoRA backend, to a bf16 tolerance; and each adapter moves the features it is asked for."""
from __future__ import annotations

import io

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("peft")

from PIL import Image  # noqa: E402

from vlora.config import EngineConfig  # noqa: E402
from vlora.engine.api import GenerationRequest  # noqa: E402
from vlora.engine.builder import build_engine  # noqa: E402
from vlora.lora.backends import get_lora_backend  # noqa: E402

RTOL = 3e-2  # bf16: a packed batch and one image alone accumulate in different orders
MOVES = 0.1  # each adapter changes the features by more than this (relative; the tiny adapters: 0.3 to 2.5)


def _png(seed: int, w: int, h: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _setup(family: str, cache):
    """(engine, the two vision-side adapters) for ``family``, bf16 on CUDA."""
    if family == "llava":
        from vlora.models.tiny import VISION_ADAPTER_NAMES, ensure_tiny_model, ensure_tiny_vision_adapters

        model_dir = ensure_tiny_model(cache)
        root, names = ensure_tiny_vision_adapters(model_dir, cache / "llava-vision"), VISION_ADAPTER_NAMES
    else:
        from vlora.models import tiny_qwen

        model_dir = tiny_qwen.ensure_tiny_qwen(cache, variant=family)
        root = tiny_qwen.ensure_tiny_qwen_vision_adapters(model_dir, cache / f"{family}-vision")
        names = tiny_qwen.QWEN_VISION_ADAPTER_NAMES
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(model_dir), "lora.adapter_root": str(root), "model.device": "cuda", "model.dtype": "bfloat16",
        "lora.max_rank": "32", "lora.max_gpu_adapters": "4", "cache.num_blocks": "128", "engine.cuda_graphs": "off",
        "atmm.tune_at_load": "never"}))
    return engine, names


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl"])
def test_batched_vision_lora_matches_each_image_alone(family, vlora_cache):
    engine, names = _setup(family, vlora_cache)
    runner = engine.runner
    fam = runner.loaded.family
    slots = [engine.loras.acquire(n) for n in names]
    sizes = [(56, 56), (112, 56), (56, 84), (84, 84)]
    per_item, grids = [], []
    for i, (w, h) in enumerate(sizes):
        p = engine.inputs.prepare(GenerationRequest(f"img{i}", "Describe it.", images=[_png(i, w, h)]))
        per_item += fam.patches(p.pixel_values, p.image_grid_thw)
        grids += [] if p.image_grid_thw is None else list(p.image_grid_thw)
    # every image through each adapter and the base encoder, grouped by slot as the engine orders them
    plan = sorted(((i, s) for i in range(len(per_item)) for s in [-1] + slots), key=lambda x: x[1])
    grid = torch.stack([grids[i] for i, _ in plan]) if grids else None
    with torch.inference_mode():
        batched = runner.encode(fam.join([per_item[i] for i, _ in plan]), grid, [s for _, s in plan])
        keep = runner.lora_ctx.backend
        runner.lora_ctx.backend = get_lora_backend("reference")
        try:
            alone = {(i, s): runner.encode(fam.join([per_item[i]]), grids[i][None] if grids else None, [s])[0]
                     for i, s in plan}
        finally:
            runner.lora_ctx.backend = keep
    for (i, s), got in zip(plan, batched):
        want = alone[(i, s)]
        rel = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert rel <= RTOL, f"image {i} slot {s}: relative error {rel:.2e}"
        if s >= 0:
            base = alone[(i, -1)].float()
            assert (want.float() - base).abs().max() > MOVES * base.abs().max(), f"slot {s} barely moves image {i}"
    for s in slots:
        engine.loras.release(s)


def test_vision_graphs_match_the_eager_tower(vlora_cache):
    """LLaVA's fixed-size tower captured per image-count bucket (engine.vision_graph_images), vision-side LoRA
    inside: any mix of adapters and the base encoder, in buckets that pad (3 -> 4) and in a batch larger than
    the largest bucket (two replays), equals the eager tower through the reference LoRA backend within bf16."""
    from vlora.engine.vision_graphs import VisionGraphs

    engine, names = _setup("llava", vlora_cache)
    runner = engine.runner
    slots = [engine.loras.acquire(n) for n in names]
    graphs = VisionGraphs(runner, (1, 2, 4))
    graphs.capture_all()
    size = runner.model.config.vision_config.image_size
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, plan in ((1, [-1]), (1, [slots[0]]), (3, [slots[0], -1, slots[1]]), (6, [-1, slots[1], slots[1], -1, slots[0], -1])):
        px = torch.randn(n, 3, size, size, device="cuda", generator=g)
        with torch.inference_mode():
            got = graphs.run(px, plan)
            keep = runner.lora_ctx.backend
            runner.lora_ctx.backend = get_lora_backend("reference")
            try:
                want = [runner.encode(px[i:i + 1], None, [s])[0] for i, s in enumerate(plan)]
            finally:
                runner.lora_ctx.backend = keep
        assert len(got) == n
        for a, b in zip(got, want):
            rel = float((a.float() - b.float()).abs().max() / b.float().abs().max())
            assert rel < RTOL, (n, plan, rel)
    assert graphs.replays == 1 + 1 + 1 + 2
    # the runner serves LLaVA images through them once set (the engine's builder does this at load)
    runner.vision_graphs = graphs
    px = torch.randn(2, 3, size, size, device="cuda", generator=g)
    with torch.inference_mode():
        out = runner.encode(px, None, [slots[0], -1])
    assert graphs.replays == 6 and len(out) == 2
