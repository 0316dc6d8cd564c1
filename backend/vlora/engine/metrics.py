"""What the engine reports about itself. The Triton model implements this with ``pb_utils.MetricFamily``;
tests and benchmarks may record into plain Python objects. Calls come from the engine thread."""
from __future__ import annotations

from typing import Optional, Protocol


class EngineMetrics(Protocol):
    def request_admitted(self, lora_name: Optional[str]) -> None: ...

    def request_finished(self, lora_name: Optional[str], finish_reason: str, num_output_tokens: int) -> None: ...

    def step(self, batch_size: int, num_prefill_tokens: int, num_decode_tokens: int, duration_s: float) -> None: ...

    def queue_depth(self, running: int, waiting: int) -> None: ...

    def mode_step(self, mode: str, merged: Optional[str], duration_s: float) -> None: ...

    def mode_switch(self, from_mode: str, to_mode: str, duration_s: float) -> None: ...


class NullMetrics:
    """Records nothing."""

    def request_admitted(self, lora_name: Optional[str]) -> None:
        pass

    def request_finished(self, lora_name: Optional[str], finish_reason: str, num_output_tokens: int) -> None:
        pass

    def step(self, batch_size: int, num_prefill_tokens: int, num_decode_tokens: int, duration_s: float) -> None:
        pass

    def queue_depth(self, running: int, waiting: int) -> None:
        pass

    def mode_step(self, mode: str, merged: Optional[str], duration_s: float) -> None:
        pass

    def mode_switch(self, from_mode: str, to_mode: str, duration_s: float) -> None:
        pass
