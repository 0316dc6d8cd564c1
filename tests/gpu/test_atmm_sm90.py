"""The Hopper kernels (csrc/atmm/sm90.cuh: CUTLASS 3 pointer-array grouped GEMMs, TMA + wgmma)
against the fp32 reference, on fresh random data with a poisoned workspace: every h9_* expand, every
segment pattern, token counts 1..8192, ranks 8..256 (and 24, not a multiple of 16), v handed over directly
by a stream shrink or summed from split-K partials by the reduce, fp16 and bf16, CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

from test_atmm_gpu import check, check_graph_replay, family_grid  # same oracle and tolerances

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ext = pytest.importorskip("vlora_atmm_ext", reason="vlora_atmm_ext not built (pip install ./csrc)")
if torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("the CUTLASS 3 expands are built for sm_90a (Hopper)", allow_module_level=True)

SM90 = [c for c in ext.configs() if c["kind"] == "cutlass3" and c["expand"]]
if not SM90:
    pytest.skip("extension built without sm_90a (ATMM_CUDA_ARCHS)", allow_module_level=True)


def test_sm90_configs_are_expands():
    assert SM90 and not any(c["shrink"] for c in ext.configs() if c["kind"] == "cutlass3")


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
    for c in SM90:
        check(kernels, 300, 4096, 4096, torch.bfloat16, "3x3", seed=3, shrink=("t64x64_k64_s5", 2), expand=c["name"],
              ranks=(256, 64, 8, 0))
        check(kernels, 129, 4104, 1000, torch.float16, "many_short", seed=4, shrink=("t64x64_k64_s5", 1), expand=c["name"])


def test_graph_replay(kernels):
    check_graph_replay(kernels, shrink=("t64x64_k64_s5", 2), expand=SM90[0]["name"])
