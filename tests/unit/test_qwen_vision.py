"""The sync-free Qwen vision forward (vlora.models.qwen_vision) against the model's own (transformers'
get_image_features / get_video_features), fp32 on the CPU, tiny Qwen2-VL and Qwen2.5-VL: images of several
sizes in one call (runs of unequal lengths; Qwen2.5-VL's edge windows), and a video."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from vlora.models.family import load_model
from vlora.models.qwen_vision import window_index


def _png(seed: int, w: int, h: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def loaded(request, tmp_path_factory):
    from vlora.models.tiny_qwen import ensure_tiny_qwen

    return load_model(ensure_tiny_qwen(tmp_path_factory.mktemp(request.param), variant=request.param),
                      torch.float32, "cpu")


def _images(sizes):
    return [Image.open(io.BytesIO(_png(i, w, h))).convert("RGB") for i, (w, h) in enumerate(sizes)]


def test_images_match_the_models_own_forward(loaded):
    fam = loaded.family
    prompt = fam.prompt(loaded, "Describe.", _images([(56, 56), (112, 84), (56, 140), (56, 56)]), False)
    vm = loaded.model.model
    with torch.inference_mode():
        got = fam.encode_images(loaded, prompt.pixel_values, prompt.image_grid_thw)
        want = vm.get_image_features(prompt.pixel_values, prompt.image_grid_thw).pooler_output
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


def test_a_video_matches_the_models_own_forward(loaded):
    fam = loaded.family
    prompt = fam.prompt(loaded, fam.video_placeholder + "What happens?", _images([(84, 56)] * 4), False)
    assert prompt.video
    vm = loaded.model.model
    with torch.inference_mode():
        got = fam.encode_images(loaded, prompt.pixel_values, prompt.image_grid_thw, video=True)
        want = vm.get_video_features(prompt.pixel_values, prompt.image_grid_thw).pooler_output
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


def test_window_index_matches_transformers():
    vision_utils = pytest.importorskip("transformers.vision_utils")
    if not hasattr(vision_utils, "get_vision_window_index"):
        pytest.skip("this transformers keeps the window index on the model")
    grids = [(1, 16, 16), (1, 10, 22), (2, 8, 12)]
    want_index, want_bounds = vision_utils.get_vision_window_index(torch.tensor(grids), 2, 112, 14)
    index, bounds = window_index(grids, 2, 112, 14)
    assert torch.equal(index, want_index) and bounds == want_bounds.tolist()


def test_item_grid_is_the_grid_preprocessing_makes(loaded):
    """engine.vision_graph_grids names sizes; the family turns them into the grids its preprocessing gives an
    image or a video of that size (what the grid graphs are captured for)."""
    fam = loaded.family
    for w, h in [(56, 56), (112, 84), (448, 448), (640, 480)]:
        prompt = fam.prompt(loaded, "Describe.", _images([(w, h)]), False)
        assert fam.item_grid(loaded, h, w) == tuple(prompt.image_grid_thw[0].tolist()), (w, h)
    for frames in (2, 3, 4):
        prompt = fam.prompt(loaded, fam.video_placeholder + "What happens?", _images([(84, 56)] * frames), False)
        assert fam.item_grid(loaded, 56, 84, frames) == tuple(prompt.image_grid_thw[0].tolist()), frames


def test_the_plan_and_run_split_is_the_whole_forward(loaded):
    """QwenVisionForward.run over a plan made apart (what a grid graph replays) gives the forward's features."""
    from vlora.models.qwen_vision import vision_forward

    fam = loaded.family
    prompt = fam.prompt(loaded, "Describe.", _images([(56, 56), (112, 84)]), False)
    fwd = vision_forward(loaded.model.model.visual)
    grids = prompt.image_grid_thw.tolist()
    with torch.inference_mode():
        plan = fwd.plan(grids, torch.device("cpu"))
        assert plan.rows == prompt.pixel_values.shape[0]
        torch.testing.assert_close(fwd.run(prompt.pixel_values, plan), fwd(prompt.pixel_values, grids))


def test_use_ops_routes_the_rotary_and_the_mlp_activation(loaded):
    """use_ops sends every block's rotary and MLP activation through the given functions (the engine's fused
    kernels on CUDA); here fused_ops' torch references, which must give the eager forward's bits."""
    from vlora.engine import fused_ops
    from vlora.models.qwen_vision import QwenVisionForward

    visual = loaded.model.model.visual
    kind = "quick_gelu" if loaded.model.config.model_type == "qwen2_vl" else "silu_gate"
    calls = {"rotary": 0, "act": 0}

    def rotary(q, k, cos, sin):
        calls["rotary"] += 1
        return fused_ops.vision_rotary(q, k, cos, sin, impl="torch")

    def act(*xs):
        calls["act"] += 1
        return fused_ops.quick_gelu(*xs, impl="torch") if len(xs) == 1 else fused_ops.silu_mul(*xs, impl="torch")

    fwd = QwenVisionForward(visual)
    assert set(fwd.mlp_kind) == {kind}
    prompt = loaded.family.prompt(loaded, "Describe.", _images([(56, 56), (112, 84)]), False)
    grids = prompt.image_grid_thw.tolist()
    with torch.inference_mode():
        want = fwd(prompt.pixel_values, grids)
        fwd.use_ops(rotary, act, act)
        got = fwd(prompt.pixel_values, grids)
    assert torch.equal(got, want)
    assert calls == {"rotary": len(fwd.blocks), "act": len(fwd.blocks)}
