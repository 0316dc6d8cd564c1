"""A tiling table that names kernels of a family this build lacks (no triton at build time, no sm_90a)
still loads: those entries are skipped with one warning; any other unknown config is still refused."""
from __future__ import annotations

import logging

import pytest

from vlora.atmm import AtmmKernels
from vlora.atmm.tiling import write_table


class _Table:
    def __init__(self) -> None:
        self.added: list[str] = []

    def add(self, direction, dtype, tokens, width, rank, segments, config, split_k) -> None:
        if config not in _Ext.NAMES:
            raise ValueError(f"tiling table entry names config '{config}', which is not compiled")
        self.added.append(config)


class _Ext:
    NAMES = ("xs_a", "ye_a", "t64")
    TilingTable = _Table

    @staticmethod
    def configs() -> list[dict]:
        return [{"name": "xs_a", "kind": "stream"}, {"name": "ye_a", "kind": "stream"}, {"name": "t64", "kind": "cutlass"}]


def _entry(direction, tokens, config):
    return dict(direction=direction, dtype="bf16", tokens=tokens, width=4096, rank=64, segments=1, config=config, split_k=1)


def test_entries_of_a_family_this_build_lacks_are_skipped_and_warned(tmp_path, caplog):
    path = tmp_path / "t.json"
    write_table(path, {"gpu": "x"}, [_entry("shrink", 32, "xs_a"), _entry("expand", 32, "ye_a"),
                                     _entry("shrink", 8192, "tr_s_m64k128_r128_w4s4"), _entry("expand", 8192, "h9_m128n256")])
    k = AtmmKernels(ext=_Ext, load_table=False)
    with caplog.at_level(logging.WARNING, logger="vlora.atmm.dispatch"):
        assert k.load_table(path) == 4
    assert k._table.added == ["xs_a", "ye_a"]
    assert "2 entries name kernels this build lacks (cutlass3, triton: h9_m128n256, tr_s_m64k128_r128_w4s4)" in caplog.text


def test_an_unknown_config_outside_the_optional_families_is_refused(tmp_path):
    path = tmp_path / "t.json"
    write_table(path, {"gpu": "x"}, [_entry("shrink", 32, "xs_a"), _entry("shrink", 64, "zz_typo")])
    with pytest.raises(ValueError, match="zz_typo"):
        AtmmKernels(ext=_Ext, load_table=False).load_table(path)
