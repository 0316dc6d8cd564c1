"""Trained demo adapters: task heads on the tiny model, so a newcomer's first head request means something.

| name                 | heads (tasks)                           | trained on                              |
| -------------------- | --------------------------------------- | --------------------------------------- |
| demo-count-circles   | count-circles                           | generated counting images               |
| demo-shapes          | color, shape, presence-red-triangle     | the three generated datasets, jointly   |

They are trained by the same path as ``vlora train`` (``AdapterTrainer``), from fixed seeds, and are
committed in ``demo_adapters/`` (about 100 KB each) together with a stamp naming the model they were
trained on. :func:`ensure_trained_demo_adapters` copies them into the demo adapter root when the stamp
matches the model; for any other model folder (the tiny model's generator changed, say) it trains
them there, which takes a few minutes on a CPU and needs PEFT (the ``train`` extra). To refresh the
committed copies after such a change::

    python -m vlora.fusion.demo --write-committed

A first head request, against ``make serve``::

    python -m vlora.fusion.demo --example | tail -1 | sh    # or --example color, shape, presence-red-triangle
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from vlora.fusion.train import TrainConfig

log = logging.getLogger(__name__)

TRAINED_DEMO_VERSION = 1
STAMP_FILE = "vlora_demo.json"
COMMITTED_DIR = Path(__file__).parent / "demo_adapters"


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


def model_fingerprint(model_dir: Path) -> str:
    """What the demo weights depend on: the model's config and weights files. The config is hashed
    without its "transformers_version" (save_pretrained writes the installed version there): a newer
    transformers that generates the same tiny model bit for bit must not make the committed demos stale."""
    h = hashlib.sha256()
    for name in sorted(p.name for p in Path(model_dir).iterdir() if p.name == "config.json" or p.suffix == ".safetensors"):
        if name == "config.json":
            config = json.loads((Path(model_dir) / name).read_text(encoding="utf-8"))
            config.pop("transformers_version", None)
            h.update(json.dumps(config, sort_keys=True).encode())
            continue
        with open(Path(model_dir) / name, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _stamp(spec: TrainedDemo, fingerprint: str) -> dict:
    blob = json.dumps({"version": TRAINED_DEMO_VERSION, "spec": repr(spec)}, sort_keys=True)
    return {"trained_demo_version": TRAINED_DEMO_VERSION, "spec_sha256": hashlib.sha256(blob.encode()).hexdigest(),
            "model": fingerprint}


def _read_stamp(d: Path):
    try:
        return json.loads((d / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def ensure_trained_demo_adapters(model_dir: Path, out_root: Path, *, train_missing: bool = True) -> list[str]:
    """Put the trained demo adapters for ``model_dir`` under ``out_root``; return the names now there.

    Each is kept if its stamp matches, copied from the committed copy if that matches, else trained
    (unless ``train_missing`` is false, or PEFT is missing: then it is left out, with a warning).
    Written to a temporary folder and renamed into place, as the random demo adapters are.
    """
    model_dir, out_root = Path(model_dir), Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    fingerprint = model_fingerprint(model_dir)
    present = []
    for spec in TRAINED_DEMOS:
        final = out_root / spec.name
        stamp = _stamp(spec, fingerprint)
        if _read_stamp(final) == stamp:
            present.append(spec.name)
            continue
        committed = COMMITTED_DIR / spec.name
        if _read_stamp(committed) == stamp:
            _install(final, lambda tmp, c=committed: shutil.copytree(c, tmp, dirs_exist_ok=True))
            present.append(spec.name)
            continue
        if not train_missing:
            continue
        try:
            import peft  # noqa: F401
        except ImportError:
            log.warning("demo adapter %s is not built for %s: training it needs PEFT (pip install 'vlora[train]')",
                        spec.name, model_dir)
            continue
        log.warning("training demo adapter %s for %s (first run only; a few minutes on a CPU)", spec.name, model_dir)

        def build(tmp: Path, spec=spec, stamp=stamp) -> None:
            train_demo(spec, model_dir, tmp)
            (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")

        _install(final, build)
        present.append(spec.name)
    return present


def _install(final: Path, build) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    old = None
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        if final.exists() or final.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            try:
                os.rename(final, old / "adapter")
            except FileNotFoundError:
                pass
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        for d in (tmp, old):
            if d is not None and d.exists():
                shutil.rmtree(d, ignore_errors=True)


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

        _install(final, build)


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
    p.add_argument("--write-committed", action="store_true", help="retrain the copies committed in vlora/fusion/demo_adapters")
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
