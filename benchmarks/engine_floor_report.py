"""The results of ``benchmarks/engine_floor.py``: the targets' verdicts over the measured rows, the tables and lines
it prints, the RESULTS.md line, and the files it writes.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from benchmarks.common import record_result

NAME = "engine-floor"
TARGETS = {"base_x_floor": 1.3, "lora_x_base_bs1": 1.2, "lora_x_base_bs32": 1.3, "merged_x_base": 1.03, "prefill_x_floor": 1.4,
           "lora_prefill_x_base": 1.15}


def evaluate_targets(decode: list[dict], prefill: list[dict], plain: dict) -> list[dict]:
    """The issue's targets over the measured rows; ``passed`` None where a number is missing."""
    out = []

    def add(name: str, value: Optional[float], limit: float, note: str = "") -> None:
        out.append({"target": name, "value": value, "limit": limit, "passed": None if value is None else bool(value <= limit),
                    **({"note": note} if note else {})})

    ok = {(r["variant"], r["batch"], r["context"]): r for r in decode if r.get("ms") is not None}
    for (variant, b, c), r in sorted(ok.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        if variant not in ("base", "gemv"):
            continue
        what = "base decode" if variant == "base" else "base decode with gemv"  # gemv: the decode-row kernels on
        add(f"{what} bs{b} ctx{c} <= {TARGETS['base_x_floor']}x floor", r["ms"] / r["floor_ms"], TARGETS["base_x_floor"])
        p = plain.get("points", {}).get(f"{b}x{c}", {})
        best = min((p[k] for k in ("masked_ms", "exact_ms") if p.get(k) is not None), default=None)
        add(f"{what} bs{b} ctx{c} faster than plain graphed", None if best is None else r["ms"] / best, 1.0,
            "" if best is not None else "plain not measured")
    for r in decode:
        if r["variant"] == "base" and r.get("ms") is None:
            add(f"base decode bs{r['batch']} ctx{r['context']} <= {TARGETS['base_x_floor']}x floor", None,
                TARGETS["base_x_floor"], r.get("skipped") or r.get("error") or "not measured")
    for (variant, b, c), r in sorted(ok.items()):
        base = ok.get(("base", b, c))
        if variant == "lora" and b in (1, 32):
            lim = TARGETS["lora_x_base_bs1"] if b == 1 else TARGETS["lora_x_base_bs32"]
            note = "" if r.get("distinct_adapters") == b else f"only {r.get('distinct_adapters')} distinct adapters"
            value = None if base is None else r["ms"] / base["ms"]
            add(f"unmerged lora bs{b} ctx{c} ({r.get('distinct_adapters')} distinct) <= {lim}x base", value, lim, note)
        if variant == "merged" and base is not None:
            add(f"merged bs{b} ctx{c} within 3% of base", r["ms"] / base["ms"], TARGETS["merged_x_base"])
    for r in prefill:
        add(f"prefill {r['tokens']} tokens <= {TARGETS['prefill_x_floor']}x floor",
            None if r.get("ms") is None else r["ms"] / r["floor_ms"], TARGETS["prefill_x_floor"],
            "" if r.get("ms") is not None else (r.get("skipped") or r.get("error") or "not measured"))
        if r.get("lora_x_base") is not None:
            add(f"prefill {r['tokens']} tokens with one adapter <= {TARGETS['lora_prefill_x_base']}x base",
                r["lora_x_base"], TARGETS["lora_prefill_x_base"])
    return out


def floor_text(row: dict) -> str:
    """A measured row against its floor, or why it has no time."""
    if "ms" not in row:
        return str(row.get("skipped") or row.get("error"))
    return f"{row['ms']:.2f} ms (floor {row['floor_ms']:.2f}, {row['ms'] / row['floor_ms']:.2f}x)"


def _f(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def plain_best(plain: dict, b: int, c: int) -> Optional[float]:
    p = plain.get("points", {}).get(f"{b}x{c}", {})
    return min((p[k] for k in ("masked_ms", "exact_ms") if p.get(k) is not None), default=None)


def media_label(r: dict) -> str:
    return f"{r['side']}x{r['side']} image" if r["kind"] == "image" else f"{r['images']}-frame {r['side']}x{r['side']} video"


def print_media_row(r: dict) -> None:
    head = f"media {media_label(r)}:"
    if r.get("ttft_ms") is None:
        print(f"{head} {r.get('skipped') or r.get('error')}", flush=True)
        return
    print(f"{head} {r['prompt_tokens']} prompt tokens ({r['visual_tokens']} visual, grid {r.get('grid')}): "
          f"TTFT {r['ttft_ms']:.1f} ms = prepare {r['prepare_ms']:.1f} + step {r['step_ms']:.1f} "
          f"(vision {r['vision_ms']:.1f}, floor {r['vision_floor_ms']:.2f}; step - vision {r['step_minus_vision_ms']:.1f}, "
          f"prefill floor {r['prefill_floor_ms']:.2f}); step {r['step_ms'] / r['floor_ms']:.2f}x its floor "
          f"{r['floor_ms']:.2f} ms", flush=True)


def print_decode_row(r: dict, plain: dict) -> None:
    head = f"decode {r['variant']:6s} bs{r['batch']:<3d} ctx{r['context']:<5d}"
    if r.get("ms") is None:
        print(f"{head} {r.get('skipped') or r.get('error')}", flush=True)
        return
    best = plain_best(plain, r["batch"], r["context"])
    print(f"{head} {r['ms']:8.2f} ms/step (median {r['median_step_ms']:.2f}), floor {r['floor_ms']:.2f} "
          f"({r['ms'] / r['floor_ms']:.2f}x), plain {_f(best)}, mode {r.get('mode')}, "
          f"{r.get('distinct_adapters', 0)} adapters", flush=True)


def print_tables(res: dict) -> None:
    rows = {(r["variant"], r["batch"], r["context"]): r for r in res["decode"]}
    plain = res.get("plain", {})
    print("\ndecode, ms per step (x floor); lora and merged also x base", flush=True)
    print(f"{'ctx':>5} {'bs':>4} | {'base':>8} {'floor':>7} {'x':>5} | {'plain':>8} {'masked':>8} | "
          f"{'lora':>8} {'floor':>7} {'x base':>6} | {'merged':>8} {'x base':>6}", flush=True)
    for c in res["settings"]["contexts"]:
        for b in res["settings"]["batches"]:
            base, lora, merged, sync, gv = (rows.get((v, b, c), {}) for v in ("base", "lora", "merged", "sync", "gemv"))
            p = plain.get("points", {}).get(f"{b}x{c}", {})
            bm = base.get("ms")
            print(f"{c:>5} {b:>4} | {_f(bm):>8} {_f(base.get('floor_ms')):>7} "
                  f"{_f(bm / base['floor_ms'] if bm else None):>5} | {_f(p.get('exact_ms')):>8} {_f(p.get('masked_ms')):>8} | "
                  f"{_f(lora.get('ms')):>8} {_f(lora.get('floor_ms')):>7} "
                  f"{_f(lora['ms'] / bm if bm and lora.get('ms') else None):>6} | {_f(merged.get('ms')):>8} "
                  f"{_f(merged['ms'] / bm if bm and merged.get('ms') else None, '.3f'):>6}"
                  + (f" | no overlap {_f(sync.get('ms'))}" if sync else "")
                  + (f" | gemv {_f(gv.get('ms'))} ({_f(gv['ms'] / gv['floor_ms'] if gv.get('ms') else None)}x floor, "
                     f"{_f(gv['ms'] / bm if bm and gv.get('ms') else None, '.3f')}x base)" if gv else ""), flush=True)
    print("\nprefill, one prompt", flush=True)
    for r in res["prefill"]:
        print(f"  {r['tokens']:>6} tokens: {_f(r.get('ms')):>8} ms, floor {r['floor_ms']:.2f} ms "
              f"({_f(r['ms'] / r['floor_ms'] if r.get('ms') else None)}x)"
              + (f", one adapter {r['lora_ms']:.2f} ms ({r['lora_x_base']:.2f}x base)" if r.get("lora_ms") else "")
              + f" {r.get('skipped') or r.get('error') or ''}", flush=True)
    if res.get("media"):
        print("image / video requests to their first token", flush=True)
        for r in res["media"]:
            print_media_row(r)
    print("vision tower", flush=True)
    for r in res["vision"]:
        print(f"  {r['images']:>6} images: {_f(r.get('ms')):>8} ms, floor {r['floor_ms']:.2f} ms "
              f"({_f(r['ms'] / r['floor_ms'] if r.get('ms') else None)}x) {r.get('error') or ''}", flush=True)
    print("\ntargets", flush=True)
    for t in res["targets"]:
        verdict = "SKIP" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        print(f"  {verdict}  {t['target']}: {_f(t['value'], '.3f')} (limit {t['limit']}) {t.get('note', '')}", flush=True)
    if res.get("notes"):
        print("notes: " + "; ".join(res["notes"]), flush=True)


def summary_line(res: dict) -> str:
    d = {(r["variant"], r["batch"], r["context"]): r for r in res["decode"] if r.get("ms") is not None}
    rows = sorted(d.items(), key=lambda kv: (kv[0][2], kv[0][1]))  # by context, then batch
    plain = res.get("plain", {})
    sections = [
        ("base decode ms (x floor)", [f"bs{b}/ctx{c} {r['ms']:.1f} ({r['ms'] / r['floor_ms']:.2f}x)" for (v, b, c), r in rows if v == "base"]),
        (f"with gemv (engine.gemv_max_rows {res.get('settings', {}).get('gemv_rows')}) ms (x floor)",
         [f"bs{b}/ctx{c} {r['ms']:.1f} ({r['ms'] / r['floor_ms']:.2f}x)" for (v, b, c), r in rows if v == "gemv"]),
        ("plain graphed ms", [f"bs{b}/ctx{c} {plain_best(plain, b, c):.1f}" for (v, b, c), _ in rows
                              if v == "base" and plain_best(plain, b, c) is not None]),
        *((f"{x} x base", [f"bs{b}/ctx{c} {r['ms'] / d[('base', b, c)]['ms']:.2f}" for (v, b, c), r in rows
                           if v == x and ("base", b, c) in d]) for x in ("lora", "merged")),
        ("prefill (new lengths; the same length again)",
         [f"{r['tokens']} {r['ms']:.1f} ms ({r['ms'] / r['floor_ms']:.2f}x)"
          + (f"; again {r['repeated_ms']:.1f} ({r['repeated_ms'] / r['floor_ms']:.2f}x)" if r.get("repeated_ms") else "")
          + (f"; one adapter {r['lora_ms']:.1f} ({r['lora_x_base']:.2f}x base)" if r.get("lora_ms") else "")
          for r in res["prefill"] if r.get("ms") is not None]),
        ("vision", [f"{r['images']} img {r['ms']:.1f} ms" for r in res["vision"] if r.get("ms") is not None]),
        ("media", [f"{media_label(r)} ({r['prompt_tokens']} tokens) TTFT {r['ttft_ms']:.1f} ms (prepare {r['prepare_ms']:.1f}, "
                   f"vision {r['vision_ms']:.1f}, step {r['step_ms']:.1f} = {r['step_ms'] / r['floor_ms']:.2f}x floor)"
                   for r in res.get("media", []) if r.get("ttft_ms") is not None])]
    parts = [f"{res['preset']} {res['dtype']}, copy {res['rates']['copy_gbs']:.0f} GB/s, matmul {res['rates']['matmul_tflops']:.0f} TFLOP/s"]
    parts += [f"{title}: " + ", ".join(items) for title, items in sections if items]
    t = res["targets"]
    parts.append(f"targets {sum(1 for x in t if x['passed'])} pass / {sum(1 for x in t if x['passed'] is False)} fail / "
                 f"{sum(1 for x in t if x['passed'] is None)} skipped")
    if plain.get("check") and not plain["check"]["passed"]:
        parts.append("PLAIN CHECK FAILED")
    return "; ".join(parts)


def write_outputs(res: dict, out: Path, no_record: bool) -> Path:
    dev = res["device"]
    name = res.get("benchmark", NAME)  # engine-floor, or engine-floor-qwen (-qwen2.5) for that family
    line = summary_line(res)
    res["summary"] = line
    if not no_record:
        path = record_result(name, dev, res, line)
        if out.resolve() == path.parent.resolve():
            return path
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{dev}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    (out / f"{name}-{dev}.results-line.md").write_text(
        f"| {time.strftime('%Y-%m-%d')} | {name} | {dev} | {res['commit']} | {line} |\n")
    print(f"wrote {path}", flush=True)
    return path
