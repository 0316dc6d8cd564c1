"""The LLaVA-1.5 family: loading a LLaVA-architecture model from a local Hugging Face folder, building
prompt token ids, and its vision tower (:class:`LlavaFamily`, see :mod:`vlora.models.base`).

One path serves the embedded tiny model and real llava-hf checkpoints (llava-hf/llava-1.5-7b-hf:
``config.json``, sharded ``*.safetensors`` with an index, tokenizer files, ``preprocessor_config.json``,
optionally ``chat_template.json``). Nothing is fetched from a hub (``local_files_only=True``) and only
safetensors weights are read: pickle files (``pytorch_model*.bin``) can run code when loaded.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from vlora.errors import InvalidRequest
from vlora.models.base import (PROJECTOR_STAGE, VISION_STAGE, LoadedModel, ModelFamily, ModelLoadError, Prompt,
                               check_safetensors_present, load_weights, read_config)

log = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"

# Used when neither the tokenizer nor the folder carries a chat template: LLaVA-1.5's format.
# Messages are llava-hf style: content is a string or a list of {"type": "image"} and
# {"type": "text", "text": ...} parts; a turn's images are rendered before its text.
LLAVA_15_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] + ' ' }}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Vision towers whose output starts with a class token (which the "default" feature strategy drops).
_CLASS_TOKEN = {"clip_vision_model": True, "siglip_vision_model": False}


def load_llava(path: str | Path, dtype: torch.dtype, device: torch.device | str,
               *, attn_implementation: Optional[str] = None) -> LoadedModel:
    """Load a LLaVA-architecture model from a local folder onto ``device`` in ``dtype``.

    Refuses, naming the problem: a missing folder, a model type other than ``llava``, pickle-only
    weights, weights missing from the checkpoint, a tokenizer whose ``<image>`` id disagrees with the
    config, and an image processor whose output size does not match the vision tower.
    """
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {str(path)!r} does not exist or is not a directory")
    config = _read_config(path)
    check_safetensors_present(path)

    kwargs: dict[str, Any] = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = load_weights(LlavaForConditionalGeneration, path, dtype, device, **kwargs)

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer from {str(path)!r}: {e}") from e
    image_processor = _load_image_processor(path)

    mconfig = model.config
    # transformers 5 names it image_token_id (an alias of image_token_index); read whichever is set.
    image_token_id = getattr(mconfig, "image_token_id", None)
    image_token_id = int(mconfig.image_token_index if image_token_id is None else image_token_id)
    tok_image_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    if tok_image_id != image_token_id:
        raise ModelLoadError(f"{str(path)!r}: the tokenizer maps {IMAGE_PLACEHOLDER!r} to {tok_image_id}, "
                             f"but config.image_token_index is {image_token_id}")
    text_config = mconfig.text_config
    if len(tokenizer) > text_config.vocab_size:
        raise ModelLoadError(f"{str(path)!r}: the tokenizer has {len(tokenizer)} tokens, "
                             f"more than the model's vocab_size {text_config.vocab_size}")

    num_image_tokens = _num_image_tokens(mconfig)
    _check_image_processor(image_processor, mconfig.vision_config.image_size, path)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        image_processor=image_processor,
        image_token_id=image_token_id,
        num_image_tokens=num_image_tokens,
        max_model_len=int(text_config.max_position_embeddings),
        name=path.resolve().name,
        text_config=text_config,
        chat_template=tokenizer.chat_template or _folder_chat_template(path) or LLAVA_15_CHAT_TEMPLATE,
        path=path,
    )


def build_prompt_ids(loaded: LoadedModel, text: str, num_images: int, apply_chat_template: bool) -> list[int]:
    """Token ids for one request, images expanded to their placeholder tokens.

    The text is used as given (the Triton vLLM backend's convention). Each ``<image>`` in it marks where
    an image goes; with no ``<image>`` at all, the images come first. Each image becomes
    ``num_image_tokens`` copies of ``image_token_id``, which the model replaces with the image's
    features. The tokenizer's BOS token, if it has one, is added once at the start.

    With ``apply_chat_template`` the text is first wrapped as one user turn through the model's chat
    template (llava-hf style content parts: images, then the text), ending with the assistant prompt,
    e.g. ``USER: <image>\\nWhat is this? ASSISTANT:``.

    Raises InvalidRequest when the placeholders and images disagree in number, or when there is
    neither text nor an image.
    """
    if not isinstance(text, str):
        raise InvalidRequest("text_input must be a string")
    if num_images < 0:
        raise InvalidRequest(f"negative number of images: {num_images}")
    if not text.strip() and num_images == 0:
        raise InvalidRequest("empty prompt: text_input is empty and no image was given")
    placeholders = text.count(IMAGE_PLACEHOLDER)
    if placeholders and placeholders != num_images:
        raise InvalidRequest(f"the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) "
                             f"but the request carries {num_images} image(s)")
    tokenizer = loaded.tokenizer
    if apply_chat_template:
        parts: list[dict[str, Any]] = [] if placeholders else [{"type": "image"} for _ in range(num_images)]
        parts.append({"type": "text", "text": text})
        text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], chat_template=loaded.chat_template,
                                             tokenize=False, add_generation_prompt=True)
        if text.count(IMAGE_PLACEHOLDER) != num_images:
            raise InvalidRequest(f"the chat template produced {text.count(IMAGE_PLACEHOLDER)} image placeholder(s) "
                                 f"for {num_images} image(s)")
    elif not placeholders:
        text = IMAGE_PLACEHOLDER * num_images + text

    # Expand in the text and tokenize once, as LlavaProcessor does, so the text around each image
    # tokenizes exactly as it would in transformers.
    image_token = tokenizer.convert_ids_to_tokens(loaded.image_token_id)
    text = text.replace(IMAGE_PLACEHOLDER, image_token * loaded.num_image_tokens)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    found = sum(1 for i in ids if i == loaded.image_token_id)
    if found != num_images * loaded.num_image_tokens:
        raise InvalidRequest(f"the prompt holds {found} image tokens, expected {num_images} image(s) x "
                             f"{loaded.num_image_tokens}; do not write the image token except as {IMAGE_PLACEHOLDER}")
    return ids


def _read_config(path: Path) -> dict[str, Any]:
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type != "llava":
        raise ModelLoadError(f"{str(path)!r}: model_type {model_type!r} is not supported; vlora serves LLaVA "
                             f"(model_type 'llava', LlavaForConditionalGeneration)")
    vision_type = (config.get("vision_config") or {}).get("model_type", "clip_vision_model")
    if vision_type not in _CLASS_TOKEN:
        raise ModelLoadError(f"{str(path)!r}: vision tower {vision_type!r} is not supported; "
                             f"supported: {sorted(_CLASS_TOKEN)}")
    return config


def _num_image_tokens(config: Any) -> int:
    """Tokens per image: the vision tower's patches (plus its class token), less the class token
    when ``vision_feature_select_strategy`` is "default" (LlavaModel drops the first feature)."""
    vc = config.vision_config
    strategy = config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"vision_feature_select_strategy {strategy!r} is not supported")
    n = (vc.image_size // vc.patch_size) ** 2 + int(_CLASS_TOKEN[vc.model_type]) - int(strategy == "default")
    declared = getattr(config, "image_seq_length", None)
    if declared is not None and declared != n:
        log.warning("config.image_seq_length is %s but the vision tower yields %s tokens per image; using %s",
                    declared, n, n)
    return n


def _load_image_processor(path: Path) -> Any:
    """AutoImageProcessor, or, where it needs torchvision that is not installed (transformers 5.17
    does), the class named in preprocessor_config.json, which falls back to its PIL backend."""
    import transformers

    try:
        try:
            return transformers.AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        except ImportError:
            config = json.loads((path / "preprocessor_config.json").read_text(encoding="utf-8"))
            name = str(config.get("image_processor_type", "CLIPImageProcessor")).removesuffix("Fast")
            cls = getattr(transformers, name, None)
            if cls is None:
                raise ModelLoadError(f"{str(path)!r}: unknown image_processor_type {name!r}") from None
            return cls.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the image processor from {str(path)!r}: {e}") from e


def _check_image_processor(image_processor: Any, image_size: int, path: Path) -> None:
    from PIL import Image

    out = image_processor(images=[Image.new("RGB", (image_size + 3, image_size + 7))], return_tensors="pt")
    shape = tuple(out["pixel_values"].shape)
    if shape != (1, 3, image_size, image_size):
        raise ModelLoadError(f"{str(path)!r}: the image processor yields pixel_values of shape {shape}, "
                             f"but the vision tower takes (1, 3, {image_size}, {image_size})")


def _folder_chat_template(path: Path) -> Optional[str]:
    """llava-hf ships the template for the processor: chat_template.json or chat_template.jinja."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    js = path / "chat_template.json"
    if js.is_file():
        try:
            template = json.loads(js.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{str(js)!r} is not a valid chat template file: {e}") from e
        return template if isinstance(template, str) else None
    return None


class LlavaFamily(ModelFamily):
    """LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP/SigLIP tower at a fixed resolution, a fixed
    number of tokens per image, 1-D rotary positions."""

    name = "llava"
    model_types = ("llava",)
    image_placeholder = IMAGE_PLACEHOLDER
    vision_markers = (IMAGE_PLACEHOLDER,)
    # CLIP/SigLIP encoder layers and the two-layer projector, as transformers 5 names them. Adapters trained
    # with transformers 4 name the tower's layers under vision_tower.vision_model., and before 4.52 without
    # the leading model.
    vision_lora_modules = (
        (VISION_STAGE, r"model\.vision_tower\.(?:vision_model\.)?encoder\.layers\.(?P<layer>\d+)\."
                       r"(?P<module>self_attn\.(?:q_proj|k_proj|v_proj|out_proj)|mlp\.fc[12])"),
        (PROJECTOR_STAGE, r"model\.multi_modal_projector\.(?P<module>linear_[12])"),
    )
    vision_lora_aliases = (
        ("model.vision_tower.vision_model.", "model.vision_tower."),
        ("vision_tower.vision_model.", "model.vision_tower."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )

    def load(self, path, dtype, device) -> LoadedModel:
        return load_llava(path, dtype, device)

    def prompt(self, loaded, text, images, apply_chat_template) -> Prompt:
        ids = build_prompt_ids(loaded, text, len(images), apply_chat_template)
        return Prompt(ids=ids, pixel_values=self.pixel_values(loaded, images) if images else None)

    def pixel_values(self, loaded, images) -> torch.Tensor:
        """[n, 3, H, W] float32 on the model's device (:mod:`vlora.models.pixels`: Pillow's resize, bit for
        bit, then the processor's crop, rescale and normalisation there); the processor itself on the CPU for
        settings that module does not reproduce."""
        from vlora.models import pixels

        layout = pixels.clip_layout(loaded.image_processor)
        if layout is None:
            from vlora.models.images import pixel_values

            return pixel_values(images, loaded.image_processor)
        with pixels.DeviceWork(next(loaded.model.parameters()).device) as work:
            return work.done(pixels.clip_pixel_values(images, layout, work.device))

    def fixed_pixels(self, loaded) -> Optional[tuple[int, int]]:
        size = loaded.model.config.vision_config.image_size
        return (size, size)

    def encode_images(self, loaded, pixel_values, image_grid_thw, video=False):
        """[n, 3, H, W] -> n x [tokens_per_image, hidden], as LlavaModel.get_image_features does."""
        return list(self.encode_batch(loaded, pixel_values))

    def encode_batch(self, loaded, pixel_values) -> torch.Tensor:
        """[n, 3, H, W] -> [n, tokens_per_image, hidden] (what :class:`vlora.engine.vision_graphs.VisionGraphs`
        captures)."""
        model = loaded.model
        vm = model.model
        p = next(vm.vision_tower.parameters())
        out = vm.vision_tower(pixel_values.to(p.device, p.dtype), output_hidden_states=True)
        layer = model.config.vision_feature_layer
        layers = layer if isinstance(layer, (list, tuple)) else [layer]
        default = model.config.vision_feature_select_strategy == "default"
        feats = torch.cat([out.hidden_states[li][:, 1:] if default else out.hidden_states[li] for li in layers], dim=-1)
        return vm.multi_modal_projector(feats)

    def vision_lora_rows(self, loaded, pixel_values, image_grid_thw, video=False):
        """Every image alike: the tower's tokens (patches, plus CLIP's class token), then its placeholder
        tokens into the projector."""
        vc = loaded.model.config.vision_config
        h, w = pixel_values.shape[-2:]
        tower = (h // vc.patch_size) * (w // vc.patch_size) + int(_CLASS_TOKEN[vc.model_type])
        n = len(pixel_values)
        return {VISION_STAGE: [tower] * n, PROJECTOR_STAGE: [loaded.num_image_tokens] * n}
