"""engine.prefill_graph_tokens and its token buckets, without a GPU (the graphs themselves: tests/gpu/test_engine_graphs.py)."""
from __future__ import annotations

import pytest

from vlora.config import ConfigError, EngineConfig
from vlora.engine.graphs import PREFILL_BUCKET, prefill_buckets


def test_buckets_8_short_of_multiples_of_32_then_64_then_128():
    assert PREFILL_BUCKET == 32
    assert prefill_buckets(1024) == tuple(range(24, 1024, 32)) + (1024,)
    assert prefill_buckets(600)[-1] == 600 and prefill_buckets(599)[-1] == 568  # a limit between buckets keeps the one below
    assert prefill_buckets(2048)[33:] == tuple(range(1088, 2049, 64))
    assert prefill_buckets(2400)[-2:] == (2176, 2304)
    assert prefill_buckets(23) == () and prefill_buckets(0) == ()
    sizes = prefill_buckets(16384)
    assert all((b - a) / b <= 1 / 16 for a, b in zip(sizes[32:], sizes[33:]))  # past 1,024: under 1/16 of a bucket


def test_on_by_default_and_checked():
    assert EngineConfig().engine.prefill_graph_tokens == 1024
    assert EngineConfig().with_overrides({"engine.prefill_graph_tokens": "0"}).engine.prefill_graph_tokens == 0
    for bad in ("-64", "100000"):
        with pytest.raises(ConfigError, match="prefill_graph_tokens"):
            EngineConfig().with_overrides({"engine.prefill_graph_tokens": bad})


def test_vision_graph_grids_take_image_and_video_sizes_and_refuse_anything_else():
    """engine.vision_graph_grids (the grid graphs of a Qwen2-VL tower): HxW images, FxHxW videos; a clear error
    naming the setting for anything else."""
    assert EngineConfig().engine.vision_graph_grids == ("448x448",)
    ok = EngineConfig().with_overrides({"engine.vision_graph_grids": '["448x448", "16x448x448", "640x480"]'})
    assert ok.engine.vision_graph_grids == ("448x448", "16x448x448", "640x480")
    assert EngineConfig().with_overrides({"engine.vision_graph_grids": "[]"}).engine.vision_graph_grids == ()
    for bad in ('["448"]', '["0x448"]', '["448x448x448x2"]', '["a448x448"]', "[448]"):
        with pytest.raises(ConfigError, match="vision_graph_grids"):
            EngineConfig().with_overrides({"engine.vision_graph_grids": bad})


def test_the_plan_lays_out_a_prefill_graph_step_with_padding():
    """Two prompts (one continuing a cached prefix) and a decode row reading its token from the previous
    step, in the 64-token graph of 4 sequences: the step plan's one writer, as a prefill graph reads it."""
    import torch

    from vlora.engine.kv_cache import PagedKVCache, SequenceBlocks
    from vlora.engine.model_runner import SeqInput
    from vlora.engine.plan import PREFILL_GRAPH, PlanBuilder, PlanShape

    kv = PagedKVCache(1, 16, 4, 1, 2, torch.float32, torch.device("cpu"))  # block size 4
    S, max_blocks = 4, 8
    builder = PlanBuilder(torch.device("cpu"), kv)
    lay, = builder.graph_layouts([(64, S, max_blocks)])
    fresh = SeqInput(token_ids=list(range(10, 20)), start_pos=0, blocks=SequenceBlocks([5, 2, 9]))
    cont = SeqInput(token_ids=[7, 8, 9], start_pos=6, blocks=SequenceBlocks([1, 3, 4]), rope_delta=2)
    dec = SeqInput(token_ids=[0], start_pos=4, blocks=SequenceBlocks([6, 11]), pending_row=3)
    plan = builder.build([fresh, cont, dec], PlanShape(PREFILL_GRAPH, lay))
    n = 14
    assert plan.pending and plan.lora is None and plan.delora is None and plan.num_tokens == n
    assert plan.ids.tolist() == list(range(10, 20)) + [7, 8, 9, 0]
    assert plan.positions.tolist() == list(range(10)) + [8, 9, 10, 4] + [0] * 50  # the continued prompt's rope delta
    assert plan.slot_mapping.tolist() == (kv.slots(fresh.blocks, 0, 10) + kv.slots(cont.blocks, 6, 9) + [11 * 4 + 0]
                                          + [-1] * 50)  # padding writes no KV
    assert plan.src.tolist() == [-1] * 13 + [3]
    assert plan.last_index.tolist() == [9, 12, 13, 0]  # last-token rows; padding sequence: 0
    assert plan.attn.cu_seqlens_q.tolist() == [0, 10, 13, 14, 14]  # the padding sequence is empty
    assert plan.attn.seq_lens.tolist() == [10, 9, 5, 0]
    assert plan.attn.max_q_len == 64 and tuple(plan.attn.block_tables.shape) == (S, max_blocks)
    tables = plan.attn.block_tables
    assert tables[0, :3].tolist() == [5, 2, 9] and tables[1, :3].tolist() == [1, 3, 4] and tables[2, :2].tolist() == [6, 11]
    # the graph's views are the plan's: the same addresses at every replay
    assert plan.positions.data_ptr() == lay.d_pos.data_ptr() and plan.attn.block_tables.data_ptr() == lay.d_tables.data_ptr()
    with pytest.raises(ValueError, match="64-token graph"):
        builder.build([SeqInput(token_ids=[1] * 65, start_pos=0, blocks=SequenceBlocks(list(range(17))))],
                      PlanShape(PREFILL_GRAPH, lay))


def test_grid_runs_compose_the_captured_buckets():
    """GridGraphs.compose: a run of a grid replays its own bucket where captured, else the grid's captured
    buckets (a video grid captured at one item: one replay per video, never an eager run or a new capture)."""
    from vlora.engine.vision_graphs import compose

    assert compose([1, 2, 4, 8], 3, 4) == [(4, 3)]  # its own bucket, one padding item
    assert compose([1], 3, 4) == [(1, 1)] * 3
    assert compose([1, 2], 7, 8) == [(2, 2)] * 3 + [(1, 1)]
    assert compose([2, 8], 3, 4) == [(2, 2), (2, 1)]  # the rest padded up to the smallest that holds it
    assert compose([4], 6, 8) == [(4, 4), (4, 2)]
    for have in ([1], [2], [1, 4], [2, 8], [1, 2, 4, 8]):
        for n in range(1, 9):
            plan = compose(have, n, None)
            assert sum(k for _, k in plan) == n and all(b in have and 0 < k <= b for b, k in plan)
