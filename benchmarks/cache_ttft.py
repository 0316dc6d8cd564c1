"""Time to first token with the encoder cache and the prefix KV cache on, against both off (issue 23).

Two workloads, each a sequence of rounds whose requests arrive together (every request asks for one token,
so a round's TTFTs are its prefill steps, in the engine in this process):

- ``video``: a camera stream watched by 4 applications, each an adapter: two vision-side ones (LoRA on the
  vision tower and projector, and q/k/v/o) and two language-only ones (q/k/v/o). Round r is the chunk of
  ``--frames`` frames starting at frame ``r * --stride`` (chunks overlap); every application asks its
  ``--questions`` questions about the chunk (V-LoRA's detection and action recognition of one chunk), each
  its own instruction (``--app-tokens`` tokens), the frames, the question; the first questions of every
  application come first. With the caches on, a frame is encoded once per vision-side weights (the plain
  encoder's features serve both language-only applications, and the frames a chunk shares with the last
  one are cached), and a question after an application's first finds the KV of its
  instruction and frames in the prefix cache when an earlier step computed them. KV is never shared
  between applications: every adapter here changes K and V.
- ``retrieval``: ``--batch`` requests a round, each a shared ``--system-tokens``-token system prompt and its
  own question, half for the base model and half for a language-only adapter. With the prefix cache on,
  the system prompt's full KV blocks are computed once per adapter and reused.

Rounds alternate between the caches off and on on the same engine (one model load per family): off, the
engine's ``cache.prefix_caching`` is off and the runner has no encoder cache; on, the one encoder cache
and the prefix cache accumulate over the on rounds only (the off rounds neither read nor fill them). The scheduler's token budget is the serve default
(``--budget``: ``scheduler.max_num_batched_tokens``, 2048): a 4-frame LLaVA prompt (about 2,400 tokens) runs
in two chunks (``scheduler.chunked_prefill``, on by default), 3 retrieval prompts fit in one step. Round 0 with the caches on is cold; the figures are the mean over the later ("steady") rounds of each round's
mean TTFT over its requests. TTFT: from the round's start (before ``inputs.prepare``: image decoding, the
processor, content hashes) to the engine reporting the request's token. The check that the caches took
part: hits, misses and reused tokens of each phase (off: none).

Models: the presets at real size with random weights (bf16), the folders engine_floor.py and
engine_decode.py write (``<work>/<preset stem>``, made on first use); on a CPU (``--tiny``), the tiny models.

    python -m benchmarks.cache_ttft --out $OUT                # LLaVA-1.5-7B and Qwen2-VL-7B (CUDA)
    python -m benchmarks.cache_ttft --tiny --no-record        # the tiny models on a CPU (a smoke run)

Writes ``<out>/cache-ttft-<device>.json`` and, unless ``--no-record``, results/cache-ttft-<device>.json and
one line in benchmarks/RESULTS.md; prints that line after ``RESULTS``.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.common import (PRESETS, TINY, build_model_engine, device_name, git_commit, model_folder,
                               model_parser, noise_png, sync_fn, write_result)

NAME = "cache-ttft"
DECODER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DELTA = 0.2  # typical size of one LoRA delta entry for a unit-RMS input
WORDS = ("describe the picture in detail and list every object you can see in it then count the cars trucks "
         "bikes and people crossing the street near the bridge at the corner of the market").split()
# (application, adapter kind, its questions about a chunk): the 4 applications of the video stream
APPS = (("detect", "vision", ("Where are the vehicles?", "Has any vehicle stopped?")),
        ("action", "vision", ("What are the people doing?", "Is anyone running?")),
        ("count", "language", ("How many cars are there?", "How many people are there?")),
        ("describe", "language", ("Describe the scene.", "What is the weather like?")))
QUESTIONS = ("Is the north bridge open today?", "Which road do the buses take?", "How often does the tram run?",
             "Where can I park near the market?", "When does the museum open?", "Is there a detour for bikes?",
             "Which lanes are closed tonight?", "Where is the nearest charging station?")


# -- models, adapters, prompts --------------------------------------------------------------------

def build(model_dir: Path, device, args: argparse.Namespace):
    """The engine, both caches on (phases switch them, see :func:`set_caches`), no decode graphs (every
    request asks for one token), no tuner sidecar and no merging (the same LoRA path in both phases)."""
    settings = {
        "lora.adapter_root": None, "lora.max_gpu_adapters": 8, "lora.max_cpu_adapters": 8, "lora.max_rank": args.rank,
        "lora.target_modules": list(DECODER_TARGETS), "scheduler.max_batch_size": max(32, args.batch),
        "orchestrator.policy": "unmerge-only", "limits.max_images": max(8, args.frames),
        "cache.prefix_caching": True, "cache.encoder_cache_mb": args.encoder_cache_mb, "cache.num_blocks": args.num_blocks}
    if args.budget:
        settings["scheduler.max_num_batched_tokens"] = args.budget
    return build_model_engine(model_dir, device, settings)


def register_adapter(engine, name: str, rank: int, seed: int, vision: bool) -> None:
    """A random rank-``rank`` adapter on q/k/v/o of every decoder layer and, if ``vision``, on every
    vision-side projection the runner serves, registered in memory (host copies as the host tier keeps them)."""
    import torch

    from vlora.lora.adapter import AdapterWeights, LoraPair

    runner = engine.runner
    dims = runner.module_dims()
    cuda = runner.device.type == "cuda"
    gen = torch.Generator().manual_seed(seed)

    def pair(target: str) -> LoraPair:
        d_in, d_out = dims[target]
        a = torch.randn(rank, d_in, generator=gen) / math.sqrt(d_in)
        b = torch.randn(d_out, rank, generator=gen) * (DELTA / math.sqrt(rank))
        if cuda:
            a, b = a.to(runner.dtype).pin_memory(), b.to(runner.dtype).pin_memory()
        return LoraPair(a=a, b=b, scale=1.0)

    pairs = {(layer, t): pair(t) for layer in range(runner.num_layers) for t in DECODER_TARGETS}
    vision_targets: tuple[str, ...] = ()
    if vision:
        if runner.vision_lora is None:
            raise RuntimeError("this runner serves no vision-side LoRA (lora.vision_lora off, or the family has none)")
        for layer, target in runner.vision_lora.layers:
            pairs[(layer, target)] = pair(target)
        vision_targets = tuple(sorted({t for _, t in runner.vision_lora.layers}))
    targets = DECODER_TARGETS + vision_targets
    engine.loras.register(name, AdapterWeights(name=name, dir=Path("<in-memory>"), pairs=pairs,
                                               ranks={t: rank for t in targets}, max_rank=rank,
                                               target_modules=targets, vision_targets=vision_targets,
                                               version=f"seed{seed}"))


def text_of(engine, tokens: int, offset: int, end: str) -> tuple[str, int]:
    """Words of :data:`WORDS` from ``offset`` on, then ``end``: the longest such text of at most ``tokens``
    tokens (as the engine's tokenizer counts them, special tokens included), and its length."""
    from vlora.engine.api import GenerationRequest

    def make(n: int) -> str:
        return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n)) + end

    def length(n: int) -> int:
        return len(engine.inputs.prepare(GenerationRequest("probe", make(n))).prompt_ids)

    lo, hi = 1, 2
    while length(hi) <= tokens:
        lo, hi = hi, hi * 2
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if length(mid) <= tokens else (lo, mid)
    return make(lo), length(lo)


# -- the workloads --------------------------------------------------------------------------------

Request = tuple[str, Optional[str], str, list]  # (tag, adapter, prompt, images)


def video_rounds(engine, args, apps: list[tuple[str, str, tuple[str, ...]]]) -> list[list[Request]]:
    """Round r: every application's questions about frames r * stride .. r * stride + frames - 1, in
    the order first questions of every application, then second ones, ..."""
    placeholder = engine.runner.loaded.family.image_placeholder
    stream = [noise_png(7919 * (i + 1), args.side) for i in range(args.frames + (args.rounds - 1) * args.stride)]
    instructions = [text_of(engine, args.app_tokens, 5 * k, ".\n")[0] for k in range(len(apps))]
    rounds = []
    for r in range(args.rounds):
        frames = stream[r * args.stride:r * args.stride + args.frames]
        rounds.append([(app, adapter, instr + placeholder * args.frames + "\n" + questions[q % len(questions)], list(frames))
                       for q in range(args.questions) for (app, adapter, questions), instr in zip(apps, instructions)])
    return rounds


def retrieval_rounds(engine, args, adapters: list[Optional[str]]) -> tuple[list[list[Request]], int]:
    """Round r: ``batch`` questions after the shared system prompt, over ``adapters`` in turn; and the
    system prompt's length in tokens."""
    system, n = text_of(engine, args.system_tokens, 0, ".\n")
    rounds = []
    for r in range(args.rounds):
        rounds.append([(f"q{i}", adapters[i % len(adapters)],
                        system + f"Question {r * args.batch + i}: " + QUESTIONS[(r + i) % len(QUESTIONS)], [])
                       for i in range(args.batch)])
    return rounds, n


# -- the measurement ------------------------------------------------------------------------------

def set_caches(engine, on: bool, encoder_cache) -> None:
    """Both caches on (the prefix cache, and ``encoder_cache`` as the runner's) or both off. The engine
    reads ``config.cache.prefix_caching`` when it admits a request; off, it neither looks blocks up nor
    registers them, so the on rounds' cached blocks are neither used nor added to."""
    cache = dataclasses.replace(engine.config.cache, prefix_caching=on)
    engine.config = dataclasses.replace(engine.config, cache=cache)
    engine.scheduler.config = engine.config  # admission (the scheduler) reads it
    engine.runner.encoder_cache = encoder_cache if on else None


def counters(engine, encoder_cache) -> dict[str, int]:
    s = encoder_cache.stats() if encoder_cache is not None else {}
    return {"encoder_hits": s.get("hits", 0), "encoder_misses": s.get("misses", 0),
            "prefix_prompt_tokens": engine.prefix_stats["queried_tokens"],
            "prefix_reused_tokens": engine.prefix_stats["reused_tokens"]}


def run_round(engine, requests: list[Request], tag: str, sync: Callable[[], None], timeout_s: float = 600.0) -> dict:
    """Submit the round's requests (one token each) and step until every one has its token."""
    from vlora.engine.api import GenerationRequest, SamplingParams

    first: dict[str, float] = {}
    texts: dict[str, str] = {}
    errors: list[str] = []
    tokens: dict[str, int] = {}

    def on_output(rid: str):
        def call(out) -> None:
            if out.error:
                errors.append(f"{rid}: {out.error}")
            if rid not in first and (out.num_output_tokens or out.finished):
                first[rid] = time.perf_counter()
            texts[rid] = out.text
        return call

    sync()
    t0 = time.perf_counter()
    rids = []
    for i, (name, adapter, prompt, images) in enumerate(requests):
        rid = f"{tag}-{i}-{name}-{time.monotonic_ns()}"
        rids.append(rid)
        p = engine.inputs.prepare(GenerationRequest(rid, prompt, images=images, lora_name=adapter,
                                                    sampling=SamplingParams(max_tokens=1)))
        tokens[rid] = len(p.prompt_ids)
        engine.add_request(p, on_output(rid))
    t_prep = time.perf_counter()
    steps, deadline = 0, time.monotonic() + timeout_s
    while engine.has_work():
        if engine.step() is None:
            if time.monotonic() > deadline:
                engine.fail_all("cancelled", "benchmark round timed out")
                raise RuntimeError(f"round {tag} made no progress for {timeout_s:.0f} s ({errors[:1]})")
            time.sleep(0.001)
        else:
            steps += 1
    sync()
    if errors or len(first) != len(rids):
        raise RuntimeError(f"round {tag}: {len(first)} of {len(rids)} requests got a token; errors: {errors[:2]}")
    ttft = [1e3 * (first[rid] - t0) for rid in rids]
    return {"ttft_ms": ttft, "mean_ms": statistics.mean(ttft), "max_ms": max(ttft),
            "prepare_ms": 1e3 * (t_prep - t0), "steps": steps, "prompt_tokens": sum(tokens.values()),
            "texts": [texts[rid] for rid in rids]}


def run_workload(engine, rounds: list[list[Request]], name: str, encoder_cache, sync) -> dict:
    """Each round with the caches off, then on; the two phases' rounds, counters and steady means."""
    phases: dict[str, dict] = {p: {"rounds": [], "counters": dict.fromkeys(counters(engine, None), 0)} for p in ("off", "on")}
    for r, requests in enumerate(rounds):
        for phase in ("off", "on"):
            set_caches(engine, phase == "on", encoder_cache)
            before = counters(engine, encoder_cache)
            row = run_round(engine, requests, f"{name}-{phase}-{r}", sync)
            after = counters(engine, encoder_cache)
            delta = {k: after[k] - before[k] for k in after}
            if phase == "off":
                if delta["encoder_hits"] or delta["encoder_misses"] or delta["prefix_reused_tokens"]:
                    raise RuntimeError(f"{name} round {r}: a cache took part with the caches off: {delta}")
                delta["prefix_prompt_tokens"] = 0  # counted by the engine whatever the setting
            row["counters"] = delta
            phases[phase]["rounds"].append(row)
            for k, v in delta.items():
                phases[phase]["counters"][k] += v
    set_caches(engine, True, encoder_cache)
    pairs = [(a, b) for off, on in zip(phases["off"]["rounds"], phases["on"]["rounds"])
             for a, b in zip(off.pop("texts"), on.pop("texts"))]
    out: dict[str, Any] = {"requests_per_round": len(rounds[0]), "rounds": len(rounds),
                           # the first token's text, caches on against off (bf16 may flip a near tie)
                           "same_answers": sum(a == b for a, b in pairs) / len(pairs)}
    for phase, p in phases.items():
        steady = p["rounds"][1:] or p["rounds"]
        p["cold_mean_ms"] = p["rounds"][0]["mean_ms"]
        p["steady_mean_ms"] = statistics.mean(x["mean_ms"] for x in steady)
        p["steady_max_ms"] = statistics.mean(x["max_ms"] for x in steady)
        p["steady_prepare_ms"] = statistics.mean(x["prepare_ms"] for x in steady)
        out[phase] = p
    out["steady_speedup"] = phases["off"]["steady_mean_ms"] / phases["on"]["steady_mean_ms"]
    on = phases["on"]["counters"]
    if len(rounds) > 1 and not (on["prefix_reused_tokens"] > 0 and (on["encoder_hits"] > 0 or name != "video")):
        raise RuntimeError(f"{name}: the caches were on but nothing was reused: {on}")
    return out


def measure_model(preset: str, args: argparse.Namespace, device) -> dict:
    import torch

    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    model_dir = model_folder(preset, Path(args.work), cuda, tiny_dir=Path(args.work))
    t_made = time.perf_counter()
    engine = build(model_dir, device, args)
    t_built = time.perf_counter()
    sync = sync_fn(device)
    encoder_cache = engine.runner.encoder_cache
    if encoder_cache is None:
        raise RuntimeError("the engine was built without an encoder cache (--encoder-cache-mb 0?)")
    apps = []
    for k, (app, kind, questions) in enumerate(APPS):
        name = f"app-{app}"
        register_adapter(engine, name, args.rank, seed=100 + k, vision=kind == "vision")
        apps.append((app, name, questions))
    config = json.loads((model_dir / "config.json").read_text())
    entry: dict[str, Any] = {"preset": preset, "model_type": config.get("model_type"),
                             "make_s": t_made - t0, "build_s": t_built - t_made,
                             "apps": [{"app": a, "adapter": n, "vision_side": k == "vision"}
                                      for (a, k, _), (_, n, _) in zip(APPS, apps)]}
    video = video_rounds(engine, args, apps)
    retrieval, system_tokens = retrieval_rounds(engine, args, [None, apps[2][1]])
    # Warm-up, caches off (so nothing is cached by it): one round of each workload, kernels compiled and
    # adapters copied into their slots before anything is timed.
    set_caches(engine, False, encoder_cache)
    run_round(engine, video[0], "warm-video", sync)
    run_round(engine, retrieval[0], "warm-retrieval", sync)
    entry["video"] = run_workload(engine, video, "video", encoder_cache, sync)
    entry["video"].update(frames=args.frames, stride=args.stride, side=args.side, questions=args.questions)
    entry["retrieval"] = run_workload(engine, retrieval, "retrieval", encoder_cache, sync)
    entry["retrieval"].update(system_tokens=system_tokens, adapters=["base", apps[2][1]])
    entry["budget_tokens"] = engine.config.scheduler.max_num_batched_tokens
    entry["encoder_cache"] = encoder_cache.stats()
    for w in ("video", "retrieval"):
        r = entry[w]
        print(f"{preset}: {w}: TTFT off {r['off']['steady_mean_ms']:.1f} ms, on {r['on']['steady_mean_ms']:.1f} ms "
              f"(x{r['steady_speedup']:.2f}; cold on {r['on']['cold_mean_ms']:.1f} ms); on: {r['on']['counters']}; "
              f"same answers {100 * r['same_answers']:.0f}%", flush=True)
    engine.loras.close()
    del engine, encoder_cache
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        entry["device_bytes_left"] = torch.cuda.memory_allocated(device)  # what the next model's engine shares the GPU with
        print(f"{preset}: {entry['device_bytes_left'] / 2**30:.2f} GiB still allocated after the engine was freed", flush=True)
    return entry


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = model_parser(__doc__, f"comma-separated model presets (default {PRESETS}; with --tiny {TINY})",
                     "where the model folders are written", tiny_help="the tiny models and small sizes (a CPU smoke run)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of each workload (default 6; --tiny 3)")
    p.add_argument("--frames", type=int, default=4, help="frames in a video chunk")
    p.add_argument("--stride", type=int, default=2, help="frames from one chunk's start to the next")
    p.add_argument("--side", type=int, default=None, help="frame side in px (default 448; --tiny 56)")
    p.add_argument("--questions", type=int, default=2, help="questions each application asks about a chunk")
    p.add_argument("--app-tokens", type=int, default=48, help="tokens of each application's instruction")
    p.add_argument("--system-tokens", type=int, default=500, help="tokens of the retrieval system prompt")
    p.add_argument("--batch", type=int, default=8, help="retrieval requests a round")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--encoder-cache-mb", type=float, default=256.0)
    p.add_argument("--num-blocks", type=int, default=2048,
                   help="KV blocks (a fixed pool: 16 GiB at LLaVA-1.5-7B width, every round's requests fit)")
    p.add_argument("--budget", type=int, default=None,
                   help="scheduler.max_num_batched_tokens (default: the serve default)")
    p.add_argument("--no-record", action="store_true", help="no line in RESULTS.md, no copy in benchmarks/results")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.tiny else 6
    if args.side is None:
        args.side = 56 if args.tiny else 448
    if args.presets is None:
        args.presets = TINY if args.tiny else PRESETS
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (round 0 is the cold one)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from vlora.atmm.dispatch import default_kernels
    from vlora.engine.builder import resolve_device

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    result: dict[str, Any] = {
        "benchmark": NAME, "device": device_name() if cuda else "cpu", "commit": git_commit(),
        "dtype": "bfloat16" if cuda else "float32", "atmm_extension": default_kernels().available if cuda else False,
        "settings": {k: getattr(args, k) for k in ("rounds", "frames", "stride", "side", "questions", "app_tokens", "system_tokens",
                                                   "batch", "rank", "encoder_cache_mb", "num_blocks", "budget", "tiny")},
        "models": []}
    t0 = time.perf_counter()
    failed = False
    for preset in args.presets.split(","):
        try:
            result["models"].append(measure_model(preset, args, device))
        except Exception as e:  # the other model still runs; the exit status says it failed
            traceback.print_exc()
            result["models"].append({"preset": preset, "error": f"{type(e).__name__}: {e}"})
            failed = True
            gc.collect()
    result["wall_s"] = time.perf_counter() - t0
    result["summary"] = summary_line(result)
    write_result(NAME, args.out, result, result["summary"], record=not args.no_record)
    print(f"RESULTS {NAME} {result['device']}: {result['summary']}")
    return 1 if failed else 0


def summary_line(result: dict[str, Any]) -> str:
    """Steady-state mean TTFT per model and workload, caches off -> on."""
    s = result["settings"]
    parts = []
    for m in result["models"]:
        if "error" in m:
            parts.append(f"{m['preset']}: FAILED ({m['error'][:80]})")
            continue
        v, r = m["video"], m["retrieval"]
        parts.append(f"{m['model_type']}: video (4 apps x {s['questions']} questions, {s['frames']} frames/chunk, stride {s['stride']}) "
                     f"{v['off']['steady_mean_ms']:.0f} -> {v['on']['steady_mean_ms']:.0f} ms (x{v['steady_speedup']:.2f}); "
                     f"retrieval ({s['batch']} requests, {r['system_tokens']}-token system prompt) "
                     f"{r['off']['steady_mean_ms']:.0f} -> {r['on']['steady_mean_ms']:.0f} ms (x{r['steady_speedup']:.2f})")
    return f"TTFT caches off -> on, rank {s['rank']}: " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
