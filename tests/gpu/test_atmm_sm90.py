"""The Hopper kernels (csrc/atmm/sm90.cuh: CUTLASS 3 pointer-array grouped GEMMs, TMA + wgmma)
against the fp32 reference, on fresh random data with a poisoned workspace: every h9_* expand and
h9s_* shrink, every segment pattern, token counts 1..8192, ranks 8..256 (and 24, not a multiple of
16), v handed over directly by a stream shrink or summed from split-K partials (by the reduce or by a
stream expand), fp16 and bf16, CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

from test_atmm_gpu import RANKS, SCALES, check, check_graph_replay, family_grid, make, ref_fp32  # noqa: F401  (same oracle and tolerances)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ext = pytest.importorskip("vlora_atmm_ext", reason="vlora_atmm_ext not built (pip install ./csrc)")
if torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("the CUTLASS 3 expands are built for sm_90a (Hopper)", allow_module_level=True)

SM90 = [c for c in ext.configs() if c["kind"] == "cutlass3" and c["expand"]]
SM90_SHRINK = [c for c in ext.configs() if c["kind"] == "cutlass3" and c["shrink"]]
if not SM90:
    pytest.skip("extension built without sm_90a (ATMM_CUDA_ARCHS)", allow_module_level=True)


def test_sm90_configs_serve_one_direction():
    assert len(SM90) >= 4 and len(SM90_SHRINK) >= 3
    assert not any(c["shrink"] for c in SM90) and not any(c["expand"] for c in SM90_SHRINK)


@family_grid
def test_every_sm90_shrink(kernels, dtype, pattern, T):
    for c in SM90_SHRINK:
        for split in (1, 3, 16):
            check(kernels, T, 4096, 5120, dtype, pattern, seed=T + split, shrink=(c["name"], split),
                  expand="ye_m32n128_r128_w1x8", ranks=(8, 16, 32, 64, 128, 24, 0))  # partials summed by the expand
        check(kernels, T, 5120, 4096, dtype, pattern, seed=T + 2, shrink=(c["name"], 2), expand=SM90[0]["name"])


@family_grid
def test_every_sm90_expand(kernels, dtype, pattern, T):
    for c in SM90:
        check(kernels, T, 4096, 5120, dtype, pattern, seed=T, shrink=("xs_m16_r128_w1x4", 1), expand=c["name"],
              ranks=(8, 16, 32, 64, 128, 24, 0))  # v written directly by the shrink
        check(kernels, T, 5120, 4096, dtype, pattern, seed=T + 1, shrink=("t64x64_k64_s5", 3), expand=c["name"])


@pytest.mark.parametrize("d", [4096, 5120])
@pytest.mark.parametrize("T", [8192, 4097])
def test_large_prefill(kernels, d, T):
    for c in SM90:
        check(kernels, T, d, d, torch.bfloat16, "1x7", seed=T + d, shrink=("t64x64_k64_s5", 1), expand=c["name"])


def test_rank_256_and_odd_widths(kernels):
    for c in SM90_SHRINK:
        check(kernels, 300, 4096, 4096, torch.bfloat16, "3x3", seed=5, shrink=(c["name"], 4), expand="t128x128_k32_s4",
              ranks=(256, 64, 8, 0))
        check(kernels, 129, 4104, 1000, torch.float16, "many_short", seed=6, shrink=(c["name"], 5), expand="fx_m64n128")
        check(kernels, 8192, 4096, 4096, torch.bfloat16, "1x7", seed=7, shrink=(c["name"], 1), expand=SM90[-1]["name"])
    for c in SM90:
        check(kernels, 300, 4096, 4096, torch.bfloat16, "3x3", seed=3, shrink=("t64x64_k64_s5", 2), expand=c["name"],
              ranks=(256, 64, 8, 0))
        check(kernels, 129, 4104, 1000, torch.float16, "many_short", seed=4, shrink=("t64x64_k64_s5", 1), expand=c["name"])


def test_graph_replay(kernels):
    check_graph_replay(kernels, shrink=("t64x64_k64_s5", 2), expand=SM90[0]["name"])
