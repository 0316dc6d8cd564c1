"""A model of real size with random weights, for benchmarks where no checkpoint can be downloaded.

``make_random_model(preset_yaml, out_dir)`` writes a folder laid out like the Hub checkpoint of the
preset's family (config, sharded safetensors, tokenizer, processor configs) that
:func:`vlora.models.family.load_model` loads by the same path as a real one. The preset's
``model_type`` picks the writer (:data:`WRITERS`): ``llava`` (the default, for presets that name none:
configs/models/llava-1.5-*.yaml), ``qwen2_vl`` and ``qwen2_5_vl`` (configs/models/qwen2*-vl-7b.yaml).

Weights are N(0, 0.02^2) from a fixed seed, drawn on the target device (the model is built on the meta
device, then given storage there in the target dtype); norm weights are 1 and biases 0. The tokenizer is
the family's tiny one (:mod:`vlora.models.tiny`, :mod:`vlora.models.tiny_qwen`: its ids fit in the
preset's vocabulary, the embedding keeps the preset's row count); throughput does not depend on which
tokenizer produced the ids. Nothing it answers means anything.

``make_random_llava`` is the LLaVA writer under its old name; its folders are unchanged (same seed, same
weights).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import yaml

log = logging.getLogger(__name__)

INIT_STD = 0.02
DEFAULT_MODEL_TYPE = "llava"
QWEN_TEXT_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "max_position_embeddings", "vocab_size", "rope_scaling")


@dataclass(frozen=True)
class RandomPreset:
    """One configs/models/*.yaml: ``model_type`` (default llava), ``text`` and ``vision`` settings, the
    processors' settings (``image_processor``, ``video_processor``) and any other top-level key (``extra``:
    LLaVA's projector settings)."""

    name: str
    model_type: str
    text: dict[str, Any]
    vision: dict[str, Any]
    image_processor: dict[str, Any] = field(default_factory=dict)
    video_processor: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in WRITERS:
            raise ValueError(f"preset {self.name}: model_type {self.model_type!r} has no random-weight writer; "
                             f"supported: {', '.join(sorted(WRITERS))}")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in self.text:
                raise ValueError(f"preset {self.name}: text.{key} is missing")
        if WRITERS[self.model_type] is _write_qwen:
            self._check_qwen()

    def _check_qwen(self) -> None:
        from vlora.models.tiny_qwen import VARIANTS

        missing = [k for k in QWEN_TEXT_REQUIRED if k not in self.text]
        if missing:
            raise ValueError(f"preset {self.name}: text.{', text.'.join(missing)} missing")
        hidden, heads = self.text["hidden_size"], self.text["num_attention_heads"]
        if hidden % heads or heads % self.text["num_key_value_heads"]:
            raise ValueError(f"preset {self.name}: hidden_size {hidden}, {heads} heads and "
                             f"{self.text['num_key_value_heads']} KV heads do not divide")
        section = self.text["rope_scaling"].get("mrope_section")
        if section is None or len(section) != 3 or sum(section) != hidden // heads // 2:
            raise ValueError(f"preset {self.name}: rope_scaling.mrope_section {section} must be three sections "
                             f"summing to head_dim / 2 = {hidden // heads // 2}")
        out_key = VARIANTS[self.model_type].vision_out_key
        if self.vision.get(out_key) != hidden:
            raise ValueError(f"preset {self.name}: vision.{out_key} {self.vision.get(out_key)} must equal the text "
                             f"hidden_size {hidden} (the merger's output is the decoder's input)")
        for key in ("min_pixels", "max_pixels"):
            if key not in self.image_processor:
                raise ValueError(f"preset {self.name}: image_processor.{key} is missing")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], name: str = "preset") -> "RandomPreset":
        spec = dict(spec)
        known = {"model_type", "text", "vision", "image_processor", "video_processor"}
        return cls(name=name, model_type=spec.get("model_type", DEFAULT_MODEL_TYPE), text=dict(spec.get("text") or {}),
                   vision=dict(spec.get("vision") or {}), image_processor=dict(spec.get("image_processor") or {}),
                   video_processor=dict(spec.get("video_processor") or {}),
                   extra={k: v for k, v in spec.items() if k not in known})


def load_preset(preset: str | os.PathLike, overrides: Optional[Mapping[str, Any]] = None) -> RandomPreset:
    """Read a preset YAML; ``overrides`` (the same layout, e.g. ``{"text": {"hidden_size": 64}}``) are merged
    into it key by key, to make a small model of the same layout."""
    spec = yaml.safe_load(Path(preset).read_text())
    if not isinstance(spec, dict):
        raise ValueError(f"preset {preset}: expected a mapping at the top level")
    return RandomPreset.from_dict(_merged(spec, overrides or {}), name=Path(preset).name)


def make_random_model(preset: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                      overrides: Optional[Mapping[str, Any]] = None) -> Path:
    """Write the preset's model with random weights into ``out_dir`` (atomically: a folder with a config.json
    is complete and is returned as it is). Returns ``out_dir``."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    spec = load_preset(preset, overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        WRITERS[spec.model_type](spec, tmp, seed=seed, dtype=dtype, device=device)
        (tmp / "README.md").write_text(f"Random weights (seed {seed}) at the dimensions of {spec.name}"
                                       f"{' with overrides ' + json.dumps(overrides) if overrides else ''}. "
                                       "Not a trained model: for throughput benchmarks only.\n")
        os.chmod(tmp, 0o755)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_random_llava(preset: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> Path:
    """A LLaVA preset's random model (:func:`make_random_model`, which also takes the other families)."""
    spec = load_preset(preset)
    if spec.model_type != "llava":
        raise ValueError(f"preset {spec.name} is a {spec.model_type} model; use make_random_model")
    return make_random_model(preset, out_dir, seed=seed, dtype=dtype, device=device)


# -- writers --------------------------------------------------------------------------------------

def _write_llava(spec: RandomPreset, out: Path, *, seed: int, dtype: torch.dtype, device: str) -> None:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from vlora.models import tiny

    tokenizer = tiny.build_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(**spec.vision)
    num_image_tokens = (vision.image_size // vision.patch_size) ** 2
    text = LlamaConfig(**spec.text, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    _check_vocab(spec, text.vocab_size, len(tokenizer))
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         image_seq_length=num_image_tokens,
                         projector_hidden_act=spec.extra.get("projector_hidden_act", "gelu"),
                         vision_feature_layer=spec.extra.get("vision_feature_layer", -2),
                         vision_feature_select_strategy=spec.extra.get("vision_feature_select_strategy", "default"),
                         tie_word_embeddings=False)
    model = _random_model(LlavaForConditionalGeneration, config, seed=seed, dtype=dtype, device=device)
    # The preset's vocabulary is the checkpoint's (its head's bytes count in every decode floor), the tokenizer the
    # tiny one: rows past it would be ids with no text, and random logits pick them 31 times in 32. As padding rows
    # (zero, as Qwen's below) a greedy answer takes real tokens, so clients that time text see some.
    with torch.no_grad():
        model.get_output_embeddings().weight[len(tokenizer):] = 0.0
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    del model
    tokenizer.save_pretrained(out)
    pre = tiny.preprocessor_config()
    pre["size"] = {"shortest_edge": vision.image_size}
    pre["crop_size"] = {"height": vision.image_size, "width": vision.image_size}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")


def _write_qwen(spec: RandomPreset, out: Path, *, seed: int, dtype: torch.dtype, device: str) -> None:
    """Qwen2-VL / Qwen2.5-VL: the Hub's flat config.json (as :func:`vlora.models.tiny_qwen.hub_config`, at
    the preset's dimensions), the tiny Qwen tokenizer and chat template, and the Hub's processor configs at
    the preset's pixel bounds."""
    from transformers import AutoConfig, GenerationConfig

    from vlora.models import tiny_qwen

    variant = tiny_qwen.VARIANTS[spec.model_type]
    tokenizer = tiny_qwen.build_tokenizer()
    tokenizer.model_max_length = int(spec.text["max_position_embeddings"])
    config_dict = qwen_hub_config(spec, tokenizer, dtype)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    model = _random_model(variant.model_class(), config, seed=seed, dtype=dtype, device=device)
    with torch.no_grad():  # rows past the tokenizer are padding, as in the Hub checkpoint: never emitted
        model.get_output_embeddings().weight[len(tokenizer):] = 0.0
    model.generation_config = GenerationConfig(
        bos_token_id=config_dict["bos_token_id"],
        eos_token_id=[config_dict["eos_token_id"], config_dict["pad_token_id"]],
        pad_token_id=config_dict["pad_token_id"], do_sample=False)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    del model
    # save_pretrained rewrites config.json in transformers' nested layout; keep the Hub's flat one
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    image = tiny_qwen.image_processor_config(variant)
    image.update(_pixel_bounds(spec.image_processor))
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    video = tiny_qwen.video_processor_config(variant)
    video.update(_pixel_bounds(spec.video_processor))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


def qwen_hub_config(spec: RandomPreset, tokenizer, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json of a Qwen preset, in the Hub's flat layout: :func:`vlora.models.tiny_qwen.hub_config`
    (the layout and the special tokens' ids) with the preset's text settings and vision config."""
    from vlora.models import tiny_qwen

    _check_vocab(spec, int(spec.text["vocab_size"]), len(tokenizer))
    config = tiny_qwen.hub_config(tiny_qwen.VARIANTS[spec.model_type], tokenizer)
    config.update(copy.deepcopy(spec.text))
    config["sliding_window"] = spec.text.get("sliding_window", spec.text["max_position_embeddings"])
    config["max_window_layers"] = spec.text.get("max_window_layers", spec.text["num_hidden_layers"])
    config["vision_config"] = dict(copy.deepcopy(spec.vision), initializer_range=INIT_STD)
    config["initializer_range"] = INIT_STD
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


# model_type -> the writer of its folder; the Qwen types are tiny_qwen.VARIANTS' names.
WRITERS: dict[str, Callable[..., None]] = {"llava": _write_llava, "qwen2_vl": _write_qwen, "qwen2_5_vl": _write_qwen}


# -- helpers --------------------------------------------------------------------------------------

def _random_model(cls, config, *, seed: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """``cls(config)`` with storage on ``device`` in ``dtype`` and every parameter drawn from ``seed``:
    norm weights 1, biases 0, the rest N(0, INIT_STD^2), in ``named_parameters`` order."""
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype).to_empty(device=device)
    norm_weights = {f"{mod_name}.weight" for mod_name, mod in model.named_modules()
                    if isinstance(mod, torch.nn.LayerNorm) or type(mod).__name__.endswith("RMSNorm")}
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in norm_weights or ("norm" in name and name.endswith("weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
    return model


def _check_vocab(spec: RandomPreset, vocab_size: int, num_tokens: int) -> None:
    if vocab_size < num_tokens:
        raise ValueError(f"preset {spec.name}: vocab_size {vocab_size} is smaller than the tokenizer ({num_tokens})")


def _pixel_bounds(bounds: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen processor config's pixel settings from a preset's ``min_pixels`` / ``max_pixels``."""
    out = {k: int(bounds[k]) for k in ("min_pixels", "max_pixels") if k in bounds}
    if len(out) == 2:
        out["size"] = {"shortest_edge": out["min_pixels"], "longest_edge": out["max_pixels"]}
    return out


def _merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
