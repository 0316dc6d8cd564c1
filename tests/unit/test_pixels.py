"""Preprocessing on the model's device (vlora.models.pixels): Pillow's bicubic resize reproduced bit for bit
(run here on the CPU through the same float64 products the GPU runs), and the families' pixel values and token
ids equal to what transformers' own processors make, for LLaVA's CLIP layout and Qwen2-VL's patches."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlora.models import pixels
from vlora.models.family import load_model

SIZES = [((480, 640), (336, 448)), ((100, 37), (336, 124)), ((37, 100), (124, 336)), ((1000, 1000), (336, 336)),
         ((57, 91), (56, 84)), ((1080, 1920), (336, 597)), ((13, 7), (336, 180)), ((300, 301), (299, 301)),
         ((336, 336), (336, 336))]


def _image(seed: int, h: int, w: int, smooth: bool) -> np.ndarray:
    if not smooth:
        return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) % 256], -1).astype(np.uint8)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("src,dst", SIZES)
def test_the_resize_is_pillows_bit_for_bit(src, dst, smooth):
    t = torch.from_numpy(_image(sum(src), *src, smooth))
    assert torch.equal(pixels.resize_uint8(t, *dst), pixels.pil_resize(t, *dst))


def test_llava_pixel_values_match_the_clip_processor(tiny_model_dir):
    loaded = load_model(tiny_model_dir, torch.float32, "cpu")
    images = [Image.fromarray(_image(i, h, w, i % 2 == 1)) for i, (h, w) in enumerate([(480, 640), (90, 33), (64, 64), (33, 90)])]
    got = loaded.family.pixel_values(loaded, images)
    want = loaded.image_processor(images=images, return_tensors="pt")["pixel_values"].float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    from vlora.models.tiny_qwen import ensure_tiny_qwen

    return load_model(ensure_tiny_qwen(tmp_path_factory.mktemp(request.param), variant=request.param), torch.float32, "cpu")


@pytest.mark.parametrize("template", [False, True])
def test_qwen_inputs_match_the_processor(qwen, template):
    from vlora.models.qwen2_vl import VISION_PLACEHOLDER

    fam = qwen.family
    images = [Image.fromarray(_image(i, h, w, i == 1)) for i, (h, w) in enumerate([(112, 56), (300, 200), (56, 56)])]
    text = f"Compare {VISION_PLACEHOLDER} and {VISION_PLACEHOLDER}, then {VISION_PLACEHOLDER}."
    if template:
        text = qwen.image_processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                                       tokenize=False, add_generation_prompt=True)
    got = fam._image_inputs(qwen, text, images)
    want = qwen.image_processor(text=[text], images=images, return_tensors="pt")
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["mm_token_type_ids"], want["mm_token_type_ids"])
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"].float(), atol=1e-6, rtol=0)
    prompt = fam.prompt(qwen, "What is it?", images[:1], False)  # the whole prompt through the same path
    assert prompt.pixel_values.shape[0] == int(prompt.image_grid_thw.prod())


@pytest.mark.parametrize("frames", [4, 3])
def test_qwen_video_inputs_match_the_processor(qwen, frames):
    from vlora.models.qwen2_vl import VIDEO_PLACEHOLDER

    fam = qwen.family
    clip = [Image.fromarray(_image(10 + i, 90, 130, i % 2 == 0)) for i in range(frames)]
    text = f"What happens in {VIDEO_PLACEHOLDER}?"
    got = fam._video_inputs(qwen, text, clip)
    want = qwen.image_processor(text=[text], videos=[clip], return_tensors="pt")
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["mm_token_type_ids"], want["mm_token_type_ids"])
    assert torch.equal(got["video_grid_thw"], want["video_grid_thw"])
    torch.testing.assert_close(got["pixel_values_videos"], want["pixel_values_videos"].float(), atol=1e-6, rtol=0)
    if "second_per_grid_ts" in want:  # Qwen2.5-VL
        assert float(got["second_per_grid_ts"][0]) == float(torch.as_tensor(want["second_per_grid_ts"]).reshape(-1)[0])
    else:
        assert "second_per_grid_ts" not in got


def test_the_video_fast_path_skips_resizes_it_does_not_reproduce():
    """transformers' own video processor resizes with torchvision's antialiased bicubic, which the fast path does
    not reproduce: frames already at the size it keeps take the fast path, others the processor; a processor that
    resizes with Pillow (QwenVideoProcessorPil, where torchvision is missing) always the fast path."""
    import numpy as np
    from PIL import Image

    from vlora.models.pixels import video_fast_path
    from vlora.models.qwen_processing import QwenVideoProcessorPil

    layout = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 768, "patch": 14, "merge": 2, "temporal": 2}

    class Torchvision:  # what transformers' Qwen2VLVideoProcessor looks like to the check
        pass

    kept = [Image.new("RGB", (448, 336))] * 4
    resized = [Image.new("RGB", (640, 480))] * 4
    assert video_fast_path(Torchvision(), kept, layout)
    assert video_fast_path(Torchvision(), [np.zeros((336, 448, 3), np.uint8)] * 2, layout)
    assert not video_fast_path(Torchvision(), resized, layout)
    assert not video_fast_path(Torchvision(), kept[:2] + [Image.new("RGB", (336, 448))], layout)  # sizes differ
    assert video_fast_path(QwenVideoProcessorPil(), resized, layout)
