"""Random-weight models from the presets in configs/models/ (vlora.models.random_init).

The 7B Qwen2-VL and Qwen2.5-VL presets are read and turned into a transformers config, and the model of
that config is built on the meta device (no weights): its dimensions are the Hub checkpoints', down to
the parameter count. A small variant of each Qwen preset (the same file with the dimensions overridden)
is then written on the CPU, loaded with vlora.models.family.load_model and served by the engine: one
step prefills a request with an image. A small LLaVA preset takes the same path through
make_random_model."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.builder import build_engine
from vlora.models.family import load_model
from vlora.models.random_init import RandomPreset, load_preset, make_random_model, qwen_hub_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS = {"qwen2_vl": ROOT / "configs/models/qwen2-vl-7b.yaml", "qwen2_5_vl": ROOT / "configs/models/qwen2.5-vl-7b.yaml"}
LLAVA_PRESET = ROOT / "configs/models/llava-1.5-7b.yaml"
# Parameters of Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct (total, vision tower).
HUB_PARAMS = {"qwen2_vl": (8_291_375_616, 675_759_104), "qwen2_5_vl": (8_292_166_656, 676_550_144)}
MAX_POSITIONS = {"qwen2_vl": 32768, "qwen2_5_vl": 128000}

SMALL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1280, max_position_embeddings=2048, sliding_window=2048,
                  max_window_layers=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # head_dim 16
SMALL = {
    "qwen2_vl": {"text": SMALL_TEXT, "vision": dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64)},
    "qwen2_5_vl": {"text": SMALL_TEXT, "vision": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                                      out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])},
}


def _png(w: int, h: int) -> bytes:
    arr = (torch.rand(h, w, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("model_type", sorted(PRESETS))
def test_7b_preset_has_the_hub_dimensions(model_type, tmp_path):
    from transformers import AutoConfig

    from vlora.models import tiny_qwen

    spec = load_preset(PRESETS[model_type])
    assert spec.model_type == model_type
    t = spec.text
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
            t["intermediate_size"], t["vocab_size"]) == (3584, 28, 28, 4, 18944, 152064)
    assert t["rope_theta"] == 1e6 and t["rope_scaling"]["mrope_section"] == [16, 24, 24]
    assert t["max_position_embeddings"] == MAX_POSITIONS[model_type]
    assert (spec.image_processor["min_pixels"], spec.image_processor["max_pixels"]) == (3136, 12845056)

    (tmp_path / "config.json").write_text(json.dumps(qwen_hub_config(spec, tiny_qwen.build_tokenizer())))
    config = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    assert config.model_type == model_type and config.text_config.hidden_size == 3584
    assert config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    v = config.vision_config
    assert (v.depth, v.num_heads, v.patch_size, v.temporal_patch_size, v.spatial_merge_size) == (32, 16, 14, 2, 2)
    if model_type == "qwen2_vl":
        assert (v.embed_dim, v.mlp_ratio, v.hidden_size) == (1280, 4, 3584)
    else:
        assert (v.hidden_size, v.intermediate_size, v.out_hidden_size, v.window_size) == (1280, 3420, 3584, 112)
        assert list(v.fullatt_block_indexes) == [7, 15, 23, 31]
    with torch.device("meta"):
        model = tiny_qwen.VARIANTS[model_type].model_class()(config)
    total, vision = HUB_PARAMS[model_type]
    assert sum(p.numel() for p in model.parameters()) == total
    assert sum(p.numel() for p in model.model.visual.parameters()) == vision
    q = model.model.language_model.layers[0].self_attn.q_proj
    assert q.bias is not None and tuple(q.weight.shape) == (3584, 3584)


def test_preset_refuses_inconsistent_dimensions():
    base = RandomPreset.from_dict(json.loads(json.dumps({"model_type": "qwen2_vl", **SMALL["qwen2_vl"],
                                                         "image_processor": {"min_pixels": 1, "max_pixels": 2}})))
    assert base.text["hidden_size"] == 64
    bad_mrope = dict(SMALL_TEXT, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    with pytest.raises(ValueError, match="mrope_section"):
        RandomPreset.from_dict({"model_type": "qwen2_vl", "text": bad_mrope, "vision": SMALL["qwen2_vl"]["vision"],
                                "image_processor": {"min_pixels": 1, "max_pixels": 2}})
    with pytest.raises(ValueError, match="must equal the text hidden_size"):
        load_preset(PRESETS["qwen2_vl"], overrides={"text": SMALL_TEXT})  # vision still 3584 wide
    with pytest.raises(ValueError, match="no random-weight writer"):
        RandomPreset.from_dict({"model_type": "gemma3", "text": SMALL_TEXT})
    assert load_preset(LLAVA_PRESET).model_type == "llava"  # a preset that names none


@pytest.fixture(scope="module", params=sorted(PRESETS))
def small_qwen(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("random-presets") / request.param
    return request.param, make_random_model(PRESETS[request.param], out, device="cpu", dtype=torch.float32,
                                            overrides=SMALL[request.param])


def test_small_qwen_folder_loads(small_qwen):
    model_type, folder = small_qwen
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == model_type and "rope_scaling" in cfg and "text_config" not in cfg  # the Hub layout
    loaded = load_model(folder, torch.float32, "cpu")
    assert loaded.family.name == "qwen2-vl"
    assert loaded.text_config.hidden_size == 64 and loaded.text_config.vocab_size == 1280
    assert loaded.max_model_len == 2048 and loaded.tokenizer.model_max_length == 2048
    emb = loaded.model.get_input_embeddings().weight
    head = loaded.model.get_output_embeddings().weight
    assert emb.shape[0] == 1280 > len(loaded.tokenizer)  # padded to the preset's vocabulary
    assert head[len(loaded.tokenizer):].abs().max() == 0 and head[:len(loaded.tokenizer)].abs().max() > 0
    assert emb.std().item() == pytest.approx(0.02, rel=0.1)
    q = loaded.model.model.language_model.layers[0].self_attn.q_proj
    assert q.bias is not None and q.bias.abs().max() == 0
    size = loaded.image_processor.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (3136, 12845056)
    assert "<|im_start|>" in loaded.chat_template
    assert loaded.tokenizer.convert_tokens_to_ids("<|image_pad|>") == loaded.image_token_id


def test_small_qwen_serves_an_image_request(small_qwen):
    _, folder = small_qwen
    cfg = EngineConfig().with_overrides({"model.path": str(folder), "model.device": "cpu", "model.dtype": "float32",
                                         "lora.adapter_root": None})
    engine = build_engine(cfg)
    outputs = []
    req = GenerationRequest("img", "What is in the picture?", images=[_png(112, 56)],
                            sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    prepared = engine.inputs.prepare(req)
    image_tokens = sum(1 for i in prepared.prompt_ids if i == engine.inputs.loaded.image_token_id)
    assert image_tokens == (112 // 28) * (56 // 28)
    engine.add_request(prepared, outputs.append)
    ran = engine.step()
    assert ran is not None and ran.num_prefill == 1
    while engine.has_work():
        engine.step()
    final = outputs[-1]
    assert final.finished and final.error is None and final.finish_reason == "length"
    assert final.num_output_tokens == 2


def test_llava_preset_goes_through_make_random_model(tmp_path):
    small = {"vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            image_size=56, patch_size=14, projection_dim=32),
             "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, max_position_embeddings=512, vocab_size=1088)}
    folder = make_random_model(LLAVA_PRESET, tmp_path / "llava", device="cpu", dtype=torch.float32, overrides=small)
    loaded = load_model(folder, torch.float32, "cpu")
    assert loaded.family.name != "qwen2-vl" and loaded.num_image_tokens == 16
    assert loaded.model.get_input_embeddings().weight.shape == (1088, 64)
