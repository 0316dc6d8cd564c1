"""The generated tiny Qwen2-VL / Qwen2.5-VL models, their processors and their PEFT adapters."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlora.models.tiny_qwen import (
    MROPE_SECTION,
    QWEN_ADAPTERS,
    SPECIAL_TOKENS,
    VARIANTS,
    ensure_tiny_qwen,
    ensure_tiny_qwen_adapters,
    load_qwen_processor,
    load_tiny_qwen,
    tiny_qwen_dirname,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def qwen_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-qwen")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(qwen_cache, variant) -> Path:
    return ensure_tiny_qwen(qwen_cache, variant)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_tiny_qwen(model_dir)


@pytest.fixture(scope="module")
def processor(model_dir):
    return load_qwen_processor(model_dir)


@pytest.fixture(scope="module")
def adapter_root(model_dir, qwen_cache, variant) -> Path:
    return ensure_tiny_qwen_adapters(model_dir, qwen_cache / f"adapters-{variant}")


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _inputs(processor, text: str, images=None, videos=None):
    content = [{"type": "image"} for _ in images or ()] + [{"type": "video"} for _ in videos or ()]
    content.append({"type": "text", "text": text})
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True)
    return processor(text=[prompt], images=images, videos=videos, return_tensors="pt")


def _generate(model, inputs, n: int = 16) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_config_matches_tokenizer_and_hub_layout(model_dir, processor, variant):
    config = json.loads((model_dir / "config.json").read_text())
    tok = processor.tokenizer
    assert config["architectures"] == [VARIANTS[variant].architecture]
    assert "text_config" not in config  # the Hub's flat layout
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": MROPE_SECTION}
    assert sum(MROPE_SECTION) == head_dim // 2
    for key, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                       ("eos_token_id", "<|im_end|>")]:
        assert config[key] == tok.convert_tokens_to_ids(token), key
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(ids[0], ids[0] + len(ids))) and ids[-1] == len(tok) - 1
    assert config["vocab_size"] >= len(tok)
    assert tok.bos_token is None
    assert tok("A cat.")["input_ids"] == tok.encode("A cat.", add_special_tokens=False)  # no BOS added
    assert type(tok).__name__ == "Qwen2Tokenizer"
    vision = config["vision_config"]
    assert vision["depth"] == 2 and vision["temporal_patch_size"] == 2 and vision["spatial_merge_size"] == 2
    if variant == "qwen2_5_vl":
        assert vision["out_hidden_size"] == config["hidden_size"]
        assert vision["fullatt_block_indexes"] == [1] and vision["window_size"] > 0


def test_model_loads_offline_with_biases_and_mrope(model, model_dir):
    assert model.config.text_config.rope_parameters["mrope_section"] == MROPE_SECTION
    q_bias = model.model.language_model.layers[0].self_attn.q_proj.bias
    assert q_bias is not None and q_bias.abs().max() > 0  # Qwen2's q/k/v biases are exercised
    assert model.lm_head.weight.shape[0] == model.config.text_config.vocab_size


def test_processor_gives_each_image_size_its_own_token_count(processor, model, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    counts, outputs = [], []
    for h, w in [(64, 64), (56, 112)]:
        inputs = _inputs(processor, "What is in the image?", images=[_image(h, w, seed=0)])
        grid = inputs["image_grid_thw"][0]
        n = int((inputs["input_ids"] == config["image_token_id"]).sum())
        assert n == int(grid.prod()) // 4
        assert inputs["pixel_values"].shape == (int(grid.prod()), 3 * 2 * 14 * 14)
        counts.append(n)
        outputs.append(_generate(model, inputs))
    assert counts == [4, 8]
    assert outputs[0] != outputs[1]
    for out in outputs:  # the random model does not collapse into one repeated token
        assert len(set(out)) >= 8, out


def test_four_frame_video_through_processor_and_generate(processor, model, model_dir, variant):
    config = json.loads((model_dir / "config.json").read_text())
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(4)]
    inputs = _inputs(processor, "Describe the video.", videos=[frames])
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert inputs["pixel_values_videos"].shape == (32, 3 * 2 * 14 * 14)
    assert int((inputs["input_ids"] == config["video_token_id"]).sum()) == 8
    if variant == "qwen2_5_vl":
        assert "second_per_grid_ts" in inputs
    out = _generate(model, inputs)
    assert len(out) == 16 and len(set(out)) >= 4
    # a clip of one still frame (twice) is patchified exactly as that frame as an image
    still = processor.video_processor([[frames[0], frames[0]]], return_tensors="pt")
    image = processor.image_processor(images=[Image.fromarray(frames[0])], return_tensors="pt")
    assert still["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    torch.testing.assert_close(still["pixel_values_videos"], image["pixel_values"], atol=1e-5, rtol=0)


def test_adapters_are_peft_folders_that_change_the_logits(adapter_root, model_dir, processor):
    from peft import PeftModel
    from safetensors import safe_open

    inputs = _inputs(processor, "What is in the image?", images=[_image(56, 112, seed=1)])
    base_model = load_tiny_qwen(model_dir)
    with torch.no_grad():
        base = base_model(**inputs).logits[0, -4:]
    for spec in QWEN_ADAPTERS:
        folder = adapter_root / spec.name
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == spec.r and config["use_rslora"] == spec.use_rslora
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            keys = set(f.keys())
            modules = {k.split(".")[-3] for k in keys}
            assert all(k.startswith("base_model.model.model.language_model.layers.") for k in keys), keys
            assert modules == set(spec.modules)
            assert len(keys) == 2 * 3 * len(spec.modules)  # A and B, 3 layers
            assert all(f.get_tensor(k).abs().max() > 0 for k in keys if ".lora_B." in k)
        peft_model = PeftModel.from_pretrained(load_tiny_qwen(model_dir), folder)
        assert not any(".visual." in n for n, _ in peft_model.named_parameters() if "lora_" in n)
        with torch.no_grad():
            logits = peft_model(**inputs).logits[0, -4:]
        assert torch.isfinite(logits).all()
        assert (logits - base).abs().max() > 0.05, spec.name


def test_adapters_pass_the_servers_adapter_reader(adapter_root, model_dir):
    from vlora.lora.adapter import ATTN_MODULES, MLP_MODULES, decoder_module_dims, load_adapter

    config = json.loads((model_dir / "config.json").read_text())
    for spec in QWEN_ADAPTERS:
        load_adapter(adapter_root, spec.name, num_layers=config["num_hidden_layers"],
                     module_dims=decoder_module_dims(config), max_rank=64,
                     supported_modules=ATTN_MODULES + MLP_MODULES)


def test_generation_is_deterministic_and_idempotent(model_dir, adapter_root, variant, tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_qwen(model_dir.parent, variant) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    assert torch.equal(torch.rand(3), expected)

    again = ensure_tiny_qwen(tmp_path, variant)
    assert again.name == model_dir.name == tiny_qwen_dirname(variant)
    files = sorted(p.name for p in model_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert _sha(model_dir / name) == _sha(again / name), name
    assert [p.name for p in tmp_path.iterdir()] == [again.name]  # no temporary folder left

    adapters_again = ensure_tiny_qwen_adapters(again, tmp_path / "adapters")
    for spec in QWEN_ADAPTERS:
        name = "adapter_model.safetensors"
        assert _sha(adapter_root / spec.name / name) == _sha(adapters_again / spec.name / name), spec.name


def test_unknown_variant_names_the_supported_ones(tmp_path):
    with pytest.raises(ValueError, match="qwen2_vl, qwen2_5_vl"):
        ensure_tiny_qwen(tmp_path, "qwen3_vl")
