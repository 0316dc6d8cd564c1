"""ATMM benchmark: adaptive ATMM against the best static configuration, torch grouped_mm, padded bmm,
a per-adapter loop, and the floor, all measured in one run on one GPU. Also the all-layer merge.

Every time is the median per call of CUDA-graph replays over rotated input sets (> 256 MB per
replay, so inputs come from HBM). The adaptive choice per shape comes from profiling every feasible
configuration (the tuner's search), written as a tiling table, loaded, and looked up through the
table like serving does. The static configuration is the single (shrink, split-K, expand) choice
with the least total time over all cases (the Punica approach: one tile for every shape).

    python -m benchmarks.atmm [--quick] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import device_name, git_commit, record_result

from vlora.atmm import AtmmKernels, atmm_reference
from vlora.atmm.tiling import write_table
from vlora.atmm.timing import copy_bandwidth_gbs, event_time_ms, graph_time_us, matmul_tflops
from vlora.atmm.tuner import feasible_configs, make_problem, profile_shape, table_entries

D = 4096
DTYPE = "bf16"


@dataclass
class Case:
    name: str
    tokens: int
    seg_ranks: list[int]  # one segment per adapter, equal lengths; adapter i in slot i


def cases(quick: bool) -> list[Case]:
    out = [Case("table1-T256-r32", 256, [32]), Case("table1-T8192-r128", 8192, [128])]
    for n in ((1, 8, 64) if quick else (1, 2, 4, 8, 16, 32, 64)):
        out.append(Case(f"decode-{n}req-r64", n, [64] * n))
    mixed = (16, 32, 64, 128)
    for T in ((1024, 8192) if quick else (256, 1024, 4096, 8192)):
        for k in ((2, 8) if quick else (2, 4, 8)):
            out.append(Case(f"prefill-T{T}-{k}ad", T, [mixed[i % 4] for i in range(k)]))
    return out


def floor_us(c: Case, bw_gbs: float, tflops: float) -> dict:
    T, S = c.tokens, len(c.seg_ranks)
    nbytes = 2 * (T * D + 2 * T * D + sum(r * 2 * D for r in c.seg_ranks))
    lengths = [T // S + (1 if i < T % S else 0) for i in range(S)]
    flops = sum(2 * n * r * 2 * D for n, r in zip(lengths, c.seg_ranks))
    mem, comp = nbytes / bw_gbs / 1e3, flops / tflops / 1e6
    return {"floor_us": max(mem, comp), "bytes": nbytes, "flops": flops, "bound": "memory" if mem >= comp else "compute"}


def baselines(p, c: Case) -> dict:
    """Callables per input set for the PyTorch baselines, and a correctness check of each."""
    T, S = c.tokens, len(c.seg_ranks)
    m = p.mapping
    lengths = [m.seg_indptr_host[i + 1] - m.seg_indptr_host[i] for i in range(S)]
    offs = torch.tensor(m.seg_indptr_host[1:], dtype=torch.int32, device="cuda")
    row_scale = torch.ones(T, 1, device="cuda", dtype=torch.bfloat16)
    lmax = max(lengths)
    dst = torch.cat([torch.arange(n, device="cuda") + i * lmax for i, n in enumerate(lengths)])
    scale_col = torch.ones(S, 1, 1, device="cuda", dtype=torch.bfloat16)

    def loop(s):
        y, x, a, b, _ = s
        return lambda: atmm_reference(y, x, a, b, p.ranks, p.scales, m)

    def padded_bmm(s):
        y, x, a, b, _ = s

        def f():
            x_pad = x.new_zeros(S * lmax, D)
            x_pad[dst] = x
            v = torch.bmm(x_pad.view(S, lmax, D), a.transpose(1, 2)) * scale_col
            out = torch.bmm(v, b.transpose(1, 2)).view(S * lmax, D)
            y.add_(out.index_select(0, dst))
        return f

    def grouped_mm(s):
        y, x, a, b, _ = s

        def f():
            v = torch._grouped_mm(x, a.transpose(1, 2), offs=offs) * row_scale
            y.add_(torch._grouped_mm(v, b.transpose(1, 2), offs=offs))
        return f

    return {"loop": loop, "padded_bmm": padded_bmm, "grouped_mm": grouped_mm}


def rel_err_of(fn_for_set, p) -> float:
    s = p.sets[0]
    y, x, a, b, ws = s
    y.normal_()  # the timed replays have grown y until bf16 rounding swallows a delta: start afresh
    y0 = y.clone()
    ref = y0.float() + 0
    for i, slot in enumerate(p.mapping.seg_slot_host):
        lo, hi = p.mapping.seg_indptr_host[i], p.mapping.seg_indptr_host[i + 1]
        r = p.ranks[slot]
        ref[lo:hi] += (x[lo:hi].float() @ a[slot, :r].float().t()) @ b[slot, :, :r].float().t() * p.scales[slot]
    fn_for_set(s)()
    torch.cuda.synchronize()
    err = ((y.float() - ref).norm() / (ref - y0.float()).norm()).item()  # relative to the LoRA delta
    y.copy_(y0)
    return err


def bench_merge(bw_gbs: float) -> dict:
    L, r = 32 * 4, 64
    w = torch.randn(L, D, D, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(L, r, D, device="cuda", dtype=torch.bfloat16) / 64
    b = torch.randn(L, D, r, device="cuda", dtype=torch.bfloat16) / 8
    from vlora.atmm import merge_lora

    def per_matrix():
        for l in range(L):
            w[l].addmm_(b[l], a[l], alpha=0.5)

    times = {}
    stream = [("stream", n) for n in kernels_ext().merge_configs()]
    for backend, config in [("torch", None)] + stream:
        key = config or backend
        try:
            times[key] = event_time_ms(lambda: merge_lora(w, a, b, 0.5, +1, backend=backend, config=config), warmup=2, reps=7)
        except (ValueError, RuntimeError) as e:
            times[key] = None
            print(f"merge {key}: {e}", flush=True)
    loop_ms = event_time_ms(per_matrix, warmup=2, reps=7)
    floor_ms = 2 * w.numel() * 2 / bw_gbs / 1e6
    best_key = min((k for k, t in times.items() if t), key=times.get)
    best = times[best_key]
    # Correctness of the fastest merge against fp32, on fresh data (the timed runs grew W).
    w.normal_()
    w0 = w[:4].float()
    merge_lora(w, a, b, 0.5, +1, backend="torch" if best_key == "torch" else "stream",
               config=None if best_key == "torch" else best_key)
    ref = w0 + 0.5 * torch.bmm(b[:4].float(), a[:4].float())
    # Relative to the rounding bf16 storage of W itself costs (~1 when exact up to that rounding).
    err = ((w[:4].float() - ref).norm() / (ref.to(w.dtype).float() - ref).norm()).item()
    return {"layers": 32, "matrices": L, "rank": r, "width": D, "floor_ms": floor_ms,
            "stacked_baddbmm_ms": times["torch"], "stream_ms": {k: v for k, v in times.items() if k != "torch"},
            "per_matrix_addmm_ms": loop_ms,
            "best": best_key, "best_ms": best, "best_err_over_bf16_rounding": err, "ratio_to_floor": best / floor_ms}


def kernels_ext():
    from vlora.atmm.dispatch import default_kernels

    return default_kernels().ext


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--out-dir", type=Path, default=None, help="also copy the results here")
    ap.add_argument("--table-out", type=Path, default=None, help="write the tuned tiling table here")
    ap.add_argument("--commit", default=None, help="commit measured (where the checkout has no .git)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    kernels = AtmmKernels(load_table=False)
    assert kernels.available, kernels.unavailable_reason
    log = lambda s: print(s, flush=True)  # noqa: E731
    bw, tf = copy_bandwidth_gbs(), matmul_tflops()
    log(f"copy bandwidth {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s")
    smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    shrink_cfgs = feasible_configs(kernels, "shrink", smem)
    expand_cfgs = feasible_configs(kernels, "expand", smem)
    t0 = time.monotonic()
    results, problems, profiles = [], [], []
    for c in cases(args.quick):
        p = make_problem(kernels, c.tokens, D, D, c.seg_ranks, DTYPE)
        prof = profile_shape(kernels, p, shrink_cfgs, expand_cfgs)
        problems.append(p)
        profiles.append(prof)
        bs, be = prof["pair"]
        log(f"profiled {c.name}: shrink {bs} {prof['shrink_us']:.1f} us, expand {be}, whole call {prof['pair_us']:.1f} us "
            f"({time.monotonic() - t0:.0f} s)")
    # The best static choices: least total time over every case, per direction; one among the CUTLASS
    # tilings (Punica's approach: one tile for every shape), one among every compiled config.
    all_cases = cases(args.quick)
    # (Only options every case could run compete: the gemv shrink is not profiled on long segments.)
    common_shrink = set.intersection(*(set(pr["shrink"]) for pr in profiles))
    common_expand = set.intersection(*(set(pr["expand"]) for pr in profiles))
    kind = {c["name"]: c["kind"] for c in kernels.ext.configs()}

    def best_static(options, direction, kinds=None):
        pool = [o for o in options if kinds is None or kind[o if isinstance(o, str) else o[0]] in kinds]
        return min(pool, key=lambda k: sum(pr[direction][k] for pr in profiles))

    static_shrink = best_static(common_shrink, "shrink", {"cutlass"})
    static_expand = best_static(common_expand, "expand", {"cutlass"})
    any_shrink = best_static(common_shrink, "shrink")
    any_expand = best_static(common_expand, "expand")
    # The adaptive table, through the real table path.
    entries = []
    for c, pr in zip(all_cases, profiles):
        entries += table_entries(pr, dtype=DTYPE, tokens=c.tokens, width=D, rank=max(c.seg_ranks), segments=len(c.seg_ranks))
    table_file = args.table_out or Path("/tmp/atmm-bench-table.json")
    write_table(table_file, {"gpu": torch.cuda.get_device_name(), "cuda_archs": kernels.ext.CUDA_ARCHS,
                             "source": "benchmarks/atmm.py profile of its own shapes"}, entries)
    kernels.load_table(table_file)

    for c, p, pr in zip(all_cases, problems, profiles):
        fl = floor_us(c, bw, tf)
        row = {"case": c.name, "tokens": c.tokens, "ranks": c.seg_ranks, **fl}
        fns = {
            "atmm": lambda s: (lambda: kernels.run(s[0], s[1], s[2], s[3], p.ranks, p.scales, p.mapping, workspace=s[4])),
            "atmm_no_pdl": lambda s: (lambda: kernels.run(s[0], s[1], s[2], s[3], p.ranks, p.scales, p.mapping,
                                                          workspace=s[4], pdl=False)),
            "static": lambda s: (lambda: kernels.run(s[0], s[1], s[2], s[3], p.ranks, p.scales, p.mapping,
                                                     shrink=static_shrink, expand=static_expand, workspace=s[4])),
            "static_any": lambda s: (lambda: kernels.run(s[0], s[1], s[2], s[3], p.ranks, p.scales, p.mapping,
                                                         shrink=any_shrink, expand=any_expand, workspace=s[4])),
        }
        fns.update(baselines(p, c))
        times, errors = {}, {}
        for name, f in fns.items():
            try:
                errors[name] = rel_err_of(f, p)
                times[name] = graph_time_us([f(s) for s in p.sets])
            except Exception as e:  # a baseline this torch cannot run is reported, not hidden
                times[name] = None
                errors[name] = f"{type(e).__name__}: {e}"[:200]
        row["us"] = times
        row["rel_err_vs_fp32"] = errors
        row["atmm_choice"] = {"shrink": list(pr["pair"][0]), "expand": pr["pair"][1]}
        # The shrink alone; the whole call with the best shrink and the best expand (expands are
        # profiled as whole calls: on Hopper the expand overlaps its start with the shrink).
        row["phase_us"] = {"shrink_best": min(pr["shrink"].values()), "two_launch_best": min(pr["expand"].values()),
                           "call_best": pr["pair_us"]}
        row["profile_us"] = {"shrink": {f"{k[0]}/{k[1]}": round(v, 2) for k, v in pr["shrink"].items()},
                             "expand_whole_call": {k: round(v, 2) for k, v in pr["expand"].items()}}
        base = [t for k, t in times.items() if k in ("loop", "padded_bmm", "grouped_mm") and t]
        row["best_baseline_us"] = min(base) if base else None
        a = times.get("atmm")
        row["atmm_over_floor"] = a / fl["floor_us"] if a else None
        row["speedup_vs_best_baseline"] = row["best_baseline_us"] / a if a and base else None
        row["atmm_over_static"] = a / times["static"] if a and times.get("static") else None
        row["atmm_over_static_any"] = a / times["static_any"] if a and times.get("static_any") else None
        results.append(row)
        ts = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}=n/a" for k, v in times.items())
        log(f"{c.name:24s} floor={fl['floor_us']:.1f} {ts}")
    merge = bench_merge(bw)
    log(f"merge: stream {merge['stream_ms']} ms, baddbmm {merge['stacked_baddbmm_ms']:.2f} ms, "
        f"per-matrix {merge['per_matrix_addmm_ms']:.2f} ms, floor {merge['floor_ms']:.2f} ms")
    out = {"device": torch.cuda.get_device_name(), "commit": args.commit or git_commit(), "torch": torch.__version__,
           "copy_bandwidth_gbs": bw, "bf16_tflops": tf, "dtype": DTYPE, "width": D,
           "static_choice": {"shrink": list(static_shrink), "expand": static_expand},
           "static_any_choice": {"shrink": list(any_shrink), "expand": any_expand},
           "cases": results, "merge": merge, "table_entries": entries,
           "method": "median per call of CUDA-graph replays over rotated inputs (>256 MB per replay)"}
    pick = {r["case"]: r for r in results}
    parts = []
    for name in ("table1-T256-r32", "table1-T8192-r128", "decode-64req-r64", "prefill-T8192-8ad"):
        r = pick.get(name)
        if r and r["us"].get("atmm"):
            parts.append(f"{name}: atmm {r['us']['atmm']:.1f} us (floor {r['floor_us']:.1f}, best baseline "
                         f"{r['best_baseline_us']:.1f}, static {r['us']['static']:.1f})")
    parts.append(f"merge 128x4096^2 r64: {merge['best_ms']:.2f} ms {merge['best']} (floor {merge['floor_ms']:.2f}, "
                 f"baddbmm {merge['stacked_baddbmm_ms']:.2f})")
    path = record_result("atmm", device_name(), out, "; ".join(parts))
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / path.name).write_text(path.read_text())
        md = (Path(__file__).resolve().parent / "RESULTS.md").read_text().splitlines()
        (args.out_dir / "RESULTS-line.md").write_text(md[-1] + "\n")
    print(json.dumps({r["case"]: {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r["us"].items()} for r in results}, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
