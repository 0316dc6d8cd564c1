"""The warm start: before the server reports ready, one request of every path a request can take runs
through the engine, so that the first client request pays for no compilation, library plan or lazy
loading (an H200 measured 1.35 s for LLaVA-7B's first image request after build, and 4.6 s for
Qwen2-VL-7B's, against 34 and 60 ms for the next ones: Triton's kernel compilation, cuDNN's plans, the
processors' first calls).

The paths: a short text prompt, greedy and sampled (decode graphs, the sampler's kernels); the same prompt at
two lengths (one a multiple of 16, one not: Triton specialises integer arguments on that) as eager prefill
steps, with the prefill graphs set aside (a step past ``engine.prefill_graph_tokens`` runs eagerly, and its
fresh-prompt attention is not the graphs'; with no eager step in the warm-up, the first such step of a
burst took about 1.2 s on an H200); a prompt with one
image of the family's (a new image size: preprocessing, the vision tower or its graphs, the multimodal
prefill); a video where the family takes one; and, where the adapter root holds an adapter, the first by name
through the same prompts (LoRA prefill and decode, vision-side LoRA where it has some) and each of its task
heads. Before them, the attention backend builds its per-shape plans (cuDNN's, one per padded prompt length).
The requests run on the building thread, before the engine loop starts; their metrics are not
reported (:class:`GatedMetrics`), the orchestrator forgets them (unmerged, fresh estimates), and what they
leave in the prefix and encoder caches is keyed by content like any request's. They run unmerged whatever the
policy: a merge and its unmerge leave the rounding of the weights' dtype in the base weights (one merge and
unmerge of a random rank-16 delta moved 15% of a bf16 matrix's values by an ulp), so a warm start that merged would serve every later request from
weights that are no longer the checkpoint's, and differently from one start to the next (the policy's merge
decision is timed). The merge kernels need no warming: they are the extension's, compiled ahead of time. ``engine.warmup``: ``auto`` (on CUDA), ``on``, ``off``.
"""
from __future__ import annotations

import io
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.orchestrator.policies import UnmergeOnlyPolicy

if TYPE_CHECKING:
    from vlora.engine.core import LLMEngine

log = logging.getLogger(__name__)

PROMPT = "Describe what you see in a few words."

# How long the warm-up waits after a step that ran nothing while its request waits (its adapter being read and
# copied in): the loader and copy threads need the GIL for each of their calls, and a loop that steps without
# pause starves them (the lora-text path took 275 s on an H200 while the loop spun; with the wait, the server was ready in 30 s).
IDLE_WAIT_S = 0.002

# The eager prefill paths' prompt lengths (tokens): one a multiple of 16, one not.
EAGER_LENGTHS = (48, 49)


class GatedMetrics:
    """Forwards every metrics call to ``inner`` once :attr:`open`; drops them before (the warm-up's requests
    are not traffic)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.open = False

    def __getattr__(self, name: str):
        fn = getattr(self._inner, name)

        def call(*args, **kwargs):
            if self.open:
                return fn(*args, **kwargs)
        return call


def _png(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def warm_requests(engine: "LLMEngine") -> list[tuple[str, GenerationRequest]]:
    """(path name, request) of every path the warm-up runs on this engine."""
    family = engine.runner.loaded.family
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    sampled = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=0, ignore_eos=True)
    image = _png(640, 480, 1)
    limit = engine.inputs.limits.max_images
    frames = [_png(320, 240, 10 + i) for i in range(min(4, limit))]
    out = [("text", GenerationRequest("warmup-text", PROMPT, sampling=greedy)),
           ("text-sampled", GenerationRequest("warmup-text-sampled", PROMPT, sampling=sampled)),
           *((f"text-eager-{n}", GenerationRequest(f"warmup-text-eager-{n}", PROMPT, sampling=greedy))
             for n in EAGER_LENGTHS),
           ("image", GenerationRequest("warmup-image", family.image_placeholder + PROMPT, images=[image], sampling=greedy))]
    if family.video_placeholder and len(frames) >= 2:
        out.append(("video", GenerationRequest("warmup-video", family.video_placeholder + PROMPT, images=frames,
                                               sampling=greedy)))
    names = engine.loras.list_adapters()
    if names:
        name = names[0]
        out += [("lora-text", GenerationRequest("warmup-lora-text", PROMPT, lora_name=name, sampling=greedy)),
                ("lora-image", GenerationRequest("warmup-lora-image", family.image_placeholder + PROMPT, images=[image],
                                                 lora_name=name, sampling=greedy))]
        for task in sorted(engine.loras.validate(name).heads):
            out.append((f"head-{task}", GenerationRequest(f"warmup-head-{task}", family.image_placeholder + PROMPT,
                                                          images=[image], lora_name=name, task=task, sampling=greedy)))
    return out


def warm_up(engine: "LLMEngine", timeout_s: float = 600.0) -> dict:
    """Run :func:`warm_requests` one at a time to their end; returns ``{"seconds": total, "paths": {name:
    seconds}}``. A path that fails is logged and named under ``"failed"``: the warm-up never stops a start
    (the same request from a client gets the same error)."""
    t0 = time.perf_counter()
    paths: dict[str, float] = {}
    failed: dict[str, str] = {}
    plans = engine.runner.warm_attention(engine.max_model_len)
    if plans:
        paths["attention-plans"] = round(time.perf_counter() - t0, 3)
    orch = engine.orchestrator
    policy, orch.policy = orch.policy, UnmergeOnlyPolicy(orch.policy.max_bs, orch.policy.theta)  # never merges
    try:
        for name, req in warm_requests(engine):
            t = time.perf_counter()
            length = int(name.rsplit("-", 1)[1]) if name.startswith("text-eager-") else None
            error = _run(engine, req, t + timeout_s, length)
            if error is None:
                paths[name] = round(time.perf_counter() - t, 3)
            else:
                failed[name] = error
                log.warning("warm-up: the %s path failed: %s", name, error)
    finally:
        orch.policy = policy
    orch.forget()  # no estimate from the warm-up's first steps
    total = time.perf_counter() - t0
    log.info("warm-up: %d paths in %.2f s (%s)", len(paths), total,
             ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in paths.items()))
    return {"seconds": round(total, 3), "paths": paths, **({"failed": failed} if failed else {})}


def _run(engine: "LLMEngine", req: GenerationRequest, deadline: float, length: Optional[int] = None) -> Optional[str]:
    """``req`` to its end; with ``length``: its prompt's tokens repeated to that many, prefilled eagerly (the
    runner's prefill graphs set aside for the request)."""
    import dataclasses

    try:
        prepared = engine.inputs.prepare(req)
    except Exception as e:  # noqa: BLE001 - named in the log, the start goes on
        return f"{type(e).__name__}: {e}"
    runner = engine.runner if length is not None else None
    graphs = runner.prefill_graphs if runner is not None else None
    if runner is not None:
        ids = list(prepared.prompt_ids)[::-1]  # reversed and rotated per length: no prefix of another warm-up prompt,
        ids = ids[length % len(ids):] + ids[:length % len(ids)]  # so each prefill is fresh (no cached block)
        prepared = dataclasses.replace(prepared, prompt_ids=(ids * (length // len(ids) + 1))[:length])
        runner.prefill_graphs = None
    done: list = []
    try:
        engine.add_request(prepared, lambda out: done.append(out) if out.finished else None)
        while not done and time.perf_counter() < deadline:
            if engine.step() is None and not done:
                time.sleep(IDLE_WAIT_S)
        engine.flush()
    finally:
        if runner is not None:
            runner.prefill_graphs = graphs
    if not done:
        engine.abort(req.request_id)
        while engine.has_work():
            engine.step()
        engine.flush()
        return "timed out"
    return done[0].error
