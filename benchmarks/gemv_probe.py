"""The decode-row projection kernels (vlora.engine.gemv) against cuBLAS at a model's decode shapes, for
choosing their launch table by measurement.

For LLaVA-1.5-7B (the default preset): q/k/v 12288x4096, o 4096x4096, gate/up 22016x4096 (plain, as LoRA
steps run it, and with SiLU * up fused, as steps without LoRA work run it), down 4096x11008 and the LM head
32064x4096, each for M in 1, 2, 4, 8, 16 rows, bf16. Every candidate launch is checked first (against an fp32
reference, and a row's bits alone and among 8 against among 16: a launch that fails is never chosen), then
timed as CUDA-graph replays over weight copies larger than L2 (``vlora.atmm.timing.graph_time_us``), next
to cuBLAS (``F.linear``; for the fused kind ``silu_mul(F.linear(...))``, what the engine runs without it).
The launch of a shape is one for every M (a row's bits must not depend on M): the candidate with the least
mean time relative to the fastest at each M.

    python -m benchmarks.gemv_probe --out $OUT --table-out $OUT/gemv-table.json   # ~40-60 s on an H100
    VLORA_GEMV_TABLE=$OUT/gemv-table.json python -m benchmarks.engine_floor ... --gemv-max-rows 16
    python -m benchmarks.gemv_probe --configs n16k256w4s4,n32k512w8s3x2T --shapes o,down   # given launches
    TRITON_INTERPRET=1 python -m benchmarks.gemv_probe --device cpu --tiny --rows 1,2 --no-record --out /tmp/p  # CPU smoke

Prints, per shape and launch, us per call and the fraction of the measured copy rate at each M (bytes: the
weight, x and y once), then the projections of one decode step (every layer and the LM head) with the best
launches against cuBLAS and against the weights' floor. Writes ``--table-out`` (a VLORA_GEMV_TABLE file:
the best launch per shape, and the lines of ``vlora.engine.gemv.TABLE`` to commit) and
``<out>/gemv-probe-<device>.json`` (``--record``: also a line in RESULTS.md). ``--deadline-s`` starts no
candidate after that many seconds; the shapes keep what was measured (the rest: the table's entry).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.common import ROOT, RESULTS, device_name, git_commit, write_result

NAME = "gemv-probe"
ROWS = "1,2,4,8,16"
# The launches tried, the table's first; the split-K ones only where a shape has few output columns.
CANDIDATES = "n16k256w4s4,n32k256w4s4,n16k512w4s3,n16k256w4s6,n32k128w4s6,n32k256w8s4,n16k256w2s5,n64k128w4s4T"
SPLIT_CANDIDATES = "n32k256w4s4x2,n64k256w4s3x4"
SPLIT_MAX_COLS = 8192
LABEL = re.compile(r"^n(\d+)k(\d+)w(\d+)s(\d+)(?:x(\d+))?(T?)$")
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1021, "num_hidden_layers": 4}


def parse_config(label: str):
    """``n16k256w4s4`` -> GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=4); ``x2``: split_k 2;
    a trailing ``T``: swap (the weight tile as the A operand)."""
    from vlora.engine.gemv import GemvConfig

    m = LABEL.match(label.strip())
    if not m:
        raise SystemExit(f"--configs: {label!r} is not like n16k256w4s4[x2][T]")
    n, k, w, s, split, swap = m.groups()
    return GemvConfig(block_n=int(n), block_k=int(k), num_warps=int(w), num_stages=int(s), split_k=int(split or 1),
                      swap=bool(swap))


def model_shapes(text: dict) -> list[dict]:
    """The decode shapes of a LLaMA-style decoder: name, kind, N (the weight's rows), K; per-layer or not."""
    h, inter = text["hidden_size"], text["intermediate_size"]
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    d = text.get("head_dim") or h // heads
    return [dict(name="qkv", kind="linear", n=(heads + 2 * kv) * d, k=h, per_layer=True),
            dict(name="o", kind="linear", n=h, k=heads * d, per_layer=True),
            dict(name="gate_up", kind="linear", n=2 * inter, k=h, per_layer=True),
            dict(name="gate_up_silu", kind="silu", n=2 * inter, k=h, per_layer=True),
            dict(name="down", kind="linear", n=h, k=inter, per_layer=True),
            dict(name="lm_head", kind="linear", n=text["vocab_size"], k=h, per_layer=False)]


def preset_text(preset: str) -> dict:
    import yaml

    path = Path(preset) if Path(preset).is_absolute() else ROOT / preset
    return yaml.safe_load(path.read_text())["text"]


def out_cols(shape: dict) -> int:
    return shape["n"] // 2 if shape["kind"] == "silu" else shape["n"]


def call_bytes(shape: dict, M: int) -> int:
    return 2 * (shape["n"] * shape["k"] + M * shape["k"] + M * out_cols(shape))


class Timer:
    """us per call: CUDA-graph replays on CUDA; on a CPU (the interpreter smoke run) one timed call."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, calls: list[Callable[[], Any]]) -> float:
        if self.cuda:
            from vlora.atmm.timing import graph_time_us

            return graph_time_us(calls, min_batch_ms=0.5, batches=5)
        calls[0]()
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls) * 1e6


def check(fn: Callable, x, w, ref, dtype, steps: float) -> dict:
    """The launch against the fp32 reference (within ``steps`` roundings of the dtype, relative to the output's
    largest value for elements near zero) and a row's bits alone / among 8 against among 16."""
    import torch

    full = fn(x, w)
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    err = (full.float() - ref).abs()
    bound = steps * step * (ref.abs() + 0.05 * ref.abs().max())
    stable = torch.equal(fn(x[:1], w), full[:1]) and torch.equal(fn(x[:8], w), full[:8]) \
        and torch.equal(fn(x[5:8], w), full[5:8])
    return {"max_rel_err": float((err / ref.abs().max().clamp(min=1e-30)).max()), "within_tolerance": bool((err <= bound).all()),
            "stable": bool(stable)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (or cpu with TRITON_INTERPRET=1: a smoke run)")
    p.add_argument("--preset", default="configs/models/llava-1.5-7b.yaml", help="model preset YAML: its text dims")
    p.add_argument("--tiny", action="store_true", help="the tiny model's dims instead (CPU smoke runs)")
    p.add_argument("--rows", default=ROWS, help=f"M values (<= 16; default {ROWS})")
    p.add_argument("--shapes", help="only these shapes (qkv, o, gate_up, gate_up_silu, down, lm_head)")
    p.add_argument("--configs", help=f"launches to try instead of the default list ({CANDIDATES}; "
                                     f"split-K where a shape has < {SPLIT_MAX_COLS} columns: {SPLIT_CANDIDATES})")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--deadline-s", type=float, default=50.0, help="start no candidate after this many seconds")
    p.add_argument("--out", default=str(RESULTS), help="folder for gemv-probe-<device>.json (default benchmarks/results)")
    p.add_argument("--table-out", help="write the best launches here (a VLORA_GEMV_TABLE file)")
    p.add_argument("--record", action="store_true", help="also a line in benchmarks/RESULTS.md")
    p.add_argument("--no-record", action="store_true", help="(the default) no RESULTS.md line")
    args = p.parse_args(argv)
    t_start = time.monotonic()

    import torch
    import torch.nn.functional as F

    from vlora.engine import gemv
    from vlora.engine.fused_ops import silu_mul, silu_mul_reference

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gemv_probe: no CUDA device (a CPU smoke run: --device cpu with TRITON_INTERPRET=1)")
    if not gemv.triton_available() or (not cuda and not gemv._INTERPRET):
        raise SystemExit("gemv_probe: needs triton, and on a CPU TRITON_INTERPRET=1")
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or max(rows) > gemv.MAX_ROWS or min(rows) < 1:
        raise SystemExit(f"--rows: values in 1..{gemv.MAX_ROWS}")
    text = TINY if args.tiny else preset_text(args.preset)
    shapes = model_shapes(text)
    if args.shapes:
        keep = set(args.shapes.split(","))
        shapes = [s for s in shapes if s["name"] in keep]
    configs = [parse_config(c) for c in (args.configs or CANDIDATES).split(",") if c.strip()]
    splits = [] if args.configs else [parse_config(c) for c in SPLIT_CANDIDATES.split(",")]
    timer = Timer(cuda)
    if cuda:
        from vlora.atmm.timing import ROTATE_BYTES, copy_bandwidth_gbs, sets_needed

        copy_gbs = copy_bandwidth_gbs(1 << 30)
    else:
        ROTATE_BYTES, copy_gbs = 0, 0.0

        def sets_needed(nbytes: int, min_bytes: int = 0) -> int:
            return 1
    print(f"{NAME}: {device_name()}, copy {copy_gbs:.0f} GB/s, {args.dtype}, rows {rows}, "
          f"{'tiny' if args.tiny else args.preset}", flush=True)

    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(gemv.MAX_ROWS, max(s["k"] for s in shapes), generator=gen, device=dev).to(dtype)
    state: dict[str, dict] = {}
    for s in shapes:
        key = gemv.table_key(s["kind"], s["n"], s["k"])
        n_sets = max(2, sets_needed(s["n"] * s["k"] * 2, ROTATE_BYTES)) if cuda else 1
        ws = [(torch.randn(s["n"], s["k"], generator=gen, device=dev) * s["k"] ** -0.5).to(dtype) for _ in range(n_sets)]
        xs = x[:, :s["k"]].contiguous()
        ref = xs.float() @ ws[0].float().T
        if s["kind"] == "silu":
            ref = silu_mul_reference(ref.to(dtype)).float()
        state[s["name"]] = {"shape": s, "key": key, "weights": ws, "x": xs, "ref": ref, "candidates": {},
                            "table_config": gemv.config_for(s["kind"], s["n"], s["k"]).label()}

    def fn_of(s: dict, cfg) -> Callable:
        f = gemv.gate_up_silu if s["kind"] == "silu" else gemv.linear_rows
        return functools.partial(f, impl="triton", config=cfg)

    # cuBLAS, what the engine runs without the kernels
    for name, st in state.items():
        s, ws, xs = st["shape"], st["weights"], st["x"]
        if s["kind"] == "silu":
            base = lambda xm, w: silu_mul(F.linear(xm, w))  # noqa: E731
        else:
            base = F.linear
        st["cublas_us"] = {M: timer([functools.partial(base, xs[:M], w) for w in ws]) for M in rows}

    tried = 0
    skipped: list[str] = []
    for cfg in configs + splits:
        for name, st in state.items():
            s = st["shape"]
            if cfg.split_k > 1 and out_cols(s) >= SPLIT_MAX_COLS:
                continue
            if args.deadline_s is not None and time.monotonic() - t_start > args.deadline_s:
                skipped.append(f"{name}:{cfg.label()}")
                continue
            fn = fn_of(s, cfg)
            row: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
            try:
                # two roundings off the reference (four through the activation's); the interpreter's bf16
                # casts truncate: two more
                steps = (4 if s["kind"] == "silu" else 2) + (2 if not cuda and dtype == torch.bfloat16 else 0)
                row.update(check(fn, st["x"], st["weights"][0], st["ref"], dtype, steps))
                if row["within_tolerance"] and row["stable"]:
                    row["us"] = {M: timer([functools.partial(fn, st["x"][:M], w) for w in st["weights"]]) for M in rows}
                tried += 1
            except Exception as e:  # a launch that does not compile or fit (shared memory): reported, not chosen
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            st["candidates"][cfg.label()] = row

    # choose: the least mean time relative to the fastest at each M, over the launches that passed
    table = {}
    for name, st in state.items():
        ok = {lab: r for lab, r in st["candidates"].items() if "us" in r}
        if not ok:
            continue
        fastest = {M: min(r["us"][M] for r in ok.values()) for M in rows}
        score = {lab: statistics.mean(r["us"][M] / fastest[M] for M in rows) for lab, r in ok.items()}
        best = min(score, key=score.get)
        st["best"], st["score"] = best, score
        st["best_per_m"] = {M: min(ok, key=lambda lab: ok[lab]["us"][M]) for M in rows}
        table[st["key"]] = gemv.GemvConfig.from_dict(ok[best]["config"])

    # report
    def frac(shape: dict, M: int, us: float) -> float:
        return call_bytes(shape, M) / (us * 1e-6) / 1e9 / copy_gbs if copy_gbs else 0.0

    for name, st in state.items():
        s = st["shape"]
        print(f"\n{name} ({s['kind']} N={s['n']} K={s['k']}, {s['n'] * s['k'] * 2 / 1e6:.1f} MB; table: {st['table_config']})"
              + "".join(f" | M={M:<2d} us/copy" for M in rows), flush=True)
        lines = [("cuBLAS", st["cublas_us"], "")]
        lines += [(lab, r["us"], " *" if lab == st.get("best") else "") for lab, r in st["candidates"].items() if "us" in r]
        for lab, us, mark in lines:
            print(f"  {lab + mark:<22s}" + "".join(f" | {us[M]:8.1f} {frac(s, M, us[M]):4.2f}" for M in rows), flush=True)
        for lab, r in st["candidates"].items():
            if "us" not in r:
                why = r.get("error") or (f"max rel err {r['max_rel_err']:.2e}, within tolerance {r['within_tolerance']}, "
                                         f"a row's bits alike in any M {r['stable']}")
                print(f"  {lab:<22s} not timed: {why}", flush=True)
        if st.get("best"):
            b = st["candidates"][st["best"]]["us"]
            print(f"  best {st['best']}: vs cuBLAS " + ", ".join(f"M={M} {b[M] / st['cublas_us'][M]:.2f}x" for M in rows)
                  + f"; fastest per M: {st['best_per_m']}", flush=True)

    layers = text["num_hidden_layers"]
    step: dict[str, Any] = {}
    names = {"qkv", "o", "gate_up_silu", "down", "lm_head"}
    if names <= set(state) and all(state[n].get("best") for n in names):
        weight_bytes = sum((layers if state[n]["shape"]["per_layer"] else 1) * state[n]["shape"]["n"] * state[n]["shape"]["k"] * 2
                           for n in names)
        floor_us = weight_bytes / (copy_gbs * 1e9) * 1e6 if copy_gbs else 0.0
        print(f"\none decode step's projections ({layers} layers + LM head, {weight_bytes / 1e9:.2f} GB; floor at the copy "
              f"rate {floor_us / 1e3:.3f} ms):", flush=True)
        for M in rows:
            ours = sum((layers if state[n]["shape"]["per_layer"] else 1) * state[n]["candidates"][state[n]["best"]]["us"][M] for n in names)
            theirs = sum((layers if state[n]["shape"]["per_layer"] else 1) * state[n]["cublas_us"][M] for n in names)
            step[M] = {"gemv_ms": ours / 1e3, "cublas_ms": theirs / 1e3, "floor_ms": floor_us / 1e3}
            print(f"  M={M:<2d} gemv {ours / 1e3:.3f} ms ({ours / floor_us if floor_us else 0:.2f}x floor), cuBLAS "
                  f"{theirs / 1e3:.3f} ms ({theirs / floor_us if floor_us else 0:.2f}x floor), saves {(theirs - ours) / 1e3:.3f} ms",
                  flush=True)
    if skipped:
        print(f"deadline: {len(skipped)} candidate runs skipped ({', '.join(skipped[:6])}{' ...' if len(skipped) > 6 else ''})",
              flush=True)

    dev_name = device_name()
    table_file = gemv.table_json(table, device=dev_name, dtype=args.dtype, commit=git_commit(),
                                 source="benchmarks/gemv_probe.py")
    if args.table_out:
        Path(args.table_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table_out).write_text(json.dumps(table_file, indent=2) + "\n")
        print(f"wrote {args.table_out} ({len(table)} launches)", flush=True)
    print("vlora.engine.gemv.TABLE lines:", flush=True)
    for key, cfg in sorted(table.items()):
        print(f'    "{key}": GemvConfig(block_n={cfg.block_n}, block_k={cfg.block_k}, num_warps={cfg.num_warps}, '
              f'num_stages={cfg.num_stages}' + (f", split_k={cfg.split_k}" if cfg.split_k > 1 else "")
              + (", swap=True" if cfg.swap else "") + "),", flush=True)
    result = {"benchmark": NAME, "device": dev_name, "commit": git_commit(), "dtype": args.dtype, "copy_gbs": copy_gbs,
              "rows": rows, "preset": "tiny" if args.tiny else args.preset, "seconds": time.monotonic() - t_start,
              "skipped": skipped, "step_projections": step, "table": table_file["configs"],
              "shapes": {name: {"kind": st["shape"]["kind"], "n": st["shape"]["n"], "k": st["shape"]["k"],
                                "table_config": st["table_config"], "cublas_us": st["cublas_us"],
                                "candidates": st["candidates"], "best": st.get("best"),
                                "best_per_m": st.get("best_per_m")} for name, st in state.items()}}
    parts = [f"copy {copy_gbs:.0f} GB/s"]
    for M in (1, 8):
        if M in step:
            parts.append(f"M={M}: projections {step[M]['gemv_ms']:.2f} ms vs cuBLAS {step[M]['cublas_ms']:.2f} "
                         f"(floor {step[M]['floor_ms']:.2f})")
    parts.append("best " + ", ".join(f"{n} {st['best']}" for n, st in state.items() if st.get("best")))
    write_result(NAME, args.out, result, "; ".join(parts), record=args.record and not args.no_record)
    print(f"{NAME}: {time.monotonic() - t_start:.0f} s, {tried} launches checked", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
