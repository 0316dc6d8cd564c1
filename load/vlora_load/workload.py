"""Workload definitions: frozen dataclasses read from ``configs/workloads/*.yaml`` and validated when built.

A workload is one or more *applications* (visual retrieval, video analytics) sharing one server. Each
application has its own request shapes, its share of the load and its latency targets (SLO). The
adapter popularity and the arrival mode are shared:

- ``arrivals.mode: open`` - every application generates its own arrival process at its share of
  ``arrivals.rate``: Poisson for visual retrieval, fixed-period camera streams for video analytics.
  Requests are sent when they are due, whether or not earlier ones have been answered.
- ``arrivals.mode: closed`` - ``arrivals.users`` users, each sending its next request as soon as the
  previous one is answered; each request's application is drawn by share.

Command-line overrides (``vlora loadtest --rate/--skewness/...``) go through ``Workload.with_overrides``.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional

import yaml

from vlora.config import ConfigError

PROTOCOLS = ("grpc", "http", "http-stream")
ARRIVAL_MODES = ("open", "closed")
POPULARITY_KINDS = ("skewness", "zipf", "uniform")
MAX_ADAPTERS = 1000


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class LengthDistribution:
    """A token length drawn from a log-normal fitted to a published median and mean, then scaled and clipped.

    A log-normal with median m and mean u has mu = ln m and sigma^2 = 2 ln(u / m). ``scale`` shrinks
    every draw (the tiny CPU model cannot take the trace's lengths); ``min``/``max`` clip after scaling.
    """

    median: float
    mean: float
    scale: float = 1.0
    min: int = 1
    max: int = 4096

    def __post_init__(self) -> None:
        _require(self.median > 0 and self.mean >= self.median, f"length: need 0 < median <= mean, got {self.median}, {self.mean}")
        _require(self.scale > 0, "length.scale must be > 0")
        _require(1 <= self.min <= self.max, f"length: need 1 <= min <= max, got {self.min}, {self.max}")

    @property
    def mu(self) -> float:
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        return math.sqrt(2.0 * math.log(self.mean / self.median))

    def sample(self, rng) -> int:
        """One length; ``rng`` is a ``random.Random``."""
        value = rng.lognormvariate(self.mu, self.sigma) * self.scale
        return int(min(self.max, max(self.min, round(value))))

    def scaled(self, factor: float) -> "LengthDistribution":
        return dataclasses.replace(self, scale=self.scale * factor)


# The Azure LLM inference trace 2023 (the V-LoRA paper's visual-retrieval workload), from its
# published summary statistics (the Splitwise paper's characterisation of the trace): conversation
# prompts have a median of about 1020 tokens and outputs a median of about 129 (means about 1155 and 211).
AZURE_CONVERSATION_INPUT = dict(median=1020, mean=1155)
AZURE_CONVERSATION_OUTPUT = dict(median=129, mean=211)
AZURE_SHAPES = {"azure-conversation-input": AZURE_CONVERSATION_INPUT, "azure-conversation-output": AZURE_CONVERSATION_OUTPUT}


def length_from(data: Any, where: str) -> LengthDistribution:
    """``{shape: azure-conversation-output, scale: 0.1, max: 64}`` or ``{median: .., mean: ..}``."""
    _require(isinstance(data, Mapping), f"{where}: expected a mapping, got {data!r}")
    data = dict(data)
    shape = data.pop("shape", None)
    if shape is not None:
        _require(shape in AZURE_SHAPES, f"{where}.shape must be one of {sorted(AZURE_SHAPES)}, got {shape!r}")
        data = {**AZURE_SHAPES[shape], **data}
    try:
        return LengthDistribution(**data)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


@dataclass(frozen=True)
class Slo:
    """Latency targets of one application; a request meets the SLO when it is answered within all set ones."""

    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    tpot_s: Optional[float] = None  # time per output token after the first

    def __post_init__(self) -> None:
        for name in ("ttft_s", "e2e_s", "tpot_s"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"slo.{name} must be > 0")

    def met(self, ttft_s: Optional[float], e2e_s: Optional[float], tpot_s: Optional[float]) -> bool:
        checks = ((self.ttft_s, ttft_s), (self.e2e_s, e2e_s), (self.tpot_s, tpot_s))
        return all(limit is None or (value is not None and value <= limit) for limit, value in checks)

    def describe(self) -> str:
        parts = [f"{n} <= {v:g}s" for n, v in (("TTFT", self.ttft_s), ("e2e", self.e2e_s), ("TPOT", self.tpot_s)) if v]
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class Popularity:
    """How requests spread over adapters.

    ``skewness``: the most popular adapter gets that share of the requests (the V-LoRA paper's
    definition), the others share the rest equally. ``zipf``: p_i proportional to 1 / i^alpha.
    ``uniform``: equal shares. ``base_share``: the share of requests that use no adapter at all.
    """

    kind: str = "skewness"
    num_adapters: int = 4
    skewness: float = 0.6
    zipf_alpha: float = 1.0
    base_share: float = 0.0

    def __post_init__(self) -> None:
        _require(self.kind in POPULARITY_KINDS, f"popularity.kind must be one of {POPULARITY_KINDS}, got {self.kind!r}")
        _require(1 <= self.num_adapters <= MAX_ADAPTERS, f"popularity.num_adapters must be in [1, {MAX_ADAPTERS}]")
        _require(0.0 < self.skewness <= 1.0, "popularity.skewness must be in (0, 1]")
        if self.kind == "skewness" and self.num_adapters > 1:
            _require(self.skewness >= 1.0 / self.num_adapters - 1e-9,
                     f"popularity.skewness {self.skewness} is below 1/num_adapters = {1 / self.num_adapters:.3f}: "
                     "the first adapter would not be the most popular")
        _require(self.zipf_alpha >= 0.0, "popularity.zipf_alpha must be >= 0")
        _require(0.0 <= self.base_share < 1.0, "popularity.base_share must be in [0, 1)")

    def probabilities(self) -> list[float]:
        """Share of each adapter rank (index 0: the most popular), summing to 1 - base_share."""
        n = self.num_adapters
        if self.kind == "uniform" or n == 1:
            weights = [1.0] * n
        elif self.kind == "skewness":
            rest = (1.0 - self.skewness) / (n - 1)
            weights = [self.skewness] + [rest] * (n - 1)
        else:
            weights = [1.0 / (i ** self.zipf_alpha) for i in range(1, n + 1)]
        total = sum(weights)
        return [w / total * (1.0 - self.base_share) for w in weights]

    def describe(self) -> str:
        what = {"skewness": f"skewness {self.skewness:g}", "zipf": f"Zipf alpha {self.zipf_alpha:g}", "uniform": "uniform"}[self.kind]
        base = f", {self.base_share:.0%} base model" if self.base_share else ""
        return f"{what} over {self.num_adapters} adapter(s){base}"


@dataclass(frozen=True)
class Arrivals:
    mode: str = "open"
    rate: float = 2.0  # requests per second over all applications (open loop)
    users: int = 4  # closed loop

    def __post_init__(self) -> None:
        _require(self.mode in ARRIVAL_MODES, f"arrivals.mode must be one of {ARRIVAL_MODES}, got {self.mode!r}")
        _require(self.rate > 0, "arrivals.rate must be > 0")
        _require(self.users >= 1, "arrivals.users must be >= 1")

    def describe(self) -> str:
        return f"open loop at {self.rate:g} req/s" if self.mode == "open" else f"closed loop with {self.users} user(s)"


class ApplicationKind:
    """An application kind's ``params``: their defaults (``PARAMS``), their checks (:meth:`validate`) and how
    a length scale applies to them (:meth:`scale_lengths`). What a workload file may say lives here; the
    requests each kind draws are its generator's (``vlora_load.generators``, a subclass of its kind)."""

    kind: ClassVar[str]
    PARAMS: ClassVar[dict[str, Any]] = {}
    TASKS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def validate(cls, app: "Application") -> None:
        unknown = sorted(set(app.params) - set(cls.PARAMS))
        if unknown:
            raise ConfigError(f"application {app.name} ({cls.kind}): unknown key(s) {unknown}; known: {sorted(cls.PARAMS)}")

    @classmethod
    def scale_lengths(cls, params: dict[str, Any], factor: float) -> dict[str, Any]:
        return params


class VisualRetrievalKind(ApplicationKind):
    kind = "visual_retrieval"
    PARAMS = {
        "tasks": {"vqa": 0.5, "caption": 0.3, "grounding": 0.2},
        "input_tokens": {"shape": "azure-conversation-input", "max": 2048},
        "output_tokens": {"shape": "azure-conversation-output", "max": 1024},
    }
    TASKS = ("vqa", "caption", "grounding")

    @classmethod
    def validate(cls, app: "Application") -> None:
        super().validate(app)
        params = {**cls.PARAMS, **dict(app.params)}
        tasks = params["tasks"]
        if not isinstance(tasks, Mapping) or not tasks or set(tasks) - set(cls.TASKS) or min(tasks.values()) < 0:
            raise ConfigError(f"application {app.name}: tasks must map some of {sorted(cls.TASKS)} to weights >= 0")
        length_from(params["input_tokens"], f"{app.name}.input_tokens")
        length_from(params["output_tokens"], f"{app.name}.output_tokens")

    @classmethod
    def scale_lengths(cls, params: dict[str, Any], factor: float) -> dict[str, Any]:
        out = dict(params)
        for key in ("input_tokens", "output_tokens"):
            spec = dict(out.get(key, cls.PARAMS[key]))
            spec["scale"] = float(spec.get("scale", 1.0)) * factor
            out[key] = spec
        return out


class VideoAnalyticsKind(ApplicationKind):
    kind = "video_analytics"
    PARAMS = {
        "frames_per_chunk": 8,
        "chunk_period_s": 1.0,
        "tasks": {"detection": 0.5, "action": 0.5},
        # Generated answers when no head declares the task: short labels (the paper: 5-10 tokens for
        # video understanding; detection answers with a few boxes).
        "output_tokens": {"detection": 24, "action": 8},
    }
    TASKS = ("detection", "action")

    @classmethod
    def validate(cls, app: "Application") -> None:
        super().validate(app)
        p = {**cls.PARAMS, **dict(app.params)}
        if not (isinstance(p["frames_per_chunk"], int) and 1 <= p["frames_per_chunk"] <= 64):
            raise ConfigError(f"application {app.name}: frames_per_chunk must be an integer in [1, 64]")
        if not (isinstance(p["chunk_period_s"], (int, float)) and p["chunk_period_s"] > 0):
            raise ConfigError(f"application {app.name}: chunk_period_s must be > 0")
        tasks = p["tasks"]
        if not isinstance(tasks, Mapping) or not tasks or set(tasks) - set(cls.TASKS):
            raise ConfigError(f"application {app.name}: tasks must map some of {sorted(cls.TASKS)} to weights")
        outs = {**cls.PARAMS["output_tokens"], **dict(p["output_tokens"])}
        if any(not isinstance(v, int) or v < 1 for v in outs.values()):
            raise ConfigError(f"application {app.name}: output_tokens must map tasks to integers >= 1")


APPLICATION_KINDS: dict[str, type[ApplicationKind]] = {k.kind: k for k in (VisualRetrievalKind, VideoAnalyticsKind)}


@dataclass(frozen=True)
class Application:
    """One application: its kind (:data:`APPLICATION_KINDS`; its generator in ``vlora_load.generators``),
    its share and its SLO.

    ``params`` are the kind's own settings; its :class:`ApplicationKind` validates them.
    """

    name: str
    kind: str
    share: float = 1.0
    slo: Slo = field(default_factory=Slo)
    protocol: Optional[str] = None  # None: the workload's
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(bool(self.name) and "/" not in self.name, f"application name {self.name!r} must be non-empty, without '/'")
        _require(self.share > 0, f"application {self.name}: share must be > 0")
        _require(self.protocol is None or self.protocol in PROTOCOLS,
                 f"application {self.name}: protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        _require(self.kind in APPLICATION_KINDS,
                 f"application {self.name}: kind must be one of {sorted(APPLICATION_KINDS)}, got {self.kind!r}")
        APPLICATION_KINDS[self.kind].validate(self)


@dataclass(frozen=True)
class Workload:
    name: str
    applications: tuple[Application, ...]
    seed: int = 0
    duration_s: float = 60.0
    arrivals: Arrivals = field(default_factory=Arrivals)
    popularity: Popularity = field(default_factory=Popularity)
    protocol: str = "grpc"
    stream: bool = True  # ask the server to stream tokens (needed for TTFT on gRPC and http-stream)
    image_size: int = 336  # side of the generated images, in pixels
    image_pool: int = 32  # distinct images per application (so the server cannot cache one)
    # How the model family's prompts mark an image and a video ("": frames are images); LLaVA's by default.
    # Qwen2-VL: "<|vision_start|><|image_pad|><|vision_end|>" and "<|vision_start|><|video_pad|><|vision_end|>".
    image_placeholder: str = "<image>"
    video_placeholder: str = ""
    tokens_per_word: float = 1.3  # filler words per prompt token (LLaMA's tokenizer: about 1.3)
    request_timeout_s: float = 300.0
    adapter_names: tuple[str, ...] = ()  # () : the server's adapters (or the demo adapters)
    source: Optional[str] = None  # the YAML it came from

    def __post_init__(self) -> None:
        _require(bool(self.applications), "a workload needs at least one application")
        names = [a.name for a in self.applications]
        _require(len(set(names)) == len(names), f"application names must differ, got {names}")
        _require(self.duration_s > 0, "duration_s must be > 0")
        _require(self.protocol in PROTOCOLS, f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        _require(16 <= self.image_size <= 4096, "image_size must be in [16, 4096]")
        _require(self.image_pool >= 1, "image_pool must be >= 1")
        _require(self.tokens_per_word > 0, "tokens_per_word must be > 0")
        _require(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        if self.adapter_names:
            _require(len(self.adapter_names) >= self.popularity.num_adapters,
                     f"popularity.num_adapters={self.popularity.num_adapters} but only {len(self.adapter_names)} adapter names")

    # -- derived ------------------------------------------------------------------------------
    def application(self, name: str) -> Application:
        for a in self.applications:
            if a.name == name:
                return a
        raise KeyError(name)

    def protocol_of(self, app: Application) -> str:
        return app.protocol or self.protocol

    def shares(self) -> dict[str, float]:
        total = sum(a.share for a in self.applications)
        return {a.name: a.share / total for a in self.applications}

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "Workload":
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except OSError as e:
            raise ConfigError(f"workload {path}: {e.strerror}") from None
        _require(isinstance(data, Mapping), f"workload {path}: expected a mapping at the top level")
        return cls.from_dict(data, source=str(p))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: Optional[str] = None) -> "Workload":
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        source = data.pop("source", None) or source
        unknown = sorted(set(data) - known)
        _require(not unknown, f"workload {source or ''}: unknown key(s) {unknown}; known: {sorted(known)}")
        apps = data.pop("applications", None)
        _require(isinstance(apps, list) and apps, "workload: 'applications' must be a non-empty list")
        applications = tuple(_application(a, i) for i, a in enumerate(apps))
        kwargs: dict[str, Any] = {}
        for key, kind in (("arrivals", Arrivals), ("popularity", Popularity)):
            if key in data:
                kwargs[key] = _build(kind, data.pop(key), key)
        if "adapter_names" in data:
            kwargs["adapter_names"] = tuple(data.pop("adapter_names") or ())
        return cls(applications=applications, source=source, **kwargs, **data)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["applications"] = [
            {"name": a.name, "kind": a.kind, "share": a.share, "protocol": a.protocol,
             "slo": dataclasses.asdict(a.slo), **dict(a.params)} for a in self.applications
        ]
        d["adapter_names"] = list(self.adapter_names)
        return d

    def with_overrides(self, *, rate: Optional[float] = None, users: Optional[int] = None,
                       mode: Optional[str] = None, duration_s: Optional[float] = None,
                       skewness: Optional[float] = None, zipf_alpha: Optional[float] = None,
                       num_adapters: Optional[int] = None, protocol: Optional[str] = None,
                       seed: Optional[int] = None, length_scale: Optional[float] = None,
                       image_size: Optional[int] = None, adapter_names: Optional[tuple[str, ...]] = None,
                       request_timeout_s: Optional[float] = None,
                       frames_per_chunk: Optional[int] = None) -> "Workload":
        """A copy with command-line overrides applied (``None`` keeps the file's value).

        ``--skewness`` or ``--zipf`` also switch the popularity kind; ``--protocol`` applies to every
        application; ``--length-scale`` multiplies every length distribution's scale;
        ``--frames-per-chunk`` applies to every video application.
        """
        arrivals = self.arrivals
        if mode is not None or rate is not None or users is not None:
            if mode is None:
                mode = "closed" if users is not None and rate is None else arrivals.mode
            arrivals = Arrivals(mode=mode, rate=rate if rate is not None else arrivals.rate,
                                users=users if users is not None else arrivals.users)
        pop = self.popularity
        changes: dict[str, Any] = {}
        if skewness is not None:
            changes.update(kind="skewness", skewness=skewness)
        if zipf_alpha is not None:
            changes.update(kind="zipf", zipf_alpha=zipf_alpha)
        if num_adapters is not None:
            changes["num_adapters"] = num_adapters
        if changes:
            pop = Popularity(**{**dataclasses.asdict(pop), **changes})
        apps = self.applications
        if protocol is not None or length_scale is not None or frames_per_chunk is not None:
            new_apps = []
            for a in apps:
                params = dict(a.params)
                if length_scale is not None:
                    params = APPLICATION_KINDS[a.kind].scale_lengths(params, length_scale)
                if frames_per_chunk is not None and "frames_per_chunk" in APPLICATION_KINDS[a.kind].PARAMS:
                    params["frames_per_chunk"] = frames_per_chunk
                new_apps.append(Application(name=a.name, kind=a.kind, share=a.share, slo=a.slo,
                                            protocol=protocol if protocol is not None else a.protocol, params=params))
            apps = tuple(new_apps)
        return dataclasses.replace(
            self,
            applications=apps,
            arrivals=arrivals,
            popularity=pop,
            duration_s=duration_s if duration_s is not None else self.duration_s,
            protocol=protocol if protocol is not None else self.protocol,
            seed=seed if seed is not None else self.seed,
            image_size=image_size if image_size is not None else self.image_size,
            adapter_names=adapter_names if adapter_names is not None else self.adapter_names,
            request_timeout_s=request_timeout_s if request_timeout_s is not None else self.request_timeout_s,
        )

    def describe(self) -> str:
        apps = ", ".join(f"{a.name} ({a.kind}, {s:.0%})" for a, s in zip(self.applications, self.shares().values()))
        return f"{self.name}: {apps}; {self.arrivals.describe()}; {self.popularity.describe()}; {self.duration_s:g}s"


def _build(kind, data: Any, where: str):
    _require(isinstance(data, Mapping), f"workload: '{where}' must be a mapping")
    try:
        return kind(**data)
    except TypeError as e:
        raise ConfigError(f"workload.{where}: {e}") from None


def _application(data: Any, index: int) -> Application:
    _require(isinstance(data, Mapping), f"applications[{index}] must be a mapping")
    data = dict(data)
    slo = _build(Slo, data.pop("slo", {}) or {}, f"applications[{index}].slo")
    top = {k: data.pop(k) for k in ("name", "kind", "share", "protocol") if k in data}
    _require("name" in top and "kind" in top, f"applications[{index}] needs 'name' and 'kind'")
    return Application(slo=slo, params=data, **top)


def resolve_workload(name_or_path: str, root: Optional[Path] = None) -> Path:
    """``video`` -> configs/workloads/video.yaml; a path is used as given."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"workload file {name_or_path} not found")
        return p
    base = root or workloads_dir()
    candidate = base / f"{name_or_path}.yaml"
    if not candidate.is_file():
        known = sorted(x.stem for x in base.glob("*.yaml")) if base.is_dir() else []
        raise ConfigError(f"no workload named {name_or_path!r} in {base}; known: {known}")
    return candidate


def workloads_dir() -> Path:
    """The workload files shipped with this package (``configs/workloads`` of a checkout links here)."""
    return Path(__file__).resolve().parent / "workloads"
