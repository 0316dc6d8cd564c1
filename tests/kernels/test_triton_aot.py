"""csrc/atmm/triton_aot.py's reading of tile_configs.def (no GPU, no triton: only the parsing): every Triton
line becomes one compile job with the kernel's constexprs, warps and stages, and a malformed line is refused
with the fields it needs named."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEF = ROOT / "csrc" / "atmm" / "tile_configs.def"


def _aot():
    spec = importlib.util.spec_from_file_location("triton_aot", ROOT / "csrc" / "atmm" / "triton_aot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_triton_line_is_one_job_with_its_fields():
    jobs = {name: (direction, consts, warps, stages) for direction, name, consts, warps, stages in _aot().parse_def(DEF)}
    lines = [s for s in DEF.read_text().splitlines() if re.match(r"^ATMM_TRITON_\w+\(", s)]
    assert len(jobs) == len(lines) and len(lines) >= 8
    assert jobs["tr_s_m64k128_r128_w4s4"] == ("SHRINK", [64, 128, 128], 4, 4)
    assert jobs["tr_e_m64n128_r128_c1024_w4s2"] == ("EXPAND", [64, 128, 128, 1024], 4, 2)
    # the column-stationary expand: (tb_m, tb_n, max_rank), warps, stages; its trailing `waves` is the launcher's
    assert jobs["tr_c_m64n256_r128_w8s3_g1"] == ("EXPAND_COLS", [64, 256, 128], 8, 3)
    for name, (_, _, warps, stages) in jobs.items():  # the names say their warps and stages
        assert re.search(rf"_w{warps}s{stages}(_|$)", name), name


def test_a_line_with_missing_fields_is_refused_naming_them(tmp_path):
    bad = tmp_path / "tile_configs.def"
    bad.write_text("ATMM_TRITON_EXPAND_COLS(tr_c_bad, 64, 128, 128, 8, 3)\n")
    with pytest.raises(SystemExit, match="expected name, BM, BN, R, warps, stages, waves"):
        _aot().parse_def(bad)
