"""Quick look at the one-launch ATMM calls (fused fc_* and flag fl_*) on the benchmark's cases, beside
what the committed tiling table picks, without the full profile of benchmarks/atmm.py (under a minute
on an H100 instead of five). Same timing method: CUDA-graph replay over > 256 MB of rotated inputs.
A developer's diagnostic: it prints (and writes --json), it records nothing in benchmarks/RESULTS.md.

    python benchmarks/atmm_calls.py [--only REGEX] [--prefix fl_] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from atmm import DTYPE, D, cases  # noqa: E402

from vlora.atmm import AtmmKernels  # noqa: E402
from vlora.atmm.timing import graph_time_us  # noqa: E402
from vlora.atmm.tuner import call_splits, make_problem, serves_rank  # noqa: E402


def bandwidth_at_call_sizes() -> dict:
    """GB/s of a copy (bytes read + written) and of a read (a sum) over 32/64/128 MB tensors, graph-replayed
    over rotated buffers like the kernels: what HBM gives at the sizes of one call, beside the 2 GB copy
    that sets the floor."""
    from vlora.atmm.timing import copy_bandwidth_gbs, sets_needed
    res = {"copy_2GB_eager": round(copy_bandwidth_gbs(), 1)}
    for mb in (32, 64, 128):
        n = mb << 19  # bf16 elements
        k = sets_needed(2 * n * 2)
        src = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
        dst = [torch.empty_like(s) for s in src]
        us = graph_time_us([(lambda s=s, d=d: d.copy_(s)) for s, d in zip(src, dst)])
        res[f"copy_{mb}MB"] = round(2 * n * 2 / us / 1e3, 1)
        us = graph_time_us([(lambda s=s: torch.sum(s, dtype=torch.float32)) for s in src])
        res[f"read_{mb}MB"] = round(n * 2 / us / 1e3, 1)
        print(f"{mb} MB: copy {res[f'copy_{mb}MB']} GB/s, read {res[f'read_{mb}MB']} GB/s", flush=True)
        del src, dst
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=".", help="regex on the case names")
    ap.add_argument("--prefix", default="fl_", help="one-launch configs whose names start with this")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--bandwidth", action="store_true",
                    help="also time plain copies and reads of the sizes a T=4096/8192 call moves, the same way")
    args = ap.parse_args()
    table = AtmmKernels()  # the committed table for this GPU
    assert table.available, table.unavailable_reason
    calls = [c for c in table.ext.configs() if c["kind"] == "call" and c["name"].startswith(args.prefix)]
    out = {}
    for c in cases(False):
        if not re.search(args.only, c.name):
            continue
        p = make_problem(table, c.tokens, D, D, c.seg_ranks, DTYPE)
        run = lambda s, **kw: (lambda: table.run(s[0], s[1], s[2], s[3], p.ranks, p.scales, p.mapping, workspace=s[4], **kw))  # noqa: E731
        row = {"table": graph_time_us([run(s) for s in p.sets])}
        rank = -(-max(c.seg_ranks) // 8) * 8
        for cfg in calls:
            if not serves_rank(cfg, rank):
                continue
            for k in call_splits(cfg):
                try:
                    row[f"{cfg['name']}/{k}"] = graph_time_us([run(s, shrink=(cfg["name"], k), expand=cfg["name"]) for s in p.sets])
                except RuntimeError as e:
                    row[f"{cfg['name']}/{k}"] = None
                    print(f"  {cfg['name']}/{k}: {e}", flush=True)
        best = min(((k, v) for k, v in row.items() if k != "table" and v), key=lambda kv: kv[1], default=(None, None))
        print(f"{c.name:24s} table {row['table']:7.1f} us   best {best[0]} {best[1] or float('nan'):7.1f} us", flush=True)
        out[c.name] = {k: (round(v, 2) if v else v) for k, v in row.items()}
        del p
        torch.cuda.empty_cache()
    if args.bandwidth:
        out["bandwidth"] = bandwidth_at_call_sizes()
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
