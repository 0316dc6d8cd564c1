"""The Qwen2-VL family (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``).

- Images keep their own resolution within the processor's pixel bounds: each image gives its own number
  of visual tokens (``image_grid_thw`` [t, h, w] patches, merged 2x2 into one token each).
- The prompt is built by the model's own processor (``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor``): the
  text is used as given, with ``<|vision_start|><|image_pad|><|vision_end|>`` where each image goes (the
  processor expands the pad token to the image's token count); with no placeholder the images come
  first; the chat-template option wraps the text as one user turn. The tokenizer adds no BOS.
- Positions are M-RoPE's three axes, from the model's own ``get_rope_index``; the prompt's
  ``rope_delta`` shifts every generated token (see :mod:`vlora.models.base`).
- Decoder layers are Qwen2's: LLaMA's with biases on q/k/v (the runner's fused q/k/v GEMM carries them).

- Videos: a prompt with ``<|vision_start|><|video_pad|><|vision_end|>`` (once) makes the request's images
  the frames of one video, through the processor's video path (temporal patches of 2; Qwen2.5-VL's
  ``second_per_grid_ts`` from the processor's frame rate) and the model's ``get_video_features``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from vlora.errors import InvalidRequest
from vlora.models.base import (PROJECTOR_STAGE, VISION_STAGE, LoadedModel, ModelFamily, ModelLoadError, Prompt,
                               check_safetensors_present, load_weights, read_model_type)

log = logging.getLogger(__name__)

VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


class Qwen2VLFamily(ModelFamily):
    name = "qwen2-vl"
    model_types = tuple(_CLASSES)
    image_placeholder = VISION_PLACEHOLDER
    video_placeholder = VIDEO_PLACEHOLDER
    vision_markers = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    # The ViT blocks' attention and MLP (fc1/fc2 in Qwen2-VL, gate/up/down in Qwen2.5-VL) and the patch
    # merger's two linear layers; transformers before 4.52 had the tower at visual. instead of model.visual.
    vision_lora_modules = (
        (VISION_STAGE, r"model\.visual\.blocks\.(?P<layer>\d+)\."
                       r"(?P<module>attn\.(?:qkv|proj)|mlp\.(?:fc1|fc2|gate_proj|up_proj|down_proj))"),
        (PROJECTOR_STAGE, r"model\.visual\.merger\.(?P<module>mlp\.[02])"),
    )
    vision_lora_aliases = (("visual.", "model.visual."),)

    def load(self, path: Path, dtype: torch.dtype, device) -> LoadedModel:
        import transformers


        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model folder {str(path)!r} does not exist or is not a directory")
        model_type = read_model_type(path)
        check_safetensors_present(path)
        model = load_weights(getattr(transformers, _CLASSES[model_type]), path, dtype, device)
        try:
            # AutoProcessor where torchvision is installed; composed from the same files where it is not.
            from vlora.models.qwen_processing import load_qwen_processor

            processor = load_qwen_processor(path)
        except (OSError, ValueError, ImportError) as e:
            raise ModelLoadError(f"cannot load the processor from {str(path)!r}: {e}") from e
        tokenizer = processor.tokenizer
        cfg = model.config
        text_config = cfg.text_config
        if getattr(text_config, "use_sliding_window", False):
            raise ModelLoadError(f"{str(path)!r}: use_sliding_window is not supported")
        image_token_id = int(cfg.image_token_id)
        if tokenizer.convert_tokens_to_ids("<|image_pad|>") != image_token_id:
            raise ModelLoadError(f"{str(path)!r}: the tokenizer's <|image_pad|> is not config.image_token_id {image_token_id}")
        return LoadedModel(model=model, tokenizer=tokenizer, image_processor=processor, image_token_id=image_token_id,
                           num_image_tokens=0, max_model_len=int(text_config.max_position_embeddings),
                           name=path.resolve().name, text_config=text_config,
                           chat_template=processor.chat_template or tokenizer.chat_template or "", path=path)

    def prompt(self, loaded: LoadedModel, text: str, images, apply_chat_template: bool) -> Prompt:
        if not isinstance(text, str):
            raise InvalidRequest("text_input must be a string")
        if not text.strip() and not images:
            raise InvalidRequest("empty prompt: text_input is empty and no image was given")
        processor = loaded.image_processor
        if VIDEO_PLACEHOLDER in text:
            return self._video_prompt(loaded, text, images, apply_chat_template)
        placeholders = text.count(VISION_PLACEHOLDER)
        if placeholders and placeholders != len(images):
            raise InvalidRequest(f"the prompt has {placeholders} {VISION_PLACEHOLDER} placeholder(s) "
                                 f"but the request carries {len(images)} image(s)")
        if text.count("<|image_pad|>") != placeholders or "<|video_pad|>" in text:
            raise InvalidRequest(f"write images as {VISION_PLACEHOLDER} and a video as {VIDEO_PLACEHOLDER}; "
                                 f"the pad tokens alone are not accepted")
        if apply_chat_template:
            parts: list[dict[str, Any]] = [] if placeholders else [{"type": "image"} for _ in images]
            parts.append({"type": "text", "text": text})
            text = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                 add_generation_prompt=True)
        elif not placeholders:
            text = VISION_PLACEHOLDER * len(images) + text
        out = self._image_inputs(loaded, text, list(images))
        ids = out["input_ids"][0]
        grid = out.get("image_grid_thw")
        pv = out.get("pixel_values")
        if images:
            positions, delta = loaded.model.model.get_rope_index(
                ids[None], out["mm_token_type_ids"], image_grid_thw=grid)
            positions, delta = positions[:, 0].to(torch.long).cpu(), int(delta.reshape(-1)[0])
        else:
            positions, delta = None, 0  # text only: 1-D positions, as the model infers them
        return Prompt(ids=ids.tolist(), pixel_values=None if pv is None else pv.to(torch.float32),
                      image_grid_thw=grid, mrope_positions=positions, rope_delta=delta)

    def render_chat(self, loaded: LoadedModel, messages: list[dict]) -> str:
        """The processor's ``apply_chat_template``, as the one-turn path (``apply_chat_template``) renders."""
        return loaded.image_processor.apply_chat_template(messages, chat_template=loaded.chat_template, tokenize=False,
                                                          add_generation_prompt=True)

    def _image_inputs(self, loaded: LoadedModel, text: str, images: list) -> dict:
        """What the processor gives for ``text`` and ``images`` (input_ids [1, T], mm_token_type_ids, pixel_values,
        image_grid_thw), the pixels made on the model's device (:mod:`vlora.models.pixels`: Pillow's resize bit
        for bit, then the processor's rescale, normalisation and patches there) and the text expanded as the
        processor does (each image's pad token repeated once per merged patch). The processor itself for
        settings that module does not reproduce, or no image."""
        from vlora.models import pixels

        processor = loaded.image_processor
        layout = pixels.qwen_layout(processor.image_processor) if images else None
        if layout is None:
            return processor(text=[text], images=images or None, return_tensors="pt")
        with pixels.DeviceWork(next(loaded.model.parameters()).device) as work:
            pv, grid = pixels.qwen_image_patches(images, layout, work.device)
            work.done(pv)
        return {**self._expand(loaded, text, processor.image_token, grid, layout["merge"], 1), "pixel_values": pv,
                "image_grid_thw": grid}

    def _video_inputs(self, loaded: LoadedModel, text: str, frames: list) -> dict:
        """As :meth:`_image_inputs`, for one video's frames (pixel_values_videos, video_grid_thw, and Qwen2.5-VL's
        second_per_grid_ts as this processor computes it)."""
        from vlora.models import pixels

        processor = loaded.image_processor
        layout = pixels.qwen_layout(processor.video_processor)
        if layout is None or not pixels.video_fast_path(processor.video_processor, frames, layout):
            return processor(text=[text], videos=[frames], return_tensors="pt")
        with pixels.DeviceWork(next(loaded.model.parameters()).device) as work:
            pv, grid = pixels.qwen_video_patches(frames, layout, work.device)
            work.done(pv)
        out = {**self._expand(loaded, text, getattr(processor, "video_token", "<|video_pad|>"), grid, layout["merge"], 2),
               "pixel_values_videos": pv, "video_grid_thw": grid}
        seconds = _seconds_per_grid(processor)
        if seconds is not None:
            out["second_per_grid_ts"] = torch.tensor([seconds])
        return out

    @staticmethod
    def _expand(loaded: LoadedModel, text: str, pad: str, grid: torch.Tensor, merge: int, kind: int) -> dict:
        """input_ids [1, T] and mm_token_type_ids (``kind`` at the pad tokens) of ``text`` with each ``pad``
        repeated once per merged patch of its item, as the processor expands and tokenizes it."""
        pieces = text.split(pad)
        if len(pieces) - 1 != len(grid):
            raise InvalidRequest(f"the prompt holds {len(pieces) - 1} {pad} tokens for {len(grid)} item(s)")
        expanded = pieces[0] + "".join(pad * (int(g.prod()) // merge ** 2) + rest for g, rest in zip(grid, pieces[1:]))
        ids = loaded.image_processor.tokenizer([expanded], return_tensors="pt")["input_ids"]
        types = torch.zeros_like(ids)
        types[ids == loaded.image_processor.tokenizer.convert_tokens_to_ids(pad)] = kind
        return {"input_ids": ids, "mm_token_type_ids": types}

    def _video_prompt(self, loaded: LoadedModel, text: str, frames, apply_chat_template: bool) -> Prompt:
        processor = loaded.image_processor
        if text.count(VIDEO_PLACEHOLDER) != 1 or text.count("<|video_pad|>") != 1 or VISION_PLACEHOLDER in text:
            raise InvalidRequest(f"a video request has one {VIDEO_PLACEHOLDER}, no other <|video_pad|> and no "
                                 "image placeholder")
        if not frames:
            raise InvalidRequest("a video request carries its frames as the request's images; none were given")
        sizes = [getattr(f, "size", None) for f in frames]
        if any(size != sizes[0] for size in sizes):
            bad = next(i for i, size in enumerate(sizes) if size != sizes[0])
            raise InvalidRequest(f"a video's frames must all have the same size: frame {bad} is {sizes[bad]}, "
                                 f"frame 0 is {sizes[0]} (width, height)")
        if apply_chat_template:
            text = text.replace(VIDEO_PLACEHOLDER, "")
            text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}],
                                                 tokenize=False, add_generation_prompt=True)
        out = self._video_inputs(loaded, text, list(frames))
        ids = out["input_ids"][0]
        grid = out["video_grid_thw"]
        extra = {"second_per_grid_ts": out["second_per_grid_ts"]} if "second_per_grid_ts" in out else {}
        positions, delta = loaded.model.model.get_rope_index(ids[None], out["mm_token_type_ids"], video_grid_thw=grid, **extra)
        return Prompt(ids=ids.tolist(), pixel_values=out["pixel_values_videos"].to(torch.float32), image_grid_thw=grid,
                      mrope_positions=positions[:, 0].to(torch.long).cpu(), rope_delta=int(delta.reshape(-1)[0]), video=True)

    def encode_images(self, loaded: LoadedModel, pixel_values: torch.Tensor,
                      image_grid_thw: Optional[torch.Tensor], video: bool = False) -> list[torch.Tensor]:
        """The model's vision tower and merger, without host syncs (:mod:`vlora.models.qwen_vision`); images and
        a video's frames alike (transformers' get_image_features and get_video_features differ only in names)."""
        from vlora.models.qwen_vision import encode_features, vision_forward

        visual = loaded.model.model.visual
        p = next(visual.parameters())
        return encode_features(vision_forward(visual), pixel_values.to(p.device, p.dtype), image_grid_thw.cpu(),
                               int(loaded.model.config.vision_config.spatial_merge_size))

    def item_grid(self, loaded: LoadedModel, height: int, width: int, frames: int = 0) -> "tuple[int, int, int] | None":
        """The (t, h, w) grid of an image of ``height`` x ``width`` (``frames`` 0), or of a video of that many
        frames of that size, as this model's processors would make it; None where their settings are not
        the ones :mod:`vlora.models.pixels` reproduces."""
        from vlora.models import pixels

        proc = loaded.image_processor
        layout = pixels.qwen_layout(proc.video_processor if frames else proc.image_processor)
        if layout is None:
            return None
        h, w = pixels.qwen_size(height, width, layout)
        t = -(-frames // layout["temporal"]) if frames else 1
        return t, h // layout["patch"], w // layout["patch"]

    def grid_vision(self, loaded: LoadedModel):
        from vlora.models.qwen_vision import vision_forward

        return vision_forward(loaded.model.model.visual)

    def item_tokens(self, loaded: LoadedModel, pixel_values, image_grid_thw, video: bool = False) -> list[int]:
        merge = loaded.model.config.vision_config.spatial_merge_size
        return (image_grid_thw.prod(-1) // merge ** 2).tolist()

    def vision_lora_rows(self, loaded, pixel_values, image_grid_thw, video=False):
        """An item's patches in the blocks (Qwen2.5-VL's window order moves rows only within their image),
        then its merged tokens in the merger."""
        return {VISION_STAGE: image_grid_thw.prod(-1).tolist(),
                PROJECTOR_STAGE: self.item_tokens(loaded, pixel_values, image_grid_thw, video)}

    def placeholder_id(self, loaded: LoadedModel, video: bool) -> int:
        return int(loaded.model.config.video_token_id) if video else loaded.image_token_id

    def patches(self, pixel_values: torch.Tensor, image_grid_thw: Optional[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch.split(pixel_values, image_grid_thw.prod(-1).tolist()))

    def join(self, per_image: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(per_image)


def _seconds_per_grid(processor) -> "float | None":
    """Qwen2.5-VL's seconds per temporal grid step for a video given as frames, as this processor computes it
    (its default frame rate differs across transformers releases), found once with a two-frame clip; None
    where the processor gives none (Qwen2-VL)."""
    cached = processor.__dict__.get("_vlora_seconds_per_grid", False)
    if cached is False:
        import numpy as np

        tiny = [np.zeros((28, 28, 3), dtype=np.uint8)] * 2
        out = processor(text=[VIDEO_PLACEHOLDER], videos=[tiny], return_tensors="pt")
        value = out.get("second_per_grid_ts")
        cached = None if value is None else float(torch.as_tensor(value).reshape(-1)[0])
        processor.__dict__["_vlora_seconds_per_grid"] = cached
    return cached
