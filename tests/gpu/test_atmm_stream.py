"""The streaming ATMM kernels (csrc/atmm/stream.cuh) against the fp32 reference, on fresh random data
with the workspace poisoned (NaN) before every call: each stream shrink and expand, every way they
hand v over (v written directly, split-K partials, CUTLASS or the fused kernel on the other side),
with and without the programmatic dependent launch, and under CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

# Same oracle and tolerances; importing it skips this module where CUDA or the extension is missing.
from test_atmm_gpu import (RANKS, SCALES, check, check_family, check_graph_replay, ext, family_configs, family_grid,
                           large_prefill_grid, make, ranks_for)

pytestmark = pytest.mark.gpu

STREAM_SHRINK, STREAM_EXPAND = family_configs("stream")


def test_there_are_stream_configs():
    assert len(STREAM_SHRINK) >= 2 and len(STREAM_EXPAND) >= 4


@family_grid
def test_every_stream_config(kernels, dtype, pattern, T):
    check_family(kernels, STREAM_SHRINK, STREAM_EXPAND, T, dtype, pattern)


@large_prefill_grid
def test_large_prefill(kernels, d, T, split):
    check(kernels, T, d, d, torch.bfloat16, "1x7", seed=T + d, shrink=("xs_m16_r128_w1x4", split), expand="ye_m64n64_r128_w2x4")
    check(kernels, T, d, d, torch.float16, "one_long", seed=T, shrink=("xs_m16_r128_w1x4", split), expand="ye_m128n64_r128_w2x4")


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("pair", [("xs_m16_r128_w1x4", "ye_m16n128_r128_w1x4"),   # v handed over directly
                                  ("t64x64_k64_s5", "ye_m64n64_r128_w2x4"),  # CUTLASS partials summed by the expand
                                  ("gemv_shrink", "ye_m16n128_r64_w1x4"),
                                  ("xs_m16_r128_w1x4", "t128x128_k32_s4"),    # v direct: the reduce is skipped
                                  ("xs_m16_r128_w1x4", "fx1_m64n128"),         # the fused expand reads v
                                  ("xs_m16_r64_w1x4", "fx_m16n256")])
@pytest.mark.parametrize("split", [1, 4])
def test_mixed_pairs(kernels, pdl, pair, split):
    cfgs = {c["name"]: c for c in ext.configs()}
    ranks = ranks_for(cfgs[pair[0]], cfgs[pair[1]]) if any(cfgs[n]["max_rank"] for n in pair) else RANKS
    for pattern in ("many_short", "3x3", "no_adapter"):
        check(kernels, 129, 5120, 4096, torch.bfloat16, pattern, seed=split, shrink=(pair[0], split), expand=pair[1],
              ranks=ranks, pdl=pdl)


def test_mlp_widths_and_deep_split(kernels):
    check(kernels, 500, 11008, 4096, torch.bfloat16, "many_short", seed=5, shrink=("xs_m16_r128_w1x4", 40), expand="ye_m32n128_r128_w1x8")
    check(kernels, 500, 4096, 11008, torch.float16, "empty", seed=6, shrink=("xs_m16_r128_w1x4", 1), expand="ye_m128n64_r128_w2x4")
    check(kernels, 64, 4104, 1000, torch.bfloat16, "many_short", seed=7, shrink=("xs_m16_r64_w1x4", 7), expand="ye_m16n128_r64_w1x4",
          ranks=(8, 16, 32, 64, 24, 0))


def test_rank_limit_is_refused_with_the_config_named(kernels):
    x, y0, a, b, mapping = make(16, 4096, 4096, torch.bfloat16, "many_short", seed=1)  # uses the rank-128 slot
    with pytest.raises(RuntimeError, match="xs_m16_r64_w1x4 serves ranks up to 64"):
        kernels.run(y0.clone(), x, a, b, RANKS, SCALES, mapping, shrink=("xs_m16_r64_w1x4", 1), expand="ye_m16n128_r128_w1x4")
    with pytest.raises(RuntimeError, match="ye_m64n128_r64_w1x8 serves ranks up to 64"):
        kernels.run(y0.clone(), x, a, b, RANKS, SCALES, mapping, shrink=("xs_m16_r128_w1x4", 1), expand="ye_m64n128_r64_w1x8")


@pytest.mark.parametrize("pair", [("xs_m16_r128_w1x4", "ye_m16n128_r128_w1x4"), ("xs_m16_r128_w1x4", "ye_m64n64_r128_w2x4")])
def test_graph_replay_with_dependent_launch(kernels, pair):
    """The expand's programmatic dependency on the shrink survives capture: replays stay exact."""
    check_graph_replay(kernels, shrink=(pair[0], 1), expand=pair[1])


def test_unused_resident_slot_of_larger_rank_does_not_refuse(kernels):
    """Only slot 0 (rank 8) is used; a resident rank-128 slot must not make a rank-64 kernel refuse."""
    check(kernels, 5, 4096, 4096, torch.bfloat16, "one_long", seed=2, shrink=("xs_m16_r64_w1x4", 4),
          expand="ye_m16n128_r64_w1x4")


@pytest.mark.parametrize("T", [1, 37, 512, 3000])
@pytest.mark.parametrize("ranks", [(8, 16, 0), (64, 24, 8), (128, 8, 0), (256, 64, 0)])
def test_default_rule_serves_every_rank(kernels, T, ranks):
    """With no tiling table, the built-in rule picks kernels that serve the call's largest rank."""
    assert kernels.table_source == "built-in default rule"
    check(kernels, T, 4096, 4096, torch.bfloat16, "3x3", seed=T, ranks=ranks)
