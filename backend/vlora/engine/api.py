"""The engine's public contract: what a request is, what comes back, and the errors a client sees.

Everything that talks to the engine (the Triton model, tests, benchmarks) uses only these types.
The Triton-facing names follow the Triton vLLM backend: ``text_input``, ``image``, ``stream``,
``sampling_parameters`` (JSON with vLLM's keys) and ``lora_name``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class InvalidRequest(ValueError):
    """A request the engine refuses before queueing it. The message is shown to the client as is."""


class EngineOverloaded(RuntimeError):
    """The engine could not admit the request within the admission timeout."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options with vLLM's names. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    # Keys accepted in ``sampling_parameters`` besides the fields above.
    EXTRA_KEYS = ("lora_name", "task", "apply_chat_template")

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise InvalidRequest(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise InvalidRequest("stop accepts at most 16 strings")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a parsed ``sampling_parameters`` dict; unknown keys are an error, not ignored."""
        if not isinstance(d, dict):
            raise InvalidRequest("sampling_parameters must be a JSON object")
        known = {"max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos"}
        unknown = sorted(set(d) - known - set(cls.EXTRA_KEYS))
        if unknown:
            raise InvalidRequest(f"sampling_parameters: unknown key(s) {unknown}; accepted: {sorted(known | set(cls.EXTRA_KEYS))}")
        kw: dict[str, Any] = {k: d[k] for k in known if k in d}
        if "stop" in kw:
            stop = kw["stop"]
            kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
            if not isinstance(kw["stop"], tuple):
                raise InvalidRequest("stop must be a string or a list of strings")
        # JSON clients often send numbers as strings (Triton parameters are strings); accept clean ones.
        for k, conv in (("max_tokens", int), ("seed", int), ("temperature", float), ("top_p", float)):
            if isinstance(kw.get(k), str):
                try:
                    kw[k] = conv(kw[k])
                except ValueError:
                    raise InvalidRequest(f"{k} must be a number, got {kw[k]!r}") from None
        if isinstance(kw.get("temperature"), int) and not isinstance(kw.get("temperature"), bool):
            kw["temperature"] = float(kw["temperature"])
        if isinstance(kw.get("top_p"), int) and not isinstance(kw.get("top_p"), bool):
            kw["top_p"] = float(kw["top_p"])
        if "ignore_eos" in kw and not isinstance(kw["ignore_eos"], bool):
            raise InvalidRequest("ignore_eos must be true or false")
        return cls(**kw)


def parse_sampling_json(text: str | bytes | None) -> dict[str, Any]:
    """The ``sampling_parameters`` input as a dict (empty when absent); InvalidRequest unless a JSON object.
    :meth:`SamplingParams.from_dict` takes it from there, after ``EXTRA_KEYS`` are split off."""
    if text is None or not text.strip():
        return {}
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise InvalidRequest("sampling_parameters must be a JSON object")
    return d


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class GenerationRequest:
    """One client request, taken from its transport. ``images`` are as the client sent them (base64
    text, as the Triton vLLM backend's clients send, or raw encoded bytes); preparation decodes them."""

    request_id: str
    prompt: str
    images: list[bytes] = field(default_factory=list)
    lora_name: Optional[str] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    apply_chat_template: bool = False
    task: Optional[str] = None


@dataclass
class GenerationOutput:
    """One event for a request. Streaming clients get every event; others only the final one.

    ``text_delta`` is the text decoded since the previous event; ``text`` is everything so far.
    ``finish_reason`` is one of ``stop``, ``length``, ``cancelled``, ``error`` (vLLM's names) once
    ``finished`` is true.
    """

    request_id: str
    text_delta: str
    text: str
    finished: bool
    finish_reason: Optional[str] = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    error: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)


OutputCallback = Callable[[GenerationOutput], None]
