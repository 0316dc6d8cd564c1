"""The step plan's one writer (vlora.engine.plan): what an eager step, a decode graph's step and a prefill graph's
step read, all views of one preallocated buffer; and the ATMM backend's per-step preparation (vlora.lora.backends),
driven on a CPU with a stand-in for the extension."""
from __future__ import annotations

import logging

import pytest
import torch

from vlora.atmm import AtmmKernels, atmm_reference
from vlora.atmm.mapping import LoraBatchMapping
from vlora.engine.kv_cache import PagedKVCache, SequenceBlocks
from vlora.engine.model_runner import SeqInput
from vlora.engine.plan import DECODE_GRAPH, PlanBuilder, PlanShape
from vlora.lora.backends import AtmmBackend
from vlora.lora.layers import LoraContext, LoraLinear

from helpers import FakeAtmmExt


@pytest.fixture
def kv():
    return PagedKVCache(1, 32, 4, 1, 2, torch.float32, torch.device("cpu"))  # block size 4


def _inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    lo = buf.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + buf.numel()


def test_an_eager_step_reads_views_of_the_plan_buffer(kv):
    """A mixed step: the values the old per-step tensors held, now in the one buffer, allocated once."""
    builder = PlanBuilder(torch.device("cpu"), kv)
    fresh = SeqInput(token_ids=[5, 6, 7], start_pos=0, blocks=SequenceBlocks([3]), slot=1)
    cont = SeqInput(token_ids=[8, 9], start_pos=5, blocks=SequenceBlocks([4, 7]), slot=1, rope_delta=3)
    dec = SeqInput(token_ids=[0], start_pos=8, blocks=SequenceBlocks([1, 2, 9]), slot=-1, delora_slot=2, pending_row=4)
    plan = builder.build([fresh, cont, dec])
    assert plan.ids.tolist() == [5, 6, 7, 8, 9, 0]
    assert plan.positions.tolist() == [0, 1, 2, 8, 9, 8]
    assert plan.slot_mapping.tolist() == kv.slots(fresh.blocks, 0, 3) + kv.slots(cont.blocks, 5, 7) + [9 * 4]
    assert plan.last_index.tolist() == [2, 4, 5]
    assert plan.src.tolist() == [-1] * 5 + [4] and plan.pending
    assert plan.attn.cu_seqlens_q.tolist() == [0, 3, 5, 6] and plan.attn.seq_lens.tolist() == [3, 7, 9]
    assert plan.attn.block_tables.shape == (3, 3) and plan.attn.block_tables[2].tolist() == [1, 2, 9]
    assert plan.attn.block_tables[0, 0] == 3 and plan.attn.block_tables[1, :2].tolist() == [4, 7]
    assert plan.attn.max_q_len == 3 and plan.attn.q_lens == (3, 2, 1) and plan.attn.fresh_rows is None
    assert not plan.decode_only
    # LoRA: neighbours of one slot are one segment; deLoRA's segments beside them
    assert plan.lora.seg_indptr_host == (0, 5, 6) and plan.lora.seg_slot_host == (1, -1) and plan.lora.has_lora
    assert plan.lora.seg_indptr.tolist() == [0, 5, 6] and plan.lora.seg_slot.tolist() == [1, -1]
    assert plan.delora.seg_slot_host == (-1, 2) and plan.delora.seg_slot.tolist() == [-1, 2]
    views = (plan.ids, plan.positions, plan.slot_mapping, plan.last_index, plan.src, plan.attn.cu_seqlens_q,
             plan.attn.seq_lens, plan.attn.block_tables, plan.lora.seg_indptr, plan.lora.seg_slot, plan.delora.seg_slot)
    assert all(_inside(v, builder.dev) for v in views)
    # the next step (another shape) reuses the buffer: nothing allocated per step
    dev = builder.dev
    again = builder.build([SeqInput(token_ids=[3], start_pos=2, blocks=SequenceBlocks([6]))])
    assert builder.dev is dev and _inside(again.ids, dev)
    assert again.decode_only and again.attn.cu_seqlens_q is None and again.src is None and again.delora is None
    assert not again.lora.has_lora and again.positions.tolist() == [2] and again.slot_mapping.tolist() == [6 * 4 + 2]


def test_m_rope_positions_are_written_on_three_axes(kv):
    builder = PlanBuilder(torch.device("cpu"), kv)
    m = torch.tensor([[0, 1, 2, 3], [0, 1, 1, 3], [0, 2, 2, 3]])
    prompt = SeqInput(token_ids=[1, 2, 3, 4], start_pos=0, blocks=SequenceBlocks([0]), mrope_positions=m, rope_delta=-1)
    text = SeqInput(token_ids=[7], start_pos=5, blocks=SequenceBlocks([1, 2]), rope_delta=2)
    plan = builder.build([prompt, text])
    assert plan.positions.shape == (3, 5)
    assert plan.positions.tolist() == [[0, 1, 2, 3, 7], [0, 1, 1, 3, 7], [0, 2, 2, 3, 7]]


def test_an_m_rope_prefill_graph_pads_its_three_axes(kv):
    """A Qwen2-VL prefill graph's layout holds positions on three axes: a prompt's M-RoPE positions, a text
    prompt's one position on all three, zeros for the padding tokens; the same views every step."""
    from vlora.engine.plan import PREFILL_GRAPH

    builder = PlanBuilder(torch.device("cpu"), kv)
    (lay,) = builder.graph_layouts([(8, 4, 6)], mrope=True)
    shape = PlanShape(PREFILL_GRAPH, lay)
    m = torch.tensor([[0, 1, 2, 3], [0, 1, 1, 3], [0, 2, 2, 3]])
    prompt = SeqInput(token_ids=[1, 2, 3, 4], start_pos=0, blocks=SequenceBlocks([0]), mrope_positions=m, rope_delta=-1)
    text = SeqInput(token_ids=[7, 8], start_pos=0, blocks=SequenceBlocks([1]))
    dummy_pos = lay.d_pos.data_ptr()
    builder.dummy(PREFILL_GRAPH, lay, 8)
    plan = builder.build([prompt, text], shape)
    assert plan.positions.shape == (3, 8) and plan.positions.data_ptr() == dummy_pos
    assert plan.positions.tolist() == [[0, 1, 2, 3, 0, 1, 0, 0], [0, 1, 1, 3, 0, 1, 0, 0], [0, 2, 2, 3, 0, 1, 0, 0]]


def test_a_prefill_graph_step_writes_one_lora_segment_per_sequence(kv):
    """A prefill graph's LoRA segments: each sequence one segment (its query offsets), its slot and deLoRA
    slot; the padding sequences empty at the end, with no adapter; the capture's dummy step has one segment of
    the whole bucket without an adapter. The mapping is a view of the buffers the graph captured."""
    from vlora.engine.plan import PREFILL_GRAPH, sequence_mapping

    builder = PlanBuilder(torch.device("cpu"), kv)
    (lay,) = builder.graph_layouts([(16, 4, 6)])
    shape = PlanShape(PREFILL_GRAPH, lay)
    builder.dummy(PREFILL_GRAPH, lay, 16)
    plus, minus = sequence_mapping(lay), sequence_mapping(lay, delora=True)
    assert not plus.even and plus.num_tokens == 16 and plus.has_lora
    assert plus.seg_indptr.tolist() == [0, 16, 16, 16, 16] and plus.seg_slot.tolist() == [-1] * 4
    assert minus.seg_indptr.tolist() == [0, 16, 16, 16, 16] and minus.seg_slot.tolist() == [-1] * 4
    a = SeqInput(token_ids=[1, 2, 3, 4, 5], start_pos=0, blocks=SequenceBlocks([0, 1]), slot=2)
    b = SeqInput(token_ids=[6, 7], start_pos=4, blocks=SequenceBlocks([2, 3]), slot=-1, delora_slot=1)
    c = SeqInput(token_ids=[8, 9, 10], start_pos=0, blocks=SequenceBlocks([4]), slot=0)
    plan = builder.build([a, b, c], shape)
    assert plan.lora is None and plan.delora is None  # the graph reads the layout's views instead
    assert plus.seg_indptr.tolist() == [0, 5, 7, 10, 10] and plus.seg_slot.tolist() == [2, -1, 0, -1]
    assert minus.seg_indptr.tolist() == [0, 5, 7, 10, 10] and minus.seg_slot.tolist() == [-1, 1, -1, -1]
    assert plus.seg_slot.data_ptr() == lay.lora_views(4, False)[1].data_ptr()


def test_a_decode_graph_step_pads_its_bucket_at_fixed_addresses(kv):
    builder = PlanBuilder(torch.device("cpu"), kv)
    lay4, lay8 = builder.graph_layouts([(4, 4, 6), (8, 8, 6)])
    shape = PlanShape(DECODE_GRAPH, lay4)
    a = SeqInput(token_ids=[11], start_pos=5, blocks=SequenceBlocks([2, 3]), slot=0, rope_delta=1)
    b = SeqInput(token_ids=[0], start_pos=0, blocks=SequenceBlocks([7]), slot=-1, delora_slot=1, pending_row=6)
    plan = builder.build([a, b], shape)
    assert plan.num_tokens == 2 and plan.pending and plan.decode_only
    assert plan.ids.tolist()[:2] == [11, 0] and plan.ids.tolist()[2:] == [0, 0]
    assert plan.src.tolist() == [-1, 6, -1, -1]
    assert plan.positions.tolist() == [6, 0, 0, 0]
    assert plan.slot_mapping.tolist() == [3 * 4 + 1, 7 * 4, kv.scratch_slot, kv.scratch_slot]  # padding: scratch
    assert plan.attn.seq_lens.tolist() == [6, 1, 0, 0] and plan.attn.block_tables.shape == (4, 6)
    assert plan.attn.block_tables[0, :2].tolist() == [2, 3] and plan.attn.block_tables[1, 0] == 7
    # per-row LoRA over the same buffers the graph captured
    from vlora.engine.plan import row_mapping

    rows = row_mapping(lay4, builder.row_indptr, 4)
    assert rows.seg_indptr.tolist() == [0, 1, 2, 3, 4] and rows.seg_slot.tolist() == [0, -1, -1, -1]
    assert row_mapping(lay4, builder.row_indptr, 4, delora=True).seg_slot.tolist() == [-1, 1, -1, -1]
    assert rows.seg_slot.data_ptr() == lay4.lora_views(4, False)[1].data_ptr()
    assert plan.ids.data_ptr() == lay4.d_ids.data_ptr() and plan.attn.block_tables.data_ptr() == lay4.d_tables.data_ptr()
    # an eager step in between, then a bigger one that outgrows the buffer: the graph's layout keeps its addresses
    builder.build([SeqInput(token_ids=list(range(9)), start_pos=0, blocks=SequenceBlocks([4, 5, 6]))])
    old = builder.dev
    big = builder.build([SeqInput(token_ids=[1] * 2000, start_pos=0, blocks=SequenceBlocks(list(range(500))))])
    assert builder.dev is not old and _inside(big.ids, builder.dev)
    plan = builder.build([b], shape)
    assert plan.ids.data_ptr() == lay4.d_ids.data_ptr() and _inside(plan.ids, old)
    assert plan.src.tolist() == [6, -1, -1, -1] and lay4.lora_views(4, False)[1].tolist() == [-1, -1, -1, -1]
    assert lay8.d_src.data_ptr() != lay4.d_src.data_ptr()  # each bucket its own layout


def test_vision_stage_mappings_come_from_one_buffer(kv):
    builder = PlanBuilder(torch.device("cpu"), kv)
    tower, proj = builder.segment_mappings([([4, 4, 2], [1, 1, -1]), ([2, 2, 1], [1, 1, -1])])
    assert tower.seg_indptr_host == (0, 8, 10) and tower.seg_slot_host == (1, -1) and tower.has_lora
    assert tower.seg_indptr.tolist() == [0, 8, 10] and tower.seg_slot.tolist() == [1, -1]
    assert proj.seg_indptr.tolist() == [0, 4, 5] and proj.num_tokens == 5
    dev = builder._aux_dev
    again, = builder.segment_mappings([([3], [-1])])
    assert builder._aux_dev is dev and not again.has_lora and again.seg_slot.tolist() == [-1]
    assert tower.seg_slot.data_ptr() - dev.data_ptr() < dev.numel()


def _layer(ctx: LoraContext, ranks=(8, 0, 16), seed=0) -> LoraLinear:
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(32, 24, bias=False).to(torch.bfloat16)
    layer = LoraLinear(base, ctx, num_slots=3, max_rank=16)
    for slot, r in enumerate(ranks):
        if r:
            layer.set_slot(slot, torch.randn(r, 32, generator=g).to(torch.bfloat16),
                           torch.randn(24, r, generator=g).to(torch.bfloat16), 0.5)
    layer.atmm_check = ""  # the buffers' one check, which a CPU tensor fails: the stand-in serves them here
    return layer


def _prepared(ext) -> tuple[AtmmBackend, LoraContext]:
    backend = AtmmBackend(AtmmKernels(ext=ext, load_table=False))
    ctx = LoraContext(backend)
    return backend, ctx


def _bind(backend: AtmmBackend, ctx: LoraContext, mapping: LoraBatchMapping) -> None:
    ctx.bind(mapping)
    backend._on, backend._stream = True, 1234  # what prepare() finds for CUDA inputs


def test_the_backend_plans_once_per_step_shape_and_layers_only_launch():
    ext = FakeAtmmExt(shrink_split=2)
    backend, ctx = _prepared(ext)
    layers = [_layer(ctx, seed=i) for i in range(3)]  # one shape and ranks: one plan
    mapping = LoraBatchMapping.from_token_slots([3, 5], [2, -1])
    x = torch.randn(8, 32).to(torch.bfloat16)
    for _ in range(2):  # two steps of the same segments
        _bind(backend, ctx, mapping)
        for layer in layers:
            y = torch.zeros(8, 24, dtype=torch.bfloat16)
            layer.add_lora(x, y)
    assert len(ext.calls) == 6 and ext.lookups == 2  # the shrink's and the expand's, once
    args = ext.calls[0]
    assert args[8:15] == (8, 32, 24, 16, 32, 24, 2)  # T, d_in, d_out, r_max, strides, segments
    assert args[15] == [0, 0, 16]  # slots no segment uses go as rank 0
    assert args[16] is layers[0].unit_scales and args[16] == [1.0, 0.0, 1.0]  # filled at adapter load
    assert args[18:21] == (0, 2, 1) and args[21] == 1234  # shrink, split_k, expand; the step's stream
    # a new table (the tuner's) is planned again at the next step
    backend.kernels.table_version += 1  # what load_table's swap does
    _bind(backend, ctx, mapping)
    layers[0].add_lora(x, torch.zeros(8, 24, dtype=torch.bfloat16))
    assert ext.lookups == 4


def test_a_refused_launch_is_served_by_the_reference_and_warned_once(caplog):
    ext = FakeAtmmExt(shrink_split=2, refuse="atmm: operation not supported")
    backend, ctx = _prepared(ext)
    layer = _layer(ctx)
    mapping = LoraBatchMapping.from_token_slots([4, 4], [0, 2])
    x = torch.randn(8, 32).to(torch.bfloat16)
    caplog.set_level(logging.WARNING, logger="vlora.lora.backends")
    _bind(backend, ctx, mapping)
    y = torch.randn(8, 24).to(torch.bfloat16)
    want = atmm_reference(y.clone(), x, layer.lora_a, layer.lora_b, layer.ranks_t, layer.unit_scales_t, mapping)
    layer.add_lora(x, y)
    assert torch.equal(y, want) and len(ext.calls) == 1 and "PyTorch reference" in caplog.text
    caplog.clear()
    y2 = torch.zeros(8, 24, dtype=torch.bfloat16)
    layer.add_lora(x, y2)  # the same signature: straight to the reference
    assert len(ext.calls) == 1 and caplog.text == ""


def test_steps_on_the_cpu_take_the_reference_unprepared():
    """No extension work where the inputs are not on CUDA: prepare leaves the backend off."""
    ext = FakeAtmmExt(shrink_split=2)
    backend, ctx = _prepared(ext)
    layer = _layer(ctx)
    mapping = LoraBatchMapping.from_token_slots([8], [2])
    ctx.bind(mapping, LoraBatchMapping.from_token_slots([8], [0]))
    assert not backend._on
    x = torch.randn(8, 32).to(torch.bfloat16)
    y = torch.zeros(8, 24, dtype=torch.bfloat16)
    want = atmm_reference(y.clone(), x, layer.lora_a, layer.lora_b, layer.ranks_t, layer.unit_scales_t, mapping)
    want = atmm_reference(want, x, layer.lora_a, layer.lora_b, layer.ranks_t, layer.neg_scales_t, ctx.delora)
    layer.add_lora(x, y)
    assert torch.equal(y, want) and not ext.calls


@pytest.mark.parametrize("rows_per_segment", [1, 5])
def test_the_graph_safe_path_adds_each_segments_slot(rows_per_segment):
    """``rows``: segments of equal length with their slots on the device (a decode graph's rows; a vision graph's
    images of R rows each) give what the segment reference gives over the same segments, slot -1 adding nothing;
    sign -1 takes the delta out again."""
    from vlora.lora.backends import lora_rows_torch

    g = torch.Generator().manual_seed(3)
    slots, r, d_in, d_out = [2, -1, 0, 2], 4, 6, 5
    T = len(slots) * rows_per_segment
    x = torch.randn(T, d_in, generator=g)
    a, b = torch.randn(3, r, d_in, generator=g), torch.randn(3, d_out, r, generator=g)
    y0 = torch.randn(T, d_out, generator=g)
    got = lora_rows_torch(y0.clone(), x, a, b, torch.tensor(slots, dtype=torch.int32), 1.0)
    mapping = LoraBatchMapping.from_segments(range(0, T + 1, rows_per_segment), slots)
    want = atmm_reference(y0.clone(), x, a, b, torch.full((3,), r), torch.ones(3), mapping)
    torch.testing.assert_close(got, want)
    back = lora_rows_torch(got, x, a, b, torch.tensor(slots, dtype=torch.int32), -1.0)
    torch.testing.assert_close(back, y0, atol=1e-5, rtol=1e-5)


def test_the_graph_safe_path_takes_uneven_segments_from_the_device():
    """A prefill graph's mapping: one segment per sequence, bounds of any length in a device buffer (padding
    sequences empty at the end, rows past the last one untouched), slot -1 adding nothing: what the segment
    reference gives over the same segments; sign -1 takes the delta out again."""
    from vlora.lora.backends import lora_rows_torch

    g = torch.Generator().manual_seed(4)
    lengths, slots, r, d_in, d_out = [5, 1, 0, 7, 3, 0, 0], [1, -1, 2, 1, 0, -1, -1], 4, 6, 5
    T = sum(lengths) + 4  # a bucket of 20 rows for 16 tokens
    indptr = [0]
    for n in lengths:
        indptr.append(indptr[-1] + n)
    x = torch.randn(T, d_in, generator=g)
    a, b = torch.randn(3, r, d_in, generator=g), torch.randn(3, d_out, r, generator=g)
    y0 = torch.randn(T, d_out, generator=g)
    dev_indptr, dev_slots = torch.tensor(indptr, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
    got = lora_rows_torch(y0.clone(), x, a, b, dev_slots, 1.0, dev_indptr)
    mapping = LoraBatchMapping.from_segments(indptr + [T], slots + [-1])
    want = atmm_reference(y0.clone(), x, a, b, torch.full((3,), r), torch.ones(3), mapping)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[sum(lengths):], y0[sum(lengths):])
    back = lora_rows_torch(got, x, a, b, dev_slots, -1.0, dev_indptr)
    torch.testing.assert_close(back, y0, atol=1e-5, rtol=1e-5)
