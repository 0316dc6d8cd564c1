"""Request validation and preprocessing, run on the caller's thread before anything is queued."""
from __future__ import annotations

import hashlib

from vlora.config import InputLimits
from vlora.engine.api import GenerationRequest, InvalidRequest
from vlora.engine.core import PreparedRequest
from vlora.lora.adapter import validate_adapter_name
from vlora.lora.manager import LoraManager
from vlora.models.images import decode_base64_image, pixel_values
from vlora.models.loader import LoadedModel, build_prompt_ids


class InputProcessor:
    def __init__(self, loaded: LoadedModel, limits: InputLimits, loras: LoraManager, max_model_len: int) -> None:
        self.loaded = loaded
        self.limits = limits
        self.loras = loras
        self.max_model_len = max_model_len

    def prepare(self, req: GenerationRequest) -> PreparedRequest:
        """Check every field, decode images, tokenize. Raises InvalidRequest naming the problem."""
        limits = self.limits
        if not req.request_id:
            raise InvalidRequest("request id is empty")
        if not isinstance(req.prompt, str) or not req.prompt.strip():
            raise InvalidRequest("text_input is empty: a prompt is required")
        if len(req.prompt) > limits.max_prompt_chars:
            raise InvalidRequest(f"text_input has {len(req.prompt)} characters; the limit is {limits.max_prompt_chars}")
        if len(req.images) > limits.max_images:
            raise InvalidRequest(f"too many images: {len(req.images)} (the limit is {limits.max_images})")
        adapter = None
        if req.lora_name is not None:
            if not isinstance(req.lora_name, str) or not req.lora_name:
                raise InvalidRequest("lora_name must be a non-empty string")
            # The name rule first: a name with a NUL or a path separator never reaches a lookup or the disk.
            validate_adapter_name(req.lora_name)
            adapter = self.loras.validate(req.lora_name)
        if req.task is not None:  # a task head answers from the prefill; it lives in the adapter
            if adapter is None:
                raise InvalidRequest(f"task {req.task!r} needs lora_name: task heads are part of an adapter")
            if req.task not in adapter.heads:
                have = sorted(adapter.heads)
                raise InvalidRequest(f"unknown task {req.task!r} for adapter {req.lora_name!r}: "
                                     + (f"its heads are {have}" if have else "it has no task heads"))
        images, keys = [], []
        for i, data in enumerate(req.images):
            images.append(decode_base64_image(data, limits, index=i))
            keys.append(hashlib.sha256(data if isinstance(data, bytes) else str(data).encode()).digest())
        ids = build_prompt_ids(self.loaded, req.prompt, len(images), req.apply_chat_template)
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt is {len(ids)} tokens (images included); the model's context is "
                                 f"{self.max_model_len} tokens and at least one must remain for the output")
        pv = pixel_values(images, self.loaded.image_processor) if images else None
        return PreparedRequest(request_id=req.request_id, prompt_ids=ids, sampling=req.sampling, lora_name=req.lora_name,
                               stream=req.stream, pixel_values=pv, image_keys=tuple(keys), task=req.task)
