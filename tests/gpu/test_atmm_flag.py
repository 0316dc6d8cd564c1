"""The flag calls (csrc/atmm/stream_flag.cu: shrink and expand in one launch, v handed over row tile by
row tile through release/acquire counters) against the fp32 reference, on fresh random data with a
poisoned workspace: every fl_* config with d_in splits 1..32, every segment pattern, token counts
1..8192, uneven widths; CUDA-graph replays and back-to-back calls of different sizes without a
synchronisation between them (the counters reset themselves at the end of every call); the refusals."""
from __future__ import annotations

import pytest
import torch

from test_atmm_gpu import RANKS, SCALES, check, check_graph_replay, family_grid, make, ranks_for, ref_fp32  # noqa: F401  (same oracle and tolerances)
from vlora.atmm import AtmmKernels

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ext = pytest.importorskip("vlora_atmm_ext", reason="vlora_atmm_ext not built (pip install ./csrc)")

FLAGS = [c for c in ext.configs() if c["kind"] == "call" and c["name"].startswith("fl_")]
SPLITS = (1, 3, 8, 32)


def test_there_are_flag_calls():
    assert len(FLAGS) >= 3
    assert all(c["shrink"] and c["expand"] and c["max_rank"] in (64, 128) for c in FLAGS)
    assert all(tuple(c["call_splits"]) == (1, 2, 4, 8, 16) for c in FLAGS)


@family_grid
def test_every_flag_call(kernels, dtype, pattern, T):
    for c in FLAGS:
        for k in SPLITS:
            check(kernels, T, 4096, 5120, dtype, pattern, seed=T + k, shrink=(c["name"], k), expand=c["name"],
                  ranks=ranks_for(c))


@pytest.mark.parametrize("widths", [(5120, 4096), (4104, 1000), (11008, 4096), (128, 72), (64, 4096)])
def test_uneven_widths(kernels, widths):
    for c in FLAGS:
        for k in (1, 3, 16):
            check(kernels, 129, widths[0], widths[1], torch.bfloat16, "3x3", seed=k, shrink=(c["name"], k),
                  expand=c["name"], ranks=ranks_for(c))


@pytest.mark.parametrize("d", [4096, 5120])
@pytest.mark.parametrize("T", [8192, 4097])
def test_large_prefill(kernels, d, T):
    for c in FLAGS:
        for k in (1, 4):
            check(kernels, T, d, d, torch.bfloat16, "1x7", seed=T + d + k, shrink=(c["name"], k), expand=c["name"],
                  ranks=ranks_for(c))


@pytest.mark.parametrize("split", [1, 4])
def test_graph_replay(kernels, split):
    """Replays of a graph of back-to-back flag calls: a counter left set by one call would let the
    next call's expand read a v that is not written yet, or skip its items."""
    check_graph_replay(kernels, shrink=("fl_m64_r128", split), expand="fl_m64_r128", calls=6, replays=4)


def test_back_to_back_calls_of_different_sizes(kernels):
    """Large, small, large calls queued on one stream with no synchronisation between them: each call's
    last block resets exactly the counters the next one needs, whatever their row-tile counts."""
    shapes = [(4097, "1x7", 4), (3, "many_short", 1), (2048, "3x3", 8), (64, "7x1", 32), (300, "empty", 3)]
    runs = []
    for i, (T, pattern, k) in enumerate(shapes):
        x, y0, a, b, mapping = make(T, 4096, 4096, torch.bfloat16, pattern, seed=100 + i)
        runs.append((y0.clone(), y0, x, a, b, mapping, k, ref_fp32(y0, x, a, b, RANKS, SCALES, mapping)))
    for _ in range(3):
        for y, y0, x, a, b, mapping, k, _ref in runs:
            y.copy_(y0)
            kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("fl_m64_r128", k), expand="fl_m64_r128")
        torch.cuda.synchronize()
        for y, y0, x, a, b, mapping, k, ref in runs:
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err <= 1e-2, f"T={x.shape[0]} split {k}: relative error {err:.2e}"


def test_refusals(kernels):
    x, y, a, b, mapping = make(64, 4096, 4096, torch.bfloat16, "many_short", seed=1)  # every slot, rank 128 too
    with pytest.raises(RuntimeError, match="fl_m64_r128.*name it for the shrink and the expand"):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("fl_m64_r128", 2), expand="ye_m16n128_r128_w1x4")
    with pytest.raises(RuntimeError, match="fl_m16_r64 serves ranks up to 64"):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("fl_m16_r64", 2), expand="fl_m16_r64")
    table = ext.TilingTable()
    table.add("shrink", "bf16", 64, 4096, 64, 1, "fl_m64_r128", 32)  # a d_in split, not a cluster size: allowed
    with pytest.raises(ValueError, match="split_k=65"):
        table.add("shrink", "bf16", 64, 4096, 64, 1, "fl_m64_r128", 65)


def test_table_entries_run_the_flag_call(kernels, tmp_path):
    from vlora.atmm.tiling import write_table
    shape = dict(dtype="bf16", tokens=64, width=4096, rank=128, segments=8)
    path = tmp_path / "t.json"
    write_table(path, {"gpu": "test"},
                [dict(direction="shrink", **shape, config="fl_m64_r128", split_k=16, time_us=1.0),
                 dict(direction="expand", **shape, config="fl_m64_r128", split_k=1, time_us=1.0)])
    k = AtmmKernels(load_table=False)
    k.load_table(path)
    x, y0, a, b, mapping = make(64, 4096, 4096, torch.bfloat16, "7x1", seed=5)
    names = k.config_names
    plan = k._plan("bf16", 64, 4096, 4096, a.shape[1], RANKS, mapping, None, None)
    assert (names[plan[0]], plan[1], names[plan[2]]) == ("fl_m64_r128", 16, "fl_m64_r128")
    check(k, 64, 4096, 4096, torch.bfloat16, "7x1", seed=5)
