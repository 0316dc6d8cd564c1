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
