"""Trained demo adapters: task heads on the tiny model, so a newcomer's first head request means something.

| name                 | heads (tasks)                           | trained on                              |
| -------------------- | --------------------------------------- | --------------------------------------- |
| demo-count-circles   | count-circles                           | generated counting images               |
| demo-shapes          | color, shape, presence-red-triangle     | the three generated datasets, jointly   |

They are trained by the same path as ``vlora train`` (``AdapterTrainer``), from fixed seeds, and are
committed as data in ``vlora/lora/demo_adapters/`` (about 100 KB each) together with a stamp naming the
model they were trained on. Serving copies them (:func:`vlora.lora.demo.install_committed_demos`) and
never trains: when the tiny model's generator changes, they are left out with a warning until the
committed copies are retrained (a few minutes on a CPU; needs PEFT, the ``train`` extra)::

    python -m vlora.fusion.demo --write-committed

A first head request, against ``make serve``::

    python -m vlora.fusion.demo --example | tail -1 | sh    # or --example color, shape, presence-red-triangle
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from vlora.fusion.train import TrainConfig
from vlora.lora.demo import COMMITTED_DIR, STAMP_FILE, install, model_fingerprint

log = logging.getLogger(__name__)

TRAINED_DEMO_VERSION = 1


@dataclass(frozen=True)
class TrainedDemo:
    name: str
    tasks: tuple[str, ...]
    config: TrainConfig
    sizes: dict[str, int] = field(default_factory=lambda: {"train": 600, "val": 64, "test": 200})
    seed: int = 7


TRAINED_DEMOS = (
    TrainedDemo("demo-count-circles", ("count-circles",), TrainConfig(steps=40, seed=7, log_every=10),
                sizes={"train": 400, "val": 32, "test": 200}),
    TrainedDemo("demo-shapes", ("color", "shape", "presence-red-triangle"), TrainConfig(steps=20, seed=7, log_every=10),
                sizes={"train": 300, "val": 32, "test": 200}),
)
TRAINED_DEMO_NAMES = tuple(d.name for d in TRAINED_DEMOS)


def _stamp(spec: TrainedDemo, fingerprint: str) -> dict:
    blob = json.dumps({"version": TRAINED_DEMO_VERSION, "spec": repr(spec)}, sort_keys=True)
    return {"trained_demo_version": TRAINED_DEMO_VERSION, "spec_sha256": hashlib.sha256(blob.encode()).hexdigest(),
            "model": fingerprint}


def train_demo(spec: TrainedDemo, model_dir: Path, out: Path, progress=None) -> dict[str, float]:
    """Train one demo adapter into ``out``; returns its test accuracy per task."""
    import torch

    from vlora.fusion.datasets import generate
    from vlora.fusion.train import AdapterTrainer
    from vlora.models.loader import load_llava

    loaded = load_llava(model_dir, torch.float32, "cpu")
    trainer = AdapterTrainer(loaded, spec.config, progress=progress or log.info)
    prepared = [trainer.prepare(generate(t, seed=spec.seed, sizes=spec.sizes)) for t in spec.tasks]
    trainer.train(prepared)
    acc = {p.name: trainer.evaluate(p, "test") for p in prepared}
    chance = {p.name: p.dataset.chance for p in prepared}
    desc = ("A demo adapter of vlora, trained on generated images for the embedded tiny model "
            f"(`python -m vlora.fusion.demo`). Test accuracy: "
            + ", ".join(f"{k} {v:.1%} (chance {chance[k]:.1%})" for k, v in acc.items()) + ".\n\n"
            "Ask it with `\"task\": \"<task>\"` and `\"lora_name\": \"" + spec.name + "\"` in sampling_parameters, "
            "and the prompt of the task below with the image(s).")
    trainer.save(out, description=desc, name=spec.name)
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "vlora tiny model (vlora.models.tiny)"  # not this machine's path
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "vlora_demo_accuracy.json").write_text(json.dumps({"test_accuracy": acc, "chance": chance}, indent=2) + "\n")
    return acc


def write_committed(model_dir: Optional[Path] = None, names: Optional[list[str]] = None) -> None:
    """Retrain the committed demo adapters for the tiny model (run after the tiny model changes)."""
    from vlora.models.tiny import ensure_tiny_model

    model_dir = Path(model_dir) if model_dir else ensure_tiny_model()
    fingerprint = model_fingerprint(model_dir)
    COMMITTED_DIR.mkdir(exist_ok=True)
    for spec in TRAINED_DEMOS:
        if names and spec.name not in names:
            continue
        final = COMMITTED_DIR / spec.name

        def build(tmp: Path, spec=spec) -> None:
            acc = train_demo(spec, model_dir, tmp, progress=print)
            (tmp / STAMP_FILE).write_text(json.dumps(_stamp(spec, fingerprint), indent=2) + "\n")
            print(f"{spec.name}: test accuracy {acc}")

        install(final, build)


def example_request(task: str = "count-circles", seed: int = 1, url: str = "localhost:8000") -> str:
    """A ready-to-run curl command asking a demo adapter's head about a generated image (and its answer)."""
    import base64
    import io

    from vlora.fusion.datasets import generate

    adapter = next(d.name for d in TRAINED_DEMOS if task in d.tasks)
    ds = generate(task, seed=seed, sizes={"train": 0, "val": 0, "test": 1})
    sample = ds.split("test")[0]
    images = []
    for img in sample.images:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        images.append(base64.b64encode(buf.getvalue()).decode())
    body = {"text_input": ds.prompt_for(len(images)), "image": images,
            "sampling_parameters": json.dumps({"lora_name": adapter, "task": task})}
    return (f"# {adapter}, task {task}; the image's true label is {sample.label!r}\n"
            f"curl -s -X POST {url}/v2/models/vlora/generate -d '{json.dumps(body)}'")


def main() -> None:
    p = argparse.ArgumentParser(description="The demo adapters with task heads: an example request, or retraining them.")
    p.add_argument("--example", metavar="TASK", nargs="?", const="count-circles",
                   help="print a curl command asking the demo head TASK (default count-circles) about a generated image")
    p.add_argument("--seed", type=int, default=1, help="which generated image --example sends")
    p.add_argument("--url", default="localhost:8000", help="the server's HTTP address for --example")
    p.add_argument("--write-committed", action="store_true", help="retrain the copies committed in vlora/lora/demo_adapters")
    p.add_argument("--only", action="append", help="only this demo adapter (repeatable)")
    args = p.parse_args()
    if args.example:
        print(example_request(args.example, args.seed, args.url))
    elif args.write_committed:
        write_committed(names=args.only)
    else:
        p.print_help()


if __name__ == "__main__":
    main()
