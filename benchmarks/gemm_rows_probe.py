"""cuBLAS time of the 7B decoder layer's four projections (q/k/v, o, gate/up, down; bf16 F.linear) against
the number of rows, every 8 rows: the data behind the prefill graphs' token buckets
(``vlora.engine.graphs.prefill_buckets``). cuBLAS picks its kernel per shape by heuristics, and the time per
row jumps between neighbouring row counts. Each point is CUDA-graph replays over two weight and input
copies (each weight set larger than half the L2 cache).

    python benchmarks/gemm_rows_probe.py [--rows 512:1024:8] [--no-record]

Writes results/gemm-rows-probe-<device>.json (``--out``) and a RESULTS.md line unless ``--no-record``: the
mean time per row at 32k - 8 rows against 32k rows.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, device_name, git_commit, write_result  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512:1024:8", help="start:stop:step (inclusive)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from vlora.atmm.timing import graph_time_us

    a, b, step = (int(x) for x in args.rows.split(":"))
    dev = torch.device("cuda")
    W = {k: [torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(2)] for k, (n, kk) in SHAPES.items()}
    print("rows " + " ".join(f"{k:>8s}" for k in SHAPES) + "    layer us  us/row", flush=True)
    points = []
    for M in range(a, b + 1, step):
        ts = {}
        for k, ws in W.items():
            xs = [torch.randn(M, ws[0].shape[1], device=dev, dtype=torch.bfloat16) for _ in range(2)]
            ts[k] = graph_time_us([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)], batches=5)
        total = sum(ts.values())
        points.append({"rows": M, "us": ts, "layer_us": total, "us_per_row": total / M})
        print(f"{M:5d} " + " ".join(f"{t:8.1f}" for t in ts.values()) + f"  {total:9.1f}  {total / M:.4f}", flush=True)
    off = [p["us_per_row"] for p in points if p["rows"] % 32 == 24]
    mult = [p["us_per_row"] for p in points if p["rows"] % 32 == 0]
    summary = {}
    if off and mult:
        summary = {"us_per_row_32k_minus_8": statistics.mean(off), "us_per_row_32k": statistics.mean(mult)}
        summary["saving"] = 1 - summary["us_per_row_32k_minus_8"] / summary["us_per_row_32k"]
        print(f"mean us per row: 32k - 8 rows {summary['us_per_row_32k_minus_8']:.4f}, 32k rows "
              f"{summary['us_per_row_32k']:.4f} ({100 * summary['saving']:.1f}% less at 32k - 8)", flush=True)
    result = {"device": device_name(), "commit": git_commit(), "rows": args.rows, "points": points, "summary": summary}
    line = (f"7B projections per layer, rows {args.rows}: " + (f"{summary['us_per_row_32k_minus_8']:.4f} us/row at 32k - 8 "
            f"rows vs {summary['us_per_row_32k']:.4f} at 32k ({100 * summary['saving']:.1f}% less)" if summary else "no summary"))
    write_result("gemm-rows-probe", args.out, result, line, not args.no_record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
