"""The results of the orchestrator benchmark (``benchmarks/orchestrator.py``): merging the cells of several runs,
vlora's cut in average token latency against each baseline per skewness (the verdicts, with what the measured costs
say about a missed target), the tables, the RESULTS.md section and line. ``python -m benchmarks.orchestrator --report
FILE`` prints and records them for a result written elsewhere (a device run).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import record_result

POLICIES = ("vlora", "merge-only", "unmerge-only", "dlora")
BASELINES = ("merge-only", "unmerge-only", "dlora")
TARGET_CUT = 0.20  # the target: vlora's average token latency at least 20% below every baseline
# Settings that must agree for cells of two runs to be merged into one result.
MERGE_KEYS = ("model", "dtype", "rank", "prompt_tokens", "output_tokens", "max_batch_size", "slots", "duration_s",
              "drain_s", "theta_s", "distinct_weights", "target_modules")


def cell_key(c: dict[str, Any]) -> tuple:
    return (c["policy"], round(c["skewness"], 4), c["num_adapters"], round(c["rate"], 4))


def merge_results(old: dict[str, Any], new: dict[str, Any], force: bool) -> dict[str, Any]:
    diff = {k: (old["settings"].get(k), new["settings"].get(k)) for k in MERGE_KEYS
            if old["settings"].get(k) != new["settings"].get(k)}
    if diff and not force:
        raise SystemExit(f"--merge-into: settings differ from the file's, cells would not be comparable: {diff} "
                         "(--force-merge to merge anyway)")
    cells = {cell_key(c): c for c in old.get("cells", [])}
    cells.update({cell_key(c): c for c in new["cells"]})
    out = dict(new)
    out["cells"] = sorted(cells.values(),
                          key=lambda c: (c["skewness"], c["num_adapters"], c["rate"], POLICIES.index(c["policy"])))
    out["switch"] = new.get("switch") or old.get("switch")
    out["calibration"] = new.get("calibration") or old.get("calibration")
    if new.get("calibration") and old.get("calibration") and new["calibration"] is not old["calibration"]:
        out["calibration"] = {**new["calibration"], "rates": {**old["calibration"].get("rates", {}),
                                                              **new["calibration"].get("rates", {})}}
    out["runs"] = old.get("runs", []) + new.get("runs", [])
    out["compute_paths"] = {**old.get("compute_paths", {}), **new.get("compute_paths", {})}
    return out


def verdicts(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per skewness: vlora's cut in average token latency against each baseline at every (adapters, rate)."""
    by = {cell_key(c): c for c in cells}
    out: dict[str, Any] = {}
    for skew in sorted({round(c["skewness"], 4) for c in cells}):
        comps, missing, hints = [], [], []
        for key, v in sorted(by.items()):
            if key[0] != "vlora" or key[1] != skew:
                continue
            for b in BASELINES:
                c = by.get((b,) + key[1:])
                if c is None:
                    missing.append(f"{b} n={key[2]} rate={key[3]:g}")
                    continue
                cut = 1.0 - v["avg_token_latency_ms"] / c["avg_token_latency_ms"]
                comps.append({"baseline": b, "num_adapters": key[2], "rate": key[3],
                              "vlora_ms": v["avg_token_latency_ms"], "baseline_ms": c["avg_token_latency_ms"],
                              "cut": cut, "meets_target": cut >= TARGET_CUT,
                              "censored": {"vlora": v["censored"], b: c["censored"]}})
                if cut < TARGET_CUT:
                    hints.append(miss_hint(v, c, b, cut))
        if not comps and not missing:
            continue
        out[f"{skew:g}"] = {"meets_target": bool(comps) and not missing and all(x["meets_target"] for x in comps),
                            "min_cut": min((x["cut"] for x in comps), default=None),
                            "min_cut_by_baseline": {b: min((x["cut"] for x in comps if x["baseline"] == b), default=None)
                                                    for b in BASELINES},
                            "missing": missing, "comparisons": comps, "why_not": hints}
    return out


def miss_hint(v: dict[str, Any], c: dict[str, Any], baseline: str, cut: float) -> str:
    """What the measured cells say about a missed target (a reading, not a proof)."""
    share = v.get("mode_share", {})
    parts = [f"n={v['num_adapters']} rate {v['rate']:.2f}/s: vlora {v['avg_token_latency_ms']:.1f} ms/tok vs "
             f"{baseline} {c['avg_token_latency_ms']:.1f} ({100 * cut:+.0f}%)"]
    unmerged = share.get("unmerge", 0.0)
    if baseline == "unmerge-only" and unmerged > 0.7:
        parts.append(f"vlora ran {100 * unmerged:.0f}% of its step time unmerged, the same ATMM path as unmerge-only "
                     f"(the cost model found no merge that repays its switches)")
    costs = v.get("costs")
    if costs:
        at = costs["at_mean_batch_ms"]
        base = at["base"]
        lora = next((x for k, x in at.items() if k.startswith("unmerged_") and not k.endswith("_1_adapter")), base)
        mix = next((x for k, x in at.items() if k.startswith("mixture_")), base)
        pair = at["merge_plus_unmerge"]
        saving = lora - base
        parts.append(f"costs at batch {costs['mean_batch']:.1f}: base {base:.2f} ms, unmerged {lora:.2f} (merging saves at "
                     f"most {saving:.2f} ms a step, {100 * saving / max(lora, 1e-9):.0f}%), mixture {mix:.2f}, a merge + "
                     f"unmerge {pair:.2f} ms (repaid after {pair / max(saving, 1e-9):.1f} fully merged steps)"
                     + "; measured steps " + ", ".join(f"{m} {x:.2f}" for m, x in costs["measured_step_ms"].items()) + " ms")
    if v["switches"] and v["switch_s"] > 0.05 * max(sum(v.get("mode_seconds", {}).values()), 1e-9):
        parts.append(f"vlora spent {v['switch_s']:.2f} s in {v['switches']} switches")
    if share.get("mixture", 0.0) > 0.2:
        parts.append(f"mixture (deLoRA) took {100 * share['mixture']:.0f}% of vlora's step time")
    if v["censored"]:
        parts.append(f"vlora left {v['censored']} requests unfinished at the drain limit (overloaded)")
    if c["censored"]:
        parts.append(f"{baseline}'s latency is a lower bound ({c['censored']} censored)")
    if v["adapter_swaps"] > v["requests"] // 4:
        parts.append(f"{v['adapter_swaps']} adapter swaps into device slots for {v['requests']} requests "
                     f"({baseline}: {c['adapter_swaps']})")
    return "; ".join(parts)


def fmt_cut(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}%"


def cost_model_text(cm: dict[str, Any], one_adapter: bool = False) -> str:
    def ms(xs: list[float]) -> str:
        return "/".join(f"{x:.2f}" for x in xs)

    return (f"cost model ({cm['source']}): decode base {ms(cm['base_ms'])} ms, unmerged (one adapter per row) {ms(cm['unmerged_ms'])}"
            + (f" ms, one adapter for all rows {ms(cm['unmerged_1_adapter_ms'])}" if one_adapter else "")
            + f" ms at batch {'/'.join(map(str, cm['batch']))}; deLoRA branch +{cm['mixture_extra_ms_at_max_batch']:.2f} ms; "
            + "switch " + ", ".join(f"{k} {v:.2f} ms" for k, v in cm["switch_ms"].items()))


def print_report(result: dict[str, Any]) -> None:
    cells = result["cells"]
    sw = result.get("switch")
    if sw:
        print(f"\nmode switch, {sw['layers']} layers x {'/'.join(sw['modules'])}, rank {sw['rank']} (median of {sw['repeats']}):")
        for k in ("merge", "swap", "unmerge"):
            print(f"  {k:8s} swift {sw['swift'][k]['median_ms']:8.2f} ms   per-layer addmm {sw['per-layer'][k]['median_ms']:8.2f} ms"
                  f"   ({sw['speedup'][k]:.2f}x)")
    cm = result.get("cost_model")
    if cm:
        print(f"\n{cost_model_text(cm, one_adapter=True)}")
    policies = [p for p in POLICIES if any(c["policy"] == p for c in cells)]
    by = {cell_key(c): c for c in cells}
    points = sorted({k[1:] for k in by})
    print("\naverage token latency, ms/token (throughput tok/s) [censored]; req: requests per cell (arrival window s):")
    print(f"{'skew':>5} {'n':>4} {'rate':>7} {'req':>9} " + " ".join(f"{p:>22}" for p in policies))
    for key in points:
        row = []
        for p in policies:
            c = by.get((p,) + key)
            if c is None:
                row.append("-")
                continue
            censored = f"[{c['censored']}]" if c["censored"] else "   "
            row.append(f"{c['avg_token_latency_ms']:9.1f} ({c['throughput_tok_s']:6.0f}){censored}")
        print(f"{key[0]:5g} {key[1]:4d} {key[2]:7.2f} {point_requests(by, key, policies):>9} " + " ".join(f"{x:>22}" for x in row))
    print("\np99 token latency (each request's latency / its output tokens), ms/token; end-to-end p99, s:")
    for key in points:
        row = [f"{by[(p,) + key].get('token_latency_p99_ms', float('nan')):9.1f} ({by[(p,) + key]['e2e_p99_s']:5.2f} s)"
               if (p,) + key in by else "-" for p in policies]
        print(f"{key[0]:5g} {key[1]:4d} {key[2]:7.2f} {'':>9} " + " ".join(f"{x:>22}" for x in row))
    print(f"\ntarget: vlora's average token latency >= {100 * TARGET_CUT:.0f}% below every baseline at every skewness")
    for skew, v in result["verdicts"].items():
        mins = ", ".join(f"{b} {fmt_cut(x)}" for b, x in v["min_cut_by_baseline"].items())
        state = "MET" if v["meets_target"] else "NOT MET"
        print(f"  skewness {skew}: {state}; smallest cut vs {mins}" + (f"; missing {v['missing']}" if v["missing"] else ""))
        for h in v["why_not"]:
            print(f"      {h}")


def point_requests(by: dict, key: tuple, policies: list[str], window: bool = True) -> str:
    """Requests of a (skewness, adapters, rate) point (every policy gets the same stream) and its arrival window."""
    c = next((by[(p,) + key] for p in policies if (p,) + key in by), None)
    if c is None:
        return "-"
    seconds = c.get("arrival_window_s") if window else None
    return f"{c['requests']}" + (f" ({seconds:.3g})" if seconds else "")


def markdown_section(result: dict[str, Any]) -> str:
    """The run as a RESULTS.md section: settings, one table row per (skewness, adapters, rate) with each policy's
    average token latency (p99 of the requests' own) and vlora's cut against each baseline, the costs, the verdicts."""
    cells, st = result["cells"], result["settings"]
    by = {cell_key(c): c for c in cells}
    policies = [p for p in POLICIES if any(c["policy"] == p for c in cells)]
    verdicts_ = result.get("verdicts") or verdicts(cells)
    met = bool(verdicts_) and all(v["meets_target"] for v in verdicts_.values())
    runs = result.get("runs", [])
    cal = result.get("calibration") or {}
    unm = cal.get("unmerged", {})
    rates = sorted({round(c["rate"], 3) for c in cells})
    reqs = [c["requests"] for c in cells]
    commits = ", ".join(sorted({str(r.get("commit")) for r in runs})) or str(result.get("commit"))
    walls = ", ".join("%.0f s" % r.get("wall_s", 0.0) for r in runs)
    lines = [f"## Orchestrator policies on {result['device']} (issue 21): target {'met' if met else 'NOT met'}", ""]
    lines.append(
        f"`python -m benchmarks.orchestrator` ({len(runs)} run(s), commit {commits}, {walls} wall): "
        f"{Path(st['model']).name}, {st['dtype']}, rank-{st['rank']} "
        f"adapters on {'/'.join(st['target_modules'])} ({st['distinct_weights']} weight sets), MaxBS {st['max_batch_size']}, "
        f"{st['slots']} slots, {st.get('prompt_tokens_actual', st['prompt_tokens'])}-token prompts and {st['output_tokens']} output "
        f"tokens, open-loop Poisson at {', '.join(f'{r:g}' for r in rates)} req/s"
        + (f" (the measured unmerged capacity x load: batch {cal.get('batch')} decode step {unm.get('decode_step_ms', 0):.1f} ms "
           f"unmerged, {cal.get('base', {}).get('decode_step_ms', 0):.1f} ms base)" if unm else "")
        + f"; {st['duration_s']:.3g} s of arrivals per cell ({min(reqs)}-{max(reqs)} requests), up to {st['drain_s']:g} s of drain "
        "(requests unfinished then are censored: their latency is a lower bound).")
    lines += ["", "Average token latency, ms/token (p99 of each request's latency per token) [censored requests]; "
              "cut: vlora's average below the baseline's (target >= 20%):", "",
              "| skewness | adapters | requests | " + " | ".join(policies) + " | cut vs " + " / ".join(b for b in BASELINES if b in policies) + " |",
              "| --- | --- | --- | " + " | ".join("---" for _ in policies) + " | --- |"]
    for key in sorted({k[1:] for k in by}):
        row = []
        for p in policies:
            c = by.get((p,) + key)
            row.append("-" if c is None else f"{c['avg_token_latency_ms']:.1f} ({c.get('token_latency_p99_ms', float('nan')):.1f})"
                       + (f" [{c['censored']}]" if c["censored"] else ""))
        v = by.get(("vlora",) + key)
        cuts = []
        for b in BASELINES:
            if b not in policies:
                continue
            c = by.get((b,) + key)
            cuts.append("-" if v is None or c is None else fmt_cut(1.0 - v["avg_token_latency_ms"] / c["avg_token_latency_ms"]))
        rate = f" @ {key[2]:g}/s" if len(rates) > 1 else ""
        lines.append(f"| {key[0]:g} | {key[1]}{rate} | {point_requests(by, key, policies, window=False)} | " + " | ".join(row)
                     + " | " + " / ".join(cuts) + " |")
    cm = result.get("cost_model")
    if cm:
        lines += ["", "C" + cost_model_text(cm)[1:] + "."]
    sw = result.get("switch")
    if sw:
        lines += ["", "Mode switch (median): " + ", ".join(
            f"{k} swift {sw['swift'][k]['median_ms']:.2f} ms vs per-layer addmm {sw['per-layer'][k]['median_ms']:.2f} ms"
            for k in ("merge", "swap", "unmerge")) + "."]
    lines += ["", "Verdicts:"]
    for skew, v in verdicts_.items():
        mins = ", ".join(f"{b} {fmt_cut(x)}" for b, x in v["min_cut_by_baseline"].items() if b in policies)
        lines.append(f"- skewness {skew}: {'met' if v['meets_target'] else 'NOT met'}; smallest cut vs {mins}"
                     + (f"; missing {', '.join(v['missing'])}" if v["missing"] else ""))
        lines += [f"  - {h}" for h in v["why_not"]]
    return "\n".join(lines) + "\n"


def summary_line(result: dict[str, Any]) -> str:
    st = result["settings"]
    counts = ",".join(str(n) for n in sorted({c["num_adapters"] for c in result["cells"]}))
    parts = [f"{Path(st['model']).name}, rank {st['rank']}, {st['prompt_tokens']}+{st['output_tokens']} tok, "
             f"MaxBS {st['max_batch_size']}, {st['slots']} slots, n={counts}"]
    by = {cell_key(c): c for c in result["cells"]}
    for skew, v in result["verdicts"].items():
        vl = [c["avg_token_latency_ms"] for k, c in by.items() if k[0] == "vlora" and f"{k[1]:g}" == skew]
        best = " / ".join(f"{b} {fmt_cut(x)}" for b, x in v["min_cut_by_baseline"].items() if x is not None)
        parts.append(f"s{skew}: vlora {min(vl):.1f}-{max(vl):.1f} ms/tok, worst cut vs {best} "
                     f"({'target met' if v['meets_target'] else 'target missed'})")
    sw = result.get("switch")
    if sw:
        parts.append(f"switch swift {sw['swift']['merge']['median_ms']:.2f} ms merge / {sw['swift']['swap']['median_ms']:.2f} swap vs "
                     f"per-layer addmm {sw['per-layer']['merge']['median_ms']:.2f} / {sw['per-layer']['swap']['median_ms']:.2f}")
    cm = result.get("cost_model")
    if cm:
        parts.append(f"cost model ({cm['source']}) at batch {cm['batch'][-1]}: base {cm['base_ms'][-1]:.2f} ms, unmerged "
                     f"{cm['unmerged_ms'][-1]:.2f}, switch merge {cm['switch_ms']['merge']:.2f} / swap {cm['switch_ms']['swap']:.2f}")
    paths = result.get("compute_paths", {})
    if paths:
        parts.append("unmerged compute: " + ", ".join(f"{p} {v}" for p, v in paths.items()))
    return "; ".join(parts)


def finish(result: dict[str, Any], args: argparse.Namespace, device: str) -> None:
    result["verdicts"] = verdicts(result["cells"])
    print_report(result)
    markdown = markdown_section(result)
    if getattr(args, "report", None):
        print("\n-- RESULTS.md section --\n" + markdown)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if not args.no_record:
        record_result("orchestrator", device, result, summary_line(result))
