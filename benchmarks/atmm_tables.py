"""Which tiling table serves the engine's LoRA calls best on this GPU: the built-in default rule, the table this GPU
resolves to (its own, or a same-capability GPU's: ``vlora.atmm.tiling.resolve_table``), and any table files given,
each timed on the calls a 7B engine makes, in one run.

The calls are the engine's own, through ``AtmmKernels.run_rows`` as its captured steps make them:
- a prefill graph of T tokens: one sequence of T rows among ``--max-batch`` segments whose bounds only the device
  holds (the others empty), as ``engine.prefill_graph_tokens`` replays it;
- the same graph replaying a mixed step (``--mixed``): ``--max-batch`` - 2 decode rows first, one segment each, then
  two prompts sharing the rest, as a prefill step under load carries them;
- a decode graph of B rows: one segment a row, each its own adapter slot;
and through ``AtmmKernels.run`` for an eager prefill step of two sequences of two adapters (past the prefill graphs).

Every projection of the model's decoder blocks (q, k, v, o, gate, up, down) at rank ``--rank`` with ``--slots``
adapter slots, each timed as CUDA-graph replays over rotated inputs and slot buffers larger than L2, beside its
floor (the bytes it must move at the measured copy rate: x, y read and written, the used slots' A and B). A step's
LoRA time is the sum over the projections times the blocks.

    python -m benchmarks.atmm_tables [--tables a.json,b.json] [--prefill 256,600,1024,2048] [--mixed 1024]
        [--decode 1,8,32] [--prefill-graph-expand tr_c_m64n128_r64_w4s4_g1 ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import yaml

from benchmarks.common import ROOT, device_name, git_commit, record_result

from vlora.atmm import AtmmKernels
from vlora.atmm.mapping import LoraBatchMapping
from vlora.atmm.tiling import TABLE_ENV, resolve_table
from vlora.atmm.timing import copy_bandwidth_gbs, graph_time_us, sets_needed

MODELS = {"llava-1.5-7b": "configs/models/llava-1.5-7b.yaml", "qwen2-vl-7b": "configs/models/qwen2-vl-7b.yaml"}


def projections(preset: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(decoder blocks, {projection: (d_in, d_out)}) of a model preset."""
    text = yaml.safe_load((ROOT / preset).read_text())["text"]
    h, inter = text["hidden_size"], text["intermediate_size"]
    head = h // text["num_attention_heads"]
    kv = head * text.get("num_key_value_heads", text["num_attention_heads"])
    return text["num_hidden_layers"], {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                                       "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def call_sets(T: int, d_in: int, d_out: int, slots: int, rank: int) -> list[tuple]:
    """Rotated (y, x, A, B) sets: one replay moves more than 256 MB, so every operand comes from HBM."""
    per_set = 2 * (T * d_in + 2 * T * d_out + slots * rank * (d_in + d_out))
    out = []
    for _ in range(sets_needed(per_set)):
        a = torch.randn(slots, rank, d_in, device="cuda", dtype=torch.bfloat16) / d_in ** 0.5
        b = torch.randn(slots, d_out, rank, device="cuda", dtype=torch.bfloat16) / rank ** 0.5
        out.append((torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16),
                    torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16), a, b))
    return out


def _graph_mapping(indptr: list[int], slots: list[int]) -> LoraBatchMapping:
    """Segments whose bounds a prefill graph reads on the device (even False)."""
    m = LoraBatchMapping.from_segments(indptr, slots, "cuda")
    return LoraBatchMapping(m.seg_indptr, m.seg_slot, m.seg_indptr_host, m.seg_slot_host, indptr[-1], True, even=False)


def prefill_graph_mapping(T: int, max_batch: int) -> LoraBatchMapping:
    """A prefill graph's mapping: ``max_batch`` segments, the first of all T rows (slot 0), the rest empty."""
    return _graph_mapping([0] + [T] * max_batch, [0] + [-1] * (max_batch - 1))


def mixed_graph_mapping(T: int, max_batch: int, slots: int) -> LoraBatchMapping:
    """A prefill graph replaying a mixed step: ``max_batch - 2`` decode rows first (one segment each, slots in
    turn), then two prompts sharing the rest of the T rows."""
    d = max_batch - 2
    return _graph_mapping(list(range(d + 1)) + [d + (T - d) // 2, T], [i % slots for i in range(d + 2)])


def time_call(kernels: AtmmKernels, kind: str, T: int, d_in: int, d_out: int, args) -> tuple[float, str, int]:
    """Microseconds of one LoRA call of this kind and shape, the kernels the table chose, the bytes it must move."""
    sets = call_sets(T, d_in, d_out, args.slots, args.rank)
    if kind == "prefill-graph":
        mapping = prefill_graph_mapping(T, args.max_batch)
        used = 1
    elif kind == "prefill-mixed":
        mapping = mixed_graph_mapping(T, args.max_batch, args.slots)
        used = min(args.max_batch, args.slots)
    elif kind == "decode-graph":
        mapping = LoraBatchMapping.from_segments(list(range(T + 1)), [i % args.slots for i in range(T)], "cuda")
        used = min(T, args.slots)
    else:  # an eager prefill step of two sequences, two adapters
        mapping = LoraBatchMapping.from_segments([0, T // 2, T], [0, 1], "cuda")
        used = 2
    ranks, scales = (args.rank,) * args.slots, (1.0,) * args.slots
    if kind == "eager":
        calls = [lambda s=s: kernels.run(s[0], s[1], s[2], s[3], ranks, scales, mapping) for s in sets]
        hit = kernels.lookup("shrink", "bf16", T, d_in, args.rank, 2)
        shrink, expand = (hit["config"], hit["split_k"]), kernels.lookup("expand", "bf16", T, d_out, args.rank, 2)["config"]
    else:
        calls = [lambda s=s: kernels.run_rows(s[0], s[1], s[2], s[3], mapping, 1.0) for s in sets]
        shrink, expand = kernels.row_kernels("bf16", T, d_in, d_out, args.rank, mapping.num_segments, mapping.even)
    us = graph_time_us(calls)
    del sets
    floor_bytes = 2 * (T * d_in + 2 * T * d_out + used * args.rank * (d_in + d_out))
    return us, f"{shrink[0]}/{shrink[1]} + {expand}", floor_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.atmm_tables", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--tables", default="", help="more table files to time, comma-separated")
    ap.add_argument("--prefill", default="256,600,1024,2048", help="prefill graph sizes in tokens")
    ap.add_argument("--mixed", default="1024", help="prefill graph sizes in tokens replaying a mixed step (decode rows "
                    "first, then two prompts)")
    ap.add_argument("--eager", default="2048", help="eager prefill steps in tokens (two sequences)")
    ap.add_argument("--decode", default="1,8,32", help="decode graph sizes in rows")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8, help="adapter slots (lora.max_gpu_adapters)")
    ap.add_argument("--max-batch", type=int, default=32, help="scheduler.max_batch_size: a prefill graph's segments")
    ap.add_argument("--prefill-graph-expand", action="append", default=[], metavar="CONFIG",
                    help="also time the prefill-graph kinds with this expand config (each a column of its own; the "
                         "engine's choice otherwise: the table's, the row-tile one on a mixed step)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.atmm_tables: needs CUDA", file=sys.stderr)
        return 0
    probe = AtmmKernels(load_table=False)
    if not probe.available:
        print(f"benchmarks.atmm_tables: {probe.unavailable_reason}", file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name()
    resolved, why = resolve_table(gpu, torch.cuda.get_device_capability())
    options: dict[str, Path | None] = {"default rule": None}
    if resolved is not None:
        options[f"resolved: {resolved.name}"] = resolved
    for t in filter(None, args.tables.split(",")):
        options[Path(t).name] = Path(t)
    for cfg in args.prefill_graph_expand:  # the resolved table, with this expand for the prefill graphs
        if cfg not in probe.config_names:
            print(f"benchmarks.atmm_tables: --prefill-graph-expand {cfg}: not a compiled config", file=sys.stderr)
            return 2
        options[f"expand {cfg}"] = resolved
    bw = copy_bandwidth_gbs()
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    shapes = [("prefill-graph", T) for T in ints(args.prefill)] + [("prefill-mixed", T) for T in ints(args.mixed)] + \
             [("eager", T) for T in ints(args.eager)] + [("decode-graph", T) for T in ints(args.decode)]
    result: dict = {"device": device_name(), "gpu": gpu, "commit": git_commit(), "copy_gbs": round(bw, 1),
                    "resolved": f"{resolved} ({why})", "rank": args.rank, "slots": args.slots,
                    "max_batch": args.max_batch, "options": list(options), "models": {}}
    t0 = time.monotonic()
    for name in filter(None, args.models.split(",")):
        layers, projs = projections(MODELS[name])
        model: dict = {"layers": layers, "projections": {k: list(v) for k, v in projs.items()}, "steps": []}
        for kind, T in shapes:
            row: dict = {"kind": kind, "tokens": T, "floor_ms": 0.0, "options": {}}
            for label, path in options.items():
                os.environ[TABLE_ENV] = str(path) if path is not None else "none"
                kernels = AtmmKernels()  # resolves $VLORA_ATMM_TABLE
                if label.startswith("expand "):
                    if kind not in ("prefill-graph", "prefill-mixed"):
                        continue
                    kernels.prefill_graph_expand = label.removeprefix("expand ")
                per, total, floor = {}, 0.0, 0.0
                for proj, (d_in, d_out) in projs.items():
                    us, chose, nbytes = time_call(kernels, kind, T, d_in, d_out, args)
                    per[proj] = {"us": round(us, 2), "floor_us": round(nbytes / bw / 1e3, 2), "kernels": chose}
                    total += us * layers
                    floor += nbytes / bw / 1e3 * layers
                row["floor_ms"] = round(floor / 1e3, 3)
                row["options"][label] = {"step_ms": round(total / 1e3, 3), "x_floor": round(total / floor, 2),
                                         "projections": per}
                print(f"{name} {kind} T={T} {label}: LoRA {total / 1e3:.2f} ms a step ({total / floor:.2f}x its "
                      f"floor {floor / 1e3:.2f} ms; {time.monotonic() - t0:.0f} s)", flush=True)
            model["steps"].append(row)
        result["models"][name] = model
    os.environ.pop(TABLE_ENV, None)
    result["seconds"] = round(time.monotonic() - t0, 1)
    parts = []
    for name, model in result["models"].items():
        for row in model["steps"]:
            figs = ", ".join(f"{label} {o['step_ms']:.2f} ms ({o['x_floor']:.1f}x)" for label, o in row["options"].items())
            parts.append(f"{name} {row['kind']} {row['tokens']}: {figs}; floor {row['floor_ms']:.2f} ms")
    summary = (f"LoRA time of one step, every decoder projection at rank {args.rank}, {args.slots} slots, against its "
               f"floor at {bw:.0f} GB/s, per table (resolved here: {why}): " + "; ".join(parts))
    if not args.no_record:
        record_result("atmm-tables", result["device"], result, summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
