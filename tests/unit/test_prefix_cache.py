"""The prefix KV cache (cache.prefix_caching): reused blocks give the tokens a fresh prefill gives, and
blocks are never shared between adapters, versions of one adapter, or different images.

The reference is an engine with the cache off on the same weights (fp32, CPU, tiny LLaVA), running the
same requests: repeated frames, a shared system prompt, eviction under memory pressure, and an adapter
reloaded with new weights under the same name."""
from __future__ import annotations

import io
import shutil

import pytest
import torch
from PIL import Image

from adapter_edit import clone_adapter
from helpers import count_encodes
from vlora.config import EngineConfig
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.builder import build_engine
from vlora.engine.kv_cache import BlockAllocator

SYSTEM = "USER: You are a careful assistant that looks at traffic camera frames and answers briefly. " * 3
MAX_NEW = 6


def _png(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_allocator_counts_shares_and_evicts_least_recently_used():
    a = BlockAllocator(4)
    x = a.allocate(2)
    a.register(x[0], b"h0")
    a.register(x[1], b"h1")
    a.free(x)  # cached, held by nobody
    assert a.num_free == 4 and a.num_cached == 2
    assert a.lookup([b"h0", b"h1", b"h2"]) == x
    a.share(x[:1])
    assert a.num_free == 3
    y = a.allocate(3)  # two free blocks, then the cached one nobody holds (h1) is evicted
    assert x[0] not in y and x[1] in y and a.evictions == 1
    assert a.lookup([b"h0", b"h1"]) == [x[0]]
    with pytest.raises(MemoryError):
        a.allocate(1)
    a.free([x[0]])  # shared once: back to the cache, evictable
    assert a.num_free == 1 and a.num_cached == 1


def _engine(tiny_model_dir, root, prefix: bool, num_blocks: int = 512):
    cfg = EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "32", "lora.max_gpu_adapters": "4",
        "cache.num_blocks": str(num_blocks), "cache.prefix_caching": "on" if prefix else "off"})
    return build_engine(cfg)


def _run(engine, specs):
    """specs: [(request id, adapter, text, images)], run one after another (each may reuse the last's blocks)."""
    out = {}
    for rid, adapter, text, images in specs:
        req = GenerationRequest(rid, text, images=images, lora_name=adapter,
                                sampling=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        engine.add_request(engine.inputs.prepare(req), lambda o: None)
        seq = engine.waiting[-1]
        while engine.has_work():
            engine.step()
        out[rid] = (seq.output_ids, seq.cached_tokens)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory, demo_adapter_root):
    r = tmp_path_factory.mktemp("adapters")
    for name in ("demo-r8-qv", "demo-r16-attn"):
        shutil.copytree(demo_adapter_root / name, r / name)
    return r


def test_reused_prefixes_give_the_fresh_tokens(tiny_model_dir, root):
    frame = [_png(1)]
    specs = [
        ("sys-1", None, SYSTEM + "How many cars? ASSISTANT:", []),
        ("sys-2", None, SYSTEM + "Is it raining? ASSISTANT:", []),  # the shared system prompt
        ("frame-a1", "demo-r8-qv", "USER: <image>\nHow many cars? ASSISTANT:", frame),
        ("frame-a2", "demo-r8-qv", "USER: <image>\nAny trucks? ASSISTANT:", frame),  # the same frame
        ("frame-b", "demo-r16-attn", "USER: <image>\nAny trucks? ASSISTANT:", frame),  # another adapter
        ("other-frame", "demo-r8-qv", "USER: <image>\nAny trucks? ASSISTANT:", [_png(2)]),  # another frame
    ]
    on = _run(_engine(tiny_model_dir, root, True), specs)
    off = _run(_engine(tiny_model_dir, root, False), specs)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    assert on["sys-2"][1] >= 6 * 16  # the system prompt's full blocks came from the cache
    assert on["frame-a2"][1] > 0  # the frame's blocks too
    assert on["frame-b"][1] == 0  # never another adapter's
    assert on["other-frame"][1] < on["frame-a2"][1]  # the blocks holding the other frame are not reused
    assert all(v[1] == 0 for v in off.values())


def test_eviction_under_memory_pressure(tiny_model_dir, root):
    """A pool just large enough for a few requests: cached blocks are evicted for new ones, and nothing
    is refused for memory that an empty cache would have admitted."""
    question = lambda i: SYSTEM + f"Lane {i}: " + f"what moves in lane {i} now? " * 6 + "ASSISTANT:"  # noqa: E731
    specs = [(f"r{i}", None, question(i), []) for i in range(6)]
    specs += [(f"again{i}", None, question(i), []) for i in (0, 5)]
    eng = _engine(tiny_model_dir, root, True, num_blocks=16)
    on = _run(eng, specs)
    off = _run(_engine(tiny_model_dir, root, False, num_blocks=16), specs)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    assert eng.runner.kv.allocator.evictions > 0


def test_an_adapter_reloaded_with_new_weights_never_reuses_old_blocks(tiny_model_dir, root, tmp_path):
    local = tmp_path / "adapters"
    shutil.copytree(root / "demo-r8-qv", local / "demo-r8-qv")
    spec = [("q", "demo-r8-qv", SYSTEM + "How many cars? ASSISTANT:", [])]
    eng = _engine(tiny_model_dir, local, True)
    first = _run(eng, spec)
    assert first["q"][1] == 0
    again = _run(eng, [("q2", *spec[0][1:])])
    assert again["q2"][1] > 0 and again["q2"][0] == first["q"][0]  # same weights: reused
    eng.unload_adapter("demo-r8-qv")
    shutil.rmtree(local / "demo-r8-qv")
    clone_adapter(root, "demo-r8-qv", "tmp-new", edit_tensors=lambda t: [v.mul_(3.0) for k, v in t.items() if "lora_B" in k])
    shutil.move(str(root / "tmp-new"), str(local / "demo-r8-qv"))
    eng.loras.load("demo-r8-qv")
    after = _run(eng, [("q3", *spec[0][1:])])
    fresh = _run(_engine(tiny_model_dir, local, False), [("q4", *spec[0][1:])])
    assert after["q3"][1] == 0  # the new version shares nothing with the old one's blocks
    assert after["q3"][0] == fresh["q4"][0]
    assert after["q3"][0] != first["q"][0]  # and the new weights do change the answer


def test_encoder_cache_reuses_features_and_evicts_within_its_budget(tiny_model_dir, root):
    """Repeated frames are encoded once (hits), outputs equal the cache off, and a tiny budget evicts."""
    frames = [_png(20 + i) for i in range(3)]
    specs = [(f"q{i}", "demo-r8-qv" if i % 2 else None, f"USER: <image>\nQuestion {i}? ASSISTANT:", [frames[i % 3]])
             for i in range(6)]
    cfg = lambda mb, prefix: EngineConfig().with_overrides({  # noqa: E731
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "32", "lora.max_gpu_adapters": "4",
        "cache.encoder_cache_mb": str(mb), "cache.prefix_caching": prefix})
    cached = build_engine(cfg(64, "off"))
    plain = build_engine(cfg(0, "off"))
    on, off = _run(cached, specs), _run(plain, specs)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    stats = cached.runner.encoder_cache.stats()
    assert stats["hits"] == 3 and stats["misses"] == 3 and stats["bytes"] > 0
    assert plain.runner.encoder_cache is None
    one = stats["bytes"] / 3  # one image's features
    small = build_engine(cfg(1.5 * one / 2**20, "off"))
    assert {k: v[0] for k, v in _run(small, specs).items()} == {k: v[0] for k, v in off.items()}
    s = small.runner.encoder_cache.stats()
    assert s["evictions"] > 0 and s["bytes"] <= 1.5 * one


def test_a_waiting_prompt_is_charged_without_its_cached_prefix(tiny_model_dir, root):
    """With a token budget smaller than a prompt, a request whose prompt is mostly cached joins the running
    decode at once: the scheduler charges it the tokens it will run, not its whole length (which would make
    it wait until the batch drained)."""
    cfg = EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
        "model.dtype": "float32", "lora.max_rank": "32", "lora.max_gpu_adapters": "4", "cache.num_blocks": "512",
        "cache.prefix_caching": "on", "scheduler.max_num_batched_tokens": "64"})
    engine = build_engine(cfg)
    _run(engine, [("warm", None, SYSTEM + "How many cars? ASSISTANT:", [])])  # caches the system prompt's blocks
    n_prompt = len(engine.tokenizer(SYSTEM + "Is it raining? ASSISTANT:")["input_ids"])
    assert n_prompt > 64, n_prompt  # the whole prompt exceeds the budget: alone, it would run by itself
    long = GenerationRequest("busy", "USER: count the lanes. ASSISTANT:",
                             sampling=SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request(engine.inputs.prepare(long), lambda o: None)
    engine.step()  # its prefill
    engine.step()  # decoding now
    req = GenerationRequest("cached", SYSTEM + "Is it raining? ASSISTANT:",
                            sampling=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    engine.add_request(engine.inputs.prepare(req), lambda o: None)
    seq = engine.waiting[-1]
    ran = engine.step()
    assert sorted(ran.request_ids) == ["busy", "cached"], ran
    assert seq.cached_tokens >= 6 * 16 and seq.prefilled
    while engine.has_work():
        engine.step()


def test_images_wholly_inside_the_cached_prefix_are_not_encoded(tiny_model_dir, root):
    """A prompt that continues a cached prefix encodes only the images with a placeholder among the tokens it
    runs: those wholly inside the prefix already have their keys and values in the cache. The tokens are
    those of a fresh prefill (the prefix cache off)."""
    frames = [_png(3), _png(4)]
    text = "USER: <image>\nCompare this frame with the next. " + "Count the lanes and the cars. " * 4
    specs = [("first", "demo-r8-qv", text + "Which is busier: <image>\nASSISTANT:", frames),
             ("again", "demo-r8-qv", text + "Which is darker: <image>\nASSISTANT:", frames)]  # same frames
    engines = {}
    encoded = {}
    for prefix in (True, False):
        eng = _engine(tiny_model_dir, root, prefix)
        encoded[prefix] = count_encodes(eng.runner)  # every image the step needs is encoded: the count shows which
        engines[prefix] = eng
    on = _run(engines[True], specs)
    off = _run(engines[False], specs)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    loaded = engines[True].runner.loaded
    ids = engines[True].inputs.prepare(GenerationRequest("probe", specs[1][2], images=frames)).prompt_ids
    marks = [i for i, t in enumerate(ids) if t == loaded.image_token_id]
    n = loaded.num_image_tokens
    cached = on["again"][1]
    assert cached > marks[n - 1], (cached, marks[:1], n)  # the first frame's placeholders are all cached
    assert cached <= marks[n], (cached, marks[n])  # the second frame's are not (its question differs before it)
    assert encoded[True] == [2, 1]  # the second request encodes the second frame only
    assert encoded[False] == [2, 2]
