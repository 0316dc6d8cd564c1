"""The loader's norms and views take a few torch calls per adapter, not a few per tensor: each torch call
releases the GIL and must take it back, which beside a busy engine thread waits up to the switch interval.
The batched norms are the per-tensor ones (fp32 accumulation, fp64 for fp64), the views the file's bytes, and
the first bad tensor in load order is still the one named."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load, save as st_save, save_file

from vlora.lora.adapter import AdapterError, load_adapter
from vlora.lora.peft_format import _l2_norms, _parse_safetensors

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def _reference(t: torch.Tensor) -> float:
    """The norm as the loader defines it: the squares summed in fp32 (fp64 for fp64), one tensor at a time."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    flat = t.reshape(-1).to(acc)
    return math.sqrt(float(torch.dot(flat, flat))) if flat.numel() else 0.0


def test_batched_norms_are_the_per_tensor_norms():
    g = torch.Generator().manual_seed(0)
    ts: list = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn):
        for shape in [(8, 32), (32, 8), (5,), (), (2, 3, 4), (0, 7)]:
            for _ in range(19 if shape == (8, 32) else 2):
                ts.append((torch.randn(shape, generator=g) * 3).to(dtype))
    inf_bf16 = torch.ones(8, 32, dtype=torch.bfloat16)
    inf_bf16[3, 4] = float("inf")
    nan_fp16 = torch.ones(8, 32, dtype=torch.float16)
    nan_fp16[0, 0] = float("nan")
    nan_fp64 = torch.ones(5, dtype=torch.float64)
    nan_fp64[2] = float("nan")
    overflow = torch.full((8, 32), 1e20, dtype=torch.bfloat16)  # finite values whose squares overflow fp32
    wide = torch.full((8, 32), 1e20, dtype=torch.float64)  # ... but not fp64
    ts[5:5] = [inf_bf16, nan_fp16, None, torch.arange(6, dtype=torch.int32), nan_fp64, overflow, wide]
    ts.append(torch.randn(64, 64, generator=g).to(torch.bfloat16)[:, ::2])  # not contiguous

    got = _l2_norms(ts)
    assert len(got) == len(ts)
    for t, norm in zip(ts, got):
        if t is None or not t.is_floating_point():
            assert math.isnan(norm)
            continue
        want = _reference(t)
        if math.isnan(want):
            assert math.isnan(norm), t.dtype
        elif math.isinf(want):
            assert norm == math.inf, t.dtype
        else:
            assert norm == pytest.approx(want, rel=1e-12 if t.dtype == torch.float64 else 1e-5, abs=1e-30), (
                t.dtype, tuple(t.shape))
    at = {id(t): i for i, t in enumerate(ts)}
    assert math.isinf(got[at[id(overflow)]]) and math.isfinite(got[at[id(wide)]])
    assert _l2_norms([]) == []


def test_parsed_tensors_are_views_of_the_files_bytes():
    g = torch.Generator().manual_seed(1)
    want = {
        "a": torch.randn(3, 5, 7, generator=g),
        "b": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "c": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "d": torch.randn(6, 4, generator=g).to(torch.bfloat16),  # b's shape, at another phase of its rows
        "e": torch.tensor(2.5, dtype=torch.float16),
        "f": torch.randn(9, generator=g).to(torch.float64),
        "g": torch.randn(2, 4, generator=g).to(torch.float16),
        "h": torch.empty(0, 3),
    }
    blob = st_save(want)
    n = int.from_bytes(blob[:8], "little")
    data = bytearray(blob)
    got = _parse_safetensors(data, json.loads(blob[8:8 + n]), 8 + n, "adapter 'x'")
    lib = st_load(blob)
    start = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    for key, t in got.items():
        assert t.dtype == lib[key].dtype and t.shape == lib[key].shape and torch.equal(t, lib[key]), key
        assert t.is_contiguous(), key
        if t.numel():
            assert start <= t.data_ptr() < start + len(data), key  # no copy
    got["b"].fill_(7)  # a view: writes land in the buffer, not in another tensor
    assert torch.equal(_parse_safetensors(data, json.loads(blob[8:8 + n]), 8 + n, "x")["b"], got["b"])
    assert torch.equal(got["d"], lib["d"]) and torch.equal(got["c"], lib["c"])


def _write_adapter(root: Path, name: str, layers: int, rank: int = 4, d: int = 64, dtype=torch.bfloat16,
                   edit=None) -> None:
    g = torch.Generator().manual_seed(2)
    t = {}
    for layer in range(layers):
        for m in MODULES:
            p = f"base_model.model.model.language_model.layers.{layer}.self_attn.{m}"
            t[f"{p}.lora_A.weight"] = (torch.randn(rank, d, generator=g) * 0.01).to(dtype)
            t[f"{p}.lora_B.weight"] = (torch.randn(d, rank, generator=g) * 0.01).to(dtype)
    if edit is not None:
        edit(t)
    (root / name).mkdir(parents=True)
    save_file(t, str(root / name / "adapter_model.safetensors"))
    (root / name / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}))


def _load(root: Path, name: str, layers: int, d: int = 64, dtype=torch.bfloat16):
    dims = {m: (d, d) for m in MODULES}
    return load_adapter(root, name, num_layers=layers, module_dims=dims, max_rank=64, supported_modules=MODULES,
                        dtype=dtype)


# Tensor accessors that read a field and keep the GIL; every other torch call is counted.
_GIL_FREE = {"Tensor.is_floating_point", "Tensor.is_contiguous", "Tensor.numel", "Tensor.dim"}


def _calls(fn, counted) -> int:
    """C calls for which ``counted(callable)`` holds, made while ``fn`` runs."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "c_call" and counted(arg):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _is_torch_call(arg) -> bool:
    q = getattr(arg, "__qualname__", "")
    return q not in _GIL_FREE and ((getattr(arg, "__module__", None) or "").startswith("torch")
                                   or isinstance(getattr(arg, "__self__", None), torch.Tensor)
                                   or q.startswith(("Tensor.", "_VariableFunctionsClass.")))


def _torch_calls(fn) -> int:
    return _calls(fn, _is_torch_call)


def test_a_load_makes_a_few_torch_calls_not_a_few_per_tensor(tmp_path):
    _write_adapter(tmp_path, "small", layers=2)
    _write_adapter(tmp_path, "big", layers=32)  # 256 tensors, as a rank-64 q/k/v/o adapter of a 7B model
    w = _load(tmp_path, "big", 32)
    assert len(w.pairs) == 128 and w.pairs[(31, "o_proj")].a.dtype == torch.bfloat16
    _load(tmp_path, "small", 2)
    small = _torch_calls(lambda: _load(tmp_path, "small", 2))
    big = _torch_calls(lambda: _load(tmp_path, "big", 32))
    # 240 more tensors: nothing per tensor (per tensor the views and norms took 5 calls: 1,200 more)
    assert big - small <= 4, (small, big)
    assert big <= 60, big


def test_the_first_bad_tensor_in_load_order_is_named(tmp_path):
    def poison(t):
        t["base_model.model.model.language_model.layers.7.self_attn.v_proj.lora_B.weight"][0, 0] = float("inf")
        t["base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight"][1, 2] = float("nan")
        t["base_model.model.model.language_model.layers.9.self_attn.k_proj.lora_A.weight"].fill_(1e20)

    _write_adapter(tmp_path, "bad", layers=12, edit=poison)
    with pytest.raises(AdapterError, match=r"layers\.3\.self_attn\.q_proj\.lora_A\.weight' holds non-finite values"):
        _load(tmp_path, "bad", 12)

    def overflow_first(t):
        poison(t)
        t["base_model.model.model.language_model.layers.2.self_attn.o_proj.lora_B.weight"].fill_(1e20)

    # finite values whose norm overflows fp32: the magnitude check refuses them, first in load order
    _write_adapter(tmp_path, "huge", layers=12, edit=overflow_first)
    with pytest.raises(AdapterError, match=r"layers\.2\.self_attn\.o_proj: \|scale\| \* \|\|B\|\| \* \|\|A\|\| = inf"):
        _load(tmp_path, "huge", 12)


def test_converted_weights_and_norms_match_the_file(tmp_path):
    _write_adapter(tmp_path, "fp16", layers=3, dtype=torch.float16)
    w = _load(tmp_path, "fp16", 3, dtype=torch.float32)
    lib = st_load((tmp_path / "fp16" / "adapter_model.safetensors").read_bytes())
    for (layer, m), pair in w.pairs.items():
        p = f"base_model.model.model.language_model.layers.{layer}.self_attn.{m}"
        assert pair.a.dtype == torch.float32 and torch.equal(pair.a, lib[f"{p}.lora_A.weight"].float())
        assert torch.equal(pair.b, lib[f"{p}.lora_B.weight"].float())


_SYSCALLS = {"lstat", "stat", "open", "fstat", "read", "readv", "pread", "close", "lseek", "set_blocking", "listdir",
             "scandir", "readlink", "access"}


def _os_calls(fn) -> int:
    """System calls made through ``os`` (each releases the GIL and takes it back) while ``fn`` runs."""
    return _calls(fn, lambda arg: getattr(arg, "__module__", None) == "posix" and arg.__name__ in _SYSCALLS)


def test_a_load_checks_its_paths_with_a_few_system_calls(tmp_path):
    """The root is resolved once per load, and a folder and files that are no symlinks cost one lstat each (every
    system call waits for the GIL again on a loader thread beside a busy engine thread). A symlinked adapter
    folder is still followed, and still must stay inside the root."""
    root = tmp_path / "a" / "b" / "c"
    _write_adapter(root, "plain", layers=2)
    _load(root, "plain", 2)
    path_calls = _os_calls(lambda: _load(root, "plain", 2))
    # the root's components, then the folder and its two files; then the two files' reads (open, fstat, reads,
    # close: 16). The root resolved at each check made 36 more.
    assert path_calls <= len(root.resolve().parts) + 3 + 17, path_calls
    (root / "linked").symlink_to(root / "plain")
    assert _load(root, "linked", 2).dir == (root / "plain").resolve()
    outside = tmp_path / "outside"
    _write_adapter(outside, "x", layers=2)
    (root / "escape").symlink_to(outside / "x")
    with pytest.raises(AdapterError, match="unknown adapter 'escape'"):
        _load(root, "escape", 2)
    (root / "plain2").mkdir()
    for f in ("adapter_config.json",):
        (root / "plain2" / f).write_bytes((root / "plain" / f).read_bytes())
    (root / "plain2" / "adapter_model.safetensors").symlink_to(outside / "x" / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="adapter_model.safetensors is not a regular file inside the adapter root"):
        _load(root, "plain2", 2)
    (root / "plain2" / "adapter_model.safetensors").unlink()
    (root / "plain2" / "adapter_model.safetensors").symlink_to(root / "nowhere")  # dangling: reads as missing
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        _load(root, "plain2", 2)


def test_check_values_off_leaves_only_the_values_to_the_caller(tmp_path):
    """``check_values=False`` (a request's read on CUDA, whose slot copy checks the values on the device): no norm
    is taken and a non-finite value passes, marked unchecked; every other check stays, the scale's bound too."""
    key = "base_model.model.model.language_model.layers.2.self_attn.k_proj.lora_B.weight"
    _write_adapter(tmp_path, "bad", layers=4, edit=lambda t: t[key].__setitem__((1, 1), float("nan")))
    with pytest.raises(AdapterError, match="non-finite"):
        _load(tmp_path, "bad", 4)
    dims = {m: (64, 64) for m in MODULES}
    load = lambda name, **kw: load_adapter(tmp_path, name, num_layers=4, module_dims=dims, max_rank=64,  # noqa: E731
                                           supported_modules=MODULES, dtype=torch.bfloat16, **kw)
    w = load("bad", check_values=False)
    assert not w.values_checked and len(w.pairs) == 16 and torch.isnan(w.pairs[(2, "k_proj")].b).any()
    _write_adapter(tmp_path, "good", layers=4)
    assert load("good").values_checked
    is_norm = lambda fn: getattr(fn, "__name__", "") == "_foreach_norm"  # noqa: E731
    assert _calls(lambda: load("good"), is_norm) >= 1 and _calls(lambda: load("good", check_values=False), is_norm) == 0
    cfg = tmp_path / "bad" / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"lora_alpha": 8', '"lora_alpha": 1e12'))
    with pytest.raises(AdapterError, match="scale"):
        load("bad", check_values=False)
