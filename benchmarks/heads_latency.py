"""Latency of a task head's answer against generating the same answer through the LM head.

For video analytics (the V-LoRA paper's Fig. 19: a 41-63% cut), a request of F frames asks how a shape
moves. Answered by the adapter's task head, it takes one prefill. Answered in text, it takes the same
prefill plus one decode round per answer token: ``--answer-tokens`` sets how many (2 is " left</s>";
longer answers such as "The shape moves to the left." take 8 or more). Both run in the engine
(``LLMEngine.step()``, the code the server runs, without Triton in the way), with the same adapter,
one request alone and ``--batch`` requests together, on generated frames.

    # GPU, LLaVA-1.5-7B width (random weights; latency does not depend on what the weights are):
    python -m benchmarks.heads_latency --preset configs/models/llava-1.5-7b.yaml --work /tmp/vlora-heads --device cuda \
        --json-out $OUT/heads-latency.json
    # CPU smoke run on the tiny model:
    python -m benchmarks.heads_latency --device cpu --repeats 2 --no-record

With ``--preset`` it writes a random-weight model of that size, a rank-16 q/v adapter and a random
action head for it under ``--work`` (first run only). Writes
``benchmarks/results/heads-latency-<device>.json`` and a line in ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import device_name, git_commit, record_result

ADAPTER = "bench-action-head"
TASK = "action"


def prepare_model(args) -> tuple[Path, Path]:
    """The model folder and an adapter root holding one q/v adapter with a random action head."""
    import torch

    from vlora.fusion.datasets import ACTIONS
    from vlora.heads import TaskHead, save_heads
    from vlora.lora.demo import DemoAdapter, write_adapter

    work = Path(args.work)
    if args.preset:
        from vlora.models.random_init import make_random_llava

        model_dir = make_random_llava(args.preset, work / ("model-" + Path(args.preset).stem),
                                      device="cuda" if args.device.startswith("cuda") else "cpu")
    else:
        from vlora.models.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model()
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    root = work / f"adapters-{model_dir.name}"
    adir = root / ADAPTER
    if not (adir / "vlora_heads.json").is_file():
        adir.mkdir(parents=True, exist_ok=True)
        write_adapter(DemoAdapter(ADAPTER, r=16, alpha=32, modules=("q_proj", "v_proj"), seed=5), model_dir, text, adir)
        g = torch.Generator().manual_seed(0)
        hidden = int(text["hidden_size"])
        save_heads(adir, {TASK: TaskHead(TASK, "action", ACTIONS, torch.randn(len(ACTIONS), hidden, generator=g) * 0.02,
                                         torch.zeros(len(ACTIONS)), None)})
    return model_dir, root


def frames(n_frames: int, image_size: int, seed: int) -> tuple[list[bytes], str]:
    from vlora.fusion.datasets import generate

    ds = generate("action", seed=seed, sizes={"train": 0, "val": 0, "test": 1}, image_size=image_size,
                  min_frames=n_frames, max_frames=n_frames)
    sample = ds.split("test")[0]
    out = []
    for img in sample.images:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out, ds.prompt_for(n_frames)


def run_batch(engine, requests) -> dict:
    """Add every request at once, step until all finish; per-request latency and the step count."""
    import torch

    finished: dict[str, float] = {}
    tokens: dict[str, int] = {}
    prepared = [engine.inputs.prepare(r) for r in requests]
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()

    def done(out):
        if out.finished:
            finished[out.request_id] = time.perf_counter() - t0
            tokens[out.request_id] = out.num_output_tokens
            if out.error:
                raise RuntimeError(out.error)

    for p in prepared:
        engine.add_request(p, done)
    steps = 0
    while engine.has_work():
        engine.step()
        sync()
        steps += 1
    return {"latency_s": [finished[r.request_id] for r in requests], "steps": steps,
            "output_tokens": [tokens[r.request_id] for r in requests]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="model preset YAML (random weights at that size); default: the tiny model")
    p.add_argument("--work", default="/tmp/vlora-heads-latency", help="where the random model and adapter go")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--frames", type=int, default=4, help="video frames per request (4 to 8)")
    p.add_argument("--answer-tokens", default="2,4,8", help="generated answer lengths to compare with the head")
    p.add_argument("--batch", type=int, default=8, help="requests sent together in the batched case")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-record", action="store_true", help="do not write results/ or RESULTS.md")
    p.add_argument("--json-out", metavar="FILE", help="also write the result JSON here (e.g. $OUT/heads-latency.json)")
    args = p.parse_args()

    import torch

    from vlora.config import EngineConfig
    from vlora.engine.api import GenerationRequest, SamplingParams
    from vlora.engine.builder import build_engine

    model_dir, root = prepare_model(args)
    config = EngineConfig().with_overrides({"model.path": str(model_dir), "lora.adapter_root": str(root),
                                            "model.device": args.device, "model.dtype": args.dtype,
                                            "lora.max_gpu_adapters": "2", "lora.max_rank": "16"})
    engine = build_engine(config)
    image_size = int(json.loads((model_dir / "config.json").read_text())["vision_config"]["image_size"])
    answer_lengths = [int(x) for x in args.answer_tokens.split(",") if x]

    def requests(kind: str, n: int, k: int = 0):
        out = []
        for i in range(n):
            imgs, prompt = frames(args.frames, image_size, seed=i)
            if kind == "head":
                out.append(GenerationRequest(f"{kind}-{k}-{i}", prompt, images=imgs, lora_name=ADAPTER, task=TASK))
            else:
                out.append(GenerationRequest(f"{kind}-{k}-{i}", prompt, images=imgs, lora_name=ADAPTER,
                                             sampling=SamplingParams(max_tokens=k, ignore_eos=True)))
        return out

    cases = [("head", 0)] + [("generate", k) for k in answer_lengths]
    results: dict[str, dict] = {}
    for batch in (1, args.batch):
        for kind, k in cases:
            run_batch(engine, requests(kind, batch, k))  # warm-up: kernels, allocator, adapter slot
            lat, steps = [], None
            for _ in range(args.repeats):
                r = run_batch(engine, requests(kind, batch, k))
                lat.append(statistics.mean(r["latency_s"]))
                steps = r["steps"]
                expect = 1 if kind == "head" else k
                if any(t != expect for t in r["output_tokens"]):
                    raise RuntimeError(f"{kind}: output tokens {r['output_tokens']}, expected {expect}")
            name = f"bs{batch}-{kind}" + (f"-{k}tok" if kind == "generate" else "")
            results[name] = {"batch": batch, "kind": kind, "answer_tokens": k or 1, "mean_latency_ms": 1000 * statistics.median(lat),
                             "all_ms": [round(1000 * x, 3) for x in lat], "steps": steps}
            print(f"{name:>22}: {1000 * statistics.median(lat):9.2f} ms per request ({steps} engine steps)")
    cuts = {}
    for batch in (1, args.batch):
        head = results[f"bs{batch}-head"]["mean_latency_ms"]
        for k in answer_lengths:
            gen = results[f"bs{batch}-generate-{k}tok"]["mean_latency_ms"]
            cuts[f"bs{batch}-vs-{k}tok"] = round(100 * (1 - head / gen), 1)
    print("latency cut by the head: " + ", ".join(f"{k} {v}%" for k, v in cuts.items()))
    info = engine.model_info
    result = {"commit": git_commit(), "model": info.get("name"), "dtype": info.get("dtype"), "device": info.get("device"),
              "preset": args.preset, "frames": args.frames, "prompt_tokens": len(engine.inputs.prepare(requests("head", 1)[0]).prompt_ids),
              "results": results, "latency_cut_percent": cuts, "torch": torch.__version__}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_record:
        dev = device_name()
        width = f"{Path(args.preset).stem}" if args.preset else "tiny"
        summary = (f"{width}, {args.frames} frames, head vs generated answer: "
                   + ", ".join(f"{k} -{v}%" for k, v in cuts.items()))
        record_result("heads-latency", dev, result, summary)
    else:
        print(json.dumps(result["latency_cut_percent"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
