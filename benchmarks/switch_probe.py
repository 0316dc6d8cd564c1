"""Where a mode switch's time goes at 7B width: one merge of rank 64 into q/k/v/o of 32 layers, timed
eagerly between device synchronisations (as the orchestrator times a switch), by its parts.

    python benchmarks/switch_probe.py     # CUDA only; prints one line per variant

Variants: stacked ``baddbmm_`` per projection (the swift switcher's operator), the extension's merge
kernels, the swift switcher's gathering of A/B from the slot buffers, and per-matrix ``addmm_``.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch


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


def main() -> int:
    if not torch.cuda.is_available():
        print("switch_probe: needs CUDA")
        return 0
    from vlora.atmm.merge import merge_lora

    L, d, r, mods, slots = 32, 4096, 64, 4, 8
    dt = torch.bfloat16
    W = [torch.randn(L, d, d, device="cuda", dtype=dt) for _ in range(mods)]
    A = torch.randn(L, r, d, device="cuda", dtype=dt) * 0.01
    B = torch.randn(L, d, r, device="cuda", dtype=dt) * 0.01
    slot_a = [torch.randn(slots, r, d, device="cuda", dtype=dt) for _ in range(L)]  # per layer, like LoraLinear
    slot_b = [torch.randn(slots, d, r, device="cuda", dtype=dt) for _ in range(L)]
    gb = mods * L * d * d * 2 * 2 / 1e9
    print(f"{torch.cuda.get_device_name()}: merge rank {r} into {mods} x {L} x {d}x{d} bf16; W read+written = {gb:.1f} GB")
    rows = {
        "baddbmm_ x4 (swift's operator)": lambda: [merge_lora(w, A, B, 1.0, 1) for w in W],
        "gather A/B from slot buffers x4 (torch.stack)": lambda: [(torch.stack([x[3] for x in slot_a]),
                                                                  torch.stack([x[3] for x in slot_b])) for _ in range(mods)],
        "per-matrix addmm_ (128 calls)": lambda: [w[i].addmm_(B[i], A[i]) for w in W for i in range(L)],
    }
    for backend in ("cutlass", "fused"):
        try:
            merge_lora(W[0], A, B, 1.0, 1, backend=backend)
            rows[f"extension merge ({backend}) x4"] = lambda b=backend: [merge_lora(w, A, B, 1.0, 1, backend=b) for w in W]
        except (ValueError, RuntimeError) as e:
            print(f"  extension merge ({backend}): not available ({e})")
    for name, fn in rows.items():
        ms = timed(fn)
        print(f"  {name:48s} {ms:8.2f} ms" + (f"  ({gb / ms:.2f} TB/s of W traffic)" if "gather" not in name else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
