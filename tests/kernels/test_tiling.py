"""Tiling table files, and the C++ table when the extension is importable (it loads without a GPU)."""
from __future__ import annotations

import json

import pytest

from vlora.atmm.tiling import TableEntry, arch_of, gpu_slug, read_table, resolve_table, table_path, write_table


def test_gpu_slug_and_path(tmp_path):
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert table_path("NVIDIA A100-SXM4-80GB", tmp_path) == tmp_path / "nvidia-a100-sxm4-80gb.json"


def test_roundtrip(tmp_path):
    entry = dict(direction="shrink", dtype="bf16", tokens=256, width=4096, rank=32, segments=1,
                 config="t64x64_k64_s5", split_k=8, time_us=3.5)
    write_table(tmp_path / "t.json", {"gpu": "x"}, [entry])
    header, entries = read_table(tmp_path / "t.json")
    assert header["gpu"] == "x"
    assert entries == [TableEntry(**{k: v for k, v in entry.items() if k != "time_us"})]


def test_bad_entry_is_named(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"format": 1, "entries": [
        dict(direction="sideways", dtype="bf16", tokens=1, width=8, rank=8, segments=1, config="c")]}))
    with pytest.raises(ValueError, match="entry 0"):
        read_table(tmp_path / "t.json")


def _table(path, gpu, archs, n):
    entry = dict(direction="shrink", dtype="bf16", tokens=256, width=4096, rank=32, segments=1, config="c", split_k=1)
    write_table(path, {"gpu": gpu, "cuda_archs": archs}, [dict(entry, tokens=256 + i) for i in range(n)])


def test_resolve_table_own_then_same_capability_then_the_rule(tmp_path):
    """A GPU's own table serves it; without one, the largest shipped table of the same compute capability (an
    H200 takes the H100's); without that, the default rule. $VLORA_ATMM_TABLE (the benchmarks') wins."""
    assert arch_of("90a") == "90" and arch_of("sm_80") == "80" and arch_of("90a;80") == "90"
    _table(tmp_path / "nvidia-h100-80gb-hbm3.json", "NVIDIA H100 80GB HBM3", "90a", 3)
    _table(tmp_path / "nvidia-h100-pcie.json", "NVIDIA H100 PCIe", "90a", 2)
    _table(tmp_path / "nvidia-a100-sxm4-80gb.json", "NVIDIA A100-SXM4-80GB", "80", 5)
    (tmp_path / "broken.json").write_text("{")  # skipped, not fatal
    path, why = resolve_table("NVIDIA H100 PCIe", (9, 0), tmp_path)
    assert path == tmp_path / "nvidia-h100-pcie.json" and "this GPU's" in why
    path, why = resolve_table("NVIDIA H200", (9, 0), tmp_path)
    assert path == tmp_path / "nvidia-h100-80gb-hbm3.json"
    assert "no table for NVIDIA H200" in why and "NVIDIA H100 80GB HBM3's" in why and "sm_90" in why
    assert resolve_table("NVIDIA L4", (8, 9), tmp_path)[0] is None
    assert resolve_table("NVIDIA H200", None, tmp_path)[0] is None
    assert resolve_table("NVIDIA H200", (9, 0), tmp_path, env="none") == (None, "$VLORA_ATMM_TABLE=none: the built-in default rule")
    with pytest.raises(FileNotFoundError, match="VLORA_ATMM_TABLE"):
        resolve_table("NVIDIA H200", (9, 0), tmp_path, env=str(tmp_path / "x.json"))
    _table(tmp_path / "x.json", "mine", "90a", 1)
    assert resolve_table("NVIDIA H200", (9, 0), tmp_path, env=str(tmp_path / "x.json"))[0] == tmp_path / "x.json"


def test_every_shipped_table_names_its_capability():
    """What resolve_table matches a GPU without a table of its own against."""
    from vlora.atmm.tiling import default_table_dir

    for path in default_table_dir().glob("*.json"):
        header, _ = read_table(path)
        assert arch_of(header.get("cuda_archs", "")), path


def test_committed_tables_parse():
    from vlora.atmm.tiling import default_table_dir

    for path in default_table_dir().glob("*.json"):
        read_table(path)


def test_cpp_table_validation_and_fallback(tmp_path):
    ext = pytest.importorskip("vlora_atmm_ext", reason="the ATMM CUDA extension is built only on a CUDA machine "
                                                       "(make atmm-ext), and this test runs where it is")
    names = [c["name"] for c in ext.configs()]
    assert len(names) >= 8
    table = ext.TilingTable()
    with pytest.raises(ValueError, match="no_such_config"):
        table.add("shrink", "bf16", 256, 4096, 32, 1, "no_such_config", 4)
    expand_only = [c["name"] for c in ext.configs() if not c["shrink"]]
    if expand_only:
        with pytest.raises(ValueError, match="shrink"):
            table.add("shrink", "bf16", 256, 4096, 32, 1, expand_only[0], 1)
    hit = table.lookup("shrink", "bf16", 256, 4096, 32, 1)
    assert hit["default"] and hit["config"] in names
    table.add("shrink", "bf16", 256, 4096, 32, 1, names[0], 4)
    table.add("shrink", "bf16", 8192, 4096, 128, 8, names[1], 1)
    hit = table.lookup("shrink", "bf16", 250, 4096, 32, 1)  # same 32-token bucket
    assert hit["exact"] and hit["config"] == names[0] and hit["split_k"] == 4
    hit = table.lookup("shrink", "bf16", 7000, 4096, 128, 7)
    assert not hit["exact"] and not hit["default"] and hit["config"] == names[1]
    assert table.key("shrink", "bf16", 250, 4096, 32, 1) == table.key("shrink", "bf16", 256, 4096, 32, 1)
    assert table.key("shrink", "bf16", 256, 4096, 32, 1) != table.key("expand", "bf16", 256, 4096, 32, 1)


def test_committed_tables_name_only_configs_of_the_one_list():
    """Every config a committed table names is a line of csrc/atmm/tile_configs.def (no extension needed)."""
    import re

    from pathlib import Path

    from vlora.atmm.tiling import default_table_dir

    root = Path(__file__).resolve().parents[2]
    lines = (root / "csrc" / "atmm" / "tile_configs.def").read_text().splitlines()
    names = {m.group(1) for m in (re.match(r"^ATMM_[A-Z0-9_]+\(\s*(\w+)\s*[,)]", s) for s in lines) if m}
    assert {"gemv_shrink", "t64x64_k64_s5", "tr_s_m64k128_r128_w4s4", "h9_m128n256_co_e128"} <= names
    for path in default_table_dir().glob("*.json"):
        _, entries = read_table(path)
        unknown = sorted({e.config for e in entries} - names)
        assert not unknown, f"{path.name} names configs that tile_configs.def does not list: {unknown}"
