"""The engine behind the Triton model: input validation on the caller's thread, the iteration loop
on its own thread, back-pressure on admission, cancellation, and a draining shutdown.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional

import torch

from vlora.config import EngineConfig, default_cache_dir
from vlora.engine.api import EngineOverloaded, GenerationRequest, InvalidRequest, OutputCallback
from vlora.engine.core import LLMEngine, PreparedRequest
from vlora.engine.metrics import EngineMetrics
from vlora.engine.model_runner import ModelRunner
from vlora.lora.manager import LoraManager

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={name} but CUDA is not available here")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class AsyncEngine:
    """Thread-safe front of :class:`LLMEngine`. See ``vlora.engine.api`` for the request types."""

    def __init__(self, config: EngineConfig, metrics: Optional[EngineMetrics] = None) -> None:
        from vlora.models.loader import load_llava

        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        cache_dir = Path(config.model.cache_dir) if config.model.cache_dir else default_cache_dir()
        model_dir, adapter_root = resolve_model_and_adapters(config, cache_dir)
        t0 = time.perf_counter()
        self.loaded = load_llava(model_dir, self.dtype, self.device)
        self.max_model_len = min(config.model.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        runner = ModelRunner(self.loaded.model, image_token_id=self.loaded.image_token_id,
                             num_slots=config.lora.max_gpu_adapters, max_rank=config.lora.max_rank,
                             target_modules=config.lora.target_modules)
        runner.allocate_kv(config.cache.num_blocks, config.cache.block_size, config.cache.gpu_memory_fraction)
        self.loras = LoraManager(adapter_root, runner.lora_layers, runner.num_layers, runner.module_dims(), config.lora)
        self.engine = LLMEngine(config, runner, self.loras, self.loaded.tokenizer, self.max_model_len,
                                eos_token_ids(self.loaded), metrics)
        log.info("engine ready: %s on %s/%s in %.1fs, adapters at %s", self.loaded.name, self.device, self.dtype,
                 time.perf_counter() - t0, adapter_root)
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._cancels: set[str] = set()
        self._backlog = 0
        self._stopping = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="vlora-engine", daemon=True)
        self._thread.start()

    # -- info ------------------------------------------------------------------------------------
    @property
    def model_info(self) -> dict:
        return {"name": self.loaded.name, "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
                "max_model_len": self.max_model_len}

    def list_adapters(self) -> list[str]:
        return self.loras.list_adapters()

    # -- requests --------------------------------------------------------------------------------
    def prepare(self, req: GenerationRequest) -> PreparedRequest:
        """Validate and preprocess on the caller's thread. Raises InvalidRequest naming the problem."""
        from vlora.models.images import decode_base64_image, pixel_values
        from vlora.models.loader import build_prompt_ids

        limits = self.config.limits
        if not req.request_id:
            raise InvalidRequest("request id is empty")
        if not isinstance(req.prompt, str) or not req.prompt.strip():
            raise InvalidRequest("text_input is empty: a prompt is required")
        if len(req.prompt) > limits.max_prompt_chars:
            raise InvalidRequest(f"text_input has {len(req.prompt)} characters; the limit is {limits.max_prompt_chars}")
        if len(req.images) > limits.max_images:
            raise InvalidRequest(f"too many images: {len(req.images)} (the limit is {limits.max_images})")
        if req.task is not None:
            raise InvalidRequest(f"unknown task {req.task!r}: this adapter has no task heads")
        if req.lora_name is not None:
            if not isinstance(req.lora_name, str) or not req.lora_name:
                raise InvalidRequest("lora_name must be a non-empty string")
            self.loras.validate(req.lora_name)
        images, keys = [], []
        for i, data in enumerate(req.images):
            try:
                images.append(decode_base64_image(data, limits))
            except InvalidRequest as e:
                raise InvalidRequest(f"image {i}: {e}") from None
            keys.append(hashlib.sha256(data if isinstance(data, bytes) else str(data).encode()).digest())
        ids = build_prompt_ids(self.loaded, req.prompt, len(images), req.apply_chat_template)
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt is {len(ids)} tokens (images included); the model's context is "
                                 f"{self.max_model_len} tokens and at least one must remain for the output")
        pv = pixel_values(images, self.loaded.image_processor) if images else None
        return PreparedRequest(request_id=req.request_id, prompt_ids=ids, sampling=req.sampling, lora_name=req.lora_name,
                               stream=req.stream, pixel_values=pv, image_keys=tuple(keys), task=req.task)

    def submit(self, prepared: PreparedRequest, callback: OutputCallback, timeout: Optional[float] = None) -> None:
        """Queue a prepared request. Blocks while the engine's waiting queue is full (back-pressure)."""
        limit = self.config.scheduler.max_waiting
        deadline = time.monotonic() + (self.config.scheduler.admission_timeout_s if timeout is None else timeout)
        with self._cond:
            while self._backlog + len(self._inbox) >= limit:
                if self._stopping:
                    raise EngineOverloaded("server is shutting down")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineOverloaded(f"server overloaded: {limit} requests already waiting")
                self._cond.wait(remaining)
            if self._stopping:
                raise EngineOverloaded("server is shutting down")
            self._inbox.append((prepared, callback))
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._cancels.add(request_id)
            self._cond.notify_all()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish (cancel what remains at ``timeout``), join."""
        with self._cond:
            if self._stopped:
                return
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._cancel_all = True
                self._cond.notify_all()
            self._thread.join(10.0)
        self._stopped = True

    # -- the engine thread ---------------------------------------------------------------------
    _cancel_all = False

    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not self._inbox and not self._cancels and not eng.has_work() and not self._stopping:
                    self._cond.wait()
                while self._inbox:
                    eng.add_request(*self._inbox.popleft())
                for rid in self._cancels:
                    eng.abort(rid)
                self._cancels.clear()
                if self._cancel_all:
                    eng.fail_all("cancelled", "server shut down before the request finished")
                if self._stopping and not eng.has_work():
                    self._backlog = 0
                    self._cond.notify_all()
                    return
            try:
                eng.step()
            except Exception as e:  # never let the loop die with requests in flight
                log.exception("engine step crashed")
                eng.fail_all("error", f"internal error: {e}")
            with self._cond:
                self._backlog = len(eng.waiting)
                self._cond.notify_all()


def resolve_model_and_adapters(config: EngineConfig, cache_dir: Path) -> tuple[Path, Optional[Path]]:
    """The model folder and adapter root; with no model given, the tiny model and its demo adapters."""
    if config.model.path:
        model_dir = Path(config.model.path)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model.path {model_dir} is not a folder")
        root = Path(config.lora.adapter_root) if config.lora.adapter_root else None
    else:
        from vlora.lora.demo import ensure_demo_adapters
        from vlora.models.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model(cache_dir)
        root = Path(config.lora.adapter_root) if config.lora.adapter_root else ensure_demo_adapters(model_dir, cache_dir / "demo-adapters")
    if root is not None and not root.is_dir():
        raise FileNotFoundError(f"lora.adapter_root {root} is not a folder")
    return model_dir, root


def eos_token_ids(loaded) -> set[int]:
    ids = set()
    tok = loaded.tokenizer
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    gen = getattr(loaded.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return ids
