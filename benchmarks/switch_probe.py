"""Where a mode switch's time goes at 7B width: rank 64 into q/k/v/o of 32 layers, timed eagerly between
device synchronisations (as the orchestrator times a switch), with the switchers' own code.

    python -m benchmarks.switch_probe [--json FILE]     # CUDA only

The weights and slot buffers are laid out as the model runner lays them out (one stack per weight group,
q/k/v [L, 3d, d] and o [L, d, d]; the LoRA slot buffers of each group in one stack, A [L, M, S, r, d]), and
the switchers run on them: ``SwiftSwitcher`` merge (nothing -> A), swap (A -> B, one fused pass) and
unmerge (B -> nothing), and ``PerLayerSwitcher`` (dLoRA's ``addmm_`` per matrix) for comparison. Beside
them: the merge operator alone on contiguous A and B (what a switch cannot beat), and the floor: the
weights' bytes read and written at the measured copy rate. Target (issue 21): merge, swap and unmerge at
most 1.3x the floor (3.7 ms on an H100 80GB HBM3).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch


TARGET_X_FLOOR = 1.3


def timed(fn, reps: int = 9) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


def copy_rate(nbytes: int, reps: int) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    ms = timed(lambda: src.clone(), reps)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def synthetic_runner(L: int, d: int, r: int, slots: int, dtype: torch.dtype, device: str):
    """What the switchers read of a ModelRunner (``groups``, ``lora_layers``, ``num_layers``), for q/k/v/o
    of a LLaMA layer of width ``d`` with no GQA, built as ModelRunner builds it (q/k/v and o stacks in one
    buffer; the slot buffers of each group in one stack)."""
    from torch import nn

    from vlora.engine.model_runner import GroupSlots, WeightGroup  # noqa: F401
    from vlora.lora.layers import LoraContext, LoraLinear

    ctx = LoraContext()
    layers, groups = {}, {}
    buf = torch.randn(4 * L, d, d, dtype=dtype, device=device) * 0.02  # as ModelRunner._attention_buffer
    stacks = {"qkv": buf[:3 * L].view(L, 3 * d, d), "o": buf[3 * L:]}
    for name, mods in (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",))):
        M = len(mods)
        stack = stacks[name]
        a = torch.zeros(L, M, slots, r, d, dtype=dtype, device=device)
        b = torch.zeros(L, M, slots, d, r, dtype=dtype, device=device)
        lora = []
        for li in range(L):
            wrappers = []
            for k, m in enumerate(mods):
                lin = nn.Linear(d, d, bias=False, device="meta", dtype=dtype)
                lin.weight = nn.Parameter(stack[li, k * d:(k + 1) * d], requires_grad=False)
                w = LoraLinear(lin, ctx, slots, r, lora_a=a[li, k], lora_b=b[li, k])
                layers[(li, m)] = w
                wrappers.append((k * d, d, w))
            lora.append(tuple(wrappers))
        groups[name] = WeightGroup(name, stack, None, tuple((m, k * d, d) for k, m in enumerate(mods)), lora,
                                   GroupSlots(mods, a, b, tuple(b[:, k] for k in range(M))))
    return SimpleNamespace(groups=groups, lora_layers=layers, num_layers=L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--slots", type=int, default=64, help="adapter slots (the orchestrator benchmark's 64)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("switch_probe: needs CUDA")
        return 0
    from vlora.atmm.merge import merge_lora
    from vlora.orchestrator.switcher import PerLayerSwitcher, SwiftSwitcher

    L, d, r, S = args.layers, args.width, args.rank, args.slots
    dt = torch.bfloat16
    runner = synthetic_runner(L, d, r, S, dt, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for slot in (3, 5):
        for w in runner.lora_layers.values():
            w.set_slot(slot, torch.randn(r, d, generator=gen, device="cuda", dtype=dt) * 0.01,
                       torch.randn(d, r, generator=gen, device="cuda", dtype=dt) * 0.01, 1.0)
    n_mats = 4 * L
    w_bytes = n_mats * d * d * 2
    rate = copy_rate(w_bytes // 4, args.reps)  # a quarter of W, copied
    floor_ms = 1e3 * 2 * w_bytes / rate
    name = torch.cuda.get_device_name()
    print(f"{name}: rank {r} into {n_mats} matrices {d}x{d} bf16 (q/k/v/o x {L} layers), {S} slots; "
          f"copy {rate / 1e9:.0f} GB/s -> floor {floor_ms:.2f} ms (W read + written)")
    out = {"device": name, "layers": L, "width": d, "rank": r, "slots": S, "copy_gb_s": rate / 1e9, "floor_ms": floor_ms}

    def switcher_times(sw) -> dict[str, float]:
        for slot in (3, 5, None):  # warm-up
            sw.switch(slot)
        times = {"merge": [], "swap": [], "unmerge": []}
        for _ in range(args.reps):
            times["merge"].append(sw.switch(3))
            times["swap"].append(sw.switch(5))
            times["unmerge"].append(sw.switch(None))
        return {k: 1e3 * statistics.median(v) for k, v in times.items()}

    for cls in (SwiftSwitcher, PerLayerSwitcher):
        t = switcher_times(cls(runner))
        out[cls.name] = t
        print(f"  {cls.name + ' switcher':22s} merge {t['merge']:6.2f} ms  swap {t['swap']:6.2f} ms  unmerge {t['unmerge']:6.2f} ms"
              f"  ({max(t.values()) / floor_ms:.2f}x floor at worst)")
    # The merge operator alone, on contiguous A and B: what the swift switcher adds is the rest.
    A = [torch.randn(L * M, r, d, device="cuda", dtype=dt) * 0.01 for M in (3, 1)]
    B = [torch.randn(L * M, d, r, device="cuda", dtype=dt) * 0.01 for M in (3, 1)]
    Ws = [g.stack.view(-1, d, d) for g in runner.groups.values()]
    op_ms = timed(lambda: [merge_lora(w, a, b, 1.0, 1) for w, a, b in zip(Ws, A, B)], args.reps)
    A2 = [torch.cat([a, a], dim=1) for a in A]
    B2 = [torch.cat([b, -b], dim=2) for b in B]
    op2_ms = timed(lambda: [merge_lora(w, a, b, 1.0, 1) for w, a, b in zip(Ws, A2, B2)], args.reps)
    out["operator_ms"] = {"rank": op_ms, "rank_x2": op2_ms}
    print(f"  {'merge operator alone':22s} rank {r} {op_ms:6.2f} ms, rank {2 * r} (a swap) {op2_ms:6.2f} ms")
    worst = max(out["swift"].values())
    out["target_ms"] = TARGET_X_FLOOR * floor_ms
    out["meets_target"] = worst <= TARGET_X_FLOOR * floor_ms
    print(f"target: swift merge/swap/unmerge <= {TARGET_X_FLOOR}x floor = {TARGET_X_FLOOR * floor_ms:.2f} ms: "
          f"{'MET' if out['meets_target'] else 'NOT MET'} (worst {worst:.2f} ms)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
