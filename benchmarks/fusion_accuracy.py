"""Accuracy of task heads and knowledge fusion on the generated vision tasks, on the tiny model (CPU).

For each generated task it measures, on the test split:
- the base model answering in text (greedy generation must give exactly the label; zero-shot),
- the base model with a task head only (a linear probe on the frozen model's features: no LoRA),
- a per-task adapter (LoRA + head, trained on that task alone),
- the fused adapters of ``vlora fuse``, whose floors are each task's per-task validation accuracy less
  ``--floor-margin``: fusion must keep every task within that margin of its own adapter.
and reports how many adapters fusion produced against one per task.

    python -m benchmarks.fusion_accuracy --steps 30 --out /tmp/vlora-fusion-bench

Writes ``benchmarks/results/fusion-accuracy-<device>.json`` and ``.md`` (the table), the fusion report
(markdown + PNG) under ``--out``, and a line in ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, device_name, git_commit, record_result

TASKS = ("count-circles", "count-squares", "color", "shape", "presence-red-triangle", "action")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per dataset")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train-size", type=int, default=300)
    p.add_argument("--val-size", type=int, default=64)
    p.add_argument("--test-size", type=int, default=200)
    p.add_argument("--frames", type=int, default=4, help="frames of the action task (4 keeps the CPU run short)")
    p.add_argument("--floor-margin", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/vlora-fusion-bench")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()

    import torch

    from vlora.fusion.datasets import generate
    from vlora.fusion.fuse import FusionTask, fuse
    from vlora.fusion.report import write_report
    from vlora.fusion.train import AdapterTrainer, TrainConfig
    from vlora.models.loader import load_llava
    from vlora.models.tiny import ensure_tiny_model

    def say(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    t_start = time.perf_counter()
    names = [t for t in args.tasks.split(",") if t]
    sizes = {"train": args.train_size, "val": args.val_size, "test": args.test_size}
    datasets = {n: generate(n, seed=args.seed, sizes=sizes, min_frames=args.frames, max_frames=args.frames)
                if n == "action" else generate(n, seed=args.seed, sizes=sizes) for n in names}
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed, log_every=10)
    trainer = AdapterTrainer(load_llava(ensure_tiny_model(), torch.float32, "cpu"), config, progress=say)
    prepared = {n: trainer.prepare(ds) for n, ds in datasets.items()}

    rows: dict[str, dict] = {}
    for n in names:
        p_ = prepared[n]
        trainer.new_adapter()
        trainer.add_head(p_.dataset)
        trainer.fit_head(p_, use_lora=False)  # the base model's probe: LoRA is zero here anyway
        rows[n] = {"chance": datasets[n].chance,
                   "base_generated": trainer.evaluate(p_, "test", use_head=False, use_lora=False),
                   "base_probe": trainer.evaluate(p_, "test", use_lora=False)}
        trainer.new_adapter()
        t0 = time.perf_counter()
        trainer.train([p_], label=f"per-task {n}")
        rows[n].update(per_task_val=trainer.evaluate(p_, "val"), per_task=trainer.evaluate(p_, "test"),
                       per_task_seconds=round(time.perf_counter() - t0, 1))
        say(f"{n}: {rows[n]}")

    tasks = [FusionTask(datasets[n], max(0.0, rows[n]["per_task_val"] - args.floor_margin)) for n in names]
    out = Path(args.out)
    result = fuse(trainer, tasks, out_dir=out, progress=say)
    report = write_report(result, out, chance={n: datasets[n].chance for n in names},
                          title="Knowledge fusion of the generated vision tasks (tiny model)")
    for n in names:
        a = result.adapter_of(n)
        rows[n].update(fused=a.test_accuracy[n], fused_adapter=a.name, floor=result.floors[n])

    lines = ["| task | labels | chance | base model, generated answer | base model + head (probe) | per-task adapter | fused adapter | floor (val) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n in names:
        r = rows[n]
        lines.append(f"| {n} | {len(datasets[n].labels)} | {r['chance']:.1%} | {r['base_generated']:.1%} | {r['base_probe']:.1%} | "
                     f"{r['per_task']:.1%} | {r['fused']:.1%} ({r['fused_adapter']}) | {r['floor']:.1%} |")
    lines.append("")
    lines.append(f"Adapters: {len(result.adapters)} from fusion ("
                 + "; ".join(f"{a.name}: {', '.join(a.tasks)}" for a in result.adapters)
                 + f") against {len(names)} with one per task.")
    table = "\n".join(lines)
    print(table)
    dev = device_name()
    summary = {"commit": git_commit(), "tasks": rows, "num_adapters": len(result.adapters), "one_per_task": len(names),
               "adapters": {a.name: a.tasks for a in result.adapters}, "config": vars(config), "sizes": sizes,
               "frames": args.frames, "floor_margin": args.floor_margin, "report": str(report),
               "seconds": round(time.perf_counter() - t_start, 1)}
    summary["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in summary["config"].items()}
    if not args.no_record:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"fusion-accuracy-{dev}.md").write_text(table + "\n")
        record_result("fusion-accuracy", dev, summary,
                      f"{len(names)} tasks -> {len(result.adapters)} adapters; mean test accuracy per-task "
                      f"{sum(r['per_task'] for r in rows.values()) / len(rows):.1%}, fused "
                      f"{sum(r['fused'] for r in rows.values()) / len(rows):.1%}, base probe "
                      f"{sum(r['base_probe'] for r in rows.values()) / len(rows):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
