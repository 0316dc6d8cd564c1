"""A sampled token equal to the image token id is text: in a step that also prefills a prompt with an
image, it must neither take image features nor fail the step (found by the 1-GPU load test on an H200:
a random 7B model sampled `<image>` and all 32 requests of the step failed with "image placeholders
(577 tokens) do not match image features (576)")."""
from __future__ import annotations

import torch

from engine_parity import _png, make_engine
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.kv_cache import SequenceBlocks
from vlora.engine.model_runner import SeqInput


def test_decoded_image_token_beside_an_image_prefill(tiny_model_dir, demo_adapter_root):
    eng = make_engine(tiny_model_dir, demo_adapter_root, "cpu", "float32")
    runner, kv = eng.runner, eng.runner.kv
    runner.set_encoder_cache(0)  # the same image is prefilled twice below: both times through the encoder

    def prepare(rid, prompt, images):
        return eng.inputs.prepare(GenerationRequest(request_id=rid, prompt=prompt, images=images,
                                                    sampling=SamplingParams(max_tokens=4)))

    def blocks(n):
        return SequenceBlocks(kv.allocator.allocate(kv.blocks_for(n + 2)))

    img = prepare("img", "<image>\nWhat is in the picture?", [_png(3)])
    txt = prepare("txt", "Count the circles.", [])
    assert runner.image_token_id in img.prompt_ids

    def image_prefill(b):
        return SeqInput(img.prompt_ids, 0, b, pixel_values=img.pixel_values, image_keys=img.image_keys)

    alone = runner.forward([image_prefill(blocks(len(img.prompt_ids)))]).logits[0]

    b_txt = blocks(len(txt.prompt_ids))
    runner.forward([SeqInput(txt.prompt_ids, 0, b_txt)])
    decode = SeqInput([runner.image_token_id], len(txt.prompt_ids), b_txt)  # the sampled token was <image>
    out = runner.forward([decode, image_prefill(blocks(len(img.prompt_ids)))])
    assert out.num_images_encoded == 1
    torch.testing.assert_close(out.logits[1], alone, rtol=1e-5, atol=1e-5)
