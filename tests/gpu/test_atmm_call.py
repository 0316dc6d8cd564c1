"""The fused calls (csrc/atmm/stream_call.cu: shrink and expand in one launch on Hopper thread-block
clusters) against the fp32 reference, on fresh random data with a poisoned workspace: every fc_*
config with every cluster size, every segment pattern, token counts 1..8192, widths that do not split
evenly over the cluster, CUDA-graph replay; and the refusals (a fused call named for one direction
only, a cluster size past 8, a phase of a call, a table entry with split_k > 8)."""
from __future__ import annotations

import pytest
import torch

from test_atmm_gpu import RANKS, SCALES, check, check_graph_replay, family_grid, make, ranks_for, ref_fp32  # noqa: F401  (same oracle and tolerances)
from vlora.atmm import AtmmKernels
from vlora.atmm.dispatch import PHASE_PREP, PHASE_SHRINK

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ext = pytest.importorskip("vlora_atmm_ext", reason="vlora_atmm_ext not built (pip install ./csrc)")
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("fused calls need thread-block clusters (Hopper and later)", allow_module_level=True)

CALLS = [c for c in ext.configs() if c["kind"] == "call" and c["name"].startswith("fc_")]  # fl_*: test_atmm_flag.py
CLUSTERS = (1, 2, 4, 8)


def test_there_are_fused_calls():
    assert len(CALLS) >= 4
    assert all(c["shrink"] and c["expand"] and c["max_rank"] in (64, 128) for c in CALLS)


@family_grid
def test_every_fused_call(kernels, dtype, pattern, T):
    for c in CALLS:
        for cl in CLUSTERS:
            check(kernels, T, 4096, 5120, dtype, pattern, seed=T + cl, shrink=(c["name"], cl), expand=c["name"],
                  ranks=ranks_for(c))


@pytest.mark.parametrize("cl", CLUSTERS)
@pytest.mark.parametrize("widths", [(5120, 4096), (4104, 1000), (11008, 4096), (128, 72), (64, 4096)])
def test_uneven_widths(kernels, cl, widths):
    """d_in and d_out that leave some blocks of a cluster a short share, or none at all."""
    for c in CALLS:
        check(kernels, 129, widths[0], widths[1], torch.bfloat16, "3x3", seed=cl, shrink=(c["name"], cl),
              expand=c["name"], ranks=ranks_for(c))


@pytest.mark.parametrize("d", [4096, 5120])
@pytest.mark.parametrize("T", [8192, 4097])
@pytest.mark.parametrize("name", ["fc_m64_r128", "fc_m128_r128", "fc_m128_r64"])
def test_large_prefill(kernels, d, T, name):
    c = next(c for c in CALLS if c["name"] == name)
    for cl in (1, 4):
        check(kernels, T, d, d, torch.bfloat16, "1x7", seed=T + d + cl, shrink=(name, cl), expand=name, ranks=ranks_for(c))


def test_graph_replay(kernels):
    check_graph_replay(kernels, shrink=("fc_m16_r128", 4), expand="fc_m16_r128")


def test_refusals_name_the_config(kernels):
    x, y0, a, b, mapping = make(16, 4096, 4096, torch.bfloat16, "many_short", seed=1)
    y = y0.clone()
    with pytest.raises(RuntimeError, match="fc_m16_r128.*name it for the shrink and the expand"):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("fc_m16_r128", 2), expand="ye_m16n128_r128_w1x4")
    with pytest.raises(RuntimeError, match="fc_m16_r128.*name it for the shrink and the expand"):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("xs_m16_r128_w1x4", 1), expand="fc_m16_r128")
    with pytest.raises(RuntimeError, match="name it for the shrink and the expand"):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("fc_m16_r128", 2), expand="fc_m64_r128")
    with pytest.raises(RuntimeError, match="cluster size"):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("fc_m16_r128", 9), expand="fc_m16_r128")
    with pytest.raises(RuntimeError, match="runs only as a whole call"):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("fc_m16_r128", 2), expand="fc_m16_r128",
                    phases=PHASE_PREP | PHASE_SHRINK)
    with pytest.raises(RuntimeError, match="fc_m16_r64 serves ranks up to 64"):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("fc_m16_r64", 2), expand="fc_m16_r64")
    assert torch.equal(y, y0), "a refused call wrote y"
    table = ext.TilingTable()
    with pytest.raises(ValueError, match="fc_m16_r128.*split_k=16"):
        table.add("shrink", "bf16", 64, 4096, 64, 1, "fc_m16_r128", 16)


def test_table_entries_run_the_fused_call(kernels, tmp_path):
    """A table naming a fused call for a shape serves it through the normal (unforced) path."""
    from vlora.atmm.tiling import write_table

    shape = dict(dtype="bf16", tokens=300, width=4096, rank=128, segments=8)
    write_table(tmp_path / "t.json", {"gpu": "test"},
                [dict(direction="shrink", **shape, config="fc_m32_r128", split_k=4, time_us=1.0),
                 dict(direction="expand", **shape, config="fc_m32_r128", split_k=1, time_us=1.0)])
    k = AtmmKernels(load_table=False)
    k.load_table(tmp_path / "t.json")
    names = k.config_names
    x, y0, a, b, mapping = make(300, 4096, 4096, torch.bfloat16, "many_short", seed=3)
    plan = k._plan("bf16", 300, 4096, 4096, a.shape[1], RANKS, mapping, None, None)
    assert (names[plan[0]], plan[1], names[plan[2]]) == ("fc_m32_r128", 4, "fc_m32_r128")
    check(k, 300, 4096, 4096, torch.bfloat16, "many_short", seed=3)
