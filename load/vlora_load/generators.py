"""Request generators: seeded, so the same workload and seed always send the same requests at the same times.

Each application kind is a class in ``GENERATORS`` that draws requests (its ``params``, their defaults and checks, are
its kind's in ``vlora_load.workload.APPLICATION_KINDS``, which it subclasses):

- ``visual_retrieval``: VQA, captioning and grounding prompts over one generated image, with input
  and output lengths from log-normal shapes fitted to the Azure LLM inference trace. Open-loop
  arrivals are Poisson.
- ``video_analytics``: N camera streams, each sending one chunk of F frames every period; a chunk is
  one request, for object detection (on the newest frame) or action recognition (on all frames).
  Open-loop arrivals are periodic per stream, with seeded phases.

Images are drawn with pillow (random shapes on a random background, moving between frames for video)
from a pool per application, encoded once, base64 as the ``image`` input expects.
"""
from __future__ import annotations

import base64
import io
import math
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping, Optional

from vlora.config import ConfigError
from vlora_load.heads import HeadPolicy
from vlora_load.workload import (Application, LengthDistribution, VideoAnalyticsKind, VisualRetrievalKind, Workload,
                                 length_from)

# Words for filler text (context in the prompt) so that a prompt has the drawn input length.
_FILLER = (
    "the a picture shows small red house next to tall green tree sky above is blue there are few white clouds dog "
    "sleeping on grass in front of door woman standing doorway holding cup tea looking at garden two cats sitting "
    "wooden table window street cars people bowl fruit apples bananas kitchen counter children playing football park"
).split()
_OBJECTS = ("car", "person", "bicycle", "dog", "truck", "bus", "traffic light", "cat")
_COLOURS = ("red", "green", "blue", "yellow", "white", "black", "orange", "purple")
_ACTIONS = ("moving left", "moving right", "moving up", "moving down", "spinning", "standing still")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send, and what a full answer looks like."""

    index: int
    application: str
    task: str
    adapter: Optional[str]
    prompt: str
    images: tuple[str, ...]  # base64
    max_tokens: int
    head_task: Optional[str] = None  # set: answered by the adapter's task head (one prefill)
    stream_id: Optional[int] = None
    send_at: Optional[float] = None  # seconds from the start (open loop); None: as soon as possible

    def sampling_parameters(self) -> dict[str, Any]:
        params: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        if self.adapter:
            params["lora_name"] = self.adapter
        if self.head_task:
            params["task"] = self.head_task
        return params

    @property
    def expected_output_tokens(self) -> int:
        """With ignore_eos a generating request produces exactly max_tokens; a head's label counts as one."""
        return 1 if self.head_task else self.max_tokens

    @property
    def image_bytes(self) -> int:
        return sum(len(i) for i in self.images)


class AdapterPicker:
    """Draws the adapter of each request from the workload's popularity (index 0 the most popular)."""

    def __init__(self, workload: Workload, adapter_names: tuple[str, ...]) -> None:
        n = workload.popularity.num_adapters
        if len(adapter_names) < n:
            raise ConfigError(f"popularity.num_adapters={n} but the server has {len(adapter_names)} adapter(s): "
                              f"{list(adapter_names)[:8]}; write more with --num-adapters or lower it")
        self.names: tuple[Optional[str], ...] = tuple(adapter_names[:n])
        probs = workload.popularity.probabilities()
        base = workload.popularity.base_share
        if base > 0:
            self.names = self.names + (None,)
            probs = probs + [base]
        self._cum = []
        acc = 0.0
        for p in probs:
            acc += p
            self._cum.append(acc)

    def pick(self, rng: random.Random) -> Optional[str]:
        u = rng.random() * self._cum[-1]
        lo, hi = 0, len(self._cum) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self._cum[mid] >= u:
                hi = mid
            else:
                lo = mid + 1
        return self.names[lo]


class ImagePool:
    """A fixed, seeded set of generated images (JPEG, base64), and of frame sequences for video."""

    def __init__(self, seed: int, size: int, count: int) -> None:
        self.seed, self.size, self.count = seed, size, count
        self._images: dict[int, str] = {}
        self._clips: dict[tuple[int, int], tuple[str, ...]] = {}

    def image(self, i: int) -> str:
        key = i % self.count
        if key not in self._images:
            rng = random.Random(self.seed * 1_000_003 + key)
            self._images[key] = _encode(_draw_scene(rng, self.size, frame=0, frames=1))
        return self._images[key]

    def clip(self, i: int, frames: int) -> tuple[str, ...]:
        key = (i % self.count, frames)
        if key not in self._clips:
            rng_seed = self.seed * 1_000_003 + 7919 * key[0] + frames
            self._clips[key] = tuple(
                _encode(_draw_scene(random.Random(rng_seed), self.size, frame=f, frames=frames)) for f in range(frames))
        return self._clips[key]


def _draw_scene(rng: random.Random, size: int, frame: int, frames: int):
    """Random shapes on a random background; shape k moves along its own direction over the frames."""
    from PIL import Image, ImageDraw

    bg = tuple(rng.randrange(40, 216) for _ in range(3))
    img = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(2, 5)):
        colour = tuple(rng.randrange(256) for _ in range(3))
        r = rng.uniform(0.06, 0.18) * size
        x, y = rng.uniform(r, size - r), rng.uniform(r, size - r)
        dx, dy = rng.uniform(-0.3, 0.3) * size, rng.uniform(-0.3, 0.3) * size
        t = frame / max(frames - 1, 1)
        cx, cy = (x + dx * t) % size, (y + dy * t) % size
        box = [cx - r, cy - r, cx + r, cy + r]
        if rng.random() < 0.5:
            draw.ellipse(box, fill=colour)
        else:
            draw.rectangle(box, fill=colour)
    return img


def _encode(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _filler(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_FILLER) for _ in range(max(words, 0)))


class ApplicationGenerator:
    """Draws the requests of one application. Subclasses (each also a subclass of its
    ``vlora_load.workload.ApplicationKind``, which owns its ``params``) are registered in ``GENERATORS`` by kind."""

    kind: ClassVar[str]
    PARAMS: ClassVar[dict[str, Any]] = {}

    def __init__(self, workload: Workload, app: Application, adapters: AdapterPicker, heads: HeadPolicy) -> None:
        self.workload, self.app, self.adapters, self.heads = workload, app, adapters, heads
        self.params = {**self.PARAMS, **dict(app.params)}
        app_seed = workload.seed * 7_919 + sum(ord(c) for c in app.name)
        self.images = ImagePool(app_seed, workload.image_size, workload.image_pool)
        self.rate = workload.arrivals.rate * workload.shares()[app.name]
        self.tasks = dict(self.params["tasks"])  # task -> weight: every kind draws its requests' tasks

    def draw(self, rng: random.Random, index: int, stream_id: Optional[int] = None,
             send_at: Optional[float] = None) -> RequestSpec:
        raise NotImplementedError

    def arrival_times(self, rng: random.Random, duration_s: float) -> Iterator[tuple[float, Optional[int]]]:
        """Open-loop arrival times in [0, duration) with the stream id (None when there are no streams)."""
        raise NotImplementedError


class VisualRetrieval(VisualRetrievalKind, ApplicationGenerator):
    PROMPTS = {
        "vqa": "USER: <image>\n{context}\nQuestion: how many {colour} objects are in the picture? "
               "Answer the question in detail. ASSISTANT:",
        "caption": "USER: <image>\n{context}\nDescribe this image in detail. ASSISTANT:",
        "grounding": "USER: <image>\n{context}\nProvide the bounding box of the region this sentence describes: "
                     "the {colour} {obj}. ASSISTANT:",
    }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.input_len = length_from(self.params["input_tokens"], f"{self.app.name}.input_tokens")
        self.output_len = length_from(self.params["output_tokens"], f"{self.app.name}.output_tokens")

    def draw(self, rng, index, stream_id=None, send_at=None) -> RequestSpec:
        task = _weighted(rng, self.tasks)
        n_in, n_out = self.input_len.sample(rng), self.output_len.sample(rng)
        template = self.PROMPTS[task]
        fixed_words = len(template.split()) + 4
        words = int(round(n_in / self.workload.tokens_per_word)) - fixed_words
        prompt = template.format(context=_filler(rng, words), colour=rng.choice(_COLOURS), obj=rng.choice(_OBJECTS))
        prompt = prompt.replace("<image>", self.workload.image_placeholder)
        adapter = self.adapters.pick(rng)
        image = self.images.image(rng.randrange(1 << 30))
        return RequestSpec(index, self.app.name, task, adapter, prompt, (image,), n_out,
                           head_task=None, stream_id=stream_id, send_at=send_at)

    def arrival_times(self, rng, duration_s):
        t = 0.0
        while True:
            t += rng.expovariate(self.rate)
            if t >= duration_s:
                return
            yield t, None


class VideoAnalytics(VideoAnalyticsKind, ApplicationGenerator):
    PROMPTS = {
        "detection": "USER: <image>\nDetect every {obj} in this video frame and give their bounding boxes. ASSISTANT:",
        "action": "USER: {images}\nThese are {frames} consecutive frames of a video. Which action happens in this "
                  "clip? Answer with one of: {actions}. ASSISTANT:",
    }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.frames = int(self.params["frames_per_chunk"])
        self.output_tokens = {**self.PARAMS["output_tokens"], **dict(self.params["output_tokens"])}
        # The offered rate decides the number of streams: each stream sends one chunk per period.
        period = float(self.params["chunk_period_s"])
        self.num_streams = max(1, math.ceil(self.rate * period - 1e-9))
        self.stream_period_s = self.num_streams / self.rate  # exact offered rate, even for fractional rates
        stream_rng = random.Random(self.workload.seed * 31 + 17)
        self.stream_task = [_weighted(stream_rng, self.tasks) for _ in range(self.num_streams)]
        self.stream_adapter = [self.adapters.pick(stream_rng) for _ in range(self.num_streams)]
        self._chunk = [0] * self.num_streams

    def draw(self, rng, index, stream_id=None, send_at=None) -> RequestSpec:
        if stream_id is None:  # closed loop: the user is a camera; pick a stream
            stream_id = rng.randrange(self.num_streams)
        task = self.stream_task[stream_id]
        adapter = self.stream_adapter[stream_id]
        chunk = self._chunk[stream_id]
        self._chunk[stream_id] += 1
        clip = self.images.clip(stream_id * 1009 + chunk, self.frames)
        wl = self.workload
        if task == "detection":
            images = clip[-1:]
            prompt = self.PROMPTS["detection"].format(obj=rng.choice(_OBJECTS)).replace("<image>", wl.image_placeholder)
        else:
            images = clip  # one video where the family takes one, else the frames as images
            marks = wl.video_placeholder or wl.image_placeholder * len(clip)
            prompt = self.PROMPTS["action"].format(images=marks, frames=len(clip), actions=", ".join(_ACTIONS))
        head = self.heads.head_task(adapter, task)
        max_tokens = 1 if head else int(self.output_tokens[task])
        return RequestSpec(index, self.app.name, task, adapter, prompt, tuple(images), max_tokens,
                           head_task=head, stream_id=stream_id, send_at=send_at)

    def arrival_times(self, rng, duration_s):
        phases = [rng.uniform(0, self.stream_period_s) for _ in range(self.num_streams)]
        times = []
        for s, phase in enumerate(phases):
            t = phase
            while t < duration_s:
                times.append((t, s))
                t += self.stream_period_s
        yield from sorted(times)


GENERATORS: dict[str, type[ApplicationGenerator]] = {g.kind: g for g in (VisualRetrieval, VideoAnalytics)}


def _weighted(rng: random.Random, weights: Mapping[str, float]) -> str:
    keys = sorted(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


@dataclass
class WorkloadGenerator:
    """All applications of a workload: the open-loop schedule, or requests one by one for closed-loop users."""

    workload: Workload
    adapter_names: tuple[str, ...]
    heads: HeadPolicy = field(default_factory=HeadPolicy.none)

    def __post_init__(self) -> None:
        picker = AdapterPicker(self.workload, self.adapter_names)
        self.generators = {a.name: GENERATORS[a.kind](self.workload, a, picker, self.heads)
                           for a in self.workload.applications}
        self._shares = self.workload.shares()

    def schedule(self) -> list[RequestSpec]:
        """Every open-loop request of the run, in sending order (seeded: the same every time)."""
        timed = []
        for k, (name, gen) in enumerate(sorted(self.generators.items())):
            rng = random.Random(self.workload.seed * 1_000_003 + 101 * k)
            for t, stream in gen.arrival_times(rng, self.workload.duration_s):
                timed.append((t, name, stream))
        timed.sort(key=lambda x: (x[0], x[1]))
        draw_rng = random.Random(self.workload.seed)
        return [self.generators[name].draw(draw_rng, i, stream_id=stream, send_at=t)
                for i, (t, name, stream) in enumerate(timed)]

    def user_stream(self, user_index: int) -> Iterator[RequestSpec]:
        """Closed loop: the requests of one user, forever; indices are unique across users."""
        rng = random.Random(self.workload.seed * 1_000_003 + 7 * user_index + 1)
        names = sorted(self._shares)
        weights = [self._shares[n] for n in names]
        i = 0
        while True:
            name = rng.choices(names, weights=weights)[0]
            yield self.generators[name].draw(rng, user_index * 10_000_000 + i)
            i += 1

    def num_streams(self) -> dict[str, int]:
        return {n: g.num_streams for n, g in self.generators.items() if isinstance(g, VideoAnalytics)}


def expected_length(dist: LengthDistribution) -> float:
    """Mean of the clipped, scaled distribution (approximate: ignores clipping)."""
    return math.exp(dist.mu + dist.sigma ** 2 / 2) * dist.scale


def task_images(task: str, n: int = 6, seed: int = 7) -> list[str]:
    """``n`` base64 PNGs of a generated vision task (``vlora.fusion.datasets``: e.g. 1 to 6 circles for
    ``count-circles``), for requests to the task's head; [] for a task it does not generate."""
    from vlora.fusion.datasets import TASKS, generate

    if task not in TASKS:
        return []
    out = []
    for sample in generate(task, seed=seed, sizes={"train": 0, "val": 0, "test": n}).split("test"):
        buf = io.BytesIO()
        sample.images[0].save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out
