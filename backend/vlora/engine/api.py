"""The engine's public contract: what a request is, what comes back, and the errors a client sees.

Everything that talks to the engine (the Triton model, tests, benchmarks) uses only these types.
The Triton-facing names follow the Triton vLLM backend: ``text_input``, ``image``, ``stream``,
``sampling_parameters`` (JSON with vLLM's keys) and ``lora_name``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch

# The error types live in vlora.errors; they are part of this contract too, so they are named here as well.
from vlora.errors import EngineDead, EngineOverloaded, InvalidRequest  # noqa: F401


# Limits on sampling_parameters, checked before a request is queued (see SamplingParams).
MIN_TEMPERATURE = 1e-2  # keeps logits / T far from float32 overflow; colder is greedy in all but name: send 0
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-3
MAX_TOKENS_LIMIT = 1 << 20  # the engine also stops at the model's context (max_model_len)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_NUMBER_CHARS = 32  # a number sent as a string ("16"); int() of a long digit string is slow or refused
MAX_SAMPLING_JSON_BYTES = 64 * 1024
MAX_SAMPLING_JSON_DEPTH = 8  # the object, the stop list, and room to spare
MAX_LATENCY_TARGET_S = 86400.0  # a latency target beyond a day is a unit mistake (milliseconds sent as seconds)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options with vLLM's names, each checked against its range:

    - ``max_tokens``: an integer in [1, MAX_TOKENS_LIMIT] (2**20); generation also ends at the context.
    - ``temperature``: 0 (greedy), or a number in [MIN_TEMPERATURE, MAX_TEMPERATURE] = [0.01, 100].
    - ``top_p``: a number in [MIN_TOP_P, 1] = [0.001, 1].
    - ``seed``: an integer in [0, 2**64); without one, a sampled request gets a random seed.
    - ``stop``: at most 16 non-empty strings of at most 256 characters each.
    - ``latency_target``: seconds, a positive finite number up to 86400: this request's latency target
      (its application's SLO). The scheduler counts a request as starving once its credit (time waited
      since it last ran + the estimated step + any switch it needs) passes it, and then runs it in the
      next step; without one, the adapter's ``orchestrator.latency_targets`` entry or ``theta_s`` applies.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    latency_target: Optional[float] = None

    # The fields above, as keys of ``sampling_parameters`` (and of the request parameters).
    KEYS = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "latency_target")
    # Keys accepted in ``sampling_parameters`` besides the fields above.
    EXTRA_KEYS = ("lora_name", "task", "apply_chat_template")

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or not (1 <= self.max_tokens <= MAX_TOKENS_LIMIT):
            raise InvalidRequest(f"max_tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got {_shown(self.max_tokens)}")
        if not _is_number(self.temperature) or not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidRequest(f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], "
                                 f"got {_shown(self.temperature)}")
        if not _is_number(self.top_p) or not (MIN_TOP_P <= self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be a number in [{MIN_TOP_P}, 1], got {_shown(self.top_p)}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**64)):
            raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {_shown(self.seed)}")
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequest(f"each stop string may have at most {MAX_STOP_CHARS} characters, "
                                 f"got one of {max(len(s) for s in self.stop)}")
        if self.latency_target is not None and (not _is_number(self.latency_target)
                                                or not 0.0 < self.latency_target <= MAX_LATENCY_TARGET_S):
            raise InvalidRequest(f"latency_target must be a positive number of seconds, at most {MAX_LATENCY_TARGET_S:g}, "
                                 f"got {_shown(self.latency_target)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a parsed ``sampling_parameters`` dict; unknown keys are an error, not ignored."""
        if not isinstance(d, dict):
            raise InvalidRequest("sampling_parameters must be a JSON object")
        known = set(cls.KEYS)
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
        for k, conv in (("max_tokens", int), ("seed", int), ("temperature", float), ("top_p", float),
                        ("latency_target", float)):
            if isinstance(kw.get(k), str):
                if len(kw[k]) > MAX_NUMBER_CHARS:
                    raise InvalidRequest(f"{k} must be a number; got a string of {len(kw[k])} characters "
                                         f"(at most {MAX_NUMBER_CHARS})")
                try:
                    kw[k] = conv(kw[k])
                except ValueError:
                    raise InvalidRequest(f"{k} must be a number, got {_shown(kw[k])}") from None
        for k in ("temperature", "top_p", "latency_target"):
            if _is_int(kw.get(k)):
                try:
                    kw[k] = float(kw[k])
                except OverflowError:
                    raise InvalidRequest(f"{k} is out of range, got an integer of {kw[k].bit_length()} bits") from None
        if "ignore_eos" in kw and not isinstance(kw["ignore_eos"], bool):
            raise InvalidRequest("ignore_eos must be true or false")
        return cls(**kw)


def parse_sampling_json(text: str | bytes | None) -> dict[str, Any]:
    """The ``sampling_parameters`` input as a dict (empty when absent); InvalidRequest unless a JSON object.
    :meth:`SamplingParams.from_dict` takes it from there, after ``EXTRA_KEYS`` are split off."""
    if text is None or not text.strip():
        return {}
    too_long = f"sampling_parameters is longer than {MAX_SAMPLING_JSON_BYTES} bytes"
    if len(text) > MAX_SAMPLING_JSON_BYTES:
        raise InvalidRequest(too_long)
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if len(data) > MAX_SAMPLING_JSON_BYTES:
        raise InvalidRequest(too_long)
    depth = _json_depth(data)
    if depth > MAX_SAMPLING_JSON_DEPTH:
        raise InvalidRequest(f"sampling_parameters nests {depth} levels deep; the limit is {MAX_SAMPLING_JSON_DEPTH}")
    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, an int over Python's digit limit
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {_cut(str(e), 200)}") from None
    if not isinstance(d, dict):
        raise InvalidRequest("sampling_parameters must be a JSON object")
    return d


_JSON_STRUCTURE = re.compile(rb'[\[\]{}"\\]')


def check_text(field: str, text: str) -> str:
    """``text``, unless it holds a lone UTF-16 surrogate (JSON's "\\ud800") or a NUL: InvalidRequest naming
    ``field``, never quoting the text (it may be a token)."""
    if "\x00" in text:
        raise InvalidRequest(f"{field} holds a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{field} holds a lone UTF-16 surrogate at character {e.start}, not valid text") from None
    return text


def _json_depth(data: bytes) -> int:
    """How deep the brackets of JSON ``data`` nest, outside strings: a linear scan, so that json.loads
    never recurses deeply. Malformed data gets some number; json.loads reports its errors."""
    depth = deepest = 0
    in_string = False
    skip = -1  # the position after a backslash inside a string: escaped, not structure
    for m in _JSON_STRUCTURE.finditer(data):
        pos, ch = m.start(), data[m.start()]
        if pos == skip:
            continue
        if in_string:
            if ch == 0x5C:  # backslash
                skip = pos + 1
            elif ch == 0x22:  # quote
                in_string = False
        elif ch == 0x22:
            in_string = True
        elif ch in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif ch in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _shown(x: Any) -> str:
    """``repr(x)`` cut short, for error messages (the repr of an int over Python's digit limit raises)."""
    try:
        return _cut(repr(x), 80)
    except ValueError:
        return f"<{type(x).__name__}>"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    # A whole conversation instead of ``prompt`` (the ``messages`` input, :mod:`vlora.engine.chat`), rendered
    # through the checkpoint's chat template when the request is prepared; ``prompt`` is then empty.
    messages: Optional[Any] = None  # vlora.engine.chat.Conversation
    received: float = field(default_factory=time.monotonic)  # taken from its transport: the stage timer "admit" starts


@dataclass
class PreparedRequest:
    """A validated request: token ids, preprocessed images, and everything the loop needs (made by
    :class:`vlora.engine.inputs.InputProcessor` from a :class:`GenerationRequest`)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    lora_name: Optional[str] = None
    stream: bool = False
    pixel_values: Optional[torch.Tensor] = None  # as the model family's vision tower takes them
    image_keys: tuple[bytes, ...] = ()
    task: Optional[str] = None
    image_grid_thw: Optional[torch.Tensor] = None  # [n_images, 3] (Qwen2-VL)
    mrope_positions: Optional[torch.Tensor] = None  # [3, len(prompt_ids)] (M-RoPE), None: 1-D positions
    rope_delta: int = 0  # generated tokens sit at their index plus this (M-RoPE)
    video: bool = False  # pixel_values are one video's frames (Qwen2-VL's video path)
    timings: dict = field(default_factory=dict)  # stage -> seconds spent preparing it (vlora.metrics.STAGES)
    latency_target: Optional[float] = None  # seconds: this application's target, for the scheduler's credits
    arrival: float = field(default_factory=time.monotonic)


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

    def then(self, later: "GenerationOutput") -> Optional["GenerationOutput"]:
        """This event and the next one of the same request as one event (a sender that fell behind sends
        both at once: the text deltas joined, the rest from ``later``), or None where they must stay two:
        this one is final, or ``later`` carries an error or a cancellation, which are sent alone."""
        if (later.request_id != self.request_id or self.finished
                or later.error is not None or later.finish_reason in ("error", "cancelled")):
            return None
        return dataclasses.replace(later, text_delta=self.text_delta + later.text_delta)


def coalesce(events: list) -> list:
    """Merge consecutive :class:`GenerationOutput` events of each request in ``events`` (a queue's
    backlog, in order) with :meth:`GenerationOutput.then`; anything else in the list (control items)
    stays where it is and keeps every event queued before it ahead of it. A request's events keep their
    order, so a streaming client gets the same text in fewer, larger pieces."""
    out: list = []
    pending: dict[str, int] = {}  # request id -> index in out of its latest event since the last control item
    for item in events:
        if not isinstance(item, GenerationOutput):
            out.append(item)
            pending.clear()
            continue
        i = pending.get(item.request_id)
        merged = out[i].then(item) if i is not None else None
        if merged is not None:
            out[i] = merged
        else:
            pending[item.request_id] = len(out)
            out.append(item)
    return out


OutputCallback = Callable[[GenerationOutput], None]


@dataclass
class StepResult:
    """What one engine step ran (``LLMEngine.step()`` returns it; tests and benchmarks read it): the batch's
    requests in row order, how many were prefills and decodes, their adapter slots, the waiting requests it
    admitted, the inference mode and merged adapter, the running requests it left out (paused), and the
    forward's last-token logits [rows, vocab] and hidden states [rows, hidden] (on the device). A prefill row is
    one chunk of its prompt (``scheduler.chunked_prefill``): ``num_prefill_tokens`` counts the prompt tokens the
    step ran, and ``partial_prefills`` names the prompts that go on in a later step (their rows sample nothing)."""

    request_ids: list[str]
    num_prefill: int
    num_decode: int
    slots: list[int]
    admitted: list[str]
    mode: str
    merged: Optional[str]
    paused: list[str]
    logits: "torch.Tensor"
    hidden: "torch.Tensor"
    num_images_encoded: int = 0
    num_prefill_tokens: int = 0
    partial_prefills: list[str] = field(default_factory=list)
