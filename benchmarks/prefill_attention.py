"""Prefill attention kernels on the GPU: the Triton paged kernel against PyTorch's FlashAttention-2 varlen
kernel (``fa2``) and cuDNN's fused attention through SDPA (``cudnn``: the prompt's K/V gathered from the
pools, then SDPA on [1, H, T, D] views), and the ``flash`` backend (which picks one of them by its
thresholds for fresh prompts), per layer call at the 7B model's shapes (H=32, D=128,
bf16), for one prompt of T tokens; each timed as CUDA-graph replays, with its causal-attention FLOPs and
the rate they imply beside the measured bf16 matmul rate (the floor).

    python benchmarks/prefill_attention.py --tokens 600,2300,8000 [--kv-heads 32]

Prints one line per T; writes nothing (a probe for choosing engine.attention's ``auto``: the engine
figures are in engine_floor.py's prefill points).
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="600,2300,8000")
    ap.add_argument("--kv-heads", type=int, default=32)
    args = ap.parse_args()
    from vlora.atmm.timing import graph_time_us, matmul_tflops
    from vlora.engine import attention as attn
    from vlora.engine.attention import AttentionMetadata

    dev, H, D, BS, dtype = torch.device("cuda"), 32, 128, 16, torch.bfloat16
    peak = matmul_tflops()
    print(f"bf16 matmul {peak:.0f} TFLOP/s; flash available: {attn.flash_available(dev)}", flush=True)
    for T in [int(t) for t in args.tokens.split(",")]:
        nb = -(-T // BS)
        table = torch.randperm(nb).tolist()
        k = torch.randn(nb * BS, args.kv_heads, D, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(T, H, D, device=dev, dtype=dtype)
        meta = AttentionMetadata.for_prefill([table], [T], [T], dev)
        meta.fresh_rows = torch.tensor([table[p // BS] * BS + p % BS for p in range(T)], device=dev)
        flops = 4 * T * T / 2 * H * D  # QK^T and PV, causal half
        row = [f"T={T}"]
        triton_backend = attn.get_attention_backend("triton", dev)
        for name in ("triton", "fa2", "cudnn", "flash"):
            out = torch.empty_like(q)
            if name == "cudnn":
                run = lambda: attn.cudnn_prefill(q, k, v, meta.fresh_rows, [T], D ** -0.5, out)  # noqa: E731
            elif name == "fa2":
                run = lambda: out.copy_(attn.flash_prefill(q, k, v, meta.cu_seqlens_q, meta.fresh_rows, T,  # noqa: E731
                                                           D ** -0.5))
            else:  # the engine's backends: the flash backend picks by the thresholds
                backend = triton_backend if name == "triton" else attn.get_attention_backend(name, dev)
                run = lambda: backend.prefill(q, k, v, meta, D ** -0.5, BS, out=out)  # noqa: E731
            try:
                run()
            except RuntimeError as e:
                row.append(f"{name} failed: {str(e).splitlines()[0][:120]}")
                continue
            if name != "triton":
                ref = triton_backend.prefill(q, k, v, meta, D ** -0.5, BS)
                row.append(f"[{name} max err vs triton {(out.float() - ref.float()).abs().max().item():.3g}]")
            ms = graph_time_us([run]) / 1e3
            row.append(f"{name} {ms * 1e3:.0f} us ({flops / ms / 1e9:.0f} TFLOP/s, {flops / ms / 1e9 / peak:.2f} of matmul)")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
