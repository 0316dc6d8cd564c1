"""Parity of the engine with transformers + PEFT on the same weights; used by tests/unit (CPU) and
tests/gpu (CUDA).

One engine step holds a mixed batch: three adapters of different ranks and target modules, a
base-model request, prefills and decodes together, prompts of different lengths, with and without
images. Every request's logits must match transformers + PEFT run one request at a time, and greedy
generations must be token-identical.
"""
from __future__ import annotations

import io
import itertools
from typing import Optional

import torch
from PIL import Image

from helpers import peft_with_adapters, tiny_config, with_adapter
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.builder import build_engine
from vlora.models.qwen2_vl import VIDEO_PLACEHOLDER, VISION_PLACEHOLDER
from vlora.orchestrator.policies import MERGE, MIXTURE, Decision, Policy

ADAPTERS = ("demo-r8-qv", "demo-r16-attn", "demo-r32-mlp")
MAX_NEW = 6


def _png(seed: int, w: int = 80, h: Optional[int] = None) -> bytes:
    """A random RGB PNG, ``w`` x ``h`` pixels (square when ``h`` is None), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(w if h is None else h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


# The Qwen2-VL mixed batch (tests/unit/test_qwen2_vl_engine.py, tests/gpu/test_qwen_gpu.py): request id ->
# (adapter, text, images); images of different sizes, two in one prompt, a 4-frame video, text alone.
QWEN_SPECS = {
    "img-small-r8": ("qwen-r8-qv", "Describe this picture.", [_png(1, 56, 56)]),
    "text-base": (None, "Hello there, how are you today?", []),
    "img-wide-r16": ("qwen-r16-attn", f"Left {VISION_PLACEHOLDER} and right {VISION_PLACEHOLDER}: which is brighter?",
                     [_png(2, 112, 56), _png(3, 56, 84)]),
    "text-r32": ("qwen-r32-mlp", "Count to ten, slowly, please.", []),
    "img-base": (None, "What do you see?", [_png(4, 84, 84)]),
    "video-r16": ("qwen-r16-attn", f"{VIDEO_PLACEHOLDER}What happens in this clip?", [_png(10 + i, 64, 64) for i in range(4)]),
}


def make_engine(tiny_model_dir, demo_adapter_root, device: str, dtype: str, **over):
    return build_engine(tiny_config(tiny_model_dir, demo_adapter_root, **{
        "model.device": device, "model.dtype": dtype, "lora.max_gpu_adapters": "4",
        "cache.num_blocks": "512",  # several engines share one GPU in the tests
        **over,
    }))


def make_reference(tiny_model_dir, demo_adapter_root, device: str, dtype: torch.dtype):
    """transformers LlavaForConditionalGeneration with every demo adapter loaded through PEFT."""
    from transformers import LlavaForConditionalGeneration

    base = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=dtype, local_files_only=True).to(device).eval()
    return peft_with_adapters(base, demo_adapter_root, ADAPTERS).eval().to(device)


def _ref_logits(ref, adapter, ids, pixel_values):
    dev = next(ref.parameters()).device
    kw = {"input_ids": torch.tensor([ids], device=dev)}
    if pixel_values is not None:
        kw["pixel_values"] = pixel_values.to(dev, next(ref.parameters()).dtype)
    return with_adapter(ref, adapter, lambda: ref(**kw).logits[0, -1].float())


def _requests(engine, specs):
    out = []
    for rid, (adapter, prompt, n_images) in specs.items():
        req = GenerationRequest(request_id=rid, prompt=prompt, images=[_png(hash(rid) % 1000 + i) for i in range(n_images)],
                                lora_name=adapter, sampling=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        out.append(engine.inputs.prepare(req))
    return out


def check_mixed_batch(engine, reference, rtol: float, exact_tokens: bool = True):
    """Run the mixed step and the whole generation; compare with the reference one request at a time."""
    first = {"base-img": (None, "<image>\nWhat is in the picture?", 1),
             "r8-short": ("demo-r8-qv", "Count the circles.", 0)}
    second = {"r16-img": ("demo-r16-attn", "Describe <image> briefly, please, in a few words.", 1),
              "r32-long": ("demo-r32-mlp", "A much longer prompt that goes on for a while so the lengths differ a lot " * 3, 0),
              "r8-again": ("demo-r8-qv", "Is there a red triangle?", 0),
              "base-text": (None, "Hello there", 0)}
    prepared = {p.request_id: p for p in _requests(engine, first) + _requests(engine, second)}
    adapter_of = {rid: spec[0] for rid, spec in itertools.chain(first.items(), second.items())}
    finals = {}

    def cb(out):
        if out.finished:
            finals[out.request_id] = out

    for name in ADAPTERS:  # in their slots before the steps: on CUDA a copy into a slot completes asynchronously
        engine.loras.release(engine.loras.acquire(name))
    seq_of = {}
    for rid in first:
        engine.add_request(prepared[rid], cb)
        seq_of[rid] = engine.waiting[-1]
    engine.step()  # prefill of the first two
    engine.step()  # first decode
    for rid in second:
        engine.add_request(prepared[rid], cb)
        seq_of[rid] = engine.waiting[-1]
    result = engine.step()  # decode of the first two, prefill of four more: one mixed step
    info = result
    assert info.num_prefill == 4 and info.num_decode == 2
    assert len({engine.loras.resident[a] for a in ADAPTERS}) == 3  # three adapters resident in one step
    assert -1 in info.slots and len(set(info.slots)) == 4

    seqs = {s.req.request_id: s for s in engine.running}
    for row, rid in enumerate(info.request_ids):
        s = seqs[rid]
        # The logits of this step predicted its last token: output_ids[-1], or the token still in flight
        # under the step overlap (the step's tokens are read back during the next one).
        ids = s.req.prompt_ids + s.output_ids[:len(s.output_ids) + s.inflight - 1]
        ref = _ref_logits(reference, adapter_of[rid], ids, s.req.pixel_values)
        rel = (result.logits[row] - ref).abs().max() / ref.abs().max()
        assert rel <= rtol, f"{rid}: relative error {rel:.2e} > {rtol:.0e}"

    while engine.has_work():
        engine.step()
    assert set(finals) == set(prepared)

    if not exact_tokens:
        return
    for rid, p in prepared.items():  # greedy continuation, one request at a time, in transformers + PEFT
        ids = list(p.prompt_ids)
        for _ in range(MAX_NEW):
            ids.append(int(_ref_logits(reference, adapter_of[rid], ids, p.pixel_values).argmax()))
        ref_out = ids[len(p.prompt_ids):]
        assert seq_of[rid].output_ids == ref_out, rid
        assert finals[rid].num_output_tokens == MAX_NEW
        assert finals[rid].finish_reason == "length"
        assert finals[rid].text == engine.tokenizer.decode(ref_out, skip_special_tokens=True), rid


def check_adapters_matter(engine, reference):
    """Guards the parity check: the demo adapters must move the logits, or matching would prove nothing."""
    p = _requests(engine, {"probe": (None, "Count the circles.", 0)})[0]
    base = _ref_logits(reference, None, p.prompt_ids, None)
    for name in ADAPTERS:
        delta = (_ref_logits(reference, name, p.prompt_ids, None) - base).abs().max() / base.abs().max()
        assert delta > 1e-3, f"{name} barely changes the logits ({delta:.1e})"


def add_greedy(engine, rid: str, adapter: Optional[str], text: str, images=(), max_new: int = MAX_NEW):
    """Queue request ``rid`` (``adapter`` None: the base model) for ``max_new`` tokens, EOS ignored, its outputs
    dropped; returns its Sequence."""
    req = GenerationRequest(rid, text, images=list(images), lora_name=adapter,
                            sampling=SamplingParams(max_tokens=max_new, ignore_eos=True))
    engine.add_request(engine.inputs.prepare(req), lambda out: None)
    return engine.waiting[-1]


def step_recording(engine, seqs: dict, logits: dict):
    """One ``engine.step()``; each row's logits go to ``logits[(request id, output index)]``, the index of the
    token that step chose (``output_ids[-1]``, or with the step overlap the one still in flight). ``seqs``:
    request id -> its Sequence. Returns the step's result (None: nothing ran)."""
    result = engine.step()
    if result is not None:
        for row, rid in enumerate(result.request_ids):
            s = seqs[rid]
            logits[(rid, len(s.output_ids) + s.inflight - 1)] = result.logits[row].float().clone()
    return result


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def check_fast_against_eager(fast, ref, scripts: dict, run, max_new: int, rtol: float, exact: bool) -> None:
    """Every script of ``scripts`` (name -> ScriptedPolicy script) run by ``run(engine, script)`` (returning
    (request id -> output ids, (request id, output index) -> logits)) on the fast engine and on the eager
    reference: ``max_new`` tokens each, the same tokens when ``exact``, and the logits within ``rtol``. Not
    exact (bf16): the prefill's logits and the first decode step's (a graph replay), whose input token both
    engines chose alike; after a token differs, the inputs differ."""
    for name, script in scripts.items():
        tokens, logits = run(fast, script)
        ref_tokens, ref_logits = run(ref, script)
        assert all(len(t) == max_new for t in tokens.values())
        if exact:
            assert tokens == ref_tokens, name
        for (rid, i), want in ref_logits.items():
            if not exact and (i > 1 or tokens[rid][0] != ref_tokens[rid][0]):
                continue
            err = rel_err(logits[(rid, i)], want)
            assert err <= rtol, f"{name} {rid} step {i}: relative error {err:.2e} > {rtol:.0e}"


class ScriptedPolicy(Policy):
    """Mode and merged adapter from a script, one entry per step, cycling (the graph-vs-eager parity tests
    drive every inference mode this way); a merge step with no request of the merged adapter runs as a
    mixture of everything."""

    name = "scripted"

    def __init__(self, script):
        super().__init__(max_batch_size=16, theta_s=1e9)
        self.script, self.i = script, 0

    def decide(self, cands, now, mode, merged, est):
        mode, merged = self.script[self.i % len(self.script)]
        self.i += 1
        batch = [c for c in cands if mode != MERGE or c.adapter == merged]
        if not batch:
            mode, batch = MIXTURE, list(cands)
        return Decision(mode, merged, batch)
