"""CUDA graphs of decode steps, one per batch-size bucket and LoRA variant, and of the decoder for
prefill steps without LoRA work, one per token-count bucket (:class:`PrefillGraphs`).

A decode step's shapes depend only on its batch size, so each bucket (``engine.graph_batch_sizes``) is
captured once and replayed with the batch padded up to it. Everything a replay reads sits at a fixed
device address: one int32 buffer holds the step's token ids, positions, KV slots, context lengths, the
rows' adapter slots and block tables, filled from pinned host memory with one copy per step; the
weights, the LoRA slot buffers and the KV pools are allocated once. Padding rows read nothing (context
length 0), write their keys and values to the cache's scratch block, and use no adapter.

Three variants per bucket, chosen per step by :meth:`DecodeGraphs.variant` from the rows' slots: ``base``
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
from typing import TYPE_CHECKING, Optional

import torch

from vlora.atmm.mapping import LoraBatchMapping
from vlora.engine.attention import AttentionMetadata

if TYPE_CHECKING:
    from vlora.engine.model_runner import ModelRunner, SeqInput, ForwardOutput

log = logging.getLogger(__name__)

VARIANTS = ("base", "lora", "mixture")
# Fields of the per-step buffer before the block tables, each max_batch int32 long. _SRC: the row of the
# previous step's sampled ids that holds this row's token (-1: _IDS holds it), for the step overlap.
_IDS, _POS, _SLOT, _LEN, _LORA, _DELORA, _SRC = range(7)
_FIELDS = 7


def smallest_at_least(sizes: tuple[int, ...], n: int) -> Optional[int]:
    """The first of the ascending ``sizes`` that holds ``n`` (a captured bucket), None if none does."""
    for b in sizes:
        if b >= n:
            return b
    return None


def _static_mapping(indptr: torch.Tensor, slots: torch.Tensor, n: int) -> LoraBatchMapping:
    """A per-row mapping over fixed buffers (one segment per row). Its host tuples are placeholders: the
    ``rows`` path of the LoRA backends reads the device buffers only."""
    return LoraBatchMapping(seg_indptr=indptr[:n + 1], seg_slot=slots[:n], seg_indptr_host=tuple(range(n + 1)),
                            seg_slot_host=(0,) * n, num_tokens=n, has_lora=True)


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", sizes: tuple[int, ...], max_model_len: int) -> None:
        self.runner = runner
        self.sizes = tuple(sorted(set(sizes)))
        self.max_batch = self.sizes[-1]
        kv = runner.kv
        self.max_blocks = -(-max_model_len // kv.block_size)
        n = self.max_batch
        dev = runner.device
        self.host = torch.zeros(_FIELDS * n + n * self.max_blocks, dtype=torch.int32).pin_memory()
        self.host_np = self.host.numpy()
        self.buf = torch.zeros_like(self.host, device=dev)
        self.indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.prev = torch.zeros(n, dtype=torch.int64, device=dev)  # the previous step's sampled ids (_SRC reads them)
        with torch.cuda.device(dev):
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.pool = None
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.memory_bytes = 0
        self.capture_s = 0.0
        self.replays: Counter = Counter()  # (bucket, variant) -> replays

    def field(self, i: int, n: int) -> torch.Tensor:
        return self.buf[i * self.max_batch:i * self.max_batch + n]

    def tables(self, n: int) -> torch.Tensor:
        off = _FIELDS * self.max_batch
        return self.buf[off:off + self.max_batch * self.max_blocks].view(self.max_batch, self.max_blocks)[:n]

    # -- which steps replay ----------------------------------------------------------------------
    def bucket(self, n: int) -> Optional[int]:
        return smallest_at_least(self.sizes, n)

    def serves(self, seqs: list["SeqInput"]) -> bool:
        return (len(seqs) <= self.max_batch and all(len(s.token_ids) == 1 and s.pixel_values is None for s in seqs)
                and all(s.start_pos < self.max_blocks * self.runner.kv.block_size for s in seqs))

    @staticmethod
    def variant(seqs: list["SeqInput"]) -> str:
        if any(s.delora_slot >= 0 for s in seqs):
            return "mixture"
        return "lora" if any(s.slot >= 0 for s in seqs) else "base"

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

    def _dummy_fill(self, b: int) -> None:
        """A valid step for capture: every row one token at the scratch slot, no adapter."""
        kv = self.runner.kv
        n, h = self.max_batch, self.host_np
        self._copied.synchronize()
        h[:] = 0
        h[_SLOT * n:_SLOT * n + n] = kv.scratch_slot
        h[_LEN * n:_LEN * n + n] = 1
        h[_LORA * n:_LORA * n + 3 * n] = -1  # _LORA, _DELORA, _SRC
        tables = h[_FIELDS * n:].reshape(n, self.max_blocks)
        tables[:, 0] = kv.scratch_block
        self.buf.copy_(self.host, non_blocking=True)
        self._copied.record()

    def _capture(self, b: int, variant: str) -> None:
        r = self.runner
        self._dummy_fill(b)
        side = torch.cuda.Stream(r.device)
        side.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: lazy initialisation and autotuning stay out of the graph
                self._body(b, variant)
        torch.cuda.current_stream(r.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # thread_local: CUDA calls of other threads (the adapter loader's pinned copies) must not void it.
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            logits, hidden = self._body(b, variant)
        self.graphs[(b, variant)] = (g, logits, hidden)

    def _body(self, b: int, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        kv = r.kv
        src = self.field(_SRC, b).long()
        ids = torch.where(src >= 0, self.prev.index_select(0, src.clamp(min=0)).clamp(min=0), self.field(_IDS, b).long())
        positions = self.field(_POS, b).long()
        slot_mapping = self.field(_SLOT, b).long()
        meta = AttentionMetadata(block_tables=self.tables(b), seq_lens=self.field(_LEN, b))
        scale = r._attn_scale

        def attend(q: torch.Tensor, li: int) -> torch.Tensor:
            return r.attention.decode(q, kv.k[li], kv.v[li], meta, scale, kv.block_size)

        ctx = r.lora_ctx
        ctx.rows = True
        ctx.mapping = _static_mapping(self.indptr, self.field(_LORA, b), b) if variant != "base" else None
        ctx.delora = _static_mapping(self.indptr, self.field(_DELORA, b), b) if variant == "mixture" else None
        try:
            return r._decoder(r.lm.embed_tokens(ids), positions, slot_mapping, attend, None)
        finally:
            ctx.rows = False
            ctx.mapping = ctx.delora = None

    # -- replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list["SeqInput"], prev_tokens: Optional[torch.Tensor] = None) -> "ForwardOutput":
        from vlora.engine.model_runner import ForwardOutput

        r = self.runner
        kv = r.kv
        n = len(seqs)
        b = self.bucket(n)
        variant = self.variant(seqs)
        if (b, variant) not in self.graphs:
            self._capture(b, variant)
        g, logits, hidden = self.graphs[(b, variant)]
        m, h, bs = self.max_batch, self.host_np, kv.block_size
        self._copied.synchronize()  # the previous step's copy has read the host buffer
        tables = h[_FIELDS * m:].reshape(m, self.max_blocks)
        for i, s in enumerate(seqs):
            p = s.start_pos
            t = s.blocks.table()
            h[_IDS * m + i] = s.token_ids[0]
            h[_SRC * m + i] = s.pending_row
            h[_POS * m + i] = p + s.rope_delta
            h[_SLOT * m + i] = t[p // bs] * bs + p % bs
            h[_LEN * m + i] = p + 1
            h[_LORA * m + i] = s.slot
            h[_DELORA * m + i] = s.delora_slot
            tables[i, :len(t)] = t
        if b > n:  # padding rows: no context, scratch slot, no adapter
            h[_IDS * m + n:_IDS * m + b] = 0
            h[_POS * m + n:_POS * m + b] = 0
            h[_SLOT * m + n:_SLOT * m + b] = kv.scratch_slot
            h[_LEN * m + n:_LEN * m + b] = 0
            h[_LORA * m + n:_LORA * m + b] = -1
            h[_DELORA * m + n:_DELORA * m + b] = -1
            h[_SRC * m + n:_SRC * m + b] = -1
        self.buf.copy_(self.host, non_blocking=True)
        if prev_tokens is not None and any(s.pending_row >= 0 for s in seqs):
            self.prev[:prev_tokens.shape[0]].copy_(prev_tokens)
        self._copied.record()
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


def fill_prefill_host(ln, im, seqs: list["SeqInput"], b: int, T: int, S: int, max_blocks: int, kv) -> bool:
    """Write one prefill step into :class:`PrefillGraphs`' host buffers for the ``b``-token graph; returns
    whether a sequence reads its token from the previous step (``pending_row``).

    ``ln`` int64 [4 T + S]: token ids, positions, KV slots (-1: padding, nothing written), the previous
    step's row per token (-1: none), then each sequence's last-token row (padding sequences: 0).
    ``im`` int32 [2 S + 1 + S max_blocks]: query offsets (padding sequences: empty at the end), context
    lengths (padding: 0), block tables. Entries past what a sequence reads are left as they were."""
    import numpy as np

    bs = kv.block_size
    lengths = [len(s.token_ids) for s in seqs]
    n, ns = sum(lengths), len(seqs)
    if n > b or b > T or ns > S:
        raise ValueError(f"fill_prefill_host: {n} tokens of {ns} sequences for a {b}-token graph ({T}, {S} max)")
    cu = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:ns + 1])
    cu[ns + 1:] = n  # padding sequences: no tokens
    tables = im[2 * S + 1:].reshape(S, max_blocks)
    pending = False
    for i, s in enumerate(seqs):
        a, e, p = int(cu[i]), int(cu[i + 1]), s.start_pos
        ln[a:e] = s.token_ids
        ln[T + a:T + e] = np.arange(p + s.rope_delta, p + s.rope_delta + lengths[i])
        ln[2 * T + a:2 * T + e] = kv.slots(s.blocks, p, p + lengths[i])
        ln[3 * T + a:3 * T + e] = -1
        if s.pending_row >= 0:
            ln[3 * T + a] = s.pending_row
            pending = True
        nb = -(-(p + lengths[i]) // bs)
        tables[i, :nb] = s.blocks.table()[:nb]
        im[S + 1 + i] = p + lengths[i]
    ln[T + n:T + b] = 0
    ln[2 * T + n:2 * T + b] = -1  # padding tokens write no KV
    ln[4 * T:4 * T + ns] = cu[1:ns + 1] - 1
    ln[4 * T + ns:4 * T + S] = 0
    im[:S + 1] = cu
    im[S + 1 + ns:2 * S + 1] = 0
    return pending


class PrefillGraphs:
    """CUDA graphs of the decoder for steps that hold a prefill, one per token-count bucket.

    An eager prefill issues about ten launches per layer from Python, and at a few hundred tokens its host
    is slower than its GPU (600 tokens on an H200: 14-15 ms of wall against 12.3 ms of kernels). A replay
    issues them all at once. What a step brings varies, so the graph starts after the embedding: the
    step's token ids are embedded (and their images put in) eagerly into a fixed hidden-state buffer, and
    the graph runs every decoder layer, the final norm and the LM head at the sequences' last tokens.
    Fixed buffers hold positions, KV slots, the sequences' query offsets, context lengths and block
    tables (as wide as the model's longest context) and the rows to read logits from. Padding tokens
    belong to no sequence: their KV slot is -1 (not written), attention leaves them alone, and every
    other kernel works row by row, so they touch no real row. Padding sequences have no tokens.

    Served: steps with no LoRA work (base requests, merged mode) and 1-D positions (no M-RoPE prompt
    with images), at most ``max_seqs`` sequences, ``max_tokens`` tokens. Everything else runs eagerly.
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
        T, S = self.max_tokens, max_seqs
        # int64: ids, positions, KV slots, the previous step's row (step overlap); then the logit rows
        self.lhost = torch.zeros(4 * T + S, dtype=torch.int64).pin_memory()
        self.lnp = self.lhost.numpy()
        self.lbuf = torch.zeros_like(self.lhost, device=dev)
        # int32: query offsets [S + 1], context lengths [S], block tables [S, max_blocks]
        self.ihost = torch.zeros(2 * S + 1 + S * self.max_blocks, dtype=torch.int32).pin_memory()
        self.inp = self.ihost.numpy()
        self.ibuf = torch.zeros_like(self.ihost, device=dev)
        self.hidden = torch.zeros(T, runner.lm.embed_tokens.weight.shape[1], dtype=runner.dtype, device=dev)
        with torch.cuda.device(dev):
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.pool = pool
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.memory_bytes = 0
        self.replays: Counter = Counter()  # bucket -> replays

    def _l(self, i: int, n: int) -> torch.Tensor:
        return self.lbuf[i * self.max_tokens:i * self.max_tokens + n]

    def _meta(self, b: int) -> AttentionMetadata:
        S = self.max_seqs
        return AttentionMetadata(block_tables=self.ibuf[2 * S + 1:].view(S, self.max_blocks), seq_lens=self.ibuf[S + 1:2 * S + 1],
                                 cu_seqlens_q=self.ibuf[:S + 1], max_q_len=b)

    def bucket(self, n: int) -> Optional[int]:
        return smallest_at_least(self.sizes, n)

    def serves(self, seqs: list["SeqInput"]) -> bool:
        if not self.sizes or len(seqs) > self.max_seqs:
            return False
        total = 0
        limit = self.max_blocks * self.runner.kv.block_size
        for s in seqs:
            if s.slot >= 0 or s.delora_slot >= 0 or s.start_pos + len(s.token_ids) > limit:
                return False
            if s.mrope_positions is not None and s.start_pos < s.mrope_positions.shape[1]:
                return False
            total += len(s.token_ids)
        return 0 < total <= self.max_tokens

    # -- capture ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> None:
        if not self.sizes:
            return
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        free0, reserved0 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        for i, b in enumerate(reversed(self.sizes)):  # largest first: smaller graphs reuse its memory
            self._capture(b)
            if (i + 1) % 8 == 0 or i + 1 == len(self.sizes):
                log.info("CUDA graphs: captured %d/%d prefill graphs (%.1f s)", i + 1, len(self.sizes),
                         time.perf_counter() - t0)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = max(0, free0 - torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev) - reserved0)
        log.info("CUDA graphs: %d prefill graphs (%d to %d tokens, up to %d sequences) in %.1f s, "
                 "%.0f MiB of device memory more", len(self.sizes), self.sizes[0], self.sizes[-1],
                 self.max_seqs, self.capture_s, self.memory_bytes / 2**20)

    def _dummy_fill(self, b: int) -> None:
        """A valid step of ``b`` tokens for capture: one sequence of every token of the bucket, whose keys all
        come from the cache's scratch block; nothing is written to the cache (every slot -1). (The sequence
        must not be longer than the bucket: attention would read and write query rows past its ``b``.)"""
        kv = self.runner.kv
        T, S = self.max_tokens, self.max_seqs
        self._copied.synchronize()
        self.lnp[:] = 0
        self.lnp[2 * T:3 * T] = -1  # slots: nothing written
        self.lnp[3 * T:4 * T] = -1
        self.inp[:] = 0
        self.inp[1:S + 1] = b  # sequence 0 has every token of the bucket
        self.inp[S + 1] = b
        self.inp[2 * S + 1:2 * S + 1 + self.max_blocks] = kv.scratch_block
        self.lbuf.copy_(self.lhost, non_blocking=True)
        self.ibuf.copy_(self.ihost, non_blocking=True)
        self._copied.record()

    def _capture(self, b: int) -> None:
        r = self.runner
        self._dummy_fill(b)
        side = torch.cuda.Stream(r.device)
        side.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: Triton compiles and cuBLAS picks its kernels outside the capture
                self._body(b)
        torch.cuda.current_stream(r.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            logits, hidden = self._body(b)
        self.graphs[b] = (g, logits, hidden)

    def _body(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        kv = r.kv
        meta = self._meta(b)
        scale = r._attn_scale

        def attend(q: torch.Tensor, li: int) -> torch.Tensor:
            return r.attention.prefill(q, kv.k[li], kv.v[li], meta, scale, kv.block_size)

        ctx = r.lora_ctx
        ctx.mapping = ctx.delora = None
        T = self.max_tokens
        last = self.lbuf[4 * T:4 * T + self.max_seqs]
        return r._decoder(self.hidden[:b], self._l(1, b), self._l(2, b), attend, last)

    # -- replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list["SeqInput"], prev_tokens: Optional[torch.Tensor] = None) -> "ForwardOutput":
        from vlora.engine.model_runner import ForwardOutput

        r = self.runner
        kv = r.kv
        T, S = self.max_tokens, self.max_seqs
        lengths = [len(s.token_ids) for s in seqs]
        n, ns = sum(lengths), len(seqs)
        b = self.bucket(n)
        if b not in self.graphs:
            self._capture(b)
        g, logits, hidden = self.graphs[b]
        self._copied.synchronize()  # the previous step's copies have read the host buffers
        pending = fill_prefill_host(self.lnp, self.inp, seqs, b, T, S, self.max_blocks, kv)
        self.lbuf.copy_(self.lhost, non_blocking=True)
        self.ibuf.copy_(self.ihost, non_blocking=True)
        self._copied.record()
        ids = self._l(0, n)
        if pending:
            if prev_tokens is None:
                raise ValueError("a sequence reads its token from the previous step, but prev_tokens is None")
            src = self._l(3, n)
            ids = torch.where(src >= 0, prev_tokens.index_select(0, src.clamp(min=0)).clamp(min=0), ids)
        self.hidden[:n].copy_(r.lm.embed_tokens(ids))
        if b > n:
            self.hidden[n:b].zero_()  # padding rows start clean each step
        n_enc = r._insert_images(seqs, ids, self.hidden[:n])
        g.replay()
        self.replays[b] += 1
        return ForwardOutput(logits=logits[:ns], hidden=hidden[:ns], num_images_encoded=n_enc)
