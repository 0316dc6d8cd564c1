"""What the engine reports about itself: the EngineMetrics protocol, in a leaf module that imports nothing of
vlora, so that the engine and the LoRA manager (adapter swaps) report through it without importing each other.
The Triton model implements it with ``pb_utils.MetricFamily`` (vlora.server.metrics, which only accumulates
here and applies the values from its own thread every 0.2 s); tests and benchmarks may record into plain
Python objects. Calls come from the engine thread, several per step, so an implementation must not block or
wake other threads per call; ``adapter_swap`` for host loads may also come from request and loader threads."""
from __future__ import annotations

from typing import Mapping, Optional, Protocol

# What a request's time goes to, as the engine's own timers see it (``EngineMetrics.stage``): admit (taken from
# its transport to its preparation's start: the checks, and the wait for an image worker), queue (submitted
# to its first step), image_decode (PNG/JPEG to pixels), preprocess (the rest of preparing it: pixels on the
# device, tokens, positions), vision (the vision tower and projector of a step's images: CUDA events on a GPU,
# read once the step's tokens are), prefill_step and decode_step (steps with and without a prefill).
STAGES = ("admit", "queue", "image_decode", "preprocess", "vision", "prefill_step", "decode_step")
# An adapter's way in, timed by the LoRA manager: adapter_read (its files read, checked and staged in host
# memory, on a loader thread) and adapter_copy (its slot copy from issue to completion, on the copy thread), which
# splits into adapter_copy_queue (behind other adapters' copies) and adapter_copy_work (the copy thread enqueueing
# it: the CPU copies into the page-locked buffers, the waits for them) before the transfer's own end; of the work,
# adapter_copy_host is the CPU copies, adapter_copy_wait the waits for a buffer and adapter_copy_h2d the calls that
# enqueue the host-to-device copies (on CUDA; the rest is the copy thread's own Python and its waits for the GIL).
# Only requests whose adapter was not resident pay them.
ADAPTER_STAGES = ("adapter_read", "adapter_copy", "adapter_copy_queue", "adapter_copy_work", "adapter_copy_host",
                  "adapter_copy_wait", "adapter_copy_h2d")
EXPORTED_STAGES = STAGES + ADAPTER_STAGES  # the server's vlora_stage_seconds series


class EngineMetrics(Protocol):
    def request_admitted(self, lora_name: Optional[str]) -> None: ...

    def request_finished(self, lora_name: Optional[str], finish_reason: str, num_output_tokens: int) -> None: ...

    def step(self, batch_size: int, num_prefill_tokens: int, num_decode_tokens: int, duration_s: float) -> None: ...

    def stage(self, name: str, seconds: float) -> None: ...

    def queue_depth(self, running: int, waiting: int) -> None: ...

    def mode_step(self, mode: str, merged: Optional[str], duration_s: float) -> None: ...

    def mode_switch(self, from_mode: str, to_mode: str, duration_s: float) -> None: ...

    def adapter_requests(self, running: Mapping[Optional[str], int], waiting: Mapping[Optional[str], int]) -> None:
        """Running and waiting requests per adapter (None: the base model), sent when they change.
        An adapter absent from both maps has none."""

    def adapter_swap(self, kind: str, lora_name: str) -> None:
        """An adapter moved between tiers; ``kind`` is ``gpu_load`` (copied into a device slot),
        ``gpu_eviction`` (its slot given to another adapter, or unloaded), ``host_load`` (read into
        host memory) or ``host_eviction``."""

    def adapters_resident(self, gpu: int, host: int) -> None:
        """How many adapters are in device slots and in host memory, sent when it changes."""

    def kv_cache_usage(self, used_blocks: int, total_blocks: int) -> None:
        """The KV cache's blocks held by requests (reserved for their whole budget at admission; cached
        prefix blocks no request holds count as free) and the pool's size, sent when it changes."""

    def prefix_cache(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None:
        """One admitted request: its prompt's tokens, those whose KV came from the prefix cache, and the
        cached blocks evicted since the last call."""

    def encoder_cache(self, hits: int, misses: int, evictions: int, bytes_used: int) -> None:
        """The image-feature cache since the last call (hits, misses, evictions) and its size now."""


class NullMetrics:
    """Records nothing."""

    def request_admitted(self, lora_name: Optional[str]) -> None:
        pass

    def request_finished(self, lora_name: Optional[str], finish_reason: str, num_output_tokens: int) -> None:
        pass

    def stage(self, name: str, seconds: float) -> None:
        pass

    def step(self, batch_size: int, num_prefill_tokens: int, num_decode_tokens: int, duration_s: float) -> None:
        pass

    def queue_depth(self, running: int, waiting: int) -> None:
        pass

    def mode_step(self, mode: str, merged: Optional[str], duration_s: float) -> None:
        pass

    def mode_switch(self, from_mode: str, to_mode: str, duration_s: float) -> None:
        pass

    def adapter_requests(self, running: Mapping[Optional[str], int], waiting: Mapping[Optional[str], int]) -> None:
        pass

    def adapter_swap(self, kind: str, lora_name: str) -> None:
        pass

    def adapters_resident(self, gpu: int, host: int) -> None:
        pass

    def kv_cache_usage(self, used_blocks: int, total_blocks: int) -> None:
        pass

    def prefix_cache(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None:
        pass

    def encoder_cache(self, hits: int, misses: int, evictions: int, bytes_used: int) -> None:
        pass
