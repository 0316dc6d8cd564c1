"""benchmarks/atmm_tables.py on a CPU: the calls it times are the engine's (the projections of each 7B preset, a
prefill graph's mapping); the timing itself needs CUDA and the extension."""
from __future__ import annotations

from benchmarks import atmm_tables


def test_projections_of_the_presets():
    layers, projs = atmm_tables.projections(atmm_tables.MODELS["llava-1.5-7b"])
    assert layers == 32
    assert projs == {"q_proj": (4096, 4096), "k_proj": (4096, 4096), "v_proj": (4096, 4096), "o_proj": (4096, 4096),
                     "gate_proj": (4096, 11008), "up_proj": (4096, 11008), "down_proj": (11008, 4096)}
    layers, projs = atmm_tables.projections(atmm_tables.MODELS["qwen2-vl-7b"])
    assert layers == 28 and projs["k_proj"] == (3584, 512) and projs["gate_proj"] == (3584, 18944)


def test_prefill_graph_mapping_is_the_graphs_layout(monkeypatch):
    """One sequence of all T rows in slot 0 among max_batch segments, the others empty and of no slot, bounds
    read on the device (even False): as AtmmKernels.run_rows sees a prefill graph's call."""
    import torch

    from vlora.atmm.mapping import LoraBatchMapping

    real = LoraBatchMapping.from_segments
    monkeypatch.setattr(LoraBatchMapping, "from_segments",
                        classmethod(lambda cls, indptr, slots, device="cpu": real(indptr, slots, "cpu")))
    m = atmm_tables.prefill_graph_mapping(600, 32)
    assert m.num_segments == 32 and m.num_tokens == 600 and not m.even and m.has_lora
    assert m.seg_indptr.tolist() == [0] + [600] * 32
    assert m.seg_slot.tolist() == [0] + [-1] * 31
    assert m.seg_indptr.dtype == torch.int32


def test_mixed_graph_mapping_puts_decode_rows_first(monkeypatch):
    """A prefill graph replaying a mixed step: max_batch - 2 one-row decode segments, then two prompts."""
    from vlora.atmm.mapping import LoraBatchMapping

    real = LoraBatchMapping.from_segments
    monkeypatch.setattr(LoraBatchMapping, "from_segments",
                        classmethod(lambda cls, indptr, slots, device="cpu": real(indptr, slots, "cpu")))
    m = atmm_tables.mixed_graph_mapping(1024, 32, 8)
    assert m.num_segments == 32 and not m.even
    assert m.seg_indptr.tolist() == list(range(31)) + [527, 1024]
    assert m.seg_slot.tolist() == [i % 8 for i in range(32)]


def test_prefill_graphs_take_a_row_tile_expand_over_a_column_stationary_one():
    """run_rows' choice for a prefill graph: the table's column-stationary expand (its cost grows with a mixed
    step's short segments) becomes the row-tile Triton expand of the rank, where that is compiled; any other
    choice stays."""
    from vlora.atmm.dispatch import mixed_step_expand

    compiled = ["tr_c_m64n128_r64_w4s4_g1", "tr_e_m64n128_r64_c1024_w4s3", "tr_e_m64n128_r128_c1024_w4s2"]
    assert mixed_step_expand("tr_c_m64n128_r64_w4s4_g1", 64, compiled) == "tr_e_m64n128_r64_c1024_w4s3"
    assert mixed_step_expand("tr_c_m64n128_r128_w8s4_g1", 128, compiled) == "tr_e_m64n128_r128_c1024_w4s2"
    assert mixed_step_expand("tr_c_m64n128_r64_w4s4_g1", 256, compiled) == "tr_c_m64n128_r64_w4s4_g1"
    assert mixed_step_expand("ye_m64n256_r64_w1x8", 64, compiled) == "ye_m64n256_r64_w1x8"
    assert mixed_step_expand("tr_c_m64n128_r64_w4s4_g1", 64, compiled[:1]) == "tr_c_m64n128_r64_w4s4_g1"
