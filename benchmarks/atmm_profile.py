"""Run one ATMM shape with forced configurations a few times, for a profiler (ncu) to look at.

    ncu --clock-control none -k regex:stream_ --section SpeedOfLight --section WarpStateStats \\
        python benchmarks/atmm_profile.py --tokens 8192 --ranks 128 --shrink t64x64_k64_s5:1 --expand ye_m64n64_r128_w2x4

Also prints the median graph-replayed time of the call, so a run without a profiler is a quick probe.
"""
from __future__ import annotations

import argparse
import sys

import torch

from vlora.atmm import AtmmKernels
from vlora.atmm.timing import graph_time_us
from vlora.atmm.tuner import make_problem


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--ranks", required=True, help="one rank per segment, comma-separated")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--shrink", required=True, help="config:split_k")
    ap.add_argument("--expand", required=True)
    ap.add_argument("--calls", type=int, default=4, help="eager calls (what a profiler sees)")
    args = ap.parse_args()
    kernels = AtmmKernels(load_table=False)
    if not kernels.available:
        print(kernels.unavailable_reason, file=sys.stderr)
        return 1
    name, split = args.shrink.split(":")
    shrink = (name, int(split))
    p = make_problem(kernels, args.tokens, args.width, args.width, [int(r) for r in args.ranks.split(",")], "bf16")
    for i in range(args.calls):
        y, x, a, b, ws = p.sets[i % len(p.sets)]
        kernels.run(y, x, a, b, p.ranks, p.scales, p.mapping, shrink=shrink, expand=args.expand, workspace=ws)
    torch.cuda.synchronize()
    us = graph_time_us([lambda s=s: kernels.run(s[0], s[1], s[2], s[3], p.ranks, p.scales, p.mapping, shrink=shrink,
                                                 expand=args.expand, workspace=s[4]) for s in p.sets])
    print(f"T={args.tokens} ranks={args.ranks} {args.shrink} + {args.expand}: {us:.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
