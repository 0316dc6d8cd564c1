"""``vlora train`` and ``vlora fuse``: shared options and the two entry points (see vlora.cli)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from vlora.fusion.datasets import TASKS, VisionDataset, resolve_dataset
from vlora.fusion.train import MODES, TrainConfig


def say(msg: str) -> None:
    """Progress goes to stderr, so stdout carries only the result."""
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="local LLaVA folder (default: the embedded tiny model)")
    p.add_argument("--cache-dir", metavar="DIR", help="where the tiny model is generated (default ~/.cache/vlora)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="training dtype of the base weights (LoRA and heads train in it too)")
    p.add_argument("--mode", choices=MODES, default="head",
                   help="head: LoRA + a task head per dataset; lm: LoRA trained to generate the label; both")
    p.add_argument("--r", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha")
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated decoder projections to adapt")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per dataset")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3, help="LoRA learning rate")
    p.add_argument("--head-lr", type=float, default=5e-3, help="task head learning rate")
    p.add_argument("--head-init", choices=["probe", "random"], default="probe",
                   help="probe: fit a new head on the current features before training (default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the initialisation and the batches")
    p.add_argument("--train-size", type=int, default=400, help="samples per generated train split")
    p.add_argument("--val-size", type=int, default=64)
    p.add_argument("--test-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=64, help="side of generated images, in pixels")
    p.add_argument("--max-frames", type=int, help="most frames of a generated action sample (4 to 8 by default)")


def train_config(args) -> TrainConfig:
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    return TrainConfig(r=args.r, lora_alpha=args.alpha, target_modules=targets, mode=args.mode, steps=args.steps,
                       batch_size=args.batch_size, lr=args.lr, head_lr=args.head_lr, seed=args.seed,
                       head_init=args.head_init)


def load_datasets(specs: list[str], args) -> list[VisionDataset]:
    sizes = {"train": args.train_size, "val": args.val_size, "test": args.test_size}
    out = []
    for spec in specs:
        say(f"dataset {spec}")
        out.append(resolve_dataset(spec, seed=args.seed, sizes=sizes, image_size=args.image_size, max_frames=args.max_frames))
    return out


def load_model(args):
    import torch

    from vlora.engine.builder import resolve_device
    from vlora.models.loader import load_llava

    if args.model:
        model_dir = Path(args.model)
    else:
        from vlora.models.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model(Path(args.cache_dir) if args.cache_dir else None)
    device = resolve_device(args.device)
    say(f"loading {model_dir} on {device}")
    return load_llava(model_dir, getattr(torch, args.dtype), device)


def _guarded(command: str, run, args) -> int:
    """``run(args)``; a bad dataset, option or path is one line on stderr and exit code 2."""
    try:
        return run(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        say(f"vlora {command}: {e}")
        return 2


def example_request(adapter: str, task: str, ds: VisionDataset) -> str:
    prompt = ds.prompt_for(1 if ds.task_type != "action" else 4)
    body = {"text_input": prompt, "image": ["<base64 PNG>"] * prompt.count("<image>"),
            "sampling_parameters": json.dumps({"lora_name": adapter, "task": task})}
    return f"curl -s -X POST localhost:8000/v2/models/vlora/generate -d '{json.dumps(body)}'"


# -- vlora train -------------------------------------------------------------------------------------

def train_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", action="append", required=True, metavar="TASK|DIR",
                   help=f"generated task ({', '.join(TASKS)}) or a dataset folder; repeat to train on several")
    p.add_argument("--out", required=True, metavar="DIR", help="the adapter folder to write (PEFT format + heads)")
    add_common(p)


def train_run(args) -> int:
    return _guarded("train", _train, args)


def _train(args) -> int:
    from vlora.fusion.train import AdapterTrainer

    config = train_config(args)
    datasets = load_datasets(args.dataset, args)
    trainer = AdapterTrainer(load_model(args), config, progress=say)
    prepared = [trainer.prepare(ds) for ds in datasets]
    t0 = time.perf_counter()
    trainer.train(prepared)
    results = {}
    for p in prepared:
        r = {"val": trainer.evaluate(p, "val"), "test": trainer.evaluate(p, "test"), "chance": p.dataset.chance}
        if config.mode == "both":
            r["test_generated"] = trainer.evaluate(p, "test", use_head=False)
        results[p.name] = r
        say(f"{p.name}: val {r['val']:.1%}, test {r['test']:.1%} (chance {r['chance']:.1%})")
    desc = (f"Trained by `vlora train` on {', '.join(p.name for p in prepared)} in {time.perf_counter() - t0:.0f} s. "
            f"Test accuracy: " + ", ".join(f"{k} {v['test']:.1%}" for k, v in results.items()) + ".")
    out = trainer.save(Path(args.out), description=desc)
    print(json.dumps({"adapter": str(out), "accuracy": results}, indent=2))
    if config.uses_head:
        say("serve it: vlora serve --adapters " + str(out.parent) + " ; then, for example:\n  "
            + example_request(out.name, prepared[0].name, prepared[0].dataset))
    return 0


# -- vlora fuse --------------------------------------------------------------------------------------

def fuse_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", action="append", required=True, metavar="TASK|DIR[:FLOOR]",
                   help="a generated task or dataset folder, optionally with its accuracy floor "
                        "(0..1, e.g. count-circles:0.5); repeat, in fusion order")
    p.add_argument("--floor", type=float, default=0.5, help="floor of datasets given without one")
    p.add_argument("--out", required=True, metavar="DIR", help="adapters go to DIR/<prefix>-<i>, the report to DIR")
    p.add_argument("--prefix", default="fused", help="adapter name prefix")
    p.add_argument("--order", choices=["given", "random"], default="given",
                   help="fusion order: as given, or shuffled with --seed")
    add_common(p)


def fuse_run(args) -> int:
    return _guarded("fuse", _fuse, args)


def _fuse(args) -> int:
    from vlora.fusion.fuse import FusionTask, fuse as run_fusion
    from vlora.fusion.report import write_report
    from vlora.fusion.train import AdapterTrainer

    specs, floors = [], []
    for item in args.dataset:
        spec, floor = item, args.floor
        head, sep, tail = item.rpartition(":")
        if sep and _is_float(tail):
            spec, floor = head, float(tail)
        specs.append(spec)
        floors.append(floor)
    datasets = load_datasets(specs, args)
    tasks = [FusionTask(ds, f) for ds, f in zip(datasets, floors)]
    trainer = AdapterTrainer(load_model(args), train_config(args), progress=say)
    out = Path(args.out)
    result = run_fusion(trainer, tasks, out_dir=out, prefix=args.prefix, order=args.order, seed=args.seed, progress=say)
    report = write_report(result, out, chance={ds.name: ds.chance for ds in datasets})
    print(json.dumps({"adapters": {a.name: a.tasks for a in result.adapters}, "report": str(report)}, indent=2))
    say(f"{len(tasks)} datasets -> {len(result.adapters)} adapter(s); report: {report}")
    return 0


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True
