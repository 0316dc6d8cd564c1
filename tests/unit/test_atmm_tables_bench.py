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


class _RecordingExt:
    """Enough of vlora_atmm_ext for AtmmKernels.run_rows on CPU tensors: a table that always answers the
    column-stationary expand, and forward() recording the expand it is given."""
    NAMES = ("tr_s_m64k128_r64_w4s4", "tr_c_m64n128_r64_w4s4_g1", "tr_e_m64n128_r64_c1024_w4s3")

    def __init__(self):
        self.expands = []

    def configs(self):
        return [{"name": n, "kind": "triton"} for n in self.NAMES]

    def TilingTable(self):  # noqa: N802 (the extension's class)
        class Table:
            def lookup(self, direction, dtype, tokens, width, rank, segments):
                name = _RecordingExt.NAMES[0] if direction == "shrink" else _RecordingExt.NAMES[1]
                return {"config": name, "split_k": 1, "exact": True, "default": False, "matched": None}
        return Table()

    def workspace_size(self, *args):
        return 256

    def forward(self, *args):
        self.expands.append(self.NAMES[args[20]])


def test_run_rows_picks_the_prefill_graph_expand():
    """A prefill graph of several sequences takes the row-tile expand over the table's column-stationary one; a
    graph of one sequence and a decode graph (bounds fixed) keep the table's; a named prefill_graph_expand
    (atmm_tables --prefill-graph-expand) replaces both for prefill graphs."""
    import torch

    from vlora.atmm import AtmmKernels
    from vlora.atmm.mapping import LoraBatchMapping

    def mapping(indptr, slots, even):
        m = LoraBatchMapping.from_segments(indptr, slots, "cpu")
        return LoraBatchMapping(m.seg_indptr, m.seg_slot, m.seg_indptr_host, m.seg_slot_host, indptr[-1], True,
                                even=even)

    T, d, r, slots = 64, 128, 64, 4
    y, x = torch.zeros(T, d, dtype=torch.bfloat16), torch.zeros(T, d, dtype=torch.bfloat16)
    a, b = torch.zeros(slots, r, d, dtype=torch.bfloat16), torch.zeros(slots, d, r, dtype=torch.bfloat16)
    graph = mapping([0, T] + [T] * 7, [0] + [-1] * 7, False)
    one = mapping([0, T], [0], False)
    decode = mapping(list(range(T + 1)), [i % slots for i in range(T)], True)
    ext = _RecordingExt()
    k = AtmmKernels(ext=ext, load_table=False)
    assert k.prefill_graph_expand is None
    for m in (graph, one, decode):
        assert k.run_rows(y, x, a, b, m, 1.0, stream=0)
    assert ext.expands == ["tr_e_m64n128_r64_c1024_w4s3", "tr_c_m64n128_r64_w4s4_g1", "tr_c_m64n128_r64_w4s4_g1"]
    # row_kernels is that choice (atmm_tables reports it)
    assert [k.row_kernels("bf16", T, d, d, r, m.num_segments, m.even)[1] for m in (graph, one, decode)] == ext.expands
    ext, k2 = _RecordingExt(), None
    k2 = AtmmKernels(ext=ext, load_table=False)
    k2.prefill_graph_expand = "tr_c_m64n128_r64_w4s4_g1"
    for m in (graph, one, decode):
        assert k2.run_rows(y, x, a, b, m, 1.0, stream=0)
    assert ext.expands == ["tr_c_m64n128_r64_w4s4_g1"] * 3


def test_the_prefill_graph_expand_setting_reaches_the_kernels():
    """atmm.prefill_graph_expand: auto leaves run_rows' own choice; a compiled expand config is set on the runner's
    kernels before the prefill graphs plan their calls; a name that is not a compiled expand is refused at load,
    naming the setting; without the extension the setting is ignored."""
    from types import SimpleNamespace

    import pytest

    from vlora.atmm import AtmmKernels
    from vlora.config import ConfigError, EngineConfig
    from vlora.engine.builder import set_prefill_graph_expand

    class Ext(_RecordingExt):
        def configs(self):
            return [{"name": n, "kind": "triton", "expand": not n.startswith("tr_s_")} for n in self.NAMES]

    def runner_with(kernels):
        return SimpleNamespace(lora_ctx=SimpleNamespace(backend=SimpleNamespace(kernels=kernels)))

    kernels = AtmmKernels(ext=Ext(), load_table=False)
    assert kernels.expand_config_names == ["tr_c_m64n128_r64_w4s4_g1", "tr_e_m64n128_r64_c1024_w4s3"]
    cfg = lambda v: EngineConfig().with_overrides({"atmm.prefill_graph_expand": v})  # noqa: E731
    set_prefill_graph_expand(cfg("tr_c_m64n128_r64_w4s4_g1"), runner_with(kernels))
    assert kernels.prefill_graph_expand == "tr_c_m64n128_r64_w4s4_g1"
    set_prefill_graph_expand(cfg("auto"), runner_with(kernels))
    assert kernels.prefill_graph_expand is None
    with pytest.raises(ConfigError, match="atmm.prefill_graph_expand"):
        set_prefill_graph_expand(cfg("tr_s_m64k128_r64_w4s4"), runner_with(kernels))  # a shrink
    with pytest.raises(ConfigError, match="atmm.prefill_graph_expand"):
        set_prefill_graph_expand(cfg("no_such_config"), runner_with(kernels))
    absent = AtmmKernels(ext=None, load_table=False)
    absent.unavailable_reason = "no extension"
    set_prefill_graph_expand(cfg("tr_c_m64n128_r64_w4s4_g1"), runner_with(absent))  # ignored, with a warning
    assert absent.prefill_graph_expand is None
