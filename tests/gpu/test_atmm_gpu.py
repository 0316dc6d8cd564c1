"""ATMM's CUDA kernels against an fp32 reference on fresh random data. Needs CUDA and vlora_atmm_ext.

The workspace (problem arrays, split-K partials, v) is poisoned with 0xFF bytes (NaN in every float
format) before each call, so a read of anything the kernels did not write shows up as NaN; rows
without an adapter must come back bit-identical.
"""
from __future__ import annotations

import pytest
import torch

from vlora.atmm import AtmmKernels, atmm
from vlora.atmm.cases import RANK_CYCLE, lora_weights, mapping_for

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ext = pytest.importorskip("vlora_atmm_ext", reason="vlora_atmm_ext not built (pip install ./csrc)")

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
N_SLOTS = 6  # ranks 8, 16, 32, 64, 128, then 0 (a slot that does not target this layer)
RANKS = tuple(RANK_CYCLE) + (0,)
SCALES = (2.0, 0.5, 1.0, 0.25, 1.5, 3.0)


def family_configs(kind: str) -> tuple[list[dict], list[dict]]:
    """The extension's configs of one kind (``stream``, ``triton``, ``cutlass3``...): (its shrinks, its expands)."""
    configs = [c for c in ext.configs() if c["kind"] == kind]
    return [c for c in configs if c["shrink"]], [c for c in configs if c["expand"]]


def family_grid(test):
    """The grid of every kernel family's test_every_*: both dtypes x five segment patterns x T 1..2048."""
    test = pytest.mark.parametrize("T", [1, 7, 64, 300, 2048])(test)
    test = pytest.mark.parametrize("pattern", ["one_long", "many_short", "empty", "no_adapter", "7x1"])(test)
    return pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])(test)


def large_prefill_grid(test):
    """The grid of the stream and Triton families' test_large_prefill: widths 4096 and 5120 x T 8192 and 4097
    (one past a power of two) x d_in split in 1 or 2."""
    test = pytest.mark.parametrize("split", [1, 2])(test)
    test = pytest.mark.parametrize("T", [8192, 4097])(test)
    return pytest.mark.parametrize("d", [4096, 5120])(test)


def make(T, d_in, d_out, dtype, pattern, seed, ranks=RANKS):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a, b = lora_weights(len(ranks), d_in, d_out, ranks, dtype, "cuda", g)
    x = torch.randn(T, d_in, generator=g, device="cuda").to(dtype)
    y0 = torch.randn(T, d_out, generator=g, device="cuda").to(dtype)
    mapping = mapping_for(pattern, T, len(ranks), "cuda")
    return x, y0, a, b, mapping


def ref_fp32(y0, x, a, b, ranks, scales, mapping):
    out = y0.float().clone()
    p = mapping.seg_indptr_host
    for i, s in enumerate(mapping.seg_slot_host):
        if s < 0 or ranks[s] == 0 or p[i + 1] == p[i]:
            continue
        r = ranks[s]
        out[p[i]:p[i + 1]] += (x[p[i]:p[i + 1]].float() @ a[s, :r].float().t()) @ b[s, :, :r].float().t() * scales[s]
    return out


def untouched_rows(mapping, ranks):
    p = mapping.seg_indptr_host
    rows = []
    for i, s in enumerate(mapping.seg_slot_host):
        if s < 0 or ranks[s] == 0:
            rows.extend(range(p[i], p[i + 1]))
    return rows


def check_graph_replay(kernels, shrink, expand, calls=4, replays=3):
    """``calls`` back-to-back calls captured in one CUDA graph (each call's launches depend on its own
    earlier ones only) stay exact over ``replays`` replays."""
    x, y0, a, b, mapping = make(256, 4096, 4096, torch.bfloat16, "3x3", seed=11)
    ref = ref_fp32(y0, x, a, b, RANKS, SCALES, mapping)
    y = y0.clone()
    run = lambda: kernels.run(y, x, a, b, RANKS, SCALES, mapping, shrink=shrink, expand=expand)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    for _ in range(replays):
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        want = y0.float() + calls * (ref - y0.float())
        assert ((y.float() - want).norm() / want.norm()).item() <= 2e-2


def ranks_for(*configs) -> tuple[int, ...]:
    """Slot ranks every config serves (8..the smallest max_rank, a rank that is not a multiple of 16, and 0)."""
    limit = min(c["max_rank"] for c in configs)
    return tuple(r for r in (8, 16, 32, 64, 128) if r <= limit) + (24, 0)


def check_family(kernels, shrinks, expands, T, dtype, pattern):
    """Every shrink of a kernel family with an expand of it and every expand with a shrink, d_in 4096 ->
    d_out 5120, d_in whole and split in 3. Partners rotate through the other list, small tiles with small."""
    both = shrinks + expands

    def partner(c, pool):
        same = [o for o in pool if (o["tb_m"] >= 64) == (c["tb_m"] >= 64)] or pool
        return same[both.index(c) % len(same)]

    pairs = [(cs, partner(cs, expands)) for cs in shrinks] + [(partner(ce, shrinks), ce) for ce in expands]
    for cs, ce in pairs:
        for split in (1, 3):
            check(kernels, T, 4096, 5120, dtype, pattern, seed=T + split, shrink=(cs["name"], split),
                  expand=ce["name"], ranks=ranks_for(cs, ce))


def check(kernels, T, d_in, d_out, dtype, pattern, seed, shrink=None, expand=None, ranks=RANKS, pdl=True):
    x, y0, a, b, mapping = make(T, d_in, d_out, dtype, pattern, seed, ranks)
    scales = tuple(SCALES[i % len(SCALES)] for i in range(len(ranks)))
    ref = ref_fp32(y0, x, a, b, ranks, scales, mapping)
    y = y0.clone()
    assert not kernels.unsupported(y, x, a, b, ranks, scales, mapping)
    used = [s for s in mapping.seg_slot_host if s >= 0]
    split = shrink[1] if shrink else 16
    need = kernels.ext.workspace_size(mapping.num_segments, split, T, a.shape[1], "bf16" if dtype == torch.bfloat16 else "fp16")
    ws = torch.full((need,), 0xFF, dtype=torch.uint8, device="cuda")
    kernels.run(y, x, a, b, ranks, scales, mapping, shrink=shrink, expand=expand, workspace=ws, pdl=pdl)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all(), "non-finite output: an unwritten intermediate was read"
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]} ({dtype}, T={T}, {pattern}, {shrink}, {expand})"
    # The LoRA delta alone, where it is nonzero: catches a small delta hidden under a large y.
    delta_ref = ref - y0.float()
    if used and delta_ref.norm() > 0:
        derr = ((y.float() - y0.float() - delta_ref).norm() / delta_ref.norm()).item()
        assert derr <= 2 * TOL[dtype], f"delta relative error {derr:.2e}"
    rows = untouched_rows(mapping, ranks)
    if rows:
        idx = torch.tensor(rows, device="cuda")
        assert torch.equal(y[idx], y0[idx]), "rows without an adapter were modified"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [4096, 5120])
@pytest.mark.parametrize("pattern", ["one_long", "many_short", "empty", "no_adapter"])
@pytest.mark.parametrize("T", [1, 7, 64, 300, 2048, 8192])
def test_atmm_matches_fp32_reference(kernels, dtype, d, pattern, T):
    check(kernels, T, d, d, dtype, pattern, seed=T + d + len(pattern))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_compiled_config(kernels, dtype):
    for c in ext.configs():
        # Configs limited to a rank serve calls up to it: give them slots of every rank they serve.
        ranks = RANKS if not c["max_rank"] else tuple(r for r in RANKS if r <= c["max_rank"]) + (24,)
        for split in (1, 3):
            if c["shrink"]:
                for expand in ("t128x128_k32_s4", "fx1_m64n128"):
                    check(kernels, 333, 4096, 1024, dtype, "3x3", seed=split, shrink=(c["name"], split), expand=expand,
                          ranks=ranks)
            if c["expand"]:
                for shrink in (("t64x64_k64_s5", split), ("gemv_shrink", split)):
                    check(kernels, 333, 4096, 1024, dtype, "3x3", seed=split, shrink=shrink, expand=c["name"],
                          ranks=ranks)


@pytest.mark.parametrize("split", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("pair", [("t64x64_k64_s5", "t128x128_k32_s4"), ("gemv_shrink", "fx1_m64n128"),
                                  ("t64x64_k64_s5", "fx_m32n128"), ("gemv_shrink", "t64x128_k32_s6")])
def test_split_k(kernels, split, pair):
    check(kernels, 129, 5120, 4096, torch.bfloat16, "7x1", seed=split, shrink=(pair[0], split), expand=pair[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", ["one_long", "many_short", "empty", "no_adapter"])
@pytest.mark.parametrize("T", [1, 7, 300, 2048])
def test_hand_written_kernels(kernels, dtype, pattern, T):
    for expand in ("fx1_m64n128", "fx_m16n256", "fx_m32n128", "fx1_m16n256"):
        shrink = ("gemv_shrink", 8) if T <= 300 else ("t64x64_k64_s5", 2)
        check(kernels, T, 4096, 5120, dtype, pattern, seed=T + 3, shrink=shrink, expand=expand)
    for split in (1, 16, 40):
        check(kernels, T, 5120, 4096, dtype, pattern, seed=T + split, shrink=("t64x64_k64_s5", split), expand="fx1_m64n128")


def test_rank_not_multiple_of_8_uses_zero_padding(kernels):
    check(kernels, 100, 4096, 4096, torch.bfloat16, "3x3", seed=1, ranks=(12, 8, 100, 0))


def test_mlp_widths(kernels):
    check(kernels, 500, 4096, 11008, torch.bfloat16, "many_short", seed=2)
    check(kernels, 500, 11008, 4096, torch.float16, "empty", seed=3)


def test_public_entry_point_uses_extension_and_matches(kernels):
    x, y0, a, b, mapping = make(256, 4096, 4096, torch.bfloat16, "3x3", seed=9)
    ref = ref_fp32(y0, x, a, b, RANKS, SCALES, mapping)
    y = atmm(y0.clone(), x, a, b, RANKS, SCALES, mapping)
    assert ((y.float() - ref).norm() / ref.norm()).item() <= 1e-2


def test_graph_capture_replays(kernels):
    x, y0, a, b, mapping = make(64, 4096, 4096, torch.bfloat16, "many_short", seed=4)
    ref = ref_fp32(y0, x, a, b, RANKS, SCALES, mapping)
    y = y0.clone()
    kernels.run(y.clone(), x, a, b, RANKS, SCALES, mapping)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.run(y, x, a, b, RANKS, SCALES, mapping)
    for _ in range(3):
        y.copy_(y0)
        graph.replay()
    torch.cuda.synchronize()
    assert ((y.float() - ref).norm() / ref.norm()).item() <= 1e-2


@pytest.mark.parametrize("T", [24, 600, 1536])
def test_rows_with_segment_bounds_on_the_device_replay_any_bounds(kernels, T):
    """A prefill graph's call (``run_rows`` over ``even=False`` segments): captured once over S segment bounds and
    slots in device buffers, then replayed with other bounds (uneven, some empty, the last short of T: rows past
    it untouched) and slots (-1: none), each replay against the fp32 reference of that step's segments. Every
    slot at r_max with scale +1, as the graphs run it (the slot buffers hold scale * B, zero past the rank)."""
    from vlora.atmm.mapping import LoraBatchMapping

    S, r_max, n = 8, 64, 4
    g = torch.Generator(device="cuda").manual_seed(T)
    ranks = (64, 16, 32, 64)
    a, b = lora_weights(n, 4096, 4096, ranks, torch.bfloat16, "cuda", g)
    x = torch.randn(T, 4096, generator=g, device="cuda").to(torch.bfloat16)
    y0 = torch.randn(T, 4096, generator=g, device="cuda").to(torch.bfloat16)
    indptr = torch.zeros(S + 1, dtype=torch.int32, device="cuda")
    slots = torch.full((S,), -1, dtype=torch.int32, device="cuda")
    mapping = LoraBatchMapping(seg_indptr=indptr, seg_slot=slots, seg_indptr_host=(0,) * (S + 1), seg_slot_host=(0,) * S,
                               num_tokens=T, has_lora=True, even=False)
    y = y0.clone()

    def call():
        assert kernels.run_rows(y, x, a, b, mapping, 1.0)

    call()  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    rng = torch.Generator().manual_seed(T + 1)
    for step in range(4):
        used = int(torch.randint(1, S + 1, (1,), generator=rng))
        real = T - int(torch.randint(0, max(1, T // 8), (1,), generator=rng))
        cuts = sorted(torch.randint(0, real + 1, (used - 1,), generator=rng).tolist())
        bounds = [0] + cuts + [real] + [real] * (S - used)
        seg_slots = [int(torch.randint(-1, n, (1,), generator=rng)) for _ in range(used)] + [-1] * (S - used)
        if step == 0:
            seg_slots[0] = 0  # at least one adapter
        indptr.copy_(torch.tensor(bounds, dtype=torch.int32))
        slots.copy_(torch.tensor(seg_slots, dtype=torch.int32))
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        ref = ref_fp32(y0, x, a, b, (r_max,) * n, (1.0,) * n, LoraBatchMapping.from_segments(bounds, seg_slots))
        assert torch.isfinite(y).all()
        assert torch.equal(y[real:], y0[real:]), "rows past the last segment were modified"
        delta = ref - y0.float()
        if delta.norm() > 0:
            err = ((y.float() - y0.float() - delta).norm() / delta.norm()).item()
            assert err <= 2 * TOL[torch.bfloat16], f"step {step} {bounds} {seg_slots}: delta relative error {err:.2e}"
        else:
            assert torch.equal(y, y0)


def test_refusals_name_the_problem(kernels):
    x, y0, a, b, mapping = make(8, 4096, 4096, torch.bfloat16, "one_long", seed=0)
    y_odd = torch.randn(8, 4090, device="cuda", dtype=torch.bfloat16)
    b_odd = b[:, :4090].contiguous()
    assert "multiples of 8" in kernels.unsupported(y_odd, x, a, b_odd, RANKS, SCALES, mapping)
    assert "fp16, bf16" in kernels.unsupported(y0.float(), x.float(), a.float(), b.float(), RANKS, SCALES, mapping)


@pytest.mark.parametrize("backend", ["torch", "stream", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sign", [1, -1])
def test_merge_cuda_matches_reference(backend, dtype, sign):
    _merge_case(backend, dtype, sign, None)


def test_merge_configs_are_the_def_lines():
    from vlora.atmm.merge import MERGE_CONFIGS

    assert tuple(ext.merge_configs()) == MERGE_CONFIGS
    assert ext.merge_config_max_ranks() == [64, 128]


@pytest.mark.parametrize("config", ext.merge_configs())
@pytest.mark.parametrize("rank", [8, 16, 24, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_stream_configs(config, rank, dtype):
    if rank > ext.merge_config_max_ranks()[ext.merge_configs().index(config)]:
        from vlora.atmm import merge_lora

        w = torch.zeros(2, 64, 64, device="cuda", dtype=dtype)
        a = torch.zeros(2, rank, 64, device="cuda", dtype=dtype)
        b = torch.zeros(2, 64, rank, device="cuda", dtype=dtype)
        with pytest.raises(RuntimeError, match="serves ranks up to"):
            merge_lora(w, a, b, 1.0, 1, backend="stream", config=config)
        return
    _merge_case("stream", dtype, -1 if rank == 24 else 1, config, rank=rank, d_in=1032)


def _merge_case(backend, dtype, sign, config, rank=64, d_in=512):
    from vlora.atmm import merge_lora, merge_lora_reference

    g = torch.Generator(device="cuda").manual_seed(rank)
    w = torch.randn(8, 1000, d_in, generator=g, device="cuda").to(dtype)
    a = (torch.randn(8, rank, d_in, generator=g, device="cuda") / 8).to(dtype)
    b = (torch.randn(8, 1000, rank, generator=g, device="cuda") / 8).to(dtype)
    got = merge_lora(w.clone(), a, b, 0.5, sign, backend=backend, config=config)
    ref = merge_lora_reference(w.clone().float(), a.float(), b.float(), 0.5, sign)
    delta = ref - w.float()
    err = ((got.float() - ref).norm() / delta.norm()).item()
    assert err <= (1e-2 if dtype == torch.bfloat16 else 5e-3) * 8, f"merge error {err:.2e} relative to the delta"
    assert ((got.float() - ref).norm() / ref.norm()).item() <= (1e-2 if dtype == torch.bfloat16 else 5e-3)


def test_committed_tables_load_and_validate():
    """Every committed table names only compiled configs (the C++ table refuses unknown ones)."""
    from vlora.atmm.tiling import default_table_dir

    fresh = AtmmKernels(load_table=False)
    for path in default_table_dir().glob("*.json"):
        assert fresh.load_table(path) > 0
        assert fresh.table_source == str(path)
    with pytest.raises(ValueError, match="not compiled"):
        fresh.ext.TilingTable().add("shrink", "bf16", 32, 4096, 64, 1, "t999x999", 1)
