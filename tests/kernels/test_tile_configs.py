"""Every kernel config csrc/atmm/tile_configs.def compiles earns its place (no GPU, no extension): a committed
tiling table or the built-in default rule (table.cpp, TilingTable::default_choice: what a build without a table
serves, the A100's ATMM_CUDA_ARCHS=80 included) picks each ATMM config, and vlora.atmm.merge picks each merge
config. A config nothing picks is deleted, its measurements kept in csrc/atmm/NOTES.md."""
from __future__ import annotations

import re
from pathlib import Path

from vlora.atmm.merge import MERGE_CONFIGS
from vlora.atmm.tiling import default_table_dir, read_table

ROOT = Path(__file__).resolve().parents[2]
DEF = ROOT / "csrc" / "atmm" / "tile_configs.def"
TABLE_CPP = ROOT / "csrc" / "atmm" / "table.cpp"


def def_lines() -> dict[str, str]:
    """name -> family macro of every config line of the .def."""
    out = {}
    for line in DEF.read_text().splitlines():
        m = re.match(r"^(ATMM_[A-Z0-9_]+)\(\s*(\w+)\s*[,)]", line)
        if m:
            assert m.group(2) not in out, f"{m.group(2)} is listed twice"
            out[m.group(2)] = m.group(1)
    return out


def default_rule_configs() -> set[str]:
    """The config names the default rule's body asks find_config() for."""
    src = TABLE_CPP.read_text()
    body = src[src.index("LookupResult TilingTable::default_choice"):src.index("LookupResult TilingTable::lookup")]
    return set(re.findall(r'"(\w+)"', body))


def table_configs() -> set[str]:
    names = set()
    for path in default_table_dir().glob("*.json"):
        _, entries = read_table(path)
        names |= {e.config for e in entries}
    return names


def test_every_compiled_config_is_picked():
    lines = def_lines()
    atmm = {n for n, fam in lines.items() if fam != "ATMM_MERGE_STREAM"}
    merge = {n for n, fam in lines.items() if fam == "ATMM_MERGE_STREAM"}
    picked = table_configs() | default_rule_configs()
    unused = sorted(atmm - picked)
    assert not unused, f"tile_configs.def compiles configs no committed table and no default rule picks: {unused}"
    assert merge == set(MERGE_CONFIGS), f"merge configs {sorted(merge)} != vlora.atmm.merge.MERGE_CONFIGS"


def test_every_picked_config_is_compiled():
    lines = def_lines()
    missing = sorted((table_configs() | default_rule_configs() | set(MERGE_CONFIGS)) - set(lines))
    assert not missing, f"picked but not in tile_configs.def: {missing}"


def test_the_default_rule_is_read():
    """The parse above finds the rule's choices (a rename in table.cpp must not make this test vacuous)."""
    rule = default_rule_configs()
    assert {"xs_m16_r64_w1x4", "t64x64_k64_s5", "ye_m16n128_r64_w1x4", "t64x128_k32_s6", "t128x128_k32_s4"} <= rule
    assert table_configs(), "no committed tiling table found"


def test_the_header_explains_every_prefix():
    """The .def's header table names each family macro in use, with the prefix of its configs."""
    text = DEF.read_text()
    header = text[text.index("// Kernel names: what each prefix means."):text.index("#ifndef ATMM_CONFIG")]
    for name, fam in def_lines().items():
        assert fam in header, f"{fam} ({name}) is not in the prefix table"
        prefix = re.match(r"^(t|gemv|fx1?|xs|ye|h9|tr_[sec]|mg)", name)
        assert prefix and prefix.group(1) in header, name
