"""CUDA graphs of decode steps, one per batch-size bucket and LoRA variant, and of the decoder for
prefill steps, one per token-count bucket and LoRA variant (:class:`PrefillGraphs`).

A decode step's shapes depend only on its batch size, so each bucket (``engine.graph_batch_sizes``) is
captured once and replayed with the batch padded up to it. Everything a replay reads sits at a fixed
device address: the step plan (:mod:`vlora.engine.plan`: token ids, positions, KV slots, context lengths,
the rows' adapter slots and block tables), which its one writer fills per step as the bucket's layout
says, with one copy from pinned host memory, the same buffer the eager steps read; the weights, the LoRA
slot buffers and the KV pools are allocated once. Padding rows read nothing (context length 0), write
their keys and values to the cache's scratch block, and use no adapter.

Three variants per bucket, chosen per step by :func:`step_variant` from the rows' slots: ``base``
(no LoRA kernels at all: merged mode, a mixture step whose rows are all the merged adapter's, and base
requests), ``lora`` (every row's adapter through the LoRA backend's graph-safe ``rows`` path: unmerged
mode) and ``mixture`` (also the merged adapter taken out again for the rows of other adapters).
``replays`` counts the replays per (bucket, variant). Capture happens at model load
(:meth:`DecodeGraphs.capture_all`, with progress in the log); a variant not captured then (mixture
under a policy that never mixes) is captured when a step first needs it. Merges change the weights in
place (the runner's weight groups), so the graphs stay valid.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from vlora.engine.plan import DECODE_GRAPH, PREFILL_GRAPH, PlanShape, row_mapping, sequence_mapping

if TYPE_CHECKING:
    from vlora.engine.model_runner import ModelRunner, SeqInput, ForwardOutput

log = logging.getLogger(__name__)

VARIANTS = ("base", "lora", "mixture")


def step_variant(seqs: list["SeqInput"]) -> str:
    """The graph variant a step's sequences need: ``mixture`` when one takes a merged adapter out again,
    ``lora`` when one adds an unmerged adapter, else ``base``."""
    if any(s.delora_slot >= 0 for s in seqs):
        return "mixture"
    return "lora" if any(s.slot >= 0 for s in seqs) else "base"


def smallest_at_least(sizes: tuple[int, ...], n: int) -> Optional[int]:
    """The first of the ascending ``sizes`` that holds ``n`` (a captured bucket), None if none does."""
    for b in sizes:
        if b >= n:
            return b
    return None


def capture_graph(device: torch.device, body: Callable[[], Any], pool: Any) -> tuple[Any, Any, Any]:
    """One CUDA graph of ``body()``: run it twice first on a side stream (lazy initialisation, Triton's compiles,
    cuBLAS's and other libraries' plans stay out of the graph), then capture one call into a new graph drawing from
    the memory ``pool`` (a new one when None). The capture is thread-local: CUDA calls of other threads (the adapter
    loaders' and the copy thread's) do not void it. Returns (graph, what the captured call returned, pool); every
    graph set of the engine (decode, prefill, vision) captures through here."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        out = body()
    return g, out, pool


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", sizes: tuple[int, ...], max_model_len: int) -> None:
        self.runner = runner
        self.sizes = tuple(sorted(set(sizes)))
        self.max_batch = self.sizes[-1]
        kv = runner.kv
        self.max_blocks = -(-max_model_len // kv.block_size)
        dev = runner.device
        # Each bucket's view of the step plan (tokens = sequences = the bucket, the longest context's blocks)
        self.layouts = dict(zip(self.sizes, runner.plans.graph_layouts([(b, b, self.max_blocks) for b in self.sizes])))
        self.shapes = {b: PlanShape(DECODE_GRAPH, lay) for b, lay in self.layouts.items()}
        self.prev = torch.zeros(self.max_batch, dtype=torch.int64, device=dev)  # the previous step's sampled ids (src reads them)
        self.pool = None
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.memory_bytes = 0
        self.capture_s = 0.0
        self.replays: Counter = Counter()  # (bucket, variant) -> replays

    # -- which steps replay ----------------------------------------------------------------------
    def bucket(self, n: int) -> Optional[int]:
        return smallest_at_least(self.sizes, n)

    def serves(self, seqs: list["SeqInput"]) -> bool:
        return (len(seqs) <= self.max_batch and all(len(s.token_ids) == 1 and s.pixel_values is None for s in seqs)
                and all(s.start_pos < self.max_blocks * self.runner.kv.block_size for s in seqs))

    # -- capture ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self, variants: tuple[str, ...] = VARIANTS) -> None:
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        free0, reserved0 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        total = len(self.sizes) * len(variants)
        done = 0
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            for v in variants:
                self._capture(b, v)
                done += 1
            log.info("CUDA graphs: captured batch %d (%d/%d graphs, %.1f s)", b, done, total, time.perf_counter() - t0)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        # The graphs' private pool grows the allocator's reservation; blocks it had cached before can
        # hide that from the device's free memory, so take the larger of the two measures.
        self.memory_bytes = max(0, free0 - torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev) - reserved0)
        log.info("CUDA graphs: %d decode graphs (batch sizes %s, variants %s) in %.1f s, %.0f MiB of device memory",
                 total, list(self.sizes), list(variants), self.capture_s, self.memory_bytes / 2**20)

    def capture_missing(self, variants: tuple[str, ...] = VARIANTS) -> int:
        """Capture the graphs of ``variants`` not captured yet (a policy that mixes, set after load), so
        that no step of a timed run pays a capture. Returns how many were captured."""
        todo = [(b, v) for b in reversed(self.sizes) for v in variants if (b, v) not in self.graphs]
        for b, v in todo:
            self._capture(b, v)
        if todo:
            log.info("CUDA graphs: captured %d more (variants %s)", len(todo), sorted({v for _, v in todo}))
        return len(todo)

    def _capture(self, b: int, variant: str) -> None:
        r = self.runner
        r.plans.dummy(DECODE_GRAPH, self.layouts[b], b)
        g, (logits, hidden), self.pool = capture_graph(r.device, lambda: self._body(b, variant), self.pool)
        self.graphs[(b, variant)] = (g, logits, hidden)

    def _body(self, b: int, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        kv = r.kv
        lay = self.layouts[b]
        src = lay.d_src
        ids = torch.where(src >= 0, self.prev.index_select(0, src.clamp(min=0)).clamp(min=0), lay.d_ids)
        meta = lay.attention(b, 1, True, False)
        scale = r._attn_scale

        def attend(q: torch.Tensor, li: int) -> torch.Tensor:
            return r.attention.decode(q, kv.k[li], kv.v[li], meta, scale, kv.block_size)

        ctx = r.lora_ctx
        indptr = r.plans.row_indptr
        ctx.bind(row_mapping(lay, indptr, b) if variant != "base" else None,
                 row_mapping(lay, indptr, b, delora=True) if variant == "mixture" else None, rows=True)
        try:
            return r._decoder(r.lm.embed_tokens(ids), lay.d_pos, lay.d_slot, attend, None)
        finally:
            ctx.clear()

    # -- replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list["SeqInput"], prev_tokens: Optional[torch.Tensor] = None) -> "ForwardOutput":
        from vlora.engine.model_runner import ForwardOutput

        r = self.runner
        n = len(seqs)
        b = self.bucket(n)
        variant = step_variant(seqs)
        if (b, variant) not in self.graphs:
            self._capture(b, variant)
        g, logits, hidden = self.graphs[(b, variant)]
        plan = r.plans.build(seqs, self.shapes[b])
        if plan.pending and prev_tokens is not None:
            self.prev[:prev_tokens.shape[0]].copy_(prev_tokens)
        g.replay()
        self.replays[(b, variant)] += 1
        return ForwardOutput(logits=logits[:n], hidden=hidden[:n])


# Prefill steps: token-count buckets (a step pads its tokens up to the next one): every PREFILL_BUCKET
# tokens up to 1,024, 8 short of each multiple (24, 56, ..., 1,016, then 1,024), then every 64 up to
# 2,048, then every 128. cuBLAS's heuristics pick slower kernels for many row counts that are multiples of
# 32: on an H100 the 7B model's four projections took 4.0% less time per row on average at 32k - 8 rows
# than at 32k over 512..1,024 (the since-removed gemm_rows_probe: benchmarks/NOTES.md, results/gemm-rows-probe-nvidia-h100-80gb-hbm3.json;
# 600 rows 327 us a layer, 608 rows 359).
PREFILL_BUCKET = 32


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token counts captured for prefill steps, up to ``max_tokens``: 32k - 8 up to 1,016, then 1,024,
    then steps of 64 up to 2,048 and of 128 beyond, so that past 512 tokens padding adds at most about 6%
    of a step's rows, 3% on average (600 tokens run as 600, 601 as 632, 1,500 as 1,536)."""
    out = [n for n in range(PREFILL_BUCKET - 8, 1024, PREFILL_BUCKET) if n <= max_tokens]
    n = 1024
    while n <= max_tokens:
        out.append(n)
        n += 64 if n < 2048 else 128
    return tuple(out)


class PrefillGraphs:
    """CUDA graphs of the decoder for steps that hold a prefill, one per token-count bucket and LoRA variant.

    An eager prefill issues about ten launches per layer from Python, and at a few hundred tokens its host
    is slower than its GPU (600 tokens on an H200: 14-15 ms of wall against 12.3 ms of kernels; with one
    rank-64 adapter, about 700 launches, 39-41 ms against 15). A replay issues them all at once. What a step
    brings varies, so the graph starts after the embedding: the step's token ids are embedded (and their
    images put in) eagerly into a fixed hidden-state buffer, and the graph runs every decoder layer, the
    final norm and the LM head at the sequences' last tokens. Fixed buffers hold positions, KV slots, the
    sequences' query offsets, context lengths and block tables (as wide as the model's longest context) and
    the rows to read logits from. Padding tokens belong to no sequence: their KV slot is -1 (not written),
    attention leaves them alone, and every other kernel works row by row, so they touch no real row.
    Padding sequences have no tokens.

    Variants as the decode graphs' (:func:`step_variant`): ``base`` (no LoRA kernels), ``lora`` (each
    sequence's adapter through the LoRA backend's graph-safe ``rows`` path, one segment per sequence, its
    bounds and slot in the plan's LoRA fields: :func:`vlora.engine.plan.sequence_mapping`; every slot at
    the buffers' ``r_max``) and ``mixture`` (also the merged adapter taken out again). Served: at most
    ``max_seqs`` sequences, ``max_tokens`` tokens, a variant that was captured; an M-RoPE model's graphs read
    positions on three axes (prompts with images and videos replay too). Everything else runs eagerly.
    Attention inside the graphs is the Triton kernel (fresh prompts' cuDNN path reads host lengths).
    The graphs share the decode graphs' memory pool."""

    def __init__(self, runner: "ModelRunner", max_tokens: int, max_seqs: int, max_model_len: int,
                 pool=None) -> None:
        self.runner = runner
        self.sizes = prefill_buckets(max_tokens)
        self.max_tokens = self.sizes[-1] if self.sizes else 0
        self.max_seqs = max_seqs
        kv = runner.kv
        self.max_blocks = -(-max_model_len // kv.block_size)
        dev = runner.device
        # Each bucket's view of the step plan: its tokens, every sequence the graphs take, the longest context's blocks
        # M-RoPE models (Qwen2-VL) lay their positions out on three axes, so that prompts with images replay too
        self.mrope = hasattr(runner.lm.rotary_emb, "mrope_section")
        self.layouts = dict(zip(self.sizes, runner.plans.graph_layouts(
            [(b, max_seqs, self.max_blocks) for b in self.sizes], mrope=self.mrope)))
        self.shapes = {b: PlanShape(PREFILL_GRAPH, lay) for b, lay in self.layouts.items()}
        self.hidden = torch.zeros(self.max_tokens, runner.lm.embed_tokens.weight.shape[1], dtype=runner.dtype, device=dev)
        self.pool = pool
        self.variants: tuple[str, ...] = ()  # captured by capture_all
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.memory_bytes = 0
        self.replays: Counter = Counter()  # (bucket, variant) -> replays

    def bucket(self, n: int) -> Optional[int]:
        return smallest_at_least(self.sizes, n)

    def serves(self, seqs: list["SeqInput"]) -> bool:
        if not self.sizes or len(seqs) > self.max_seqs or step_variant(seqs) not in self.variants:
            return False
        total = 0
        limit = self.max_blocks * self.runner.kv.block_size
        for s in seqs:
            if s.start_pos + len(s.token_ids) > limit:
                return False
            if not self.mrope and s.mrope_positions is not None and s.start_pos < s.mrope_positions.shape[1]:
                return False
            total += len(s.token_ids)
        return 0 < total <= self.max_tokens

    # -- capture ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self, variants: tuple[str, ...] = ("base",)) -> None:
        """Capture every bucket in each of ``variants`` (``base``; ``lora`` and ``mixture`` where the runner
        has adapter slots)."""
        if not self.sizes:
            return
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        free0, reserved0 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        todo = [(b, v) for b in reversed(self.sizes) for v in variants]  # largest first: smaller graphs reuse its memory
        for i, (b, v) in enumerate(todo):
            self._capture(b, v)
            if (i + 1) % 16 == 0 or i + 1 == len(todo):
                log.info("CUDA graphs: captured %d/%d prefill graphs (%.1f s)", i + 1, len(todo), time.perf_counter() - t0)
        self.variants = tuple(dict.fromkeys(self.variants + tuple(variants)))
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = max(0, free0 - torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev) - reserved0)
        log.info("CUDA graphs: %d prefill graphs (%d to %d tokens, up to %d sequences, variants %s) in %.1f s, "
                 "%.0f MiB of device memory more", len(todo), self.sizes[0], self.sizes[-1], self.max_seqs,
                 list(variants), self.capture_s, self.memory_bytes / 2**20)

    def _capture(self, b: int, variant: str) -> None:
        r = self.runner
        r.plans.dummy(PREFILL_GRAPH, self.layouts[b], b)
        g, (logits, hidden), self.pool = capture_graph(r.device, lambda: self._body(b, variant), self.pool)
        self.graphs[(b, variant)] = (g, logits, hidden)

    def _body(self, b: int, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        kv = r.kv
        lay = self.layouts[b]
        meta = lay.attention(lay.S, b, False, False)
        scale = r._attn_scale

        def attend(q: torch.Tensor, li: int) -> torch.Tensor:
            return r.attention.prefill(q, kv.k[li], kv.v[li], meta, scale, kv.block_size)

        ctx = r.lora_ctx
        ctx.bind(sequence_mapping(lay) if variant != "base" else None,
                 sequence_mapping(lay, delora=True) if variant == "mixture" else None, rows=True)
        try:
            return r._decoder(self.hidden[:b], lay.d_pos, lay.d_slot, attend, lay.d_last)
        finally:
            ctx.clear()

    # -- replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list["SeqInput"], prev_tokens: Optional[torch.Tensor] = None) -> "ForwardOutput":
        from vlora.engine.model_runner import ForwardOutput

        r = self.runner
        lengths = [len(s.token_ids) for s in seqs]
        n, ns = sum(lengths), len(seqs)
        b = self.bucket(n)
        variant = step_variant(seqs)
        if (b, variant) not in self.graphs:
            self._capture(b, variant)
        g, logits, hidden = self.graphs[(b, variant)]
        plan = r.plans.build(seqs, self.shapes[b])
        ids = plan.ids
        if plan.pending:
            if prev_tokens is None:
                raise ValueError("a sequence reads its token from the previous step, but prev_tokens is None")
            src = plan.src
            ids = torch.where(src >= 0, prev_tokens.index_select(0, src.clamp(min=0)).clamp(min=0), ids)
        self.hidden[:n].copy_(r.lm.embed_tokens(ids))
        if b > n:
            self.hidden[n:b].zero_()  # padding rows start clean each step
        n_enc = r._insert_images(seqs, ids, self.hidden[:n])
        g.replay()
        self.replays[(b, variant)] += 1
        return ForwardOutput(logits=logits[:ns], hidden=hidden[:ns], num_images_encoded=n_enc)
