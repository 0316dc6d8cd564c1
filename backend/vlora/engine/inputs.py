"""Request validation and preprocessing, run before anything is queued.

Two stages: ``check`` validates every field, the adapter and the images' headers (cheap: no pixel is
decoded; the Triton model runs it on the request thread), and ``preprocess`` decodes the images and
builds the model inputs (as costly as the images' pixels; the Triton model runs it on the image workers,
:class:`vlora.engine.preprocess.PreprocessPool`, for requests with many pixels).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from vlora.config import InputLimits
from vlora.engine.api import GenerationRequest, InvalidRequest
from vlora.engine.api import PreparedRequest
from vlora.lora.adapter import validate_adapter_name
from vlora.lora.manager import LoraManager
from vlora.models.family import LoadedModel
from vlora.models.images import ProbedImage, check_decode_budget, decode_images, probe_images


@dataclass
class CheckedRequest:
    """A request whose fields, adapter and image headers passed ``InputProcessor.check``."""

    req: GenerationRequest
    images: list[ProbedImage]
    image_keys: tuple[bytes, ...]

    @property
    def pixels(self) -> int:
        """Decoded pixels of all its images: what preprocessing it costs."""
        return sum(image.pixels for image in self.images)


class InputProcessor:
    def __init__(self, loaded: LoadedModel, limits: InputLimits, loras: LoraManager, max_model_len: int) -> None:
        self.loaded = loaded
        self.limits = limits
        self.loras = loras
        self.max_model_len = max_model_len

    def prepare(self, req: GenerationRequest) -> PreparedRequest:
        """Check every field, decode images, tokenize. Raises InvalidRequest naming the problem."""
        return self.preprocess(self.check(req))

    def check(self, req: GenerationRequest, wait_adapter: bool = True) -> CheckedRequest:
        """Every field, the adapter, and the images' headers and pixel budget; no pixel decoded. Raises
        InvalidRequest naming the problem.

        ``wait_adapter=False`` (the server's admission, which must not wait for a disk): an adapter not in memory
        is only resolved under the root here, and read once the request is queued (LLMEngine.add_request's
        prefetch; a read that fails fails the request at admission with the same message), unless a task head
        must be looked up in it."""
        limits = self.limits
        if not req.request_id:
            raise InvalidRequest("request id is empty")
        if req.messages is not None:
            self._check_conversation(req)
        elif not isinstance(req.prompt, str) or not req.prompt.strip():
            raise InvalidRequest("text_input is empty: a prompt is required")
        elif len(req.prompt) > limits.max_prompt_chars:
            raise InvalidRequest(f"text_input has {len(req.prompt)} characters; the limit is {limits.max_prompt_chars}")
        if len(req.images) > limits.max_images:
            raise InvalidRequest(f"too many images: {len(req.images)} (the limit is {limits.max_images})")
        adapter = None
        if req.lora_name is not None:
            if not isinstance(req.lora_name, str) or not req.lora_name:
                raise InvalidRequest("lora_name must be a non-empty string")
            # The name rule first: a name with a NUL or a path separator never reaches a lookup or the disk.
            validate_adapter_name(req.lora_name)
            adapter = self.loras.validate(req.lora_name, wait=wait_adapter or req.task is not None)
        if req.task is not None:  # a task head answers from the prefill; it lives in the adapter
            if adapter is None:
                raise InvalidRequest(f"task {req.task!r} needs lora_name: task heads are part of an adapter")
            if req.task not in adapter.heads:
                have = sorted(adapter.heads)
                raise InvalidRequest(f"unknown task {req.task!r} for adapter {req.lora_name!r}: "
                                     + (f"its heads are {have}" if have else "it has no task heads"))
        probed = probe_images(req.images, limits)
        keys = tuple(hashlib.sha256(data if isinstance(data, bytes) else str(data).encode()).digest() for data in req.images)
        return CheckedRequest(req, probed, keys)

    def _check_conversation(self, req: GenerationRequest) -> None:
        """A ``messages`` request (:mod:`vlora.engine.chat`, parsed by the wire): its text within
        limits.max_prompt_chars, one image per image part, a video only where the family takes one."""
        conv, limits = req.messages, self.limits
        if conv.chars > limits.max_prompt_chars:
            raise InvalidRequest(f"messages has {conv.chars} characters of text; the limit is {limits.max_prompt_chars}")
        if conv.video:
            if not self.loaded.family.video_placeholder:
                raise InvalidRequest(f"messages has a video part, but this model ({self.loaded.family.name}) takes no "
                                     "video: send the frames as images")
            if not req.images:
                raise InvalidRequest("messages has a video part but the request carries no images (its frames)")
        elif conv.images != len(req.images):
            raise InvalidRequest(f"messages has {conv.images} image part(s) but the request carries "
                                 f"{len(req.images)} image(s)")

    def preprocess(self, checked: CheckedRequest) -> PreparedRequest:
        """Decode the images (within limits.image_decode_timeout_s), tokenize, build the model inputs.
        Raises InvalidRequest naming the problem."""
        req, limits = checked.req, self.limits
        started = time.monotonic()
        images = decode_images(checked.images, limits, started)
        if images:
            check_decode_budget(limits, started, done=len(images), total=len(images))
        decoded = time.monotonic()
        # The model family tokenizes as the model's own processor does and preprocesses the images.
        if req.messages is not None:  # a conversation, through the checkpoint's chat template
            prompt = self.loaded.family.chat_prompt(self.loaded, req.messages, images)
        else:
            prompt = self.loaded.family.prompt(self.loaded, req.prompt, images, req.apply_chat_template)
        timings = {"admit": started - req.received}
        if images:
            timings.update(image_decode=decoded - started, preprocess=time.monotonic() - decoded)
        ids = prompt.ids
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt is {len(ids)} tokens (images included); the model's context is "
                                 f"{self.max_model_len} tokens and at least one must remain for the output")
        keys = checked.image_keys
        if prompt.video:  # one video: one key over all its frames, never equal to an image's
            keys = (hashlib.sha256(b"video:" + b"".join(keys)).digest(),)
        return PreparedRequest(request_id=req.request_id, prompt_ids=ids, sampling=req.sampling, lora_name=req.lora_name,
                               stream=req.stream, pixel_values=prompt.pixel_values, image_keys=keys, task=req.task,
                               image_grid_thw=prompt.image_grid_thw, mrope_positions=prompt.mrope_positions,
                               rope_delta=prompt.rope_delta, video=prompt.video, timings=timings,
                               latency_target=req.sampling.latency_target)
