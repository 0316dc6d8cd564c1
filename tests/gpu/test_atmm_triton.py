"""The Triton ATMM kernels (csrc/atmm/triton_lora.py, compiled ahead of time and launched by triton.cu)
against the fp32 reference, on fresh random data with the workspace poisoned before every call: each
Triton shrink and expand (row-tile tr_e_* and column-stationary tr_c_*), every way v is handed over (v
written directly, split-K partials, a CUTLASS, stream or gemv kernel on the other side, the expand as the
shrink's programmatic dependent or not; a split Triton shrink adds its chunks into one zeroed fp32 partial),
uneven widths, the phases run one by one, and CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

# Same oracle and tolerances; importing it skips this module where CUDA or the extension is missing.
from test_atmm_gpu import (RANKS, SCALES, check, check_family, check_graph_replay, ext, family_configs,  # noqa: F401
                           family_grid, large_prefill_grid, make, ranks_for, ref_fp32)
from vlora.atmm.dispatch import PHASE_EXPAND, PHASE_PREP, PHASE_SHRINK

pytestmark = pytest.mark.gpu

TR_SHRINK, TR_EXPAND = family_configs("triton")
if not TR_SHRINK:
    pytest.skip("the extension was built without the Triton kernels (no triton at build time)", allow_module_level=True)


def test_there_are_triton_configs():
    assert len(TR_SHRINK) >= 2 and len(TR_EXPAND) >= 2
    assert all(c["smem_bytes"] > 0 for c in TR_SHRINK + TR_EXPAND)


@family_grid
def test_every_triton_config(kernels, dtype, pattern, T):
    check_family(kernels, TR_SHRINK, TR_EXPAND, T, dtype, pattern)


@large_prefill_grid
def test_large_prefill(kernels, d, T, split):
    check(kernels, T, d, d, torch.bfloat16, "1x7", seed=T + d, shrink=("tr_s_m64k128_r128_w4s4", split),
          expand="tr_e_m64n128_r128_c1024_w4s2")
    check(kernels, T, d, d, torch.float16, "one_long", seed=T, shrink=("tr_s_m64k64_r128_w4s5", split),
          expand="tr_e_m64n128_r128_c1024_w4s2")
    check(kernels, T, d, d, torch.bfloat16, "3x3", seed=T + 1, shrink=("tr_s_m64k128_r128_w4s4", split),
          expand="tr_c_m64n256_r128_w8s3_g1")
    check(kernels, T, d, d, torch.float16, "no_adapter", seed=T + 2, shrink=("tr_s_m64k64_r128_w4s5", split),
          expand="tr_c_m64n128_r128_w8s4_g1")


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("pair", [("tr_s_m64k128_r128_w4s4", "ye_m64n64_r128_w2x4"),    # Triton v, stream expand (PDL)
                                  ("tr_s_m64k128_r128_w4s4", "t128x128_k32_s4"),         # Triton v, CUTLASS expand
                                  ("tr_s_m32k128_r128_w4s4", "fx1_m64n128"),              # the fused expand reads v
                                  ("t64x64_k64_s5", "tr_e_m64n128_r128_c1024_w4s2"),     # CUTLASS partials summed
                                  ("xs_m16_r128_w1x4", "tr_e_m64n128_r128_c1024_w4s2"),  # stream v
                                  ("gemv_shrink", "tr_e_m64n128_r64_c1024_w4s3"),
                                  ("tr_s_m64k128_r128_w4s4", "tr_c_m64n128_r128_w8s4_g1"),  # Triton pair (PDL)
                                  ("t64x64_k64_s5", "tr_c_m64n128_r128_w4s3_g1"),         # column-stationary: partials
                                  ("xs_m16_r128_w1x4", "tr_c_m32n128_r128_w4s3_g2"),      # stream v
                                  ("gemv_shrink", "tr_c_m64n256_r64_w8s3_g1")])
@pytest.mark.parametrize("split", [1, 4])
def test_mixed_pairs(kernels, pdl, pair, split):
    cfgs = {c["name"]: c for c in ext.configs()}
    ranks = ranks_for(*[cfgs[n] for n in pair if cfgs[n]["max_rank"]])
    for pattern in ("many_short", "3x3", "no_adapter"):
        check(kernels, 129, 5120, 4096, torch.bfloat16, pattern, seed=split, shrink=(pair[0], split), expand=pair[1],
              ranks=ranks, pdl=pdl)


def test_uneven_widths_and_deep_split(kernels):
    """Widths that are multiples of 8 only, and more d_in chunks than the table ever picks."""
    check(kernels, 500, 11008, 4096, torch.bfloat16, "many_short", seed=5, shrink=("tr_s_m64k128_r128_w4s4", 40),
          expand="tr_e_m64n128_r128_c1024_w4s2")
    check(kernels, 500, 4096, 11008, torch.float16, "empty", seed=6, shrink=("tr_s_m64k64_r128_w4s5", 1),
          expand="tr_e_m64n128_r128_c1024_w4s2")
    check(kernels, 64, 4104, 1000, torch.bfloat16, "many_short", seed=7, shrink=("tr_s_m64k128_r64_w4s4", 7),
          expand="tr_e_m64n128_r64_c1024_w4s3", ranks=(8, 16, 32, 64, 24, 0))


@pytest.mark.parametrize("cfg", [c["name"] for c in TR_SHRINK + TR_EXPAND])
def test_even_and_masked_cubins(kernels, cfg):
    """Each config's two cubins (triton.cu): EVEN, without column masks, where the widths are whole tiles and r_max
    is the config's rank; the masked one where a width is not (4104) or r_max is smaller than the config's rank."""
    cfgs = {c["name"]: c for c in ext.configs()}
    c = cfgs[cfg]
    partner = next(o for o in (TR_EXPAND if c["shrink"] else TR_SHRINK) if o["max_rank"] >= c["max_rank"])
    shrink, expand = ((cfg, partner["name"]) if c["shrink"] else (partner["name"], cfg))
    full = ranks_for(c)  # r_max == the config's rank
    for d_in, d_out, ranks in ((4096, 5120, full), (4104, 4104, full), (4096, 4096, (8, 16, 24, 0))):
        for split in (1, 3):
            check(kernels, 300, d_in, d_out, torch.bfloat16, "3x3", seed=split + d_in, shrink=(shrink, split),
                  expand=expand, ranks=ranks)


def test_many_segments(kernels):
    """More segments than one step of the row-tile scan (256): every program still finds its tile."""
    for shrink, expand in ((("tr_s_m32k128_r128_w4s4", 1), "tr_e_m64n128_r128_c1024_w4s2"),
                           (("tr_s_m64k64_r128_w4s5", 3), "tr_e_m64n128_r128_c1024_w4s2"),
                           (("tr_s_m32k128_r128_w4s4", 1), "tr_c_m64n128_r128_w4s2_g2"),
                           (("tr_s_m64k64_r128_w4s5", 3), "tr_c_m32n128_r128_w4s3_g2")):
        check(kernels, 1400, 4096, 4096, torch.bfloat16, "many_tiny", seed=9, shrink=shrink, expand=expand,
              ranks=(8, 16, 32, 64, 128, 24, 0))


def test_rank_limit_is_refused_with_the_config_named(kernels):
    x, y0, a, b, mapping = make(16, 4096, 4096, torch.bfloat16, "many_short", seed=1)  # uses the rank-128 slot
    with pytest.raises(RuntimeError, match="tr_s_m64k128_r64_w4s4 serves ranks up to 64"):
        kernels.run(y0.clone(), x, a, b, RANKS, SCALES, mapping, shrink=("tr_s_m64k128_r64_w4s4", 1),
                    expand="tr_e_m64n128_r128_c1024_w4s2")


@pytest.mark.parametrize("shrink, expand", [(("tr_s_m64k128_r128_w4s4", 1), "tr_e_m64n128_r128_c1024_w4s2"),
                                            (("tr_s_m64k128_r128_w4s4", 1), "tr_c_m64n128_r128_w8s4_g1"),
                                            (("tr_s_m64k128_r128_w4s4", 1), "ye_m64n64_r128_w2x4"),
                                            (("tr_s_m64k128_r128_w4s4", 4), "tr_c_m64n128_r128_w8s4_g1"),
                                            (("tr_s_m64k64_r128_w4s8", 3), "ye_m64n64_r128_w2x4")])
def test_graph_replay(kernels, shrink, expand):
    """Loaded modules, the slot-scale kernel and the zeroing kernel of a split shrink survive capture: replays stay
    exact (a partial not zeroed again by every replay would add up)."""
    check_graph_replay(kernels, shrink=shrink, expand=expand)


@pytest.mark.parametrize("expand", ["tr_c_m64n128_r128_w8s4_g1", "tr_e_m64n128_r128_c1024_w4s2", "ye_m64n64_r128_w2x4",
                                    "t128x128_k32_s4", "fx1_m64n128"])
def test_split_shrink_phases_one_by_one(kernels, expand):
    """A split Triton shrink zeroes its one partial in its own phase and adds into it: run as prep, shrink and
    expand calls of their own (as the tuner times them), twice on one workspace, the result stays exact."""
    T, d = 300, 4096
    x, y0, a, b, mapping = make(T, d, d, torch.bfloat16, "3x3", seed=13)
    ref = ref_fp32(y0, x, a, b, RANKS, SCALES, mapping)
    need = kernels.ext.workspace_size(mapping.num_segments, 4, T, a.shape[1], "bf16")
    ws = torch.full((need,), 0xFF, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        y = y0.clone()
        for ph in (PHASE_PREP, PHASE_SHRINK, PHASE_EXPAND):
            kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=("tr_s_m64k128_r128_w4s4", 4), expand=expand,
                        phases=ph, workspace=ws)
        torch.cuda.synchronize()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err <= 1e-2, f"relative error {err:.2e} ({expand})"


@pytest.mark.parametrize("pair", [(("tr_s_m64k128_r128_w4s4", 1), "tr_c_m64n128_r128_w8s4_g1"),  # slot scales: own kernel,
                                  (("tr_s_m64k64_r128_w4s5", 3), "tr_e_m64n128_r128_c1024_w4s2"),  # the shrink its dependent
                                  (("tr_s_m64k128_r128_w8s4", 4), "tr_c_m64n256_r128_w8s3_g1"),  # zeroing kernel + scales
                                  (("t64x64_k64_s5", 2), "tr_c_m64n128_r128_w4s3_g1")])  # scales written by the prep kernel
def test_back_to_back_calls_read_their_own_scales(kernels, pair):
    """Calls queued without a sync, each with other scales, on one workspace: every expand must read the slot
    scales of its own call. The slot-scale kernel, the shrink (its programmatic dependent) and the expand (the
    shrink's) overlap; an expand that read the scales early would apply the call before's."""
    shrink, expand = pair
    T, d = 700, 4096
    x, y0, a, b, mapping = make(T, d, d, torch.bfloat16, "3x3", seed=11)
    need = kernels.ext.workspace_size(mapping.num_segments, shrink[1], T, a.shape[1], "bf16")
    ws = torch.full((need,), 0xFF, dtype=torch.uint8, device="cuda")
    outs = []
    for i in range(12):
        scales = tuple(float(1 + ((i + j) % 5)) * (-1) ** i for j in range(len(RANKS)))
        y = y0.clone()
        kernels.run(y, x, a, b, RANKS, scales, mapping, shrink=shrink, expand=expand, workspace=ws, pdl=True)
        outs.append((y, scales))
    torch.cuda.synchronize()
    for i, (y, scales) in enumerate(outs):
        delta_ref = ref_fp32(y0, x, a, b, RANKS, scales, mapping) - y0.float()
        err = ((y.float() - y0.float() - delta_ref).norm() / delta_ref.norm()).item()
        assert err <= 2e-2, f"call {i}: relative error of the LoRA delta {err:.2e} (scales of another call?)"
