"""Adapter copies on CUDA: host copies in the slots' dtype (pageable), the copy into a slot on the copy
thread and a side stream with an event, a request admitted only once its own adapter's copy has completed while the others
keep decoding, and the same tokens as when the adapter was resident from the start."""
from __future__ import annotations

import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vlora.config import EngineConfig  # noqa: E402
from vlora.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from vlora.engine.builder import build_engine  # noqa: E402

ADAPTER = "demo-r8-qv"


def _req(rid, lora=None, max_tokens=8):
    return GenerationRequest(rid, "How many circles?", lora_name=lora, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_copy_on_the_side_stream_delays_only_its_own_request(tiny_model_dir, demo_adapter_root):
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cuda",
        "model.dtype": "float32", "lora.max_gpu_adapters": "2", "lora.max_rank": "32", "cache.num_blocks": "256"}))
    loras = engine.loras
    assert loras.copies.cuda and loras.copies.stream is not None
    swaps = loras.swaps_in  # the warm start's LoRA requests fill a slot with the first adapter (not this one)
    w = loras.validate(ADAPTER)
    # in the slots' dtype, in pageable memory: the copy thread moves them (page-locking stalls the engine's launches)
    assert all(not p.a.is_pinned() and not p.b.is_pinned() and p.a.dtype == torch.float32 for p in w.pairs.values())

    outs = {}

    def cb(o):
        if o.finished:
            outs[o.request_id] = o

    engine.add_request(engine.inputs.prepare(_req("base", max_tokens=16)), cb)
    engine.step()
    torch.cuda._sleep(200_000_000)  # keeps the compute stream busy: the side stream's copy, ordered after it, stays in flight
    timed = []
    loras.copies.on_timed = lambda q, w, *rest: timed.append((q, w))  # the copy's queue and enqueueing seconds
    engine.add_request(engine.inputs.prepare(_req("late", lora=ADAPTER)), cb)
    assert engine.step().request_ids == ["base"], "a request was admitted before its adapter's copy completed"
    (entry,) = loras.describe([ADAPTER])
    assert entry["tier"] == "gpu"
    deadline = time.monotonic() + 60
    while engine.has_work():
        assert time.monotonic() < deadline
        engine.step()
    assert outs["late"].finish_reason == "length" and not outs["late"].error
    assert len(timed) == 1 and all(0 <= x < 60 for x in timed[0]), timed

    again = {}
    engine.add_request(engine.inputs.prepare(_req("again", lora=ADAPTER)), lambda o: again.__setitem__(o.request_id, o) if o.finished else None)
    while engine.has_work():
        engine.step()
    assert again["again"].text == outs["late"].text
    assert loras.swaps_in - swaps == 1  # copied into its slot once, then served from it


def test_pinned_stager_copies_exactly_through_reused_buffers():
    """Many host tensors through two small page-locked buffers (each reused many times, some sources larger
    than a buffer, strided destinations as a slot's lora_b[:, :r] is): every destination equals its source."""
    from vlora.lora.transfers import PinnedStager

    stager = PinnedStager(buffers=2, nbytes=1 << 20)
    stream = torch.cuda.Stream()
    g = torch.Generator().manual_seed(0)
    pairs = []
    with torch.cuda.stream(stream):
        for i in range(200):
            rows = int(torch.randint(1, 600, (1,), generator=g))
            src = torch.randn(rows, 64, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
            big = torch.zeros(rows, 128, dtype=src.dtype, device="cuda")
            dst = big[:, :64]  # strided
            stager.put_many([dst], [src])  # one at a time
            pairs.append((big, src))
        stager.close_buffer()
    stream.synchronize()
    for big, src in pairs:
        assert torch.equal(big[:, :64].cpu(), src) and not big[:, 64:].any()


def test_pinned_stager_put_many_batches_exactly():
    """put_many (the copy thread's batched slot copy): many host tensors through two small page-locked buffers in
    batched calls, sources larger than a buffer and page-locked ones copied directly, strided destinations."""
    from vlora.lora.transfers import PinnedStager

    stager = PinnedStager(buffers=2, nbytes=1 << 20)
    stream = torch.cuda.Stream()
    g = torch.Generator().manual_seed(1)
    bigs, dsts, srcs = [], [], []
    for i in range(300):
        rows = int(torch.randint(1, 600, (1,), generator=g)) if i % 50 else 5000  # some over a buffer's 1 MiB
        src = torch.randn(rows, 64, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
        if i % 37 == 0:
            src = src.pin_memory()
        big = torch.zeros(rows, 128, dtype=src.dtype, device="cuda")
        bigs.append(big)
        dsts.append(big[:, :64])
        srcs.append(src)
    with torch.cuda.stream(stream):
        stager.put_many(dsts[:150], srcs[:150])
        stager.put_many(dsts[150:], srcs[150:])
        stager.close_buffer()
    stream.synchronize()
    for big, src in zip(bigs, srcs):
        assert torch.equal(big[:, :64].cpu(), src) and not big[:, 64:].any()


def test_slot_copies_zero_what_a_lower_rank_leaves_and_skip_it_for_a_full_rank():
    """copy_slots into a slot that held another adapter: a full-rank adapter overwrites the whole slot (its zeroing
    is skipped), a lower-rank one leaves zeros past its rank, a skipped layer is zero: each slot equals the
    reference, through the copy thread's staging as the server runs it."""
    from vlora.lora.layers import LoraContext, LoraLinear
    from vlora.lora.transfers import SlotCopies

    g = torch.Generator().manual_seed(2)
    layers = [LoraLinear(torch.nn.Linear(64, 96, bias=False).cuda().to(torch.bfloat16), LoraContext(), num_slots=2,
                         max_rank=16) for _ in range(3)]
    copies = SlotCopies(torch.device("cuda"), 2, stage_bytes=1 << 20)
    for ranks in ((8, 16, 4), (16, 16, 16), (4, None, 16), (16, 2, None)):
        entries, want = [], []
        for layer, r in zip(layers, ranks):
            if r is None:
                entries.append((layer, None, None, 0.0))
                want.append((torch.zeros(16, 64), torch.zeros(96, 16)))
                continue
            a = torch.randn(r, 64, generator=g).to(torch.bfloat16)
            b = torch.randn(96, r, generator=g).to(torch.bfloat16)
            entries.append((layer, a, b, 0.5))
            wa, wb = torch.zeros(16, 64), torch.zeros(96, 16)
            wa[:r], wb[:, :r] = a.float(), (b * 0.5).float()
            want.append((wa, wb))
        copies.issue(1, lambda e=entries: LoraLinear.copy_slots(1, e, copies.put_many), None)
        copies.synchronize()
        for layer, (wa, wb) in zip(layers, want):
            assert torch.equal(layer.lora_a[1].float().cpu(), wa)
            assert torch.equal(layer.lora_b[1].float().cpu(), wb)


def _cold_adapter_engine(tiny_model_dir, demo_adapter_root):
    """A CUDA engine whose ADAPTER is cold (out of its slot and host memory, as the warm start left it resident)."""
    engine = build_engine(EngineConfig().with_overrides({
        "model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cuda",
        "model.dtype": "float32", "lora.max_gpu_adapters": "2", "lora.max_rank": "32", "cache.num_blocks": "256"}))
    loras = engine.loras
    if ADAPTER in loras.resident:
        loras._empty_slot(loras.resident[ADAPTER])
    with loras._lock:
        loras._host.pop(ADAPTER, None)
        loras._pending.pop(ADAPTER, None)
    return engine


def _run_adapter_request(engine, outs, rid):
    engine.add_request(engine.inputs.prepare(_req(rid, lora=ADAPTER)),
                       lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    deadline = time.monotonic() + 60
    while rid not in outs:
        assert time.monotonic() < deadline
        engine.step()
    assert outs[rid].finish_reason == "length" and not outs[rid].error


def test_a_cold_adapter_lands_in_page_locked_memory_for_its_first_copy(tiny_model_dir, demo_adapter_root):
    """A request's cold adapter is read into the page-locked landing memory on its loader thread; its slot copy is
    made from there (no CPU copy on the copy thread) and gives the range back. A later copy of the same adapter
    from the host tier goes through the copy thread's staging, and the tokens are the same."""
    engine = _cold_adapter_engine(tiny_model_dir, demo_adapter_root)
    loras = engine.loras
    assert loras._landing is not None and loras._landing.buf.is_pinned()
    landed, staged = loras.landed_copies, loras.copies.stager.host_s
    outs = {}
    _run_adapter_request(engine, outs, "cold")
    assert loras.landed_copies == landed + 1 and loras.copies.stager.host_s == staged
    assert loras._landing.free_bytes == loras._landing.nbytes
    loras._empty_slot(loras.resident[ADAPTER])  # its next copy comes from the host tier
    _run_adapter_request(engine, outs, "host")
    assert loras.landed_copies == landed + 1 and loras.copies.stager.host_s > staged
    assert outs["host"].text == outs["cold"].text


def test_a_requests_read_leaves_the_value_checks_to_the_device(tiny_model_dir, demo_adapter_root, tmp_path):
    """On CUDA a request's read takes no norms on the host; its slot copy takes them on the device (bf16 slots here)
    and a bad adapter is refused by layer and module before any step reads the slot. A good one is served with the
    tokens of host-checked weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path / "adapters"
    shutil.copytree(demo_adapter_root / ADAPTER, root / ADAPTER)
    shutil.copytree(demo_adapter_root / ADAPTER, root / "nan-b")
    path = root / "nan-b" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = sorted(k for k in tensors if "lora_B" in k)[2]
    tensors[key][1, 0] = float("nan")
    save_file(tensors, str(path))
    layer, module = int(key.split(".layers.")[1].split(".")[0]), key.split(".lora_B")[0].rsplit(".", 1)[1]

    def serve(names, wait):
        engine = build_engine(EngineConfig().with_overrides({
            "model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cuda",
            "model.dtype": "bfloat16", "lora.max_gpu_adapters": "2", "lora.max_rank": "32", "cache.num_blocks": "256",
            "engine.warmup": "off"}))
        assert engine.loras._check_on_device
        outs = {}
        for name in names:
            try:
                checked = engine.inputs.check(_req(name, lora=name), wait_adapter=wait)
            except Exception as e:  # noqa: BLE001 - the host check refuses at admission
                outs[name] = e
                continue
            engine.add_request(engine.inputs.preprocess(checked),
                               lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
        deadline = time.monotonic() + 60
        while engine.has_work():
            assert time.monotonic() < deadline
            engine.step()
        return engine, outs

    engine, outs = serve(["nan-b", ADAPTER], wait=False)
    assert not engine.loras._host[ADAPTER].values_checked
    assert outs["nan-b"].finish_reason == "error"
    assert f"module {module} of layer {layer}: lora_B holds non-finite values" in outs["nan-b"].error
    assert "nan-b" not in engine.loras.resident
    host, want = serve(["nan-b", ADAPTER], wait=True)
    assert "non-finite" in str(want["nan-b"]) and host.loras._host[ADAPTER].values_checked
    assert outs[ADAPTER].finish_reason == "length" and outs[ADAPTER].text == want[ADAPTER].text
