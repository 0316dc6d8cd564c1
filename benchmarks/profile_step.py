"""Profile engine steps (torch.profiler): where the time of one decode step goes, CPU and GPU.

    python benchmarks/profile_step.py --work /tmp/vlora-bench --batch 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/vlora-bench")
    ap.add_argument("--preset", default="configs/models/llava-1.5-7b.yaml")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from vlora.config import EngineConfig
    from vlora.engine.api import GenerationRequest, SamplingParams
    from vlora.engine.builder import build_engine

    model_dir = Path(args.work) / Path(args.preset).stem
    engine = build_engine(EngineConfig().with_overrides({"model.path": str(model_dir), "model.dtype": "bfloat16",
                                                         "cache.num_blocks": "4096", "lora.max_gpu_adapters": "2"}))
    for n in [int(b) for b in args.batches.split(",")]:
        for i in range(n):
            req = GenerationRequest(f"p{n}-{i}", "Describe the scene in detail.", sampling=SamplingParams(max_tokens=40, ignore_eos=True))
            engine.add_request(engine.inputs.prepare(req), lambda o: None)
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        print(f"batch {n}: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms/step (unprofiled)", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table, flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), flush=True)
        while engine.has_work():
            engine.step()


if __name__ == "__main__":
    sys.exit(main())
