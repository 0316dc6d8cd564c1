"""The engine serving the Qwen2-VL family (tiny random Qwen2-VL and Qwen2.5-VL, fp32, CPU) against
transformers + PEFT on the same weights: greedy tokens identical one request at a time and in mixed
batches (three adapters made by PEFT and the base model together, prefill and decode in one step, images
of different sizes, so different numbers of visual tokens, text-only requests and a 4-frame video
beside them)."""
from __future__ import annotations

import pytest
import torch

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, InvalidRequest
from vlora.engine.builder import build_engine
from vlora.models.qwen2_vl import VIDEO_PLACEHOLDER, VISION_PLACEHOLDER

from engine_parity import QWEN_SPECS, _png, add_greedy  # noqa: E402
from helpers import peft_greedy, peft_with_adapters, qwen_processor_inputs  # noqa: E402

peft = pytest.importorskip("peft")
tiny_qwen = pytest.importorskip("vlora.models.tiny_qwen")

ADAPTERS = ("qwen-r8-qv", "qwen-r16-attn", "qwen-r32-mlp")
MAX_NEW = 8


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def setup(request, tmp_path_factory):
    cache = tmp_path_factory.mktemp("qwen-cache")
    model_dir = tiny_qwen.ensure_tiny_qwen(cache, variant=request.param)
    root = tiny_qwen.ensure_tiny_qwen_adapters(model_dir, cache / f"adapters-{request.param}")
    cfg = EngineConfig().with_overrides({
        "model.path": str(model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "32", "lora.max_gpu_adapters": "4"})
    engine = build_engine(cfg)
    import transformers

    cls = getattr(transformers, {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[request.param])
    base = cls.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    ref = peft_with_adapters(base, root, ADAPTERS).eval()
    processor = tiny_qwen.load_qwen_processor(model_dir)
    return engine, ref, processor


def _reference(ref, processor, adapter, text, images):
    """transformers + PEFT greedy continuation of the request, as the processor builds it."""
    return peft_greedy(ref, adapter, qwen_processor_inputs(processor, text, images), MAX_NEW)


def _run(engine, specs: dict, together: bool):
    """specs: request id -> (adapter, text, images). Returns request id -> generated ids."""
    seqs = {}

    def add(rid):
        seqs[rid] = add_greedy(engine, rid, *specs[rid], max_new=MAX_NEW)

    ids = list(specs)
    if together:  # two first, one step, then the rest: a step with prefills and decodes together
        for rid in ids[:2]:
            add(rid)
        engine.step()
        for rid in ids[2:]:
            add(rid)
        ran = engine.step()
        assert ran.num_prefill == len(ids) - 2 and ran.num_decode == 2
    else:  # one request at a time
        for rid in ids:
            add(rid)
            while engine.has_work():
                engine.step()
    while engine.has_work():
        engine.step()
    return {rid: s.output_ids for rid, s in seqs.items()}


SPECS = QWEN_SPECS


def test_engine_matches_transformers_peft(setup):
    engine, ref, processor = setup
    want = {rid: _reference(ref, processor, a, t, im) for rid, (a, t, im) in SPECS.items()}
    assert len({tuple(v) for v in want.values()}) > 1, "the tiny model answers everything alike"
    got_alone = _run(engine, SPECS, together=False)
    assert got_alone == want
    got_mixed = _run(engine, SPECS, together=True)
    assert got_mixed == want


def test_images_of_different_sizes_take_different_token_counts(setup):
    engine, _, _ = setup
    small = engine.inputs.prepare(GenerationRequest("a", "x", images=[_png(1, 56, 56)]))
    large = engine.inputs.prepare(GenerationRequest("b", "x", images=[_png(1, 112, 112)]))
    count = lambda p: sum(1 for i in p.prompt_ids if i == engine.inputs.loaded.image_token_id)  # noqa: E731
    assert count(small) < count(large)
    assert small.mrope_positions.shape == (3, len(small.prompt_ids))


def test_placeholder_count_must_match(setup):
    engine, _, _ = setup
    with pytest.raises(InvalidRequest, match="placeholder"):
        engine.inputs.prepare(GenerationRequest("c", f"{VISION_PLACEHOLDER} {VISION_PLACEHOLDER}", images=[_png(1, 56, 56)]))


def test_a_video_is_one_item_with_its_own_key(setup):
    engine, _, _ = setup
    frames = [_png(10 + i, 64, 64) for i in range(4)]
    video = engine.inputs.prepare(GenerationRequest("v", f"{VIDEO_PLACEHOLDER}Go.", images=frames))
    first_frame = engine.inputs.prepare(GenerationRequest("i", "Go.", images=frames[:1]))
    assert video.video and video.image_grid_thw.tolist()[0][0] == 2  # 4 frames, temporal patches of 2
    assert len(video.image_keys) == 1 and video.image_keys[0] != first_frame.image_keys[0]
    with pytest.raises(InvalidRequest, match="video"):
        engine.inputs.prepare(GenerationRequest("w", f"{VIDEO_PLACEHOLDER}{VIDEO_PLACEHOLDER}", images=frames))


def test_a_malformed_video_is_a_clear_refusal(setup):
    """Frames of different sizes, or a <|video_pad|> beside the placeholder, are the client's error: a clear
    InvalidRequest naming it (these reached the processor and came back as an internal ValueError)."""
    engine, _, _ = setup
    frames = [_png(20, 64, 64), _png(21, 64, 64), _png(22, 96, 64), _png(23, 64, 64)]
    with pytest.raises(InvalidRequest, match=r"frames must all have the same size: frame 2 is \(96, 64\)"):
        engine.inputs.prepare(GenerationRequest("s", f"{VIDEO_PLACEHOLDER}Go.", images=frames))
    same = [_png(30 + i, 64, 64) for i in range(4)]
    with pytest.raises(InvalidRequest, match="no other <\\|video_pad\\|>"):
        engine.inputs.prepare(GenerationRequest("p", f"{VIDEO_PLACEHOLDER}Go.<|video_pad|><|video_pad|>", images=same))


def test_qwen2_qkv_biases_ride_in_the_fused_group(setup):
    """The engine runs q/k/v as one GEMM over concatenated weights: Qwen2's q/k/v biases are concatenated
    the same way (and each projection's bias is a view of that row), o_proj keeps none."""
    engine, ref, _ = setup
    runner = engine.runner
    group = runner.groups["qkv"]
    assert group.bias is not None and group.bias.abs().max() > 0
    hf_layers = ref.get_base_model().model.language_model.layers
    for li, (ours, theirs) in enumerate(zip(runner.lm.layers, hf_layers)):
        biases = [getattr(getattr(theirs.self_attn, m), "base_layer", getattr(theirs.self_attn, m)).bias
                  for m in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(group.bias[li], torch.cat(biases)), f"layer {li}"
        q = ours.self_attn.q_proj
        assert getattr(q, "base", q).bias.data_ptr() == group.bias[li].data_ptr()
    assert runner.groups["o"].bias is None
