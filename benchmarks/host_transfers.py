"""What a cold adapter's bytes cost on the host, before the GPU sees them: page-locking fresh host memory
(cudaHostAlloc through PyTorch's pinned allocator), filling fresh pageable memory, and the host-to-device
copy from each, on one thread and on the adapter loader's 8 threads at once; and how long a thread that
launches kernels (the engine's) stalls while the loaders page-lock memory.

    python -m benchmarks.host_transfers [--gb 2] [--threads 8]

Writes ``benchmarks/results/host-transfers-<device>.json`` (``--no-record``: only prints).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, device_name, git_commit


def _in_threads(n: int, fn) -> float:
    """Seconds for ``n`` threads running ``fn(i)`` at once."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pin_rate(total: int, chunk: int, threads: int) -> float:
    """GB/s of fresh page-locked allocations of ``chunk`` bytes, ``total`` in all, over ``threads`` threads
    (each chunk size is used once per process: PyTorch's pinned cache would hand back freed blocks)."""
    keep: list = []
    per = total // threads // chunk

    def work(_):
        mine = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(per)]
        keep.append(mine)
    return per * threads * chunk / _in_threads(threads, work) / 1e9


def pageable_rate(total: int, threads: int) -> float:
    """GB/s of fresh pageable memory written once (the page faults of a host tier in pageable memory)."""
    keep: list = []

    def work(_):
        t = torch.empty(total // threads, dtype=torch.uint8)
        t.fill_(1)
        keep.append(t)
    return total / _in_threads(threads, work) / 1e9


def copy_rate(src: torch.Tensor, dev: torch.device) -> float:
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    return src.numel() / (time.perf_counter() - t0) / 1e9


def launch_stall(dev: torch.device, busy, seconds: float = 1.0) -> dict:
    """The gaps between tiny kernel launches + syncs on this thread while ``busy()`` runs on another,
    against the same loop alone for ``seconds``."""
    x = torch.zeros(16, device=dev)

    def gaps_while(alive) -> list[float]:
        gaps, last = [], time.perf_counter()
        while alive():
            x.add_(1)
            torch.cuda.synchronize(dev)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        return sorted(gaps)

    end = time.perf_counter() + seconds
    alone = gaps_while(lambda: time.perf_counter() < end)
    worker = threading.Thread(target=busy)
    worker.start()
    beside = gaps_while(worker.is_alive)
    worker.join()
    return {"alone_max_ms": round(1e3 * alone[-1], 3), "alone_p50_ms": round(1e3 * alone[len(alone) // 2], 4),
            "beside_max_ms": round(1e3 * beside[-1], 3), "beside_p50_ms": round(1e3 * beside[len(beside) // 2], 4),
            "beside_p99_ms": round(1e3 * beside[int(0.99 * (len(beside) - 1))], 3), "launches_beside": len(beside)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="bytes per measurement, in GB")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_transfers: needs CUDA")
    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)
    total = int(args.gb * 1e9) // (64 << 20) * (64 << 20)
    n = args.threads
    r = {"device": device_name(), "commit": git_commit(), "bytes": total, "threads": n}
    r["pin_gbs_1_thread"] = round(pin_rate(total, 16 << 20, 1), 3)
    r["pin_gbs_threads"] = round(pin_rate(total, 32 << 20, n), 3)
    r["pin_gbs_1_thread_64mib"] = round(pin_rate(total, 64 << 20, 1), 3)
    r["pageable_fill_gbs_1_thread"] = round(pageable_rate(total, 1), 3)
    r["pageable_fill_gbs_threads"] = round(pageable_rate(total, n), 3)
    r["h2d_gbs_from_pinned"] = round(copy_rate(torch.empty(total // 4, dtype=torch.uint8, pin_memory=True).fill_(1), dev), 3)
    r["h2d_gbs_from_pageable"] = round(copy_rate(torch.ones(total // 4, dtype=torch.uint8), dev), 3)
    r["launch_stall_while_pinning"] = launch_stall(dev, lambda: pin_rate(total // 2, 8 << 20, n))
    r["launch_stall_while_pageable_fill"] = launch_stall(dev, lambda: pageable_rate(total, n))
    print(json.dumps(r, indent=1))
    if not args.no_record:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"host-transfers-{r['device']}.json").write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
