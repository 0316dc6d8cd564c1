"""A model of real size with random weights, for benchmarks where no checkpoint can be downloaded.

``make_random_llava(preset_yaml, out_dir)`` writes a folder laid out like a llava-hf checkpoint
(config, sharded safetensors, tokenizer, preprocessor config) that ``load_llava`` loads by the same
path as a real one. Weights are N(0, 0.02^2) from a fixed seed, drawn on the target device. The
tokenizer is the tiny model's (its ids fit in the preset's vocabulary); throughput does not depend
on which tokenizer produced the ids. Nothing it answers means anything.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import yaml

log = logging.getLogger(__name__)

INIT_STD = 0.02


def make_random_llava(preset: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> Path:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from vlora.models import tiny

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    spec = yaml.safe_load(Path(preset).read_text())
    tokenizer = tiny.build_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(**spec["vision"])
    num_image_tokens = (vision.image_size // vision.patch_size) ** 2
    text = LlamaConfig(**spec["text"], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    if text.vocab_size < len(tokenizer):
        raise ValueError(f"{preset}: vocab_size {text.vocab_size} is smaller than the tokenizer ({len(tokenizer)})")
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         image_seq_length=num_image_tokens, projector_hidden_act=spec.get("projector_hidden_act", "gelu"),
                         vision_feature_layer=spec.get("vision_feature_layer", -2),
                         vision_feature_select_strategy=spec.get("vision_feature_select_strategy", "default"),
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size="5GB")
        tokenizer.save_pretrained(tmp)
        pre = tiny.preprocessor_config()
        pre["size"] = {"shortest_edge": vision.image_size}
        pre["crop_size"] = {"height": vision.image_size, "width": vision.image_size}
        (tmp / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
        (tmp / "README.md").write_text(f"Random weights (seed {seed}) at the dimensions of {Path(preset).name}. "
                                       "Not a trained model: for throughput benchmarks only.\n")
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    del model
    return out
