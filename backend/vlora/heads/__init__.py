"""Vision task heads: a linear layer on the LMM's last hidden state, stored inside a LoRA adapter.

A head answers a request from one prefill: it maps the final-norm hidden state at the prompt's last
token (``StepResult.hidden``) to one score per label, where generating the label through the LM head
would take several decode rounds. One adapter may carry several heads (one per task fused into it).

On disk, beside ``adapter_config.json`` (PEFT ignores both files):

- ``vlora_heads.json``: ``{"format": "vlora-task-heads", "version": 1, "hidden_size": H,
  "heads": [{"task": ..., "task_type": ..., "labels": [...], "prompt": ...}, ...]}``
- ``vlora_heads.safetensors``: ``<task>.weight`` [num_labels, H] and ``<task>.bias`` [num_labels].

``scores`` are softmax probabilities over the labels, in label order; the answer is the label with the
highest score.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from vlora.files import FileTooLarge, json_object, read_once

HEADS_CONFIG = "vlora_heads.json"
HEADS_WEIGHTS = "vlora_heads.safetensors"
FORMAT = "vlora-task-heads"
VERSION = 1
TASK_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
TASK_TYPES = ("counting", "classification", "presence", "action")
MAX_LABELS = 4096
MAX_LABEL_CHARS = 256
MAX_CONFIG_BYTES = 1 << 20


class HeadError(ValueError):
    """A head file that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True)
class TaskHead:
    """``scores = softmax(hidden @ weight.T + bias)`` over ``labels``.

    Shape: weight [L, H], bias [L], hidden [n, H] -> scores [n, L] (float32).
    """

    task: str
    task_type: str
    labels: tuple[str, ...]
    weight: torch.Tensor
    bias: torch.Tensor
    prompt: Optional[str] = None

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden.to(self.weight.dtype) @ self.weight.T + self.bias
        return torch.softmax(logits.float(), dim=-1)

    def answer(self, hidden: torch.Tensor) -> tuple[str, list[float]]:
        """The label and the scores for one hidden state [H]."""
        s = self.scores(hidden.reshape(1, -1))[0]
        return self.labels[int(torch.argmax(s))], [float(x) for x in s.cpu()]

    def to(self, device: torch.device | str) -> "TaskHead":
        return TaskHead(self.task, self.task_type, self.labels, self.weight.to(device), self.bias.to(device), self.prompt)

    def describe(self) -> dict[str, Any]:
        return {"task": self.task, "task_type": self.task_type, "labels": list(self.labels), "prompt": self.prompt}


def validate_task_name(task: Any) -> str:
    if not isinstance(task, str) or not TASK_NAME.fullmatch(task):
        shown = repr(task)[:80] if isinstance(task, str) else type(task).__name__
        raise HeadError(f"invalid task name {shown}: use 1 to 64 characters from A-Z a-z 0-9 . _ -")
    return task


def has_heads(adapter_dir: Path) -> bool:
    return (Path(adapter_dir) / HEADS_CONFIG).is_file()


def save_heads(adapter_dir: Path, heads: Mapping[str, TaskHead]) -> None:
    """Write ``heads`` into an adapter folder (replacing any heads there)."""
    from safetensors.torch import save_file

    adapter_dir = Path(adapter_dir)
    if not heads:
        raise HeadError("save_heads: no heads to save")
    hidden = {int(h.weight.shape[1]) for h in heads.values()}
    if len(hidden) != 1:
        raise HeadError(f"save_heads: heads disagree on the hidden size: {sorted(hidden)}")
    tensors = {}
    entries = []
    for task, h in heads.items():
        validate_task_name(task)
        tensors[f"{task}.weight"] = h.weight.detach().to("cpu", torch.float32).contiguous()
        tensors[f"{task}.bias"] = h.bias.detach().to("cpu", torch.float32).contiguous()
        entries.append(h.describe())
    save_file(tensors, str(adapter_dir / HEADS_WEIGHTS), metadata={"format": "pt"})
    config = {"format": FORMAT, "version": VERSION, "hidden_size": hidden.pop(), "heads": entries}
    (adapter_dir / HEADS_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_heads(adapter_dir: Path, *, hidden_size: int, where: str = "adapter",
               read: Optional[Callable[[str, int], Optional[bytes]]] = None) -> dict[str, TaskHead]:
    """Read and check the heads of an adapter folder; ``{}`` when it has none.

    Refuses, naming the problem: a malformed JSON file, an unknown format or version, a hidden size
    other than the served model's, a missing, misshapen or non-finite tensor, tensors no head names,
    duplicate tasks or labels, a weights file larger than its heads' tensors can be.

    ``read(file name, limit)`` gives the bytes of a file of the folder (raising
    ``vlora.files.FileTooLarge`` past ``limit`` bytes), or None when it is absent. Each file is read
    once and parsed from those bytes; the default reads it through one descriptor
    (``vlora.files.read_once``). The adapter loader passes a reader that checks the path against the
    adapter root and adds the bytes to the adapter's version.
    """
    from safetensors.torch import load as load_safetensors


    adapter_dir = Path(adapter_dir)
    if read is None:
        def read(filename: str, limit: int) -> Optional[bytes]:
            path = adapter_dir / filename  # a symlink is followed here, as the adapter loader does
            return read_once(path.resolve(), limit) if path.is_file() else None

    try:
        raw = read(HEADS_CONFIG, MAX_CONFIG_BYTES)
    except FileTooLarge:
        raise HeadError(f"{where}: {HEADS_CONFIG} is larger than {MAX_CONFIG_BYTES} bytes") from None
    if raw is None:
        return {}
    try:
        config = json_object(raw, HEADS_CONFIG)
    except ValueError as e:
        raise HeadError(f"{where}: {e}") from None
    if config.get("format") != FORMAT:
        raise HeadError(f"{where}: {HEADS_CONFIG} must be a JSON object with \"format\": \"{FORMAT}\"")
    if config.get("version") != VERSION:
        raise HeadError(f"{where}: {HEADS_CONFIG} version {config.get('version')!r} is not supported (only {VERSION})")
    if config.get("hidden_size") != hidden_size:
        raise HeadError(f"{where}: its heads take hidden size {config.get('hidden_size')!r}, "
                        f"the served model's is {hidden_size}")
    entries = config.get("heads")
    if not isinstance(entries, list) or not entries:
        raise HeadError(f"{where}: {HEADS_CONFIG} lists no heads")
    specs: dict[str, tuple[str, tuple[str, ...], Optional[str]]] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise HeadError(f"{where}: each entry of \"heads\" must be an object")
        try:
            task = validate_task_name(entry.get("task"))
        except HeadError as e:
            raise HeadError(f"{where}: {e}") from None
        if task in specs:
            raise HeadError(f"{where}: task {task!r} is listed twice")
        task_type = entry.get("task_type")
        if task_type not in TASK_TYPES:
            raise HeadError(f"{where}: task {task!r}: task_type {task_type!r} is not one of {list(TASK_TYPES)}")
        labels = entry.get("labels")
        if (not isinstance(labels, list) or not 2 <= len(labels) <= MAX_LABELS
                or not all(isinstance(x, str) and 0 < len(x) <= MAX_LABEL_CHARS for x in labels)
                or len(set(labels)) != len(labels)):
            raise HeadError(f"{where}: task {task!r}: labels must be 2 to {MAX_LABELS} distinct non-empty strings")
        prompt = entry.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise HeadError(f"{where}: task {task!r}: prompt must be a string")
        specs[task] = (task_type, tuple(labels), prompt)

    # The heads' tensors at 8 bytes an element, and a header of at most a megabyte: anything larger is refused unread.
    limit = 8 + MAX_CONFIG_BYTES + 8 * sum(len(labels) * (hidden_size + 1) for _, labels, _ in specs.values())
    try:
        blob = read(HEADS_WEIGHTS, limit)
    except FileTooLarge:
        raise HeadError(f"{where}: {HEADS_WEIGHTS} is larger than its heads' tensors can be ({limit} bytes)") from None
    if blob is None:
        raise HeadError(f"{where}: {HEADS_WEIGHTS} is missing")
    try:
        tensors = load_safetensors(blob)
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a malformed file
        raise HeadError(f"{where}: {HEADS_WEIGHTS} is not a valid safetensors file ({e})") from None
    keys = set(tensors)
    heads: dict[str, TaskHead] = {}
    for task, (task_type, labels, prompt) in specs.items():
        parts = []
        for suffix, shape in (("weight", (len(labels), hidden_size)), ("bias", (len(labels),))):
            key = f"{task}.{suffix}"
            if key not in keys:
                raise HeadError(f"{where}: {HEADS_WEIGHTS} has no tensor {key!r}")
            t = tensors[key]
            if tuple(t.shape) != shape:
                raise HeadError(f"{where}: {key!r} has shape {list(t.shape)}, expected {list(shape)}")
            if not t.is_floating_point() or not torch.isfinite(t).all():
                raise HeadError(f"{where}: {key!r} must hold finite floating-point values")
            parts.append(t.to(torch.float32).contiguous())
            keys.discard(key)
        heads[task] = TaskHead(task, task_type, labels, parts[0], parts[1], prompt)
    if keys:
        raise HeadError(f"{where}: {HEADS_WEIGHTS} holds tensors no head names: {sorted(keys)[:3]}")
    return heads
