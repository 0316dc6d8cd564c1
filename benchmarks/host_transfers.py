"""What a cold adapter's bytes cost on the host, before the GPU sees them: page-locking fresh host memory
(cudaHostAlloc through PyTorch's pinned allocator), filling fresh pageable memory, and the host-to-device
copy from each, on one thread and on the adapter loader's 8 threads at once; and how long a thread that
launches kernels (the engine's) stalls while the loaders page-lock memory. With ``--adapters DIR --model DIR``
(serve_burst's adapters and model: ``/tmp/vlora-bench/burst-adapters-r64/served``, ``/tmp/vlora-bench/llava-1.5-7b``),
also a cold adapter's two host stages with no server beside them: the read (``load_adapter``, as the engine's
loader threads call it) and the slot copy's staging (``PinnedStager.put_many`` into device memory), one at a time
and four at once; set beside serve_burst's ``adapter_read`` and ``adapter_copy_work`` they tell the host's own
cost from the cost of sharing it with a running server (benchmarks/NOTES.md).

    python -m benchmarks.host_transfers [--gb 2] [--threads 8] [--adapters DIR --model DIR [--only-adapters]]

Writes ``benchmarks/results/host-transfers-<device>.json`` (``--no-record``: only prints).
"""
from __future__ import annotations

import argparse
import json
import sys
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


def adapter_stages(adapters: Path, model: Path, dev: torch.device, count: int = 8, threads: int = 4) -> dict:
    """Read ``count`` adapters of ``adapters`` (one at a time, then ``threads`` at once, each name once: the files
    in the page cache after a first untimed pass), and stage each read adapter into device memory through a
    PinnedStager of its own thread (one at a time, then ``threads`` at once). Figures per adapter: ms and GB/s."""
    from transformers import AutoConfig

    from vlora.lora.adapter import decoder_module_dims, load_adapter
    from vlora.lora.transfers import PinnedStager

    names = sorted(p.name for p in adapters.iterdir() if (p / "adapter_model.safetensors").is_file())[:2 * count]
    if len(names) < 2 * count:
        raise SystemExit(f"host_transfers: {adapters} holds {len(names)} adapters; {2 * count} are needed")
    text = AutoConfig.from_pretrained(model)
    text = getattr(text, "text_config", None) or text
    dims = decoder_module_dims(text)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def read(name: str):
        return load_adapter(adapters, name, num_layers=text.num_hidden_layers, module_dims=dims, max_rank=256,
                            supported_modules=tuple(dims), dtype=dtype, one_buffer=dev.type == "cuda")

    for name in names:  # into the page cache, untimed
        (adapters / name / "adapter_model.safetensors").read_bytes()

    def timed_reads(batch: list[str], n: int) -> tuple[float, list]:
        out: list = [None] * len(batch)

        def work(i: int) -> None:
            for k in range(i, len(batch), n):
                out[k] = read(batch[k])
        return _in_threads(n, work), out

    one_s, weights = timed_reads(names[:count], 1)
    many_s, more = timed_reads(names[count:], threads)
    size = sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in weights[0].pairs.values())
    r = {"adapters": count, "adapter_mb": round(size / 1e6, 1), "threads": threads,
         "read_ms_one_at_a_time": round(1e3 * one_s / count, 1), "read_gbs_one_at_a_time": round(size * count / one_s / 1e9, 2),
         f"read_ms_{threads}_at_once": round(1e3 * many_s / count * threads, 1),
         f"read_gbs_{threads}_at_once": round(size * count / many_s / 1e9, 2)}
    if dev.type != "cuda":
        return r
    slots = [[torch.empty_like(t, device=dev) for p in w.pairs.values() for t in (p.a, p.b)] for w in weights + more]
    sources = [[t for p in w.pairs.values() for t in (p.a, p.b)] for w in weights + more]

    def timed_staging(items: list[int], n: int) -> float:
        def work(i: int) -> None:
            stager = PinnedStager(nbytes=size + 256 * len(slots[0]))  # an adapter per buffer, as the server sizes them
            stream = torch.cuda.Stream(dev)
            with torch.cuda.stream(stream):
                for k in items[i::n]:
                    stager.put_many(slots[k], sources[k])
                    stager.close_buffer()
            stream.synchronize()
        return _in_threads(n, work)

    timed_staging([0], 1)  # the page-locked buffers of one stager, once (the server makes them at start)
    one_s = timed_staging(list(range(count)), 1)
    many_s = timed_staging(list(range(count, 2 * count)), threads)
    r.update({"staging_ms_one_at_a_time": round(1e3 * one_s / count, 1),
              "staging_gbs_one_at_a_time": round(size * count / one_s / 1e9, 2),
              f"staging_ms_{threads}_at_once": round(1e3 * many_s / count * threads, 1),
              f"staging_gbs_{threads}_at_once": round(size * count / many_s / 1e9, 2)})
    return r


def read_parts(adapters: Path, threads: int = 8, per_thread: int = 2) -> dict:
    """A cold adapter's read split into its parts, ``threads`` reads at once (as the loader threads read), each
    thread ``per_thread`` files (the files in the page cache): ms per read for ``readv`` into fresh memory
    (``OneRead.read_all``, NumPy's huge-page advice as it is, then turned off), into memory each thread faulted in
    before (the copy out of the page cache alone), and into page-locked memory; then the norms of the parsed
    tensors, ``_l2_norms`` against one ``_foreach_norm`` with an fp32 result."""
    import numpy as np

    from vlora.files import OneRead
    from vlora.lora.peft_format import _l2_norms, _parse_safetensors, _safetensors_header

    names = sorted(p.name for p in adapters.iterdir() if (p / "adapter_model.safetensors").is_file())
    names = (names * (threads * per_thread))[:threads * per_thread]
    paths = [adapters / n / "adapter_model.safetensors" for n in names]
    size = max(p.stat().st_size for p in paths)
    for p in paths:
        p.read_bytes()
    own: dict[str, list] = {"reused": [], "pinned": []}
    for _ in range(threads):
        own["reused"].append(np.ones(size + 1, dtype=np.uint8))
        if torch.cuda.is_available():
            own["pinned"].append(torch.empty(size + 1, dtype=torch.uint8, pin_memory=True).numpy())

    def readv_into(path: Path, buf) -> int:
        with OneRead(path) as f:
            return f.read_into(buf)

    def phase(fn) -> float:
        def work(i: int) -> None:
            for k in range(i, len(paths), threads):
                fn(i, paths[k])
        return round(1e3 * _in_threads(threads, work) / len(paths) * threads, 1)

    def fresh(_, path):
        with OneRead(path) as f:
            f.read_all(8 * size)

    from numpy._core import multiarray as nm
    huge = nm._get_madvise_hugepage()
    r = {"threads": threads, "reads": len(paths), "adapter_mb": round(size / 1e6, 1), "numpy_hugepage_advice": huge,
         "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()}
    r["readv_fresh_ms"] = phase(fresh)
    nm._set_madvise_hugepage(not huge)
    r["readv_fresh_other_advice_ms"] = phase(fresh)
    nm._set_madvise_hugepage(huge)
    r["readv_reused_ms"] = phase(lambda i, p: readv_into(p, own["reused"][i]))
    if own["pinned"]:
        r["readv_pinned_ms"] = phase(lambda i, p: readv_into(p, own["pinned"][i]))
    parsed = []
    for p in paths[:threads]:
        with OneRead(p) as f:
            header, hb = _safetensors_header(f, p.name)
            data = f.read_all(8 * size)
        parsed.append(list(_parse_safetensors(data, header, len(hb), p.name).values()))
    r["norms_l2_norms_ms"] = phase(lambda i, p: _l2_norms(parsed[i]))
    r["norms_foreach_fp32_ms"] = phase(
        lambda i, p: torch.stack(torch._foreach_norm(parsed[i], 2, dtype=torch.float32)).tolist())
    return r


def read_burst(adapters: Path, model: Path, count: int = 32, workers: int = 8) -> dict:
    """``count`` adapters asked for at once, read as the server reads them (``load_adapter`` on an AdapterLoader of
    ``workers`` threads, in the slots' dtype, one buffer each): when the first, the median and the last read
    finished (ms from the burst), and a read's mean: at this process's intra-op thread count and at one (each
    loader's torch calls fan out over that many threads), then beside a thread that keeps the GIL busy."""
    from transformers import AutoConfig

    from vlora.lora.adapter import decoder_module_dims, load_adapter
    from vlora.lora.transfers import AdapterLoader

    names = sorted(p.name for p in adapters.iterdir() if (p / "adapter_model.safetensors").is_file())
    text = AutoConfig.from_pretrained(model)
    text = getattr(text, "text_config", None) or text
    dims = decoder_module_dims(text)
    for name in names:
        (adapters / name / "adapter_model.safetensors").read_bytes()
    out = {"adapters": count, "workers": workers}
    default, interval = torch.get_num_threads(), sys.getswitchinterval()
    cases = [(f"intraop_{n}", n, None) for n in dict.fromkeys((default, 1))]
    # beside a thread that runs Python without a pause (an engine thread whose host work bounds its steps), whose
    # GIL each reader must wait for after each call that released it, at the default switch interval and at 1 ms
    cases += [("intraop_1_busy_thread", 1, interval), ("intraop_1_busy_thread_switch_1ms", 1, 0.001)]
    for case, threads, switch in cases:
        torch.set_num_threads(threads)
        stop = threading.Event()
        if switch is not None:
            sys.setswitchinterval(switch)

            def spin() -> None:
                x = 0
                while not stop.is_set():
                    x = (x + 1) % 1000
            threading.Thread(target=spin, daemon=True).start()
        loader = AdapterLoader(max_workers=workers)
        t0 = time.perf_counter()
        took: list[float] = []

        def read(name: str) -> float:
            start = time.perf_counter()
            load_adapter(adapters, name, num_layers=text.num_hidden_layers, module_dims=dims, max_rank=256,
                         supported_modules=tuple(dims), dtype=torch.bfloat16, one_buffer=True)
            took.append(time.perf_counter() - start)
            return time.perf_counter() - t0

        futs = [loader.submit(read, names[i % len(names)]) for i in range(count)]
        done = sorted(1e3 * f.result() for f in futs)
        stop.set()
        sys.setswitchinterval(interval)
        out[case] = {"first_ms": round(done[0]), "p50_ms": round(done[len(done) // 2]),
                                     "last_ms": round(done[-1]), "read_ms_mean": round(1e3 * sum(took) / len(took))}
    torch.set_num_threads(default)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="bytes per measurement, in GB")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--adapters", help="a folder of PEFT adapters (16 or more) to time a cold adapter's host stages on")
    ap.add_argument("--model", help="the model folder those adapters are for (its dimensions)")
    ap.add_argument("--only-adapters", action="store_true", help="only the adapter stages (on a CPU: only the reads)")
    ap.add_argument("--read-parts", action="store_true", help="with --adapters: only a read's parts, 8 reads at once")
    ap.add_argument("--read-burst", action="store_true", help="with --adapters and --model: only 32 reads asked at once")
    args = ap.parse_args()
    if args.read_burst:
        if not (args.adapters and args.model):
            ap.error("--read-burst needs --adapters and --model")
        print(json.dumps(read_burst(Path(args.adapters), Path(args.model)), indent=1))
        return
    if args.read_parts:
        if not args.adapters:
            ap.error("--read-parts needs --adapters")
        print(json.dumps(read_parts(Path(args.adapters), args.threads), indent=1))
        return
    if args.only_adapters:
        if not (args.adapters and args.model):
            ap.error("--only-adapters needs --adapters and --model")
        dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        print(json.dumps(adapter_stages(Path(args.adapters), Path(args.model), dev), indent=1))
        return
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
    if args.adapters and args.model:
        r["adapter_stages"] = adapter_stages(Path(args.adapters), Path(args.model), dev)
    print(json.dumps(r, indent=1))
    if not args.no_record:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"host-transfers-{r['device']}.json").write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
