"""The model-family interface (:class:`ModelFamily`) and the loading helpers every family shares. What a
family is: what differs between LMMs behind one small interface, so that the engine, the paged
KV cache, the attention kernels, the CUDA graphs and ATMM serve every family unchanged.

A family (one module each: :mod:`vlora.models.loader` for LLaVA-1.5, :mod:`vlora.models.qwen2_vl` for
Qwen2-VL and Qwen2.5-VL) owns:
- loading from a local Hugging Face folder (:meth:`ModelFamily.load`), refusing what it cannot serve;
- turning a prompt and its images into token ids, the vision inputs and the rotary positions, exactly as
  the model's own processor does (:meth:`ModelFamily.prompt`);
- the vision encoder and projector or merger (:meth:`ModelFamily.encode_images`: one feature row per
  placeholder token of each image);
- which of its vision-side projections take LoRA (:attr:`ModelFamily.vision_lora_modules`, found in the
  loaded model by :meth:`ModelFamily.vision_lora_sites`) and how many rows each image puts through them
  (:meth:`ModelFamily.vision_lora_rows`), so that one vision forward serves images of many adapters.

What the decoder layer needs is read from the Hugging Face modules themselves: the layers live at
``model.model.language_model.layers`` with LLaMA's projections (biases allowed: Qwen2 has them on
q/k/v), RMSNorm and a SiLU MLP; the rotary embedding is the model's own ``rotary_emb``, which takes
1-D positions or M-RoPE's three axes ([3, T]: temporal, height, width). A prompt's M-RoPE positions
end ``rope_delta`` past its length, and every later token of the request sits at its index plus that
delta on all three axes, so decode steps (and their CUDA graphs) stay 1-D.

To add a family (InternVL, Gemma 3, ...): subclass :class:`ModelFamily`, list its ``model_types``
(config.json ``model_type``), and list it in :data:`vlora.models.family.FAMILIES`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

import torch

from vlora.errors import InvalidRequest
from vlora.files import FileTooLarge, json_object, read_once

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB


class ModelLoadError(RuntimeError):
    """The model folder cannot be served; the message names the file or setting at fault."""


@dataclass
class LoadedModel:
    """A model ready for inference, with what the engine needs to build its inputs."""

    model: Any  # the transformers *ForConditionalGeneration, eval mode, requires_grad off
    tokenizer: Any
    image_processor: Any  # LLaVA: the image processor; Qwen2-VL: the whole processor (text + images)
    image_token_id: int
    num_image_tokens: int  # placeholder tokens per image (0: it depends on the image, as in Qwen2-VL)
    max_model_len: int
    name: str
    text_config: Any  # the decoder's config (hidden_size, num_hidden_layers, ...)
    chat_template: str
    path: Optional[Path] = None
    family: Optional["ModelFamily"] = field(default=None, repr=False)


@dataclass
class Prompt:
    """One request's model inputs. Shape: pixel_values as the family's vision tower takes them (LLaVA
    [n, 3, H, W]; Qwen2-VL [patches, C * T * P * P] for all images, in order); image_grid_thw [n, 3]
    (Qwen2-VL); mrope_positions [3, len(ids)] int64, or None for 1-D positions. With ``video`` the request's
    images are one video's frames: pixel_values are its patches and image_grid_thw its [1, 3] grid."""

    ids: list[int]
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    mrope_positions: Optional[torch.Tensor] = None
    rope_delta: int = 0
    video: bool = False  # the images are the frames of one video (its grid is image_grid_thw's one row)


# The two stages of the vision side. Their rows per image differ (CLIP: a class token and one per patch in the
# tower, one per patch into the projector; Qwen2-VL: four patches per merged token), so each has its own
# LoRA segment mapping.
VISION_STAGE = "vision"  # the vision tower's blocks
PROJECTOR_STAGE = "projector"  # the projector (LLaVA) or the patch merger (Qwen2-VL)


@dataclass(frozen=True)
class VisionLoraSite:
    """One vision-side projection that takes LoRA: its module path in the loaded model, its block index
    (0 in the projector), its target name (``<stage>.<path inside the block>``, the same in every
    block, e.g. ``vision.self_attn.q_proj``, ``projector.linear_1``) and its stage."""

    path: str
    layer: int
    target: str
    stage: str


class ModelFamily:
    """Base class; see the module docstring."""

    name: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    image_placeholder: ClassVar[str] = ""  # what a prompt writes where an image goes
    video_placeholder: ClassVar[str] = ""  # where a video goes (its frames are the request's images); "": no video
    # Vision-side LoRA: (stage, regex over the loaded model's module paths, with groups ``module`` and, in the
    # tower, ``layer``) for each stage's targetable nn.Linear projections; ``vision_lora_aliases`` are
    # (older prefix, current prefix) pairs for the module paths of adapters trained with older transformers.
    vision_lora_modules: ClassVar[tuple[tuple[str, str], ...]] = ()
    vision_lora_aliases: ClassVar[tuple[tuple[str, str], ...]] = ()

    # What a conversation's text may not hold: the markers of the family's image and video placeholders (images
    # go in image parts, so that the template's k-th placeholder is the k-th image).
    vision_markers: ClassVar[tuple[str, ...]] = ()

    def load(self, path: Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
        raise NotImplementedError

    def prompt(self, loaded: LoadedModel, text: str, images: Sequence, apply_chat_template: bool) -> Prompt:
        """Token ids and vision inputs for one request (decoded RGB images). Raises InvalidRequest."""
        raise NotImplementedError

    def chat_prompt(self, loaded: LoadedModel, conversation: Any, images: Sequence) -> Prompt:
        """A whole conversation (:class:`vlora.engine.chat.Conversation`: system, user and assistant messages,
        image and video parts) through the checkpoint's chat template (:meth:`render_chat`, with the assistant's
        prompt after it), then as a prompt of its own (:meth:`prompt`). The template writes the family's
        placeholder for each image part in the conversation's order, which is the images' order (the k-th
        placeholder is the k-th image), and a video part's for the one video. Raises InvalidRequest: a text
        part holding a placeholder's marker, a template that refuses the conversation or writes other numbers
        of placeholders than the conversation's parts."""
        for where, text in conversation.texts():
            for marker in self.vision_markers:
                if marker in text:
                    raise InvalidRequest(f"{where}.text holds {marker}: images go in image parts, not in the text")
        if not loaded.chat_template:
            raise InvalidRequest(f"messages need the model's chat template, and {loaded.name!r} has none: "
                                 "send text_input")
        try:
            text = self.render_chat(loaded, [dict(m) for m in conversation.messages])
        except InvalidRequest:
            raise
        except Exception as e:  # jinja2's TemplateError (a template's raise_exception), or transformers' ValueError
            raise InvalidRequest(f"messages: the model's chat template refused the conversation: "
                                 f"{str(e)[:300] or type(e).__name__}") from None
        wanted = [(self.image_placeholder, conversation.images)]
        if self.video_placeholder:
            wanted.append((self.video_placeholder, int(conversation.video)))
        for placeholder, n in wanted:
            got = text.count(placeholder)
            if got != n:
                raise InvalidRequest(f"messages: the model's chat template wrote {got} {placeholder} placeholder(s) "
                                     f"for {n} part(s); it does not take images where this conversation has them")
        return self.prompt(loaded, text, images, False)

    def render_chat(self, loaded: LoadedModel, messages: list[dict]) -> str:
        """The conversation's text as the checkpoint's chat template writes it, ending with the assistant's
        prompt (``add_generation_prompt``): the tokenizer's ``apply_chat_template`` with
        ``loaded.chat_template``."""
        return loaded.tokenizer.apply_chat_template(messages, chat_template=loaded.chat_template, tokenize=False,
                                                    add_generation_prompt=True)

    def encode_images(self, loaded: LoadedModel, pixel_values: torch.Tensor,
                      image_grid_thw: Optional[torch.Tensor], video: bool = False) -> list[torch.Tensor]:
        """Features of each image (or video), [tokens of that image, hidden], in order."""
        raise NotImplementedError

    def fixed_pixels(self, loaded: LoadedModel) -> Optional[tuple[int, int]]:
        """(H, W) of every image's pixel_values where the vision tower takes one fixed size (LLaVA's CLIP),
        so that an image-count bucket can be captured as a CUDA graph (:meth:`encode_batch`); None where
        the shapes depend on the image (Qwen2-VL's grids)."""
        return None

    def encode_batch(self, loaded: LoadedModel, pixel_values: torch.Tensor) -> torch.Tensor:
        """Fixed-size families: [n, 3, H, W] -> [n, tokens per image, hidden], one tensor."""
        raise NotImplementedError

    def item_grid(self, loaded: LoadedModel, height: int, width: int, frames: int = 0) -> Optional[tuple[int, int, int]]:
        """Families of many grids: the (t, h, w) grid preprocessing gives an image of ``height`` x ``width``, or a
        video of ``frames`` such frames (what ``engine.vision_graph_grids`` captures); None elsewhere."""
        return None

    def grid_vision(self, loaded: LoadedModel):
        """Families whose tower takes items of many grids (Qwen2-VL): the tower's two-part forward, a
        :class:`vlora.models.qwen_vision.QwenVisionForward` (``plan(grids, device)`` on the host, ``run(pixels,
        plan)`` device work only), so that one grid's items can be captured as a CUDA graph; None elsewhere."""
        return None

    def item_tokens(self, loaded: LoadedModel, pixel_values: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
                    video: bool = False) -> list[int]:
        """Placeholder tokens of each image (or the video) of one request, in order."""
        return [loaded.num_image_tokens] * len(pixel_values)

    def placeholder_id(self, loaded: LoadedModel, video: bool) -> int:
        """The token id the vision features replace."""
        return loaded.image_token_id

    def patches(self, pixel_values: torch.Tensor, image_grid_thw: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """One request's pixel_values split per image (to encode each distinct image once)."""
        return list(pixel_values)

    def join(self, per_image: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(per_image)

    def vision_lora_sites(self, loaded: LoadedModel) -> list[VisionLoraSite]:
        """The loaded model's projections that :attr:`vision_lora_modules` names, in module order."""
        from torch import nn

        patterns = [(stage, re.compile(rx)) for stage, rx in self.vision_lora_modules]
        sites = []
        for path, module in loaded.model.named_modules():
            for stage, rx in patterns:
                m = rx.fullmatch(path)
                if m is not None and isinstance(module, nn.Linear):
                    layer = int(m["layer"]) if "layer" in rx.groupindex else 0
                    sites.append(VisionLoraSite(path, layer, f"{stage}.{m['module']}", stage))
        return sites

    def vision_lora_rows(self, loaded: LoadedModel, pixel_values: torch.Tensor,
                         image_grid_thw: Optional[torch.Tensor], video: bool = False) -> dict[str, list[int]]:
        """Rows each image (or video) of an encoder batch puts through each stage's projections, in order:
        the per-item segments of the vision-side LoRA mapping."""
        raise NotImplementedError


def read_config(path: Path) -> dict[str, Any]:
    """The folder's config.json; ModelLoadError naming the problem."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; expected a Hugging Face model folder")
    try:  # resolved first: a Hugging Face cache snapshot links its files to blobs
        return json_object(read_once(cfg_file.resolve(), MAX_CONFIG_BYTES), "config.json")
    except FileTooLarge:
        raise ModelLoadError(f"{str(path)!r}: config.json is larger than {MAX_CONFIG_BYTES} bytes") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{str(path)!r}: {e}") from None


def read_model_type(path: Path) -> str:
    return str(read_config(path).get("model_type"))


def load_weights(cls: Any, path: Path, dtype: torch.dtype, device, **kwargs) -> Any:
    """``cls.from_pretrained`` from the local folder, safetensors only, every weight present, eval mode,
    no gradients, on ``device``; ModelLoadError naming what is wrong."""
    try:
        model, info = cls.from_pretrained(str(path), dtype=dtype, local_files_only=True, use_safetensors=True,
                                          output_loading_info=True, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model weights from {str(path)!r}: {e}") from e
    missing = [k for k in info.get("missing_keys", ()) if not k.endswith("position_ids")]
    if missing:
        raise ModelLoadError(f"{str(path)!r}: {len(missing)} weight(s) missing from the checkpoint, e.g. {missing[:3]}")
    model.eval()
    model.requires_grad_(False)
    return model.to(device)


def check_safetensors_present(path: Path) -> None:
    """ModelLoadError unless the folder holds safetensors weights (pickle weights are refused, naming them)."""
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
    if pickles:
        raise ModelLoadError(f"{str(path)!r} has only pickle weights ({', '.join(pickles[:3])}); vlora reads "
                             f"safetensors only, because loading pickle files can run arbitrary code. "
                             f"Convert the checkpoint to safetensors first")
    raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights")
