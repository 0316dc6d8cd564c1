"""LoRA on the vision tower and projector (issue 23), fp32 on the CPU, against transformers + PEFT on the
same weights.

Adapters made with PEFT target the vision side (LLaVA: CLIP's attention and MLP, the projector; Qwen2-VL
and Qwen2.5-VL: the blocks' attention and MLP, the merger), some the decoder too. Mixed in one batch with
a language-only adapter and base requests, their greedy tokens equal transformers + PEFT one request at a
time, and the step encodes the images of every vision-side adapter in one vision forward. The encoder
cache keys on the vision-side adapter's name and version: on equals off, language-only adapters share the
base model's entries, and an adapter reloaded with new weights under its name never gets the old
features. Adapters the server cannot serve are refused with the module named."""
from __future__ import annotations

import shutil

import pytest
import torch

peft = pytest.importorskip("peft")

from adapter_edit import clone_adapter, mixed_vision_root  # noqa: E402
from engine_parity import _png, _ref_logits  # noqa: E402
from test_qwen2_vl_engine import MAX_NEW, _png as _qwen_png, _reference as _qwen_reference, _run  # noqa: E402

from vlora.config import EngineConfig  # noqa: E402
from vlora.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from vlora.engine.builder import build_engine  # noqa: E402
from vlora.lora.adapter import AdapterError, load_adapter  # noqa: E402
from vlora.models import tiny_qwen  # noqa: E402
from vlora.models.qwen2_vl import VIDEO_PLACEHOLDER, VISION_PLACEHOLDER  # noqa: E402
from vlora.models.tiny import VISION_ADAPTER_NAMES  # noqa: E402

LANGUAGE_ONLY = "demo-r8-qv"
V8, V16 = VISION_ADAPTER_NAMES  # llava-vision-r8 (tower attention, projector, q/v), llava-vision-r16-mlp (vision only)
IMG_A, IMG_B, IMG_C = _png(1), _png(2), _png(3)


def _engine(model_dir, root, **overrides):
    settings = {"model.path": str(model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
                "model.dtype": "float32", "lora.max_rank": "32", "lora.max_gpu_adapters": "4",
                "cache.prefix_caching": "off"}
    settings.update(overrides)
    return build_engine(EngineConfig().with_overrides(settings))


@pytest.fixture(scope="module")
def llava_root(tmp_path_factory, tiny_model_dir, demo_adapter_root):
    return mixed_vision_root(tmp_path_factory.mktemp("vision-adapters"), tiny_model_dir, demo_adapter_root, LANGUAGE_ONLY)


@pytest.fixture(scope="module")
def llava(tiny_model_dir, llava_root):
    return _engine(tiny_model_dir, llava_root)


@pytest.fixture(scope="module")
def llava_reference(tiny_model_dir, llava_root):
    from transformers import LlavaForConditionalGeneration

    base = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()
    ref = peft.PeftModel.from_pretrained(base, llava_root / LANGUAGE_ONLY, adapter_name=LANGUAGE_ONLY).eval()
    for name in VISION_ADAPTER_NAMES:
        ref.load_adapter(llava_root / name, adapter_name=name)
    return ref


def _encode_spy(monkeypatch, engine) -> list[list[int]]:
    """Record the vision slots of every vision forward the engine runs."""
    calls = []
    encode = engine.runner.encode

    def spy(pixel_values, image_grid_thw=None, vision_slots=None, video=False):
        calls.append(list(vision_slots or []))
        return encode(pixel_values, image_grid_thw, vision_slots, video)

    monkeypatch.setattr(engine.runner, "encode", spy)
    return calls


def _assert_one_mixed_forward(calls, engine, adapters):
    """One vision forward, and only one, mixed vision-side adapters: every one of ``adapters`` and the plain encoder."""
    slots = {engine.loras.resident[a] for a in adapters}
    assert any(slots <= set(c) and -1 in c for c in calls), calls
    assert len([c for c in calls if len(set(c) - {-1}) > 1]) == 1, calls


LLAVA_FIRST = {"v8-a": (V8, "USER: <image>\nWhat is it? ASSISTANT:", [IMG_A]),
               "base-b": (None, "USER: <image>\nDescribe it. ASSISTANT:", [IMG_B])}
LLAVA_SECOND = {"v16-a": (V16, "USER: <image>\nWhat is it? ASSISTANT:", [IMG_A]),  # the same image, another adapter
                "lang-a": (LANGUAGE_ONLY, "USER: <image>\nWhat is it? ASSISTANT:", [IMG_A]),  # the plain encoder
                "v8-bc": (V8, "USER: <image> or <image>: which one? ASSISTANT:", [IMG_B, IMG_C]),
                "base-a": (None, "USER: <image>\nWhat is it? ASSISTANT:", [IMG_A]),
                "v16-text": (V16, "USER: Hello there. ASSISTANT:", [])}
LLAVA_SPECS = {**LLAVA_FIRST, **LLAVA_SECOND}


def _prepare(engine, rid, adapter, text, images):
    return engine.inputs.prepare(GenerationRequest(rid, text, images=list(images), lora_name=adapter,
                                                   sampling=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)))


@pytest.fixture(scope="module")
def llava_want(llava, llava_reference):
    """transformers + PEFT greedy tokens of every LLaVA request, one request at a time."""
    want = {}
    for rid, (adapter, text, images) in LLAVA_SPECS.items():
        p = _prepare(llava, rid, adapter, text, images)
        ids = list(p.prompt_ids)
        for _ in range(MAX_NEW):
            ids.append(int(_ref_logits(llava_reference, adapter, ids, p.pixel_values).argmax()))
        want[rid] = ids[len(p.prompt_ids):]
    return want


def test_llava_mixed_batch_matches_transformers_peft(llava, llava_want, monkeypatch):
    calls = _encode_spy(monkeypatch, llava)
    got = _run(llava, LLAVA_SPECS, together=True)
    assert got == llava_want
    _assert_one_mixed_forward(calls, llava, VISION_ADAPTER_NAMES)
    entry = {e["name"]: e for e in llava.describe_adapters()}
    assert entry[V8]["vision_targets"] == ["projector.linear_1", "projector.linear_2", "vision.self_attn.k_proj",
                                           "vision.self_attn.out_proj", "vision.self_attn.q_proj", "vision.self_attn.v_proj"]
    assert set(entry[V8]["target_modules"]) == {"q_proj", "v_proj", *entry[V8]["vision_targets"]}
    assert entry[V16]["vision_targets"] == ["projector.linear_2", "vision.mlp.fc1", "vision.mlp.fc2"]
    assert entry[LANGUAGE_ONLY]["vision_targets"] == []


def test_vision_adapters_change_the_image_features(llava):
    """Guards the parity check: each vision-side adapter moves the features the decoder sees."""
    runner = llava.runner
    pv = _prepare(llava, "probe", None, "<image>", [IMG_A]).pixel_values
    base = runner.encode(pv)[0]
    for name in VISION_ADAPTER_NAMES:
        slot = llava.loras.acquire(name)
        try:
            feats = runner.encode(pv, vision_slots=[slot])[0]
        finally:
            llava.loras.release(slot)
        assert (feats - base).abs().max() > 0.05 * base.abs().max(), name


def test_llava_one_slot_and_one_host_copy(tiny_model_dir, llava_root, llava_want):
    """The tiers carry the vision-side weights: every request refills the only slot, from disk."""
    engine = _engine(tiny_model_dir, llava_root, **{"lora.max_gpu_adapters": "1", "lora.max_cpu_adapters": "1"})
    assert _run(engine, LLAVA_SPECS, together=False) == llava_want
    assert engine.loras.swaps_in >= 4


def test_merged_adapters_keep_their_vision_side(tiny_model_dir, llava_root, llava_want):
    """merge-only merges an adapter's decoder delta into the weights; its images still take its vision-side LoRA."""
    from vlora.orchestrator.policies import MERGE

    engine = _engine(tiny_model_dir, llava_root, **{"orchestrator.policy": "merge-only"})
    got, merged = {}, set()
    for rid, spec in LLAVA_SPECS.items():
        engine.add_request(_prepare(engine, rid, *spec), lambda out: None)
        seq = engine.waiting[-1]
        while engine.has_work():
            ran = engine.step()
            if ran is not None and ran.mode == MERGE and ran.num_prefill:  # the images' step
                merged.add(ran.merged)
        got[rid] = seq.output_ids
    assert got == llava_want
    assert set(VISION_ADAPTER_NAMES) <= merged


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    import transformers

    cache = tmp_path_factory.mktemp("qwen-vision")
    model_dir = tiny_qwen.ensure_tiny_qwen(cache, variant=request.param)
    root = tiny_qwen.ensure_tiny_qwen_adapters(model_dir, cache / "adapters")
    tiny_qwen.ensure_tiny_qwen_vision_adapters(model_dir, root)
    engine = _engine(model_dir, root)
    base = getattr(transformers, tiny_qwen.VARIANTS[request.param].architecture).from_pretrained(
        str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    names = ("qwen-r8-qv",) + tiny_qwen.QWEN_VISION_ADAPTER_NAMES
    ref = peft.PeftModel.from_pretrained(base, root / names[0], adapter_name=names[0]).eval()
    for name in names[1:]:
        ref.load_adapter(root / name, adapter_name=name)
    return engine, ref, tiny_qwen.load_qwen_processor(model_dir)


def test_qwen_mixed_batch_matches_transformers_peft(qwen, monkeypatch):
    engine, ref, processor = qwen
    q8, q16 = tiny_qwen.QWEN_VISION_ADAPTER_NAMES
    small, wide, tall = _qwen_png(1, 56, 56), _qwen_png(2, 112, 56), _qwen_png(3, 56, 84)
    specs = {
        "q8-small": (q8, "Describe this picture.", [small]),
        "base-text": (None, "Hello there, how are you today?", []),
        "q16-small": (q16, "Describe this picture.", [small]),  # the same image through another adapter
        "lang-two": ("qwen-r8-qv", f"Left {VISION_PLACEHOLDER} and right {VISION_PLACEHOLDER}", [wide, tall]),
        "q8-two": (q8, f"Left {VISION_PLACEHOLDER} and right {VISION_PLACEHOLDER}", [wide, tall]),
        "base-small": (None, "What do you see?", [small]),
        "q16-video": (q16, f"{VIDEO_PLACEHOLDER}What happens in this clip?", [_qwen_png(10 + i, 64, 64) for i in range(4)]),
    }
    want = {rid: _qwen_reference(ref, processor, a, t, im) for rid, (a, t, im) in specs.items()}
    assert want["q8-small"] != want["q16-small"] != want["base-small"]
    calls = _encode_spy(monkeypatch, engine)
    assert _run(engine, specs, together=True) == want
    _assert_one_mixed_forward(calls, engine, (q8, q16))


def test_encoder_cache_keys_on_the_vision_adapter(tiny_model_dir, llava_root, llava_want):
    """On equals off; a language-only adapter reuses the base model's features, a vision-side one never."""
    order = ["base-a", "lang-a", "v8-a", "v16-a", "base-b", "v8-bc"]
    specs = {rid: LLAVA_SPECS[rid] for rid in order}
    cached = _engine(tiny_model_dir, llava_root, **{"cache.encoder_cache_mb": "64"})
    plain = _engine(tiny_model_dir, llava_root, **{"cache.encoder_cache_mb": "0"})
    on, off = _run(cached, specs, together=False), _run(plain, specs, together=False)
    assert on == off == {rid: llava_want[rid] for rid in order}
    # lang-a takes base-a's features of image A; V8 and V16 encode A anew, and V8 encodes B anew after base-b
    assert cached.runner.encoder_cache.stats() | {"bytes": 0} == {"hits": 1, "misses": 6, "evictions": 0, "bytes": 0}
    again = _run(cached, {"v8-a2": LLAVA_SPECS["v8-a"], "v16-a2": LLAVA_SPECS["v16-a"]}, together=False)
    assert again == {"v8-a2": llava_want["v8-a"], "v16-a2": llava_want["v16-a"]}
    assert cached.runner.encoder_cache.stats()["hits"] == 3


def test_a_reloaded_vision_adapter_never_gets_stale_features(tiny_model_dir, llava_root, tmp_path):
    local = tmp_path / "adapters"
    shutil.copytree(llava_root / V16, local / V16)
    spec = {"q": LLAVA_SPECS["v16-a"]}
    engine = _engine(tiny_model_dir, local, **{"cache.prefix_caching": "on"})
    first = _run(engine, spec, together=False)["q"]
    assert _run(engine, {"q2": spec["q"]}, together=False)["q2"] == first
    stats = dict(engine.runner.encoder_cache.stats())
    # the repeat's image lies wholly inside its cached prefix: it is not encoded again, nor looked up
    assert stats["hits"] == 0 and stats["misses"] == 1
    engine.unload_adapter(V16)
    clone_adapter(local, V16, "v16-new", edit_tensors=lambda t: [v.mul_(-2.0) for k, v in t.items() if "lora_B" in k])
    shutil.rmtree(local / V16)
    (local / "v16-new").rename(local / V16)
    engine.loras.load(V16)
    after = _run(engine, {"q3": spec["q"]}, together=False)["q3"]
    fresh = _run(_engine(tiny_model_dir, local, **{"cache.encoder_cache_mb": "0"}), {"q4": spec["q"]}, together=False)
    assert after == fresh["q4"]
    assert after != first  # the new weights change the answer: stale features would have shown
    now = engine.runner.encoder_cache.stats()
    assert now["hits"] == stats["hits"] and now["misses"] == stats["misses"] + 1


def test_refused_targets_name_the_module(tiny_model_dir, llava, llava_root, tmp_path):
    root = tmp_path / "adapters"
    shutil.copytree(llava_root / V8, root / V8)
    runner = llava.runner
    kw = dict(num_layers=runner.num_layers, module_dims=runner.module_dims(), max_rank=32,
              supported_modules=llava.loras.supported_modules, vision=runner.vision_lora_sites())
    assert load_adapter(root, V8, **kw).vision_targets

    def add(key, shape):
        return lambda t: t.update({key + ".lora_A.weight": torch.zeros(shape), key + ".lora_B.weight": torch.zeros(64, 4)})

    patch = "base_model.model.model.vision_tower.embeddings.patch_embedding"
    clone_adapter(root, V8, "patch", edit_tensors=add(patch, (4, 3, 8, 8)))
    with pytest.raises(AdapterError, match=r"unsupported target module model\.vision_tower\.embeddings\.patch_embedding"):
        load_adapter(root, "patch", **kw)
    deep = "base_model.model.model.vision_tower.encoder.layers.7.self_attn.q_proj"  # the tower has 2 layers
    clone_adapter(root, V8, "deep", edit_tensors=add(deep, (4, 64)))
    with pytest.raises(AdapterError, match=r"unsupported target module model\.vision_tower\.encoder\.layers\.7"):
        load_adapter(root, "deep", **kw)

    off = _engine(tiny_model_dir, root, **{"lora.vision_lora": "off"})
    assert off.runner.vision_lora is None
    with pytest.raises(AdapterError, match=r"unsupported target module (vision|projector)\.\S+ .*lora\.vision_lora is off"):
        off.loras.load(V8)


def test_adapters_trained_with_transformers_4_key_names(llava, llava_root, tmp_path):
    """PEFT keys of older transformers (the tower under vision_tower.vision_model., no leading model.) load
    into the same (layer, target) pairs."""
    shutil.copytree(llava_root / V8, tmp_path / V8)

    def rename(t):
        for k in list(t):
            new = (k.replace("base_model.model.model.vision_tower.", "base_model.model.vision_tower.vision_model.")
                   .replace("base_model.model.model.multi_modal_projector.", "base_model.model.multi_modal_projector."))
            t[new] = t.pop(k)

    clone_adapter(tmp_path, V8, "old-names", edit_tensors=rename)
    runner = llava.runner
    kw = dict(num_layers=runner.num_layers, module_dims=runner.module_dims(), max_rank=32,
              supported_modules=llava.loras.supported_modules, vision=runner.vision_lora_sites())
    new, old = load_adapter(tmp_path, V8, **kw), load_adapter(tmp_path, "old-names", **kw)
    assert old.pairs.keys() == new.pairs.keys() and old.vision_targets == new.vision_targets
    assert all(torch.equal(old.pairs[k].a, new.pairs[k].a) for k in new.pairs)


def test_benchmark_runs_on_the_tiny_model(tiny_model_dir):
    """benchmarks/vision_lora.py's measurement on a CPU, so that the GPU run cannot fail on what a CPU shows."""
    import importlib

    bench = importlib.import_module("benchmarks.vision_lora")
    engine = bench.build(tiny_model_dir, torch.device("cpu"), rank=8, slots=3)
    slots = bench.register_vision_adapters(engine, 2, rank=8, seed=1)
    point = bench.measure(engine, 3, slots, reps=1, px=64)
    assert point["rows"] == {"vision": [65] * 3, "projector": [64] * 3}
    assert point["mixed_vs_alone_rel"] < 1e-5 and point["plain_ms"] > 0
    result = {"settings": {"rank": 8}, "models": [{"model_type": "llava", "points": [point]}]}
    assert "llava x3" in bench.summary_line(result)
