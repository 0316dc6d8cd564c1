"""The fusion report: a markdown page and a PNG plot of per-task accuracy, and which task went where."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from vlora.fusion.fuse import FusionResult

REPORT_FILE = "fusion-report.md"
PLOT_FILE = "fusion-accuracy.png"
JSON_FILE = "fusion-result.json"


def result_dict(result: FusionResult) -> dict:
    return {
        "order": result.order,
        "floors": result.floors,
        "adapters": [{"name": a.name, "tasks": a.tasks, "path": str(a.path) if a.path else None,
                      "val_accuracy": a.val_accuracy, "test_accuracy": a.test_accuracy, "below_floor": a.below_floor}
                     for a in result.adapters],
        "steps": [{"task": s.task, "adapter": s.adapter, "accepted": s.accepted, "val_accuracy": s.val_accuracy,
                   "violations": s.violations, "seconds": round(s.seconds, 2),
                   "restored_bit_identical": s.restored_bit_identical} for s in result.steps],
        "added_val_accuracy": result.added_val_accuracy,
        "added_test_accuracy": result.added_test_accuracy,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(result.config).items()},
        "seconds": round(result.seconds, 1),
    }


def write_report(result: FusionResult, out_dir: Path, *, title: str = "Knowledge fusion report",
                 chance: Optional[dict[str, float]] = None) -> Path:
    """Write ``fusion-report.md``, ``fusion-accuracy.png`` and ``fusion-result.json`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / JSON_FILE).write_text(json.dumps(result_dict(result), indent=2) + "\n", encoding="utf-8")
    plotted = plot_accuracy(result, out_dir / PLOT_FILE)
    n_tasks = len(result.order)
    lines = [f"# {title}", "",
             f"{n_tasks} datasets fused into **{len(result.adapters)} adapter(s)** (one per task would be {n_tasks}), "
             f"in {result.seconds:.0f} s. Order: {', '.join(result.order)}. Training: mode {result.config.mode}, "
             f"r={result.config.r}, targets {', '.join(result.config.target_modules)}, {result.config.steps} steps per "
             f"dataset, batch {result.config.batch_size}, seed {result.config.seed}.", "",
             "Accuracy is on each dataset's test split; floors are checked on the validation split. "
             "*When added*: right after the adapter was trained on the task; *final*: in the adapter as written, "
             "after every later dataset fused into it.", "",
             "| task | adapter | floor | when added | final | met floor (val) |" + (" chance |" if chance else ""),
             "| --- | --- | --- | --- | --- | --- |" + (" --- |" if chance else "")]
    for name in result.order:
        a = result.adapter_of(name)
        met = a.val_accuracy[name] >= result.floors[name]
        row = (f"| {name} | {a.name} | {result.floors[name]:.0%} | {result.added_test_accuracy[name]:.1%} | "
               f"{a.test_accuracy[name]:.1%} | {'yes' if met else 'NO'} |")
        if chance:
            row += f" {chance.get(name, float('nan')):.1%} |"
        lines.append(row)
    lines += ["", "## Adapters", ""]
    for a in result.adapters:
        extra = f" (below floor even alone: {', '.join(a.below_floor)})" if a.below_floor else ""
        lines.append(f"- `{a.name}`: {', '.join(a.tasks)}{extra}" + (f" -> `{a.path}`" if a.path else ""))
    lines += ["", "## Steps", "", "| # | adapter | dataset | accepted | validation accuracy after training | rolled back bit-identically |",
              "| --- | --- | --- | --- | --- | --- |"]
    for i, s in enumerate(result.steps):
        accs = ", ".join(f"{k} {v:.1%}" + (" (below)" if k in s.violations else "") for k, v in s.val_accuracy.items())
        rb = "" if s.restored_bit_identical is None else ("yes" if s.restored_bit_identical else "NO")
        lines.append(f"| {i + 1} | {s.adapter} | {s.task} | {'yes' if s.accepted else 'no'} | {accs} | {rb} |")
    if plotted:
        lines += ["", f"![per-task accuracy]({PLOT_FILE})"]
    path = out_dir / REPORT_FILE
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def plot_accuracy(result: FusionResult, path: Path) -> bool:
    """Bars per task: accuracy when added and final, with the floor marked; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = result.order
    x = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(names) + 2), 3.8), dpi=110)
    added = [result.added_test_accuracy[n] for n in names]
    final = [result.adapter_of(n).test_accuracy[n] for n in names]
    ax.bar([i - 0.2 for i in x], added, width=0.38, label="when added", color="#9ecae1")
    colors = ["#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363", "#e7ba52"]
    index = {a.name: i for i, a in enumerate(result.adapters)}
    ax.bar([i + 0.2 for i in x], final, width=0.38, label="final",
           color=[colors[index[result.adapter_of(n).name] % len(colors)] for n in names])
    for i, n in enumerate(names):
        ax.hlines(result.floors[n], i - 0.42, i + 0.42, colors="black", linestyles="dashed", linewidth=1)
        ax.text(i + 0.2, final[i] + 0.015, result.adapter_of(n).name.rsplit("-", 1)[-1], ha="center", fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{len(names)} tasks -> {len(result.adapters)} adapter(s); dashed: floor; number: adapter", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
