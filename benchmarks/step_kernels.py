"""The decode step's small kernels on the GPU, for choosing their launch rules by measurement:

- paged decode attention (``vlora.engine.attention.paged_decode``) at the 7B shapes (H = Hkv = 32,
  D = 128, bf16, block 16) for each batch and context, with every context split count tried beside the
  one the rule picks, against the KV bytes / copy rate floor;
- the residual add + RMSNorm (``fused_ops.add_rms_norm``, PyTorch's summation order) against a one-pass
  kernel that keeps the row in registers (``fused_ops.add_rms_norm(..., impl="fast")``), for T rows of 4096.

Each is timed as CUDA-graph replays (``vlora.atmm.timing.graph_time_us``, median per call) of calls over rotated buffers larger than L2 (attention) or, for the
norm, over the few rows a step has (they sit in L2 in a real step too).

    python -m benchmarks.step_kernels [--batches 1,8,32,64] [--contexts 700,2000] [--rows 1,8,32,64,600]
    python -m benchmarks.step_kernels --check-host 10   # exit 3 on a host whose kernels run slow (see below)

Prints one line per point; writes nothing. Some device hosts run every kernel 4-12x slow (the plain graphed
step included) while the copy probe reads normal; ``--check-host`` tells them apart in a few seconds, so that a
device call can stop before spending its time (benchmarks/device_engine.sh runs it first).
"""
from __future__ import annotations

import argparse
import functools

import torch

from vlora.atmm.timing import graph_time_us


def attention(batches, contexts, copy_gbs: float) -> None:
    from vlora.engine import attention as attn

    dev, H, D, BS, dtype = torch.device("cuda"), 32, 128, 16, torch.bfloat16
    sms = attn.num_sms(dev)
    for ctx in contexts:
        for B in batches:
            nb = -(-ctx // BS)
            layer_bytes = 2 * B * ctx * H * D * 2
            n_pools = max(2, min(16, -(-400 * 2**20 // layer_bytes)))
            pools = []
            for i in range(n_pools):
                k = torch.randn(B * nb * BS, H, D, device=dev, dtype=dtype)
                pools.append((k, torch.randn_like(k)))
            tables = torch.randperm(B * nb, device=dev, dtype=torch.int32).view(B, nb)
            # the graphs' metadata is as wide as the model's longest context: splits follow that width
            wide = torch.zeros(B, 8192 // BS, dtype=torch.int32, device=dev)
            wide[:, :nb] = tables
            lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(B, H, D, device=dev, dtype=dtype)
            out = torch.empty_like(q)
            rule = attn.decode_config(B, H, 1, D, wide.shape[1] * BS, dtype, sms).num_splits
            floor_ms = layer_bytes / (copy_gbs * 1e9) * 1e3
            row = [f"B={B} ctx={ctx}: floor {floor_ms * 1e3:.0f} us, rule {rule} split(s)"]
            for splits in sorted({1, 2, 3, 4, 6, 8, 12, 16, rule}):
                if splits > max(1, ctx // 64):
                    continue
                ws = attn.decode_workspace(B, H, D, splits, dev) if splits > 1 else None

                calls = [functools.partial(attn.paged_decode, q, k, v, wide, lens, D ** -0.5, BS, out=out, workspace=ws,
                                           num_splits=splits) for k, v in pools]
                ms = graph_time_us(calls) / 1e3
                row.append(f"{splits}: {ms * 1e3:.0f} us ({ms / floor_ms:.2f}x)")
            print("  ".join(row), flush=True)
            del pools


def norms(rows_list) -> dict:
    from vlora.engine import fused_ops as fo

    dev, H, dtype = torch.device("cuda"), 4096, torch.bfloat16
    w = torch.rand(H, device=dev, dtype=dtype) + 0.5
    times = {}
    for T in rows_list:
        n = 65
        xs = [torch.randn(T, H, device=dev, dtype=dtype) for _ in range(n)]
        rs = [torch.randn(T, H, device=dev, dtype=dtype) for _ in range(n)]
        outs = [torch.empty(T, H, device=dev, dtype=dtype) for _ in range(n)]
        row = [f"T={T}:"]
        x, r = torch.randn(T, H, device=dev, dtype=dtype), torch.randn(T, H, device=dev, dtype=dtype)
        ref = fo.add_rms_norm(x, r, w, 1e-5, impl="torch")[0].float()
        res = {}
        for impl in ("triton", "fast"):
            calls = [functools.partial(fo.add_rms_norm, xi, ri, w, 1e-5, out=o, residual_out=ri, impl=impl)
                     for xi, ri, o in zip(xs, rs, outs)]
            ms = graph_time_us(calls) / 1e3
            times[(impl, T)] = ms * 1e3
            bytes_ = 4 * T * H * 2
            row.append(f"{impl} {ms * 1e3:.1f} us ({bytes_ / ms / 1e6:.0f} GB/s)")
            res[impl] = fo.add_rms_norm(x, r, w, 1e-5, impl=impl)[0]
            row.append(f"[max |diff| vs eager {(res[impl].float() - ref).abs().max().item():.3g}]")
        row.append(f"fast == triton: {torch.equal(res['fast'], res['triton'])}")
        print("  ".join(row), flush=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="700,2000")
    ap.add_argument("--rows", default="1,8,32,64,600")
    ap.add_argument("--skip", default="", help="attention and/or norm")
    ap.add_argument("--check-host", type=float, metavar="US",
                    help="only time the PyTorch-order RMSNorm on 8 rows and exit 3 when it takes more than US "
                         "microseconds (4.4-5.1 us on normal H200 hosts, 15-20 us on the slow ones seen)")
    args = ap.parse_args()
    from vlora.atmm.timing import copy_bandwidth_gbs

    if args.check_host is not None:
        us = norms([8])[("triton", 8)]
        if us > args.check_host:
            print(f"slow host: RMSNorm on 8 rows {us:.1f} us > {args.check_host} us", flush=True)
            raise SystemExit(3)
        return
    rate = copy_bandwidth_gbs()
    print(f"copy {rate:.0f} GB/s", flush=True)
    if "norm" not in args.skip:
        norms([int(t) for t in args.rows.split(",")])
    if "attention" not in args.skip:
        attention([int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")], rate)


if __name__ == "__main__":
    main()
