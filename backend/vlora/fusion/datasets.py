"""Vision datasets for training and fusing adapters: generated from a seed with pillow, or read from a folder.

Generated tasks (the registry ``TASKS``; each answers from a small fixed set of labels, the kind of
task a vision task head serves):

| task                   | type           | labels                                 | input                       |
| ---------------------- | -------------- | -------------------------------------- | --------------------------- |
| count-circles          | counting       | 1 .. 6                                 | one image, circles among other shapes |
| count-squares          | counting       | 1 .. 6                                 | one image, squares among other shapes |
| color                  | classification | red green blue yellow purple           | one image, one shape        |
| shape                  | classification | circle square triangle cross           | one image, one shape        |
| presence-red-triangle  | presence       | yes no                                 | one image, 2 to 5 shapes; negatives hold red non-triangles and non-red triangles |
| action                 | action         | left right up down spin                | 4 to 8 frames of one moving shape |

Every dataset has ``train``, ``val`` and ``test`` splits drawn from independent seeds derived from
(task, seed, split), and a prompt template in LLaVA-1.5's conversation format, like the V-LoRA paper's
appendix C ("USER: <image>\\n<instruction> ASSISTANT:"). ``{images}`` in a template stands for one
``<image>`` placeholder per image (per frame).

The same structure is read from a plain folder (:func:`load_folder`), so users can bring their own:

    my-dataset/
      labels.csv      columns: images (paths relative to the folder, ';' between the frames of a
                      video), label, and optionally split (train / val / test)
      dataset.json    optional: {"name", "task_type", "labels", "prompt"}
      any image files the CSV names

Without a ``split`` column, rows are split 80/10/10 by a seeded shuffle. :func:`save_folder` writes a
dataset in that layout (a generated one, for a look at its images or to share it).
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from PIL import Image, ImageDraw

SPLITS = ("train", "val", "test")
IMAGE_PLACEHOLDER = "<image>"
LABELS_FILE = "labels.csv"
META_FILE = "dataset.json"
TASK_TYPES = ("counting", "classification", "presence", "action")
DEFAULT_SIZES = {"train": 400, "val": 64, "test": 128}
MAX_FOLDER_ROWS = 1_000_000


@dataclass(frozen=True)
class Sample:
    """One example: its image (several for video frames) and its label."""

    images: tuple[Image.Image, ...]
    label: str


@dataclass
class VisionDataset:
    """A labelled dataset with train/val/test splits and the prompt its answers follow."""

    name: str
    task_type: str
    labels: tuple[str, ...]
    prompt: str  # a template: "{images}" becomes one <image> placeholder per image
    splits: dict[str, list[Sample]] = field(default_factory=dict)
    source: str = ""  # "generated:<task> seed=<n>" or the folder it was read from

    def __post_init__(self) -> None:
        if self.task_type not in TASK_TYPES:
            raise ValueError(f"dataset {self.name!r}: task_type {self.task_type!r} is not one of {TASK_TYPES}")
        if len(self.labels) < 2 or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"dataset {self.name!r}: needs at least two distinct labels, got {list(self.labels)}")
        if "{images}" not in self.prompt:
            raise ValueError(f"dataset {self.name!r}: the prompt template must contain {{images}}")
        for split, samples in self.splits.items():
            bad = sorted({s.label for s in samples} - set(self.labels))
            if bad:
                raise ValueError(f"dataset {self.name!r}, split {split}: labels {bad} are not in {list(self.labels)}")

    def split(self, name: str) -> list[Sample]:
        if name not in self.splits:
            raise KeyError(f"dataset {self.name!r} has no split {name!r}; it has {sorted(self.splits)}")
        return self.splits[name]

    def prompt_for(self, num_images: int) -> str:
        return render_prompt(self.prompt, num_images)

    def label_index(self, label: str) -> int:
        return self.labels.index(label)

    @property
    def chance(self) -> float:
        """Accuracy of always answering the most frequent test label (1/labels when balanced)."""
        test = self.splits.get("test") or []
        if not test:
            return 1.0 / len(self.labels)
        counts = {}
        for s in test:
            counts[s.label] = counts.get(s.label, 0) + 1
        return max(counts.values()) / len(test)


def render_prompt(template: str, num_images: int) -> str:
    return template.replace("{images}", IMAGE_PLACEHOLDER * num_images)


# -- drawing ---------------------------------------------------------------------------------------

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 200),
}
SHAPES = ("circle", "square", "triangle", "cross")
ACTIONS = ("left", "right", "up", "down", "spin")


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int = 20) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)


def _background(size: int, rng: random.Random) -> Image.Image:
    base = rng.randint(20, 70)
    img = Image.new("RGB", (size, size), (base, base, base))
    draw = ImageDraw.Draw(img)
    for _ in range(size // 8):  # faint speckles, so the background is not one flat colour
        x, y = rng.randrange(size), rng.randrange(size)
        v = base + rng.randint(-15, 15)
        draw.point((x, y), fill=(v, v, v))
    return img


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Corner points of a square, triangle or cross of circumradius ``r`` rotated by ``angle`` radians."""
    if kind == "square":
        pts = [(-1, -1), (1, -1), (1, 1), (-1, 1)]
        pts = [(x * r * 0.75, y * r * 0.75) for x, y in pts]
    elif kind == "triangle":
        pts = [(r * math.cos(a), r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    elif kind == "cross":
        w, L = 0.35 * r, r
        pts = [(-w, -L), (w, -L), (w, -w), (L, -w), (L, w), (w, w), (w, L), (-w, L), (-w, w), (-L, w), (-L, -w), (-w, -w)]
    else:
        raise ValueError(f"no polygon for shape {kind!r}")
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, fill, angle: float = 0.0) -> None:
    if kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(_polygon(kind, cx, cy, r, angle), fill=fill)


def _cells(size: int, grid: int, rng: random.Random, k: int) -> list[tuple[float, float, float]]:
    """``k`` distinct grid cells as (centre x, centre y, radius), jittered inside their cell."""
    cell = size / grid
    r = cell * 0.36
    out = []
    for idx in rng.sample(range(grid * grid), k):
        gx, gy = idx % grid, idx // grid
        j = cell * 0.08
        out.append(((gx + 0.5) * cell + rng.uniform(-j, j), (gy + 0.5) * cell + rng.uniform(-j, j), r * rng.uniform(0.85, 1.1)))
    return out


# -- tasks -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskSpec:
    """A generated task: how to draw one labelled sample, its labels and its prompt."""

    name: str
    task_type: str
    labels: tuple[str, ...]
    prompt: str
    make: Callable[[random.Random, str, int], Sample]  # (rng, label, image size) -> sample


def _count_task(kind: str) -> TaskSpec:
    labels = tuple(str(i) for i in range(1, 7))
    others = tuple(s for s in SHAPES if s != kind)

    def make(rng: random.Random, label: str, size: int) -> Sample:
        n = int(label)
        distractors = rng.randint(0, 3)
        img = _background(size, rng)
        draw = ImageDraw.Draw(img)
        places = _cells(size, 4, rng, n + distractors)
        for i, (x, y, r) in enumerate(places):
            shape = kind if i < n else rng.choice(others)
            draw_shape(draw, shape, x, y, r, _jitter(COLORS[rng.choice(list(COLORS))], rng), rng.uniform(-0.3, 0.3))
        return Sample((img,), label)

    plural = kind + "s" if kind != "cross" else "crosses"
    return TaskSpec(f"count-{plural}", "counting", labels,
                    f"USER: {{images}}\nHow many {plural} are in the image? Answer with a number. ASSISTANT:", make)


def _single_shape(rng: random.Random, size: int, kind: str, color: str) -> Image.Image:
    img = _background(size, rng)
    r = size * rng.uniform(0.18, 0.3)
    x, y = rng.uniform(r + 2, size - r - 2), rng.uniform(r + 2, size - r - 2)
    draw_shape(ImageDraw.Draw(img), kind, x, y, r, _jitter(COLORS[color], rng), rng.uniform(-0.4, 0.4))
    return img


def _make_color(rng: random.Random, label: str, size: int) -> Sample:
    return Sample((_single_shape(rng, size, rng.choice(SHAPES), label),), label)


def _make_shape(rng: random.Random, label: str, size: int) -> Sample:
    return Sample((_single_shape(rng, size, label, rng.choice(list(COLORS))),), label)


def _make_presence(rng: random.Random, label: str, size: int) -> Sample:
    """Positives hold one red triangle; negatives hold near misses (red non-triangles, non-red triangles)."""
    n = rng.randint(2, 5)
    img = _background(size, rng)
    draw = ImageDraw.Draw(img)
    other_colors = [c for c in COLORS if c != "red"]
    for i, (x, y, r) in enumerate(_cells(size, 3, rng, n)):
        if i == 0 and label == "yes":
            shape, color = "triangle", "red"
        else:
            shape, color = rng.choice([("triangle", rng.choice(other_colors)),
                                       (rng.choice(("circle", "square", "cross")), "red"),
                                       (rng.choice(("circle", "square", "cross")), rng.choice(other_colors))])
        draw_shape(draw, shape, x, y, r, _jitter(COLORS[color], rng, 12), rng.uniform(-0.3, 0.3))
    return Sample((img,), label)


def make_action_task(min_frames: int = 4, max_frames: int = 8) -> TaskSpec:
    if not 2 <= min_frames <= max_frames:
        raise ValueError(f"action frames: need 2 <= min_frames <= max_frames, got {min_frames}, {max_frames}")

    def make(rng: random.Random, label: str, size: int) -> Sample:
        n = rng.randint(min_frames, max_frames)
        kind = rng.choice(("triangle", "cross", "square"))
        color = _jitter(COLORS[rng.choice(list(COLORS))], rng)
        r = size * rng.uniform(0.12, 0.16)
        travel = size - 2 * r - 6  # the shape crosses most of the frame
        dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1), "spin": (0, 0)}[label]
        x0 = r + 3 if dx > 0 else size - r - 3 if dx < 0 else rng.uniform(r + 3, size - r - 3)
        y0 = r + 3 if dy > 0 else size - r - 3 if dy < 0 else rng.uniform(r + 3, size - r - 3)
        angle0 = rng.uniform(0, math.pi / 2)
        turn = rng.choice((-1, 1)) * math.pi / 5 if label == "spin" else 0.0
        frames = []
        for t in range(n):
            f = t / (n - 1)
            img = _background(size, random.Random(rng.random()))
            draw_shape(ImageDraw.Draw(img), kind, x0 + dx * travel * f, y0 + dy * travel * f, r, color, angle0 + turn * t)
            frames.append(img)
        return Sample(tuple(frames), label)

    return TaskSpec("action", "action", ACTIONS,
                    "USER: {images}\nThe images are consecutive frames of a video. How does the shape move? "
                    "Answer with one word: left, right, up, down or spin. ASSISTANT:", make)


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    _count_task("circle"),
    _count_task("square"),
    TaskSpec("color", "classification", tuple(COLORS),
             "USER: {images}\nWhat colour is the shape? Answer with one word: red, green, blue, yellow or purple. "
             "ASSISTANT:", _make_color),
    TaskSpec("shape", "classification", SHAPES,
             "USER: {images}\nWhat shape is in the image? Answer with one word: circle, square, triangle or cross. "
             "ASSISTANT:", _make_shape),
    TaskSpec("presence-red-triangle", "presence", ("yes", "no"),
             "USER: {images}\nIs there a red triangle in the image? Answer yes or no. ASSISTANT:", _make_presence),
    make_action_task(),
)}


def _seed_for(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def generate(task: str, *, seed: int = 0, sizes: Optional[dict[str, int]] = None, image_size: int = 64,
             min_frames: Optional[int] = None, max_frames: Optional[int] = None) -> VisionDataset:
    """Generate dataset ``task`` (a name in ``TASKS``) with balanced labels, reproducibly from ``seed``.

    ``sizes`` gives the number of samples per split (default ``DEFAULT_SIZES``); ``min_frames`` and
    ``max_frames`` override the action task's frame count range (4 to 8).
    """
    if task not in TASKS:
        raise KeyError(f"unknown generated task {task!r}; known: {sorted(TASKS)}")
    spec = TASKS[task]
    if task == "action" and (min_frames is not None or max_frames is not None):
        spec = make_action_task(min_frames or 4, max_frames or max(min_frames or 4, 8))
    if image_size < 32:
        raise ValueError(f"image_size must be >= 32, got {image_size}")
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    splits = {}
    for split in SPLITS:
        n = int(sizes[split])
        if n < 0:
            raise ValueError(f"split {split}: negative size {n}")
        rng = random.Random(_seed_for(task, seed, split, image_size, spec.make.__qualname__))
        labels = [spec.labels[i % len(spec.labels)] for i in range(n)]  # balanced
        rng.shuffle(labels)
        splits[split] = [spec.make(random.Random(rng.random()), label, image_size) for label in labels]
    return VisionDataset(name=spec.name, task_type=spec.task_type, labels=spec.labels, prompt=spec.prompt,
                         splits=splits, source=f"generated:{task} seed={seed} size={image_size}")


# -- folders ---------------------------------------------------------------------------------------

def save_folder(ds: VisionDataset, out: Path) -> Path:
    """Write ``ds`` as a folder dataset (PNG files, labels.csv, dataset.json) that load_folder reads back."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for split, samples in ds.splits.items():
        (out / split).mkdir(exist_ok=True)
        for i, s in enumerate(samples):
            names = []
            for j, img in enumerate(s.images):
                rel = f"{split}/{i:05d}" + (f"_{j}" if len(s.images) > 1 else "") + ".png"
                img.save(out / rel)
                names.append(rel)
            rows.append({"images": ";".join(names), "label": s.label, "split": split})
    with open(out / LABELS_FILE, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=["images", "label", "split"])
        w.writeheader()
        w.writerows(rows)
    (out / META_FILE).write_text(json.dumps({"name": ds.name, "task_type": ds.task_type, "labels": list(ds.labels),
                                             "prompt": ds.prompt}, indent=2) + "\n")
    return out


def load_folder(path: Path, *, seed: int = 0, name: Optional[str] = None) -> VisionDataset:
    """Read a folder dataset (see the module docstring). Raises ValueError naming the file and row at fault."""
    from vlora.config import InputLimits
    from vlora.models.images import decode_image

    root = Path(path).resolve()
    labels_file = root / LABELS_FILE
    if not labels_file.is_file():
        raise ValueError(f"{root}: no {LABELS_FILE} (columns: images, label, optional split)")
    meta = {}
    if (root / META_FILE).is_file():
        try:
            meta = json.loads((root / META_FILE).read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{root / META_FILE}: not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{root / META_FILE}: must hold a JSON object")
    limits = InputLimits()
    rows: list[tuple[str, tuple[Image.Image, ...], str]] = []
    with open(labels_file, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = {"images", "label"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{labels_file}: missing column(s) {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            if line > MAX_FOLDER_ROWS:
                raise ValueError(f"{labels_file}: more than {MAX_FOLDER_ROWS} rows")
            label = (row.get("label") or "").strip()
            split = (row.get("split") or "").strip()
            if not label:
                raise ValueError(f"{labels_file}:{line}: empty label")
            if split and split not in SPLITS:
                raise ValueError(f"{labels_file}:{line}: split {split!r} is not one of {SPLITS}")
            images = []
            for rel in filter(None, (p.strip() for p in (row.get("images") or "").split(";"))):
                p = (root / rel).resolve()
                if not p.is_relative_to(root) or not p.is_file():
                    raise ValueError(f"{labels_file}:{line}: image {rel!r} is not a file inside {root}")
                images.append(decode_image(p.read_bytes(), limits, index=len(images)))
            if not images:
                raise ValueError(f"{labels_file}:{line}: no image")
            if len(images) > limits.max_images:
                raise ValueError(f"{labels_file}:{line}: {len(images)} images, more than {limits.max_images}")
            rows.append((split, tuple(images), label))
    if not rows:
        raise ValueError(f"{labels_file}: no rows")
    labels = tuple(meta.get("labels") or sorted({r[2] for r in rows}))
    splits: dict[str, list[Sample]] = {s: [] for s in SPLITS}
    unsplit = [r for r in rows if not r[0]]
    for split, images, label in rows:
        if split:
            splits[split].append(Sample(images, label))
    random.Random(_seed_for("folder", seed)).shuffle(unsplit)
    n = len(unsplit)
    cut1, cut2 = int(round(n * 0.8)), int(round(n * 0.9))
    for i, (_, images, label) in enumerate(unsplit):
        splits["train" if i < cut1 else "val" if i < cut2 else "test"].append(Sample(images, label))
    default_prompt = "USER: {images}\nAnswer with one of: " + ", ".join(labels) + ". ASSISTANT:"
    return VisionDataset(name=name or meta.get("name") or root.name, task_type=meta.get("task_type", "classification"),
                         labels=labels, prompt=meta.get("prompt", default_prompt), splits=splits, source=str(root))


def resolve_dataset(spec: str, *, seed: int = 0, sizes: Optional[dict[str, int]] = None, image_size: int = 64,
                    max_frames: Optional[int] = None) -> VisionDataset:
    """A generated task name (``count-circles``) or a folder path."""
    if spec in TASKS:
        return generate(spec, seed=seed, sizes=sizes, image_size=image_size,
                        max_frames=max_frames, min_frames=min(4, max_frames) if max_frames else None)
    p = Path(spec)
    if p.is_dir():
        return load_folder(p, seed=seed)
    raise ValueError(f"dataset {spec!r} is neither a generated task ({', '.join(sorted(TASKS))}) nor a folder")


def task_names() -> Sequence[str]:
    return tuple(TASKS)
