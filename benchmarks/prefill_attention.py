"""Prefill attention kernels on the GPU: the Triton paged kernel (its default launch and the launches named
by ``--triton``) against PyTorch's FlashAttention-2 varlen kernel (``fa2``) and cuDNN's fused attention
through SDPA (``cudnn``: the prompt's K/V gathered from the pools, then SDPA on [1, H, T, D] views), and
the ``flash`` backend (which picks one of them by its thresholds for fresh prompts), per layer call at
the 7B model's shapes (H=32, D=128, bf16), for one prompt of T tokens. Each is timed as CUDA-graph
replays over rotated inputs (q and the pools of enough layers to exceed twice the L2 cache), with its
causal-attention FLOPs and the rate they imply beside the measured bf16 matmul rate (the floor), and
checked against the reference (SDPA over the gathered prompt).

    python -m benchmarks.prefill_attention --tokens 600,2300,8000 [--kv-heads 32] [--triton m64n64w4s3,...]

A Triton launch label is ``m<block_m>n<block_n>w<warps>s<stages>``, with ``-o`` for the grid in order
(no heavy-first) and ``-u`` for the causal mask on every key tile (no split); ``default`` is
``prefill_config``'s choice. Prints one line per T and launch; ``--json`` writes them (a probe for
``prefill_config`` and engine.attention's ``auto``: the engine figures are engine_floor.py's prefill points).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

DEFAULT_TRITON = "default,m128n64w8s3-o-u,m128n64w8s3,m64n64w4s3,m64n64w4s2,m64n32w4s3,m64n128w8s3,m32n64w4s3"


def parse_launch(label: str):
    from vlora.engine import attention as attn

    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)((?:-[ou])*)", label)
    if not m:
        raise SystemExit(f"--triton: {label!r} is not m<block_m>n<block_n>w<warps>s<stages>[-o][-u]")
    flags = m.group(5)
    return attn.PrefillConfig(block_m=int(m.group(1)), block_n=int(m.group(2)), num_warps=int(m.group(3)),
                              num_stages=int(m.group(4)), heavy_first="-o" not in flags, split_mask="-u" not in flags)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="600,2300,8000")
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--triton", default=DEFAULT_TRITON, help=f"Triton launches (default {DEFAULT_TRITON})")
    ap.add_argument("--others", default="fa2,cudnn,flash", help="the other kernels (fa2, cudnn, flash)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from vlora.atmm.timing import graph_time_us, matmul_tflops
    from vlora.engine import attention as attn
    from vlora.engine.attention import AttentionMetadata

    dev, H, D, BS, dtype = torch.device("cuda"), 32, 128, 16, torch.bfloat16
    peak = matmul_tflops()
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    print(f"{torch.cuda.get_device_name(dev)}: bf16 matmul {peak:.0f} TFLOP/s, L2 {l2 >> 20} MiB; "
          f"default launch {attn.prefill_config(D, dtype, attn._large_smem(dev))}; flash available: "
          f"{attn.flash_available(dev)}", flush=True)
    rows, bad = [], 0
    for T in [int(t) for t in args.tokens.split(",")]:
        nb = -(-T // BS)
        per_set = 3 * T * H * D * 2  # q, k, v (bf16)
        sets = max(1, min(16, -(-2 * l2 // per_set)))
        table = torch.randperm(nb).tolist()
        meta = AttentionMetadata.for_prefill([table], [T], [T], dev)
        meta.fresh_rows = torch.tensor([table[p // BS] * BS + p % BS for p in range(T)], device=dev)
        data = []
        for _ in range(sets):
            k = torch.randn(nb * BS, args.kv_heads, D, device=dev, dtype=dtype)
            data.append((torch.randn(T, H, D, device=dev, dtype=dtype), k, torch.randn_like(k), torch.empty(T, H, D, device=dev, dtype=dtype)))
        q0, k0, v0, _ = data[0]
        ref = attn.paged_prefill_reference(q0.float(), k0.float(), v0.float(), meta.cu_seqlens_q, meta.seq_lens,
                                           meta.block_tables, T, D ** -0.5, BS)
        flops = 4 * T * T / 2 * H * D  # QK^T and PV, causal half
        triton_backend = attn.get_attention_backend("triton", dev)

        def call(name, q, k, v, out):
            if name == "cudnn":
                return lambda: attn.cudnn_prefill(q, k, v, meta.fresh_rows, [T], D ** -0.5, out)
            if name == "fa2":
                return lambda: out.copy_(attn.flash_prefill(q, k, v, meta.cu_seqlens_q, meta.fresh_rows, T, D ** -0.5))
            if name == "flash":
                backend = attn.get_attention_backend("flash", dev)
                return lambda: backend.prefill(q, k, v, meta, D ** -0.5, BS, out=out)
            cfg = None if name == "default" else parse_launch(name)
            return lambda: attn.paged_prefill(q, k, v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, T,
                                              D ** -0.5, BS, out=out, cfg=cfg)

        names = [n for n in args.triton.split(",") if n] + [n for n in args.others.split(",") if n]
        best = None
        for name in names:
            row = {"tokens": T, "kernel": name, "sets": sets}
            try:
                calls = [call(name, *d) for d in data]
                calls[0]()
                torch.cuda.synchronize()
                row["max_err"] = (data[0][3].float() - ref).abs().max().item()
                us = graph_time_us(calls)
            except Exception as e:  # one kernel's failure is a line, not the end of the probe
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                print(f"T={T} {name:18s} failed: {row['error']}", flush=True)
                rows.append(row)
                continue
            row.update(us=us, tflops=flops / us / 1e6, of_matmul=flops / us / 1e6 / peak)
            bad += row["max_err"] > 0.05
            rows.append(row)
            if name not in ("fa2", "cudnn", "flash") and (best is None or us < best[1]):
                best = (name, us)
            print(f"T={T} {name:18s} {us:8.1f} us  {row['tflops']:5.0f} TFLOP/s  {row['of_matmul']:.2f} of matmul  "
                  f"max err {row['max_err']:.3g}", flush=True)
        if best:
            print(f"T={T} fastest Triton launch: {best[0]} {best[1]:.1f} us", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "matmul_tflops": peak,
                                               "rows": rows}, indent=1))
    if bad:
        print(f"{bad} launches off the reference by more than 0.05", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
