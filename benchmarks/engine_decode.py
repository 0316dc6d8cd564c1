"""Decode throughput of the engine in-process (no server): tokens/s at batch 1 and 32, base model and a
mixed batch of distinct rank-64 adapters, with the model and adapters that serve_decode.py writes.

    python -m benchmarks.engine_decode --work /tmp/vlora-bench --preset configs/models/llava-1.5-7b.yaml

Every request decodes ``--max-tokens`` tokens (EOS ignored); the rate counts decode steps only, after
every request of the batch has finished its prefill. Writes results/engine-decode-<device>.json.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import device_name, git_commit, record_result


def run(engine, n: int, adapters: list, max_tokens: int, policy: str) -> dict:
    import torch

    from vlora.engine.api import GenerationRequest, SamplingParams

    done = []
    for i in range(n):
        req = GenerationRequest(f"{policy}-{n}-{i}-{time.monotonic_ns()}", "Describe the scene in detail, listing every object.",
                                lora_name=adapters[i % len(adapters)], sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        engine.add_request(engine.inputs.prepare(req), lambda out: done.append(out) if out.finished else None)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    while any(not s.prefilled for s in engine.running + list(engine.waiting)):
        engine.step()
    sync()
    t0, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    sync()
    dt = time.perf_counter() - t0
    assert len(done) == n and all(o.num_output_tokens == max_tokens for o in done), "not every request finished in full"
    toks = n * (max_tokens - 1)  # every token after the prefill's first
    return {"batch": n, "decode_tokens_per_s": toks / dt, "step_ms": 1e3 * dt / max(steps, 1), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/vlora-bench")
    ap.add_argument("--preset", default="configs/models/llava-1.5-7b.yaml")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()

    import torch

    from vlora.config import EngineConfig
    from vlora.engine.builder import build_engine

    model_dir = Path(args.work) / Path(args.preset).stem
    adapters_dir = Path(args.work) / f"adapters-r{args.rank}"
    names = [f"r{args.rank}-{i:03d}" for i in range(args.num_adapters)]
    batches = [int(b) for b in args.batches.split(",")]
    cfg = EngineConfig().with_overrides({
        "model.path": str(model_dir), "lora.adapter_root": str(adapters_dir), "model.dtype": "bfloat16" if torch.cuda.is_available() else "float32",
        "lora.max_gpu_adapters": str(args.num_adapters), "lora.max_cpu_adapters": str(2 * args.num_adapters),
        "lora.max_rank": str(args.rank), "lora.target_modules": "[q_proj, k_proj, v_proj, o_proj]",
        "scheduler.max_batch_size": str(max(batches)), "cache.num_blocks": "4096",
        "atmm.tune_at_load": "never"})  # no tuner sidecar sharing the GPU while we time
    engine = build_engine(cfg)
    run(engine, 2, [None], 4, "warm")
    rows = []
    for n in batches:
        for label, use in (("base", [None]), ("lora", names[: max(n, 1)])):
            r = run(engine, n, use, args.max_tokens, label) | {"workload": label, "distinct_adapters": 0 if label == "base" else min(n, len(use))}
            print(r, flush=True)
            rows.append(r)
    dev = device_name()
    result = {"benchmark": "engine-decode", "device": dev, "commit": git_commit(), "preset": args.preset, "rank": args.rank,
              "max_tokens": args.max_tokens, "lora_compute": "atmm (reference segment loop unless the CUDA extension is built)",
              "rows": rows}
    record_result("engine-decode", dev, result,
                  "; ".join(f"bs{r['batch']} {r['workload']}: {r['decode_tokens_per_s']:.0f} tok/s ({r['step_ms']:.1f} ms/step)" for r in rows))


if __name__ == "__main__":
    main()
