"""Where the host time of engine steps goes (the device side is engine_floor.py --profile): Python's
cProfile over eager prefill steps of one T-token prompt and over decode steps at batch B, with the
wall time per step beside the GPU time of the same steps (CUDA events), and the host cost of one
launch on this machine (a small torch op, and a Triton kernel through its Python launcher).

    python benchmarks/profile_step.py --work /tmp/vlora-bench --prefill 600 --batch 1

The model folder is the one engine_floor.py / serve_decode.py write under --work for --preset.
Prints only; writes nothing. Without a GPU, benchmarks/prefill_host_probe.py runs the eager prefill's GPU code path
on the CPU with no-op kernels (host time, dispatcher ops and Triton launches per layer).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import time
from pathlib import Path

import torch


def launch_cost_us(fn, n: int = 2000) -> float:
    """Host microseconds per call of ``fn`` when the GPU is not the limit (tiny tensors)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6


def timed_steps(engine, n: int) -> tuple[float, float]:
    """(wall ms, GPU ms between events) per step over ``n`` engine steps."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        engine.step()
    end.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3, start.elapsed_time(end) / n


def show(prof: cProfile.Profile, top: int) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/vlora-bench")
    ap.add_argument("--preset", default="configs/models/llava-1.5-7b.yaml")
    ap.add_argument("--prefill", type=int, default=600, help="prompt tokens of the profiled prefill steps")
    ap.add_argument("--batch", type=int, default=1, help="batch of the profiled decode steps")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from vlora.config import EngineConfig
    from vlora.engine import fused_ops
    from vlora.engine.api import GenerationRequest, SamplingParams
    from vlora.engine.builder import build_engine

    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    print(f"host per launch: torch add {launch_cost_us(lambda: x + x):.1f} us, Triton rms_norm "
          f"{launch_cost_us(lambda: fused_ops.rms_norm(x, w, 1e-6)):.1f} us", flush=True)

    model_dir = Path(args.work) / Path(args.preset).stem
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(model_dir), "model.dtype": "bfloat16", "lora.max_gpu_adapters": 1,
        "atmm.tune_at_load": "never", "scheduler.max_batch_size": max(args.batch, 1)}))
    vocab = min(len(engine.tokenizer), engine.runner.vocab_size)
    image_id = getattr(engine.runner, "image_token_id", None)

    def add(i: int, tokens: int, max_tokens: int) -> None:
        ids = [(7919 * (i * 131 + j)) % (vocab - 100) + 50 for j in range(tokens)]
        ids = [t + 1 if t == image_id else t for t in ids]
        template = engine.inputs.prepare(GenerationRequest(f"p{i}", "x", sampling=SamplingParams(max_tokens=max_tokens,
                                                                                               ignore_eos=True)))
        engine.add_request(dataclasses.replace(template, prompt_ids=ids), lambda o: None)

    def prefill_steps(first: int, n: int) -> None:
        for i in range(n):
            add(first + i, args.prefill, 1)
            engine.step()
        while engine.has_work():
            engine.step()

    prefill_steps(0, 2)  # warm-up
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    prefill_steps(100, args.steps)
    prof.disable()
    torch.cuda.synchronize()
    print(f"\nprefill {args.prefill} tokens: {(time.perf_counter() - t0) / args.steps * 1e3:.2f} ms/step under cProfile",
          flush=True)
    wall = []
    for i in range(args.steps):
        add(200 + i, args.prefill, 1)
        wall.append(timed_steps(engine, 1))
        while engine.has_work():
            engine.step()
    print("prefill without cProfile: wall / GPU ms per step: " + ", ".join(f"{w:.2f}/{g:.2f}" for w, g in wall), flush=True)
    show(prof, args.top)

    for i in range(args.batch):
        add(300 + i, 64, 10_000)
    while any(not s.prefilled for s in engine.running + list(engine.waiting)):
        engine.step()
    timed_steps(engine, 10)
    w, g = timed_steps(engine, 20)
    print(f"\ndecode batch {args.batch}: wall {w:.2f} ms/step, GPU {g:.2f} ms/step", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    timed_steps(engine, 20)
    prof.disable()
    show(prof, args.top)
    engine.fail_all("cancelled", "probe done")


if __name__ == "__main__":
    sys.exit(main())
