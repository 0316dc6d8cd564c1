"""An adapter's version is the hash of the bytes it was loaded from (issue 37, hole 4).

The prefix cache and the encoder cache key on ``name@version``. A version made of the files' size,
mtime and inode kept its value when the weights were overwritten in place with the same size and the
mtime restored (``cp -p``, rsync), and it was taken after the weights were read, so a file swapped
mid-read paired the old weights with the new file's version. Here: a content change always gives a new
version, an unchanged reload keeps it, the version is the hash of exactly the bytes the weights were
parsed from, and a symlink swapped in after the path was checked is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from vlora.config import LORA_TARGETS, EngineConfig
from vlora.lora import adapter as adapter_mod
from vlora.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError, decoder_module_dims, load_adapter

A = "demo-r8-qv"
LONG_PROMPT = ("USER: You answer questions about the city's traffic reports. Reports: the north bridge is closed "
               "for repairs until Friday; buses take the east road; the tram runs every ten minutes. "
               "Is the bridge open? ASSISTANT:")


@pytest.fixture(scope="module")
def dims(tiny_model_dir):
    return decoder_module_dims(json.loads((tiny_model_dir / "config.json").read_text())["text_config"])


@pytest.fixture()
def root(demo_adapter_root, tmp_path) -> Path:
    out = tmp_path / "adapters"
    out.mkdir()
    shutil.copytree(demo_adapter_root / A, out / A)
    return out


def _load(root, dims, name=A):
    return load_adapter(root, name, num_layers=4, module_dims=dims, max_rank=64, supported_modules=LORA_TARGETS)


def expected_version(*files: tuple[str, bytes]) -> str:
    """The documented version: sha256 over each file's name, length and bytes, in load order."""
    h = hashlib.sha256(b"vlora-adapter\0")
    for name, data in files:
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def negated_b(weights: bytes, factor: float = -2.0) -> bytes:
    """The same safetensors file with every lora_B scaled: same keys, shapes, dtypes, hence the same size."""
    tensors = load_bytes(weights)
    n = int.from_bytes(weights[:8], "little")
    metadata = json.loads(weights[8:8 + n]).get("__metadata__")
    out = save_bytes({k: (v * factor if "lora_B" in k else v).contiguous() for k, v in tensors.items()},
                     metadata=metadata)
    assert len(out) == len(weights)
    return out


def overwrite_in_place(path: Path, data: bytes) -> None:
    """Write ``data`` over ``path`` (same inode), then restore its atime and mtime: what ``cp -p`` leaves."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def _pairs_equal(w, tensors: dict) -> bool:
    for (layer, module), pair in w.pairs.items():
        key = f"base_model.model.model.language_model.layers.{layer}.self_attn.{module}"
        if not (torch.equal(pair.a, tensors[key + ".lora_A.weight"].float())
                and torch.equal(pair.b, tensors[key + ".lora_B.weight"].float())):
            return False
    return True


# ---- the version is the content


def test_in_place_overwrite_with_same_size_and_mtime_gets_a_new_version(root, dims):
    weights = root / A / WEIGHTS_FILE
    old_bytes = weights.read_bytes()
    v1 = _load(root, dims).version
    new_bytes = negated_b(old_bytes)
    overwrite_in_place(weights, new_bytes)
    w2 = _load(root, dims)
    assert w2.version != v1, "same size, mtime and inode, other weights: the version must change"
    config = (root / A / CONFIG_FILE).read_bytes()
    assert v1 == expected_version((CONFIG_FILE, config), (WEIGHTS_FILE, old_bytes))
    assert w2.version == expected_version((CONFIG_FILE, config), (WEIGHTS_FILE, new_bytes))
    assert _pairs_equal(w2, load_bytes(new_bytes))


def test_a_config_change_in_place_gets_a_new_version(root, dims):
    path = root / A / CONFIG_FILE
    v1 = _load(root, dims).version
    text = path.read_text()
    assert '"lora_alpha": 16' in text
    overwrite_in_place(path, text.replace('"lora_alpha": 16', '"lora_alpha": 12').encode())
    w2 = _load(root, dims)
    assert w2.version != v1 and w2.scale(0, "q_proj") == 12 / 8


def test_an_unchanged_reload_keeps_its_version(root, dims):
    """Same bytes, same weights, same keys and values: what the caches hold for it is still right."""
    v1 = _load(root, dims).version
    for p in (root / A).iterdir():
        os.utime(p, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched, and copied elsewhere
    shutil.copytree(root / A, root / "copy")
    assert _load(root, dims).version == v1
    assert _load(root, dims, "copy").version == v1  # the name is part of the cache key, not of the version


def test_heads_are_part_of_the_version(root, dims):
    from vlora.heads import HEADS_CONFIG, HEADS_WEIGHTS, TaskHead, save_heads

    hidden = dims["q_proj"][0]
    g = torch.Generator().manual_seed(0)
    save_heads(root / A, {"count": TaskHead("count", "counting", ("0", "1"), torch.randn(2, hidden, generator=g),
                                            torch.zeros(2))})
    w1 = _load(root, dims)
    hw = root / A / HEADS_WEIGHTS
    old = hw.read_bytes()
    new = save_bytes({k: (v * -1).contiguous() for k, v in load_bytes(old).items()}, metadata={"format": "pt"})
    overwrite_in_place(hw, new)
    w2 = _load(root, dims)
    assert w2.version != w1.version
    assert torch.equal(w2.heads["count"].weight, -w1.heads["count"].weight)
    files = [(n, (root / A / n).read_bytes()) for n in (CONFIG_FILE, WEIGHTS_FILE, HEADS_CONFIG, HEADS_WEIGHTS)]
    assert w2.version == expected_version(*files)


# ---- the version and the weights come from one read


def test_a_file_swapped_after_the_read_does_not_lend_its_version(root, dims, monkeypatch):
    """The weights file is replaced (another inode, size and mtime) after its tensors were read: the
    version is still the hash of the bytes the weights came from."""
    weights = root / A / WEIGHTS_FILE
    old_bytes = weights.read_bytes()
    swapped = []
    check = adapter_mod._check_magnitude

    def check_then_swap(*args):
        if not swapped:  # the first tensors have been read: swap the file for another one
            tmp = weights.with_name("incoming.tmp")
            t = load_bytes(old_bytes)
            t["extra.pad"] = torch.zeros(16)  # another size, too
            tmp.write_bytes(save_bytes({k: (v * 3 if "lora_B" in k else v).contiguous() for k, v in t.items()}))
            os.replace(tmp, weights)
            swapped.append(True)
        return check(*args)

    monkeypatch.setattr(adapter_mod, "_check_magnitude", check_then_swap)
    w = _load(root, dims)
    assert swapped
    config = (root / A / CONFIG_FILE).read_bytes()
    assert w.version == expected_version((CONFIG_FILE, config), (WEIGHTS_FILE, old_bytes))
    assert _pairs_equal(w, load_bytes(old_bytes))


def test_a_file_rewritten_while_it_is_read_gets_the_version_of_the_bytes_read(root, dims, monkeypatch):
    """The weights file is overwritten in place (same size, mtime restored) between two reads of the
    loader: whatever mix was read, the weights are parsed from it and the version is its hash."""
    from vlora.lora import files

    weights = root / A / WEIGHTS_FILE
    old_bytes = weights.read_bytes()
    new_bytes = negated_b(old_bytes)
    reads: dict[str, list[bytes]] = {}
    real_read = files.OneRead.read

    def read(self, n):
        out = real_read(self, n)
        reads.setdefault(self.path.name, []).append(out)
        if self.path.name == WEIGHTS_FILE and len(reads[WEIGHTS_FILE]) == 2:  # the header is read
            overwrite_in_place(weights, new_bytes)
        return out

    real_read_all = files.OneRead.read_all

    def read_all(self, limit):  # the whole file, into one buffer
        out = real_read_all(self, limit)
        reads.setdefault(self.path.name, []).append(bytes(out))
        return out

    monkeypatch.setattr(files.OneRead, "read", read)
    monkeypatch.setattr(files.OneRead, "read_all", read_all)
    w = _load(root, dims)
    # the header was read (two reads) and checked, then the whole file in one piece: that is what was parsed
    got = {name: parts[-1] for name, parts in reads.items()}
    assert len(reads[WEIGHTS_FILE]) == 3 and got[WEIGHTS_FILE].startswith(b"".join(reads[WEIGHTS_FILE][:2]))
    assert got[WEIGHTS_FILE] != old_bytes and got[WEIGHTS_FILE] == new_bytes
    assert w.version == expected_version((CONFIG_FILE, got[CONFIG_FILE]), (WEIGHTS_FILE, got[WEIGHTS_FILE]))
    assert _pairs_equal(w, load_bytes(got[WEIGHTS_FILE]))
    monkeypatch.undo()
    assert _load(root, dims).version == w.version  # the file now holds what was read


def test_a_header_rewritten_after_it_was_checked_is_refused(root, dims, monkeypatch):
    """The file's header changes between its check and the read of the whole file: refused, not parsed
    with shapes that were never checked; the next load reads the new file."""
    from vlora.lora import files

    weights = root / A / WEIGHTS_FILE
    other = save_bytes({k: v for k, v in load_bytes(weights.read_bytes()).items()}, metadata={"format": "pt", "x": "y"})
    calls = []
    real_read = files.OneRead.read

    def read(self, n):
        out = real_read(self, n)
        calls.append(self.path.name)
        if calls.count(WEIGHTS_FILE) == 2 and self.path.name == WEIGHTS_FILE:
            overwrite_in_place(weights, other) if len(other) == weights.stat().st_size else weights.write_bytes(other)
        return out

    monkeypatch.setattr(files.OneRead, "read", read)
    with pytest.raises(AdapterError, match=f"adapter '{A}': {WEIGHTS_FILE} changed while it was read; load it again"):
        _load(root, dims)
    monkeypatch.undo()
    config = (root / A / CONFIG_FILE).read_bytes()
    assert _load(root, dims).version == expected_version((CONFIG_FILE, config), (WEIGHTS_FILE, other))


def test_a_symlink_swapped_in_after_the_check_is_refused(root, dims, tmp_path, monkeypatch):
    """The weights file becomes a symlink out of the root between the root check and the open."""
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(negated_b((root / A / WEIGHTS_FILE).read_bytes()))
    inside = adapter_mod._inside

    def inside_then_swap(adir, filename, *args):
        path = inside(adir, filename, *args)
        if filename == WEIGHTS_FILE:
            path.unlink()
            os.symlink(outside, path)
        return path

    monkeypatch.setattr(adapter_mod, "_inside", inside_then_swap)
    with pytest.raises(AdapterError, match=f"adapter '{A}': {WEIGHTS_FILE} is not a regular file inside the adapter"):
        _load(root, dims)


def test_weights_larger_than_their_tensors_are_refused_before_they_are_read(root, dims):
    path = root / A / WEIGHTS_FILE
    with open(path, "ab") as f:
        f.write(b"\0" * (1 << 20))
    with pytest.raises(AdapterError, match="not a valid safetensors file"):
        _load(root, dims)


# ---- the manager and the engine


def _engine(tiny_model_dir, root, **over):
    from vlora.engine.builder import build_engine

    base = {"model.path": str(tiny_model_dir), "lora.adapter_root": str(root), "model.device": "cpu",
            "model.dtype": "float32", "lora.max_rank": "16", "cache.prefix_caching": "on"}
    base.update(over)
    return build_engine(EngineConfig().with_overrides(base))


def _generate(engine, lora, prompt=LONG_PROMPT, max_tokens=6) -> str:
    from vlora.engine.api import GenerationRequest, SamplingParams

    outs = []
    req = GenerationRequest(f"r{time.monotonic_ns()}", prompt, lora_name=lora,
                            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.add_request(engine.inputs.prepare(req), outs.append)
    while engine.has_work():
        engine.step()
    assert outs and outs[-1].finished
    return outs[-1].text


def test_a_reload_after_an_in_place_overwrite_is_not_served_from_the_prefix_cache(tiny_model_dir, root):
    engine = _engine(tiny_model_dir, root)
    before = _generate(engine, A)
    assert _generate(engine, A) == before  # served again, from the prefix cache
    (entry,) = engine.describe_adapters([A])
    identity = engine.loras.slot_identity(engine.loras.resident[A])

    engine.unload_adapter(A)
    overwrite_in_place(root / A / WEIGHTS_FILE, negated_b((root / A / WEIGHTS_FILE).read_bytes()))
    assert engine.loras.load(A) is True
    (reloaded,) = engine.describe_adapters([A])
    after = _generate(engine, A)

    fresh = _generate(_engine(tiny_model_dir, root, **{"cache.prefix_caching": "off"}), A)
    assert fresh != before, "the new weights do not change the answer: a stale cache would not show"
    assert after == fresh
    assert engine.loras.slot_identity(engine.loras.resident[A]) != identity
    assert reloaded["version"] != entry["version"]  # the admin answer (list, load) shows it


def test_registering_other_weights_under_a_name_gets_new_keys(tiny_model_dir, root):
    import dataclasses

    engine = _engine(tiny_model_dir, root)
    w = engine.loras.validate(A)
    first = dataclasses.replace(w, version="")
    engine.loras.register("mem", first)
    slot = engine.loras.acquire("mem")
    identity = engine.loras.slot_identity(slot)
    engine.loras.release(slot)
    engine.unload_adapter("mem")
    negated = {k: dataclasses.replace(p, b=-p.b) for k, p in w.pairs.items()}
    engine.loras.register("mem", dataclasses.replace(first, pairs=negated))
    slot = engine.loras.acquire("mem")
    assert engine.loras.slot_identity(slot) != identity
    engine.loras.release(slot)
