"""PEFT adapter folders: safe name resolution, what is refused, and parity with PEFT itself."""
from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from adapter_edit import clone_adapter as _clone
from safetensors.torch import load_file

from vlora.config import LORA_TARGETS
from vlora.engine.api import InvalidRequest
from vlora.lora.adapter import (
    AdapterError,
    decoder_module_dims,
    list_adapters,
    load_adapter,
    resolve_adapter_dir,
)
from vlora.lora.demo import DEMO_ADAPTER_NAMES, DEMO_ADAPTERS, ensure_demo_adapters
from vlora.fusion.demo import TRAINED_DEMO_NAMES

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def text_config(tiny_model_dir):
    return json.loads((tiny_model_dir / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module")
def dims(text_config):
    return decoder_module_dims(text_config)


@pytest.fixture()
def root(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the demo adapters that a test may damage."""
    return ensure_demo_adapters(tiny_model_dir, tmp_path / "adapters")


def _load(root, name, dims, max_rank=64, supported=LORA_TARGETS):
    return load_adapter(root, name, num_layers=NUM_LAYERS, module_dims=dims, max_rank=max_rank,
                        supported_modules=supported)


# ---- the demo adapters


def test_demo_adapters_differ_in_rank_and_targets(root, dims):
    loaded = {n: _load(root, n, dims) for n in DEMO_ADAPTER_NAMES}
    assert len(loaded) >= 3
    assert len({a.max_rank for a in loaded.values()}) == len(loaded)
    assert len({a.target_modules for a in loaded.values()}) == len(loaded)
    assert any({"gate_proj", "up_proj", "down_proj"} <= set(a.target_modules) for a in loaded.values())
    for a in loaded.values():
        assert all(p.b.abs().max() > 0 for p in a.pairs.values())
        assert {layer for layer, _ in a.pairs} == set(range(NUM_LAYERS))
        for (layer, module), p in a.pairs.items():
            d_in, d_out = dims[module]
            assert p.a.shape == (p.rank, d_in) and p.b.shape == (d_out, p.rank)
            assert p.a.dtype == torch.float32 and p.a.device.type == "cpu"


def test_scales_follow_peft(root, dims):
    r8 = _load(root, "demo-r8-qv", dims)
    assert r8.scale(0, "q_proj") == 16 / 8
    mlp = _load(root, "demo-r32-mlp", dims)  # use_rslora
    assert mlp.scale(2, "down_proj") == pytest.approx(32 / math.sqrt(32))
    pat = _load(root, "demo-r4-pattern", dims)  # rank_pattern down_proj=12, alpha_pattern o_proj=16
    assert pat.ranks == {"q_proj": 4, "o_proj": 4, "down_proj": 12}
    assert pat.scale(1, "q_proj") == 8 / 4 and pat.scale(1, "o_proj") == 16 / 4 and pat.scale(1, "down_proj") == 8 / 12


def test_demo_generation_is_idempotent_and_deterministic(tiny_model_dir, root, tmp_path):
    before = {n: (root / n / "adapter_model.safetensors").stat().st_mtime_ns for n in DEMO_ADAPTER_NAMES}
    ensure_demo_adapters(tiny_model_dir, root)
    assert before == {n: (root / n / "adapter_model.safetensors").stat().st_mtime_ns for n in DEMO_ADAPTER_NAMES}
    other = ensure_demo_adapters(tiny_model_dir, tmp_path / "again")
    for n in DEMO_ADAPTER_NAMES:
        assert (root / n / "adapter_model.safetensors").read_bytes() == (other / n / "adapter_model.safetensors").read_bytes()
    assert sorted(list_adapters(root)) == sorted(DEMO_ADAPTER_NAMES + TRAINED_DEMO_NAMES)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_stale_demo_adapter_is_replaced(tiny_model_dir, root):
    (root / "demo-r8-qv" / "vlora_demo.json").write_text("{}")
    (root / "demo-r8-qv" / "adapter_model.safetensors").write_bytes(b"garbage")
    ensure_demo_adapters(tiny_model_dir, root)
    assert (root / "demo-r8-qv" / "adapter_model.safetensors").read_bytes()[:8] != b"garbage"


# ---- names and paths


@pytest.mark.parametrize("name", ["../x", "..", ".", "/etc", "/etc/passwd", "a/b", "a\\b", "", "x" * 129, "ü", "a b",
                                  "demo-r8-qv/../demo-r8-qv", "\x00"])
def test_bad_names_are_refused(root, name):
    with pytest.raises(AdapterError, match="invalid adapter name"):
        resolve_adapter_dir(root, name)


def test_non_string_name_is_refused(root):
    with pytest.raises(AdapterError, match="invalid adapter name"):
        resolve_adapter_dir(root, 3)  # type: ignore[arg-type]


def test_unknown_adapter_message_reveals_nothing(root):
    with pytest.raises(AdapterError) as e:
        resolve_adapter_dir(root, "nope")
    assert str(e.value) == "unknown adapter 'nope'"
    assert isinstance(e.value, InvalidRequest)


def test_symlink_escaping_the_root_is_refused(root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(root / "demo-r8-qv", outside)
    os.symlink(outside, root / "escape")
    with pytest.raises(AdapterError, match="unknown adapter 'escape'"):
        resolve_adapter_dir(root, "escape")
    os.symlink("..", root / "up")
    with pytest.raises(AdapterError, match="unknown adapter 'up'"):
        resolve_adapter_dir(root, "up")
    assert "escape" not in list_adapters(root)


def test_symlink_inside_the_root_is_followed(root, dims):
    os.symlink(root / "demo-r8-qv", root / "alias")
    assert resolve_adapter_dir(root, "alias") == (root / "demo-r8-qv").resolve()
    assert _load(root, "alias", dims).ranks == {"q_proj": 8, "v_proj": 8}


def test_weights_file_symlinked_out_of_the_root_is_refused(root, tmp_path, dims):
    (root / "sneaky").mkdir()
    shutil.copy(root / "demo-r8-qv" / "adapter_config.json", root / "sneaky" / "adapter_config.json")
    shutil.copy(root / "demo-r8-qv" / "adapter_model.safetensors", tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", root / "sneaky" / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="not a regular file inside the adapter root"):
        _load(root, "sneaky", dims)


# ---- what is refused


def test_pickle_weights_are_refused(root, dims):
    (root / "pickled").mkdir()
    shutil.copy(root / "demo-r8-qv" / "adapter_config.json", root / "pickled" / "adapter_config.json")
    torch.save({"x": torch.zeros(1)}, root / "pickled" / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle weights are not loaded; convert to safetensors"):
        _load(root, "pickled", dims)


def test_safetensors_is_preferred_and_pickle_never_read(root, dims):
    name = _clone(root, "demo-r8-qv", "both")
    (root / name / "adapter_model.bin").write_bytes(b"not even a pickle")
    assert _load(root, name, dims).max_rank == 8


def test_rank_over_max_rank(root, dims):
    with pytest.raises(AdapterError, match=r"rank 32 of .* is outside \[1, 16\]"):
        _load(root, "demo-r32-mlp", dims, max_rank=16)


def test_unsupported_module_for_this_server(root, dims):
    with pytest.raises(AdapterError, match=r"unsupported target module mlp\.(gate|up|down)_proj"):
        _load(root, "demo-r32-mlp", dims, supported=("q_proj", "k_proj", "v_proj", "o_proj"))


@pytest.mark.parametrize("key", [
    "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.multi_modal_projector.linear_1.lora_A.weight",
    "base_model.model.model.language_model.embed_tokens.lora_embedding_A",
    "base_model.model.lm_head.lora_A.weight",
    "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_magnitude_vector",
    "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.bias",
])
def test_modules_outside_the_decoder_are_refused(root, dims, key):
    name = _clone(root, "demo-r8-qv", "bad", edit_tensors=lambda t: t.__setitem__(key, torch.zeros(8, 64)))
    with pytest.raises(AdapterError, match=r"unsupported target module"):
        _load(root, name, dims)


def test_wrong_block_for_module_is_refused(root, dims):
    def move(t):
        k = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
        t[k.replace("self_attn", "mlp") + ".lora_A.weight"] = t.pop(k + ".lora_A.weight")
        t[k.replace("self_attn", "mlp") + ".lora_B.weight"] = t.pop(k + ".lora_B.weight")

    name = _clone(root, "demo-r8-qv", "moved", edit_tensors=move)
    with pytest.raises(AdapterError, match="unsupported target module mlp.q_proj"):
        _load(root, name, dims)


def test_shape_mismatch_names_key_and_shapes(root, dims):
    key = "base_model.model.model.language_model.layers.1.self_attn.v_proj.lora_B.weight"
    name = _clone(root, "demo-r8-qv", "misshaped", edit_tensors=lambda t: t.__setitem__(key, torch.zeros(128, 8)))
    with pytest.raises(AdapterError, match=rf"'{key}' has shape \[128, 8\], expected \[64, 8\]"):
        _load(root, name, dims)


def test_missing_pair_is_refused(root, dims):
    key = "base_model.model.model.language_model.layers.2.self_attn.q_proj.lora_B.weight"
    name = _clone(root, "demo-r8-qv", "half", edit_tensors=lambda t: t.pop(key))
    with pytest.raises(AdapterError, match="has no matching lora_B weight"):
        _load(root, name, dims)


def test_layer_out_of_range_is_refused(root, dims):
    def add(t):
        t["base_model.model.model.language_model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 128)
        t["base_model.model.model.language_model.layers.9.self_attn.q_proj.lora_B.weight"] = torch.zeros(128, 8)

    name = _clone(root, "demo-r8-qv", "deep", edit_tensors=add)
    with pytest.raises(AdapterError, match="names layer 9, but the model has 4 layers"):
        _load(root, name, dims)


def test_rank_disagreeing_with_config_is_refused(root, dims):
    name = _clone(root, "demo-r8-qv", "liar", edit_config=lambda c: c.update(r=4))
    with pytest.raises(AdapterError, match="has rank 8, but adapter_config.json gives r=4"):
        _load(root, name, dims)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(use_dora=True), "DoRA"),
    (lambda c: c.update(bias="all"), "bias='all'"),
    (lambda c: c.update(peft_type="IA3"), "peft_type 'IA3'"),
    (lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda c: c.update(r="eight"), "r must be a positive integer"),
    (lambda c: c.update(rank_pattern={"q_proj": "x"}), "rank_pattern"),
])
def test_unsupported_config_is_refused(root, dims, edit, message):
    name = _clone(root, "demo-r8-qv", "cfg", edit_config=edit)
    with pytest.raises(AdapterError, match=message):
        _load(root, name, dims)


def test_broken_files_are_refused(root, dims):
    name = _clone(root, "demo-r8-qv", "broken")
    (root / name / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterError, match="not a valid safetensors file"):
        _load(root, name, dims)
    name = _clone(root, "demo-r8-qv", "badjson")
    (root / name / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="adapter_config.json is not valid JSON"):
        _load(root, name, dims)
    name = _clone(root, "demo-r8-qv", "nan", edit_tensors=lambda t: next(iter(t.values())).fill_(float("nan")))
    with pytest.raises(AdapterError, match="non-finite"):
        _load(root, name, dims)


def test_transformers4_key_names_are_read(root, dims):
    def rename(t):
        for k in list(t):
            t[k.replace("base_model.model.model.language_model.", "base_model.model.language_model.model.")] = t.pop(k)

    name = _clone(root, "demo-r4-pattern", "old-names", edit_tensors=rename)
    old, new = _load(root, name, dims), _load(root, "demo-r4-pattern", dims)
    assert old.pairs.keys() == new.pairs.keys()
    for k in new.pairs:
        assert torch.equal(old.pairs[k].a, new.pairs[k].a) and old.pairs[k].scale == new.pairs[k].scale


def test_half_precision_weights_become_float32(root, dims):
    name = _clone(root, "demo-r8-qv", "bf16", edit_tensors=lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    a = _load(root, name, dims)
    assert all(p.a.dtype == torch.float32 and p.b.dtype == torch.float32 for p in a.pairs.values())


# ---- parity with PEFT


@pytest.mark.parametrize("name", DEMO_ADAPTER_NAMES)
def test_peft_loads_each_demo_adapter_identically(tiny_model_dir, demo_adapter_root, dims, name):
    peft = pytest.importorskip("peft")
    from transformers import LlavaForConditionalGeneration

    base = LlavaForConditionalGeneration.from_pretrained(str(tiny_model_dir), local_files_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, str(demo_adapter_root / name))
    complaints = [str(w.message) for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    assert not complaints, complaints
    ours = _load(demo_adapter_root, name, dims)
    _assert_same_as_peft(model, ours)
    seen = set(ours.pairs)
    spec = next(s for s in DEMO_ADAPTERS if s.name == name)
    assert {m for _, m in seen} == set(spec.modules)

    # PEFT would save exactly the keys of the file: nothing missing, nothing extra.
    from peft.utils import get_peft_model_state_dict

    saved = load_file(str(demo_adapter_root / name / "adapter_model.safetensors"))
    assert set(get_peft_model_state_dict(model)) == set(saved)


def _assert_same_as_peft(peft_model, ours):
    lora_modules = {n: m for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert lora_modules and all("language_model" in n for n in lora_modules), "PEFT wrapped modules outside the decoder"
    seen = set()
    for module_name, module in lora_modules.items():
        parts = module_name.split(".")
        layer, proj = int(parts[parts.index("layers") + 1]), parts[-1]
        pair = ours.pairs[(layer, proj)]
        assert torch.equal(module.lora_A["default"].weight, pair.a), module_name
        assert torch.equal(module.lora_B["default"].weight, pair.b), module_name
        assert module.scaling["default"] == pytest.approx(pair.scale, rel=1e-12), module_name
        seen.add((layer, proj))
    assert seen == set(ours.pairs), "PEFT and vlora disagree on which modules carry LoRA"


@pytest.mark.parametrize("use_rslora", [False, True])
def test_adapter_saved_by_peft_itself_is_read_as_peft_reads_it(tiny_model_dir, dims, tmp_path, use_rslora):
    """Per-layer rank_pattern and alpha_pattern, as PEFT writes them, give PEFT's ranks and scales."""
    peft = pytest.importorskip("peft")
    from transformers import LlavaForConditionalGeneration

    base = LlavaForConditionalGeneration.from_pretrained(str(tiny_model_dir), local_files_only=True)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, use_rslora=use_rslora,
        target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)",
        rank_pattern={"layers.1.self_attn.q_proj": 2, "down_proj": 6},
        alpha_pattern={"model.language_model.layers.0.mlp.down_proj": 3, "v_proj": 5},
    )
    torch.manual_seed(0)
    model = peft.get_peft_model(base, config)
    root = tmp_path / "adapters"
    model.save_pretrained(str(root / "from-peft"))
    ours = _load(root, "from-peft", dims)
    _assert_same_as_peft(model, ours)
    assert ours.pairs[(1, "q_proj")].rank == 2 and ours.pairs[(0, "q_proj")].rank == 4
    assert ours.ranks == {"q_proj": 4, "v_proj": 4, "down_proj": 6}


def test_an_adapter_is_carved_from_few_host_buffers(root, dims):
    """The pinned path carves an adapter's tensors from a few host buffers (page-locked allocations on CUDA):
    the same values as separate tensors, every view aligned, none overlapping, chunks filled before the next."""
    import torch

    from vlora.lora.peft_format import HostArena

    name = sorted(p.name for p in root.iterdir() if (p / "adapter_config.json").is_file())[0]
    kw = dict(num_layers=NUM_LAYERS, module_dims=dims, max_rank=64, supported_modules=LORA_TARGETS, dtype=torch.bfloat16)
    apart = load_adapter(root, name, **kw)
    one = load_adapter(root, name, one_buffer=True, **kw)
    assert one.version == apart.version and one.pairs.keys() == apart.pairs.keys()
    storages = set()
    spans = []
    for key, pair in one.pairs.items():
        for t, ref in ((pair.a, apart.pairs[key].a), (pair.b, apart.pairs[key].b)):
            assert t.dtype == torch.bfloat16 and torch.equal(t, ref)
            storages.add(t.untyped_storage().data_ptr())
            assert (t.data_ptr() - t.untyped_storage().data_ptr()) % HostArena.ALIGN == 0
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    assert len(storages) == -(-sum(HostArena.ALIGN * -(-(t.numel() * 2) // HostArena.ALIGN) for p in one.pairs.values()
                                   for t in (p.a, p.b)) // HostArena.CHUNK)
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_host_arena_chunks():
    import torch

    from vlora.lora.peft_format import HostArena

    shapes = [((4096, 64), torch.bfloat16)] * 40 + [((64, 14336), torch.bfloat16)]  # 40 x 512 KiB, then 1.75 MiB
    arena = HostArena(shapes, pin_memory=False)
    views = [arena.take(shape, dtype) for shape, dtype in shapes]
    assert arena.buffers == 2  # 32 fill the first 16 MiB chunk; the last 8 and the big one fit the second
    second = views[-1].untyped_storage()
    assert second.nbytes() == 8 << 20  # 8 x 512 KiB + 1.75 MiB = 5.75 MiB, in the next power of two
    big = HostArena([((1 << 13, 1 << 11), torch.bfloat16)], pin_memory=False)  # 32 MiB: a buffer of its own
    assert big.take((1 << 13, 1 << 11), torch.bfloat16).untyped_storage().nbytes() == 32 << 20


def test_safetensors_layout_is_checked_as_the_library_checks_it():
    """The weights are parsed as views of the file's bytes (no copy under the GIL): every layout the
    safetensors library refuses is refused here too, and a valid file gives the library's tensors."""
    import json as _json

    import pytest as _pytest
    import torch as _torch
    from safetensors.torch import load as st_load, save as st_save

    from vlora.lora.adapter import AdapterError
    from vlora.lora.peft_format import _parse_safetensors

    good = st_save({"a": _torch.arange(6, dtype=_torch.float32).view(2, 3), "b": _torch.ones(4, dtype=_torch.bfloat16)})
    n = int.from_bytes(good[:8], "little")
    header = _json.loads(good[8:8 + n])

    def parse(h, data=None):
        raw = _json.dumps(h).encode()
        raw += b" " * (-len(raw) % 8)
        body = good[8 + n:] if data is None else data
        blob = bytearray(len(raw).to_bytes(8, "little") + raw + body)
        return _parse_safetensors(blob, h, 8 + len(raw), "adapter 'x'")

    got = parse(header)
    want = st_load(good)
    assert set(got) == set(want) and all(_torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)

    def broken(**changes):
        h = _json.loads(_json.dumps(header))
        for key, (field, value) in changes.items():
            h[key][field] = value
        return h

    a_end = header["a"]["data_offsets"][1]
    for h, data, why in [
        (broken(a=("dtype", "X9")), None, "unknown dtype"),
        (broken(a=("data_offsets", [0, a_end - 4])), None, "do not hold its shape"),
        (broken(a=("data_offsets", [4, a_end + 4])), None, "starts at"),  # a hole before it
        (broken(b=("data_offsets", [a_end - 4, a_end + 4])), None, "starts at"),  # an overlap
        (broken(a=("data_offsets", "0-24")), None, "no valid data_offsets"),
        (header, good[8 + n:] + b"\0" * 8, "end at byte"),  # trailing bytes
        (header, good[8 + n:-2], "end at byte"),  # truncated
    ]:
        with _pytest.raises(AdapterError, match=why):
            parse(h, data)
