"""The step plan: everything one decoder step reads, written in one place for eager and graphed steps alike.

:meth:`PlanBuilder.build` fills a pinned host staging buffer from the step's sequences (token ids, the
previous step's rows for the step overlap, positions (1-D or M-RoPE's three axes), KV slot mapping, each
sequence's last-token row, query offsets, context lengths, the LoRA segments of the step and of deLoRA's
subtraction, block tables) and copies the part it used to one device buffer in one transfer. The
:class:`StepPlan` it returns holds views of that device buffer: the eager forward reads them, and a CUDA
graph was captured reading the views of its bucket's :class:`Layout`, which a replay's build fills.

A :class:`Layout` is a function of the step's padded shape (tokens ``T``, sequences ``S``, block-table
width ``W``, M-RoPE or not) only, so the graph of a bucket reads the same addresses at every replay:

    int64: ids [T] | src [T] | slot_mapping [T] | last_index [S] | positions [T] or [3, T]
    int32: cu_seqlens_q [S+1] | seq_lens [S] | lora indptr [S+1] | lora slot [S] | delora indptr [S+1]
           | delora slot [S] | block_tables [S, W]

(each field starts on 16 bytes). Steps run in one of three shapes (:class:`PlanShape`):
- eager: no padding; LoRA segments are runs of neighbouring sequences of one slot;
- a decode graph of ``b`` rows: one token per row, padding rows read no context (length 0) and write their
  keys and values to the cache's scratch slot; LoRA per row (segment i is row i), padding rows no adapter;
- a prefill graph of ``b`` tokens over ``max_seqs`` sequences: padding tokens belong to no sequence (KV slot
  -1: nothing written), padding sequences are empty at the end; LoRA per sequence (segment i is sequence
  i, its bounds the query offsets), padding sequences no adapter.

The host staging is double-buffered: a build waits (on CUDA) for the copy of two steps ago, which has
long finished, before it writes that buffer again. The device buffer grows when a step needs more than
it holds; layouts made before keep the buffer they view (a captured graph keeps its addresses).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

from vlora.atmm.mapping import LoraBatchMapping, segment_runs
from vlora.engine.attention import AttentionMetadata

if TYPE_CHECKING:
    from vlora.engine.kv_cache import PagedKVCache

SeqInput = Any  # vlora.engine.model_runner.SeqInput (which imports this module)

EAGER, DECODE_GRAPH, PREFILL_GRAPH = "eager", "decode-graph", "prefill-graph"


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


class Layout:
    """Element offsets of one padded step shape in the plan buffer, and (made once per layout) the device
    views every reader takes. ``n_bytes``: the prefix of the buffer a step of this shape uses."""

    __slots__ = ("T", "S", "W", "mrope", "ids", "src", "slot", "last", "pos", "cu", "lens", "pi", "ps", "di", "ds",
                 "tables", "n_bytes", "dev", "d_ids", "d_src", "d_slot", "d_last", "d_pos", "d_cu", "d_lens",
                 "d_tables", "_lora_views", "plan")

    def __init__(self, T: int, S: int, W: int, mrope: bool = False) -> None:
        self.T, self.S, self.W, self.mrope = T, S, W, mrope
        o = 0  # int64 elements, each field on 16 bytes
        self.ids, o = o, _up(o + T, 2)
        self.src, o = o, _up(o + T, 2)
        self.slot, o = o, _up(o + T, 2)
        self.last, o = o, _up(o + S, 2)
        self.pos, o = o, _up(o + (3 * T if mrope else T), 2)
        o *= 2  # int32 elements from here, each field on 16 bytes
        self.cu, o = o, _up(o + S + 1, 4)
        self.lens, o = o, _up(o + S, 4)
        self.pi, o = o, _up(o + S + 1, 4)
        self.ps, o = o, _up(o + S, 4)
        self.di, o = o, _up(o + S + 1, 4)
        self.ds, o = o, _up(o + S, 4)
        self.tables, o = o, o + S * W
        self.n_bytes = _up(4 * o, 16)
        self.dev: Optional[torch.Tensor] = None
        self.plan: Optional["StepPlan"] = None  # a decode graph's plan: its views never change, made once

    def bind(self, dev: torch.Tensor) -> "Layout":
        """Make the device views of ``dev`` (uint8, at least :attr:`n_bytes`) once."""
        T, S = self.T, self.S
        d64, d32 = dev.view(torch.int64), dev.view(torch.int32)
        self.dev = dev[:self.n_bytes]
        self.d_ids, self.d_src, self.d_slot = d64[self.ids:self.ids + T], d64[self.src:self.src + T], d64[self.slot:self.slot + T]
        self.d_last = d64[self.last:self.last + S]
        self.d_pos = d64[self.pos:self.pos + 3 * T].view(3, T) if self.mrope else d64[self.pos:self.pos + T]
        self.d_cu, self.d_lens = d32[self.cu:self.cu + S + 1], d32[self.lens:self.lens + S]
        self.d_tables = d32[self.tables:self.tables + S * self.W].view(S, self.W)
        self._lora_views = (d32[self.pi:self.pi + S + 1], d32[self.ps:self.ps + S], d32[self.di:self.di + S + 1],
                            d32[self.ds:self.ds + S])
        return self

    def lora_views(self, n_seg: int, delora: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(indptr [n_seg + 1], slot [n_seg]) device views of the step's LoRA segments (``delora``: deLoRA's)."""
        pi, ps, di, ds = self._lora_views
        return (di[:n_seg + 1], ds[:n_seg]) if delora else (pi[:n_seg + 1], ps[:n_seg])

    def attention(self, S: int, max_q_len: int, decode_only: bool, fresh: bool,
                  q_lens: tuple[int, ...] = ()) -> AttentionMetadata:
        return AttentionMetadata(block_tables=self.d_tables[:S], seq_lens=self.d_lens[:S],
                                 cu_seqlens_q=None if decode_only else self.d_cu[:S + 1], max_q_len=max_q_len,
                                 fresh_rows=self.d_slot if fresh else None, q_lens=q_lens)


@dataclass
class StepPlan:
    """One step's inputs on the device, views of the plan buffer (:class:`PlanBuilder`); the layers only read it.

    Shape: ids, slot_mapping [T] int64; positions [T] (or [3, T], M-RoPE) int64; last_index [S] int64 (each
    sequence's last new token in the packed batch); ``src`` [T] int64: the row of the previous step's sampled
    ids that holds a token (-1: ``ids`` holds it), None where no sequence reads one (eager steps); ``attn``:
    cu_seqlens_q [S+1] (None in a decode-only step), seq_lens [S] (context length after this step) and
    block_tables [S, W] int32 (:mod:`vlora.engine.attention`). ``lora``/``delora``: the step's LoRA segments
    and deLoRA's (None: no such work). ``num_tokens``: the step's real tokens (a graph's bucket may be larger).
    """

    ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    last_index: torch.Tensor
    attn: AttentionMetadata
    decode_only: bool
    lora: Optional[LoraBatchMapping]
    delora: Optional[LoraBatchMapping]
    src: Optional[torch.Tensor] = None
    num_tokens: int = 0
    pending: bool = False  # a sequence reads its token from the previous step


@dataclass(frozen=True)
class PlanShape:
    """How a step is padded: ``kind`` (:data:`EAGER`, :data:`DECODE_GRAPH`, :data:`PREFILL_GRAPH`) and, for a
    graph, its layout (bucket tokens, sequences, block-table width)."""

    kind: str = EAGER
    layout: Optional[Layout] = None


def sequence_mapping(layout: Layout, delora: bool = False) -> LoraBatchMapping:
    """A prefill graph's LoRA mapping over ``layout``: segment i is sequence i (bounds and slots in the plan's
    LoRA fields, the padding sequences empty and without an adapter). Its host tuples are placeholders: the
    backends' ``rows`` path reads the device buffers only (``even`` False: the bounds vary per step)."""
    S = layout.S
    indptr, slots = layout.lora_views(S, delora)
    return LoraBatchMapping(seg_indptr=indptr, seg_slot=slots, seg_indptr_host=(0,) * (S + 1), seg_slot_host=(0,) * S,
                            num_tokens=layout.T, has_lora=True, even=False)


def row_mapping(layout: Layout, indptr: torch.Tensor, n: int, delora: bool = False) -> LoraBatchMapping:
    """A decode graph's per-row LoRA mapping over ``layout``'s slot field (segment i is row i; ``indptr``: the
    builder's constant 0, 1, ..., :attr:`PlanBuilder.row_indptr`). Its host tuples are placeholders: the
    backends' ``rows`` path reads the device buffers only."""
    _, slots = layout.lora_views(n, delora)
    return LoraBatchMapping(seg_indptr=indptr[:n + 1], seg_slot=slots, seg_indptr_host=tuple(range(n + 1)),
                            seg_slot_host=(0,) * n, num_tokens=n, has_lora=True)


class PlanBuilder:
    """The one writer of the step plan (see the module docstring). :meth:`graph_layouts` sizes the device buffer
    for the largest layout a graph family will capture, before capture."""

    def __init__(self, device: torch.device, kv: Optional["PagedKVCache"], n_bytes: int = 1 << 16) -> None:
        self.device, self.kv = device, kv
        self.cuda = device.type == "cuda"
        self._arange = np.arange(4097, dtype=np.int32)
        self._host: list[torch.Tensor] = []
        self._h64: list[np.ndarray] = []
        self._h32: list[np.ndarray] = []
        self._events: list = []
        self._turn = 0
        self.dev: Optional[torch.Tensor] = None
        self.row_indptr = torch.arange(1, dtype=torch.int32, device=device)  # decode graphs' per-row segments
        self._retired: list[torch.Tensor] = []
        self._aux_dev: Optional[torch.Tensor] = None  # segment_mappings' buffer
        self._aux_host: list[torch.Tensor] = []
        self._aux_events: list = []
        self._aux_turn = 0
        self._grow(n_bytes)

    def _grow(self, n_bytes: int) -> None:
        with torch.inference_mode(False):  # normal tensors, even when a step inside inference mode grows them
            self._allocate(n_bytes)

    def _allocate(self, n_bytes: int) -> None:
        n_bytes = _up(max(n_bytes, 1 << 12), 1 << 12)
        self._eager: dict[tuple, Layout] = {}  # bound to the buffer being replaced: made again on the new one
        self._host, self._h64, self._h32, self._events = [], [], [], []
        for _ in range(2):
            h = torch.zeros(n_bytes, dtype=torch.uint8)
            if self.cuda:
                h = h.pin_memory()
            self._host.append(h)
            arr = h.numpy()
            self._h64.append(arr.view(np.int64))
            self._h32.append(arr.view(np.int32))
            if self.cuda:
                with torch.cuda.device(self.device):
                    self._events.append(torch.cuda.Event())
        self.dev = torch.zeros(n_bytes, dtype=torch.uint8, device=self.device)

    @property
    def capacity(self) -> int:
        return self.dev.numel()

    def graph_layouts(self, shapes: Sequence[tuple[int, int, int]], mrope: bool = False) -> list[Layout]:
        """Layouts of a graph family's buckets (T, S, W), bound to one buffer that holds the largest (grown
        first where needed): made once, before capture. ``mrope``: positions on M-RoPE's three axes (a
        prefill graph of a Qwen2-VL model; its text-only prompts write one position on all three)."""
        lays = [Layout(T, S, W, mrope) for T, S, W in shapes]
        most = max((S for _, S, _ in shapes), default=0) + 1
        if most > len(self._arange):
            self._arange = np.arange(most, dtype=np.int32)
        if most > self.row_indptr.numel():
            self._retired.append(self.row_indptr)  # graphs captured on it keep reading it: never freed
            with torch.inference_mode(False):
                self.row_indptr = torch.arange(most, dtype=torch.int32, device=self.device)
        need = max((lay.n_bytes for lay in lays), default=0)
        if need > self.capacity:
            self._grow(need)
        return [lay.bind(self.dev) for lay in lays]

    def layout(self, T: int, S: int, W: int, mrope: bool = False) -> Layout:
        """An eager step's layout, bound to the current device buffer (grown first where it is too small);
        the views of a shape seen lately are made once (a bounded set: steps of one shape repeat)."""
        key = (T, S, W, mrope)
        lay = self._eager.get(key)
        if lay is None:
            lay = Layout(T, S, W, mrope)
            if lay.n_bytes > self.capacity:
                self._grow(2 * lay.n_bytes)
            if len(self._eager) >= 512:
                self._eager.clear()
            lay = self._eager[key] = lay.bind(self.dev)
        return lay

    def _staging(self) -> tuple[torch.Tensor, np.ndarray, np.ndarray, int]:
        i = self._turn
        self._turn ^= 1
        if self.cuda:
            self._events[i].synchronize()  # the copy from this buffer two builds ago has read it
        return self._host[i], self._h64[i], self._h32[i], i

    def _copy(self, host: torch.Tensor, i: int, lay: Layout) -> None:
        n = lay.n_bytes
        if n > host.numel():
            raise RuntimeError(f"step plan: a {n}-byte layout outgrew the {host.numel()}-byte staging buffer")
        lay.dev.copy_(host[:n], non_blocking=True)
        if self.cuda:
            self._events[i].record()

    def dummy(self, kind: str, lay: Layout, b: int) -> None:
        """A valid step for a graph's capture (the builder writes every plan, this one too). Decode: every row
        one token at the scratch slot, context 1 from the scratch block, no adapter. Prefill: one sequence of
        the bucket's ``b`` tokens whose keys all come from the scratch block; nothing is written to the cache
        (every KV slot -1)."""
        kv = self.kv
        host, h64, h32, turn = self._staging()
        T, S, W = lay.T, lay.S, lay.W
        h64[lay.ids:lay.ids + T] = 0
        h64[lay.src:lay.src + T] = -1
        h64[lay.pos:lay.pos + (3 * T if lay.mrope else T)] = 0
        h64[lay.last:lay.last + S] = 0
        h32[lay.tables:lay.tables + S * W] = 0
        if kind == DECODE_GRAPH:
            h64[lay.slot:lay.slot + T] = kv.scratch_slot
            h32[lay.lens:lay.lens + S] = 1
            h32[lay.cu:lay.cu + S + 1] = self._arange[:S + 1]
            h32[lay.tables:lay.tables + S * W:W] = kv.scratch_block
        else:
            h64[lay.slot:lay.slot + T] = -1
            h32[lay.lens:lay.lens + S] = 0
            h32[lay.lens] = b
            h32[lay.cu] = 0
            h32[lay.cu + 1:lay.cu + S + 1] = b
            h32[lay.tables:lay.tables + W] = kv.scratch_block
            for at in (lay.pi, lay.di):  # LoRA segments: the one sequence (no adapter), the rest empty
                h32[at:at + S + 1] = h32[lay.cu:lay.cu + S + 1]
        for at in (lay.ps, lay.ds):
            h32[at:at + S] = -1
        self._copy(host, turn, lay)

    # -- the one writer ------------------------------------------------------------------------------
    def build(self, seqs: Sequence[SeqInput], shape: PlanShape = PlanShape(), *, lora: bool = True) -> StepPlan:
        """Write ``seqs`` into the staging buffer laid out as ``shape`` says, copy it to the device, and return
        the step's plan. ``lora``: whether an eager step describes its LoRA segments (False: the runner runs no
        LoRA, e.g. a prefill graph's step)."""
        if not seqs:
            raise ValueError("forward: empty step")
        if self.kv is None:
            raise RuntimeError("forward: no KV cache (call allocate_kv first)")
        if shape.kind == DECODE_GRAPH:
            return self._decode_graph(seqs, shape.layout)
        return self._packed(seqs, shape, lora)

    def _decode_graph(self, seqs: Sequence[SeqInput], lay: Layout) -> StepPlan:
        """One token per row, padded to the bucket (hot: a replayed decode step's whole host work)."""
        kv = self.kv
        bs = kv.block_size
        host, h64, h32, turn = self._staging()
        n, b, W = len(seqs), lay.T, lay.W
        ids, src, pos, slot = lay.ids, lay.src, lay.pos, lay.slot
        lens, ps, ds, tab = lay.lens, lay.ps, lay.ds, lay.tables
        pending = False
        for i, s in enumerate(seqs):
            p = s.start_pos
            t = s.blocks.table()
            h64[ids + i] = s.token_ids[0]
            h64[src + i] = s.pending_row
            h64[pos + i] = p + s.rope_delta
            h64[slot + i] = t[p // bs] * bs + p % bs
            h32[lens + i] = p + 1
            h32[ps + i] = s.slot
            h32[ds + i] = s.delora_slot
            h32[tab + i * W:tab + i * W + len(t)] = t
            pending |= s.pending_row >= 0
        if b > n:  # padding rows: no context, the scratch slot, no adapter
            h64[ids + n:ids + b] = 0
            h64[src + n:src + b] = -1
            h64[pos + n:pos + b] = 0
            h64[slot + n:slot + b] = kv.scratch_slot
            h32[lens + n:lens + b] = 0
            h32[ps + n:ps + b] = -1
            h32[ds + n:ds + b] = -1
        self._copy(host, turn, lay)
        plan = lay.plan
        if plan is None:  # the graph's views, made once (what its capture read)
            plan = lay.plan = StepPlan(ids=lay.d_ids, positions=lay.d_pos, slot_mapping=lay.d_slot,
                                       last_index=lay.d_last, attn=lay.attention(b, 1, True, False),
                                       decode_only=True, lora=None, delora=None, src=lay.d_src)
        plan.num_tokens, plan.pending = n, pending
        return plan

    def _packed(self, seqs: Sequence[SeqInput], shape: PlanShape, lora: bool) -> StepPlan:
        """An eager step (its own shape), or a prefill graph's (padded to its bucket's layout)."""
        kv = self.kv
        bs = kv.block_size
        lengths = [len(s.token_ids) for s in seqs]
        n, ns = sum(lengths), len(seqs)
        ends = [s.start_pos + m for s, m in zip(seqs, lengths)]
        graph = shape.kind == PREFILL_GRAPH
        mrope = shape.layout.mrope if graph else any(
            s.mrope_positions is not None and s.start_pos < s.mrope_positions.shape[1] for s in seqs)
        if graph:
            lay = shape.layout
            if n > lay.T or ns > lay.S:
                raise ValueError(f"step plan: {n} tokens of {ns} sequences for a {lay.T}-token graph "
                                 f"({lay.S} sequences max)")
        else:
            lay = self.layout(n, ns, max(-(-e // bs) for e in ends), mrope)
        T, S, W = lay.T, lay.S, lay.W
        host, h64, h32, turn = self._staging()
        cu = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:ns + 1])
        cu[ns + 1:] = n  # padding sequences (a graph's): no tokens
        pending = False
        pos_axes = h64[lay.pos:lay.pos + 3 * T].reshape(3, T) if mrope else None
        for i, s in enumerate(seqs):
            a, e, p, m = int(cu[i]), int(cu[i + 1]), s.start_pos, lengths[i]
            h64[lay.ids + a:lay.ids + e] = s.token_ids
            first = p + s.rope_delta
            if mrope:
                mp = s.mrope_positions
                if mp is not None and p + m <= mp.shape[1]:
                    pos_axes[:, a:e] = mp[:, p:p + m].cpu().numpy()
                else:
                    pos_axes[:, a:e] = np.arange(first, first + m)
            else:
                h64[lay.pos + a:lay.pos + e] = np.arange(first, first + m)
            h64[lay.slot + a:lay.slot + e] = kv.slots(s.blocks, p, p + m)
            if s.pending_row >= 0:
                if not pending:
                    h64[lay.src:lay.src + T] = -1
                    pending = True
                h64[lay.src + a] = s.pending_row
            nb = -(-ends[i] // bs)
            h32[lay.tables + i * W:lay.tables + i * W + nb] = s.blocks.table()[:nb]
        h64[lay.last:lay.last + ns] = cu[1:ns + 1] - 1
        h32[lay.cu:lay.cu + S + 1] = cu
        h32[lay.lens:lay.lens + ns] = ends
        if graph:
            if mrope:
                pos_axes[:, n:] = 0
            else:
                h64[lay.pos + n:lay.pos + T] = 0
            h64[lay.slot + n:lay.slot + T] = -1  # padding tokens write no KV
            h64[lay.last + ns:lay.last + S] = 0
            h32[lay.lens + ns:lay.lens + S] = 0
            # LoRA: one segment per sequence (the query offsets), padding sequences empty and without an adapter
            for at, slot_at, field in ((lay.pi, lay.ps, "slot"), (lay.di, lay.ds, "delora_slot")):
                h32[at:at + S + 1] = cu
                h32[slot_at:slot_at + ns] = [getattr(s, field) for s in seqs]
                h32[slot_at + ns:slot_at + S] = -1
        plus = minus = None
        if lora and not graph:
            plus = self._segments(h32, lay, lengths, [s.slot for s in seqs], False)
            if any(s.delora_slot >= 0 for s in seqs):
                minus = self._segments(h32, lay, lengths, [s.delora_slot for s in seqs], True)
        self._copy(host, turn, lay)
        if plus is not None:
            plus = self._mapping(lay, plus, False)
            minus = self._mapping(lay, minus, True) if minus is not None else None
        decode_only = not graph and max(lengths) == 1
        fresh = not graph and not decode_only and all(s.start_pos == 0 for s in seqs)
        attn = lay.attention(S, T if graph else max(lengths), decode_only, fresh, () if graph else tuple(lengths))
        return StepPlan(ids=lay.d_ids[:n] if graph else lay.d_ids, positions=lay.d_pos, slot_mapping=lay.d_slot,
                        last_index=lay.d_last, attn=attn, decode_only=decode_only, lora=plus, delora=minus,
                        src=(lay.d_src[:n] if graph else lay.d_src) if pending else None, num_tokens=n,
                        pending=pending)

    def segment_mappings(self, groups: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[LoraBatchMapping]:
        """LoRA mappings of (row counts, slots) groups outside the decoder's plan (the vision stages of one
        encoder forward): runs of one slot merged as in a step's segments, written to a small buffer of
        their own (double-buffered pinned staging, one copy for all groups), which stream order keeps from
        the kernels of the forward before."""
        plans, n = [], 0
        for lengths, slots in groups:
            if len(lengths) != len(slots):
                raise ValueError(f"lengths ({len(lengths)}) and slots ({len(slots)}) differ in length")
            segs = segment_runs(lengths, slots)
            plans.append((n, segs))
            n += _up(2 * len(segs[1]) + 1, 4)
        if self._aux_dev is None or 4 * n > self._aux_dev.numel():
            self._allocate_aux(_up(max(8 * n, 1024), 1024))
        i = self._aux_turn
        self._aux_turn ^= 1
        if self.cuda:
            self._aux_events[i].synchronize()
        host = self._aux_host[i]
        h32 = host.numpy().view(np.int32)
        d32 = self._aux_dev.view(torch.int32)
        out = []
        for at, (indptr, seg, has) in plans:
            k = len(seg)
            h32[at:at + k + 1] = indptr
            h32[at + k + 1:at + 2 * k + 1] = seg
            out.append(LoraBatchMapping(seg_indptr=d32[at:at + k + 1], seg_slot=d32[at + k + 1:at + 2 * k + 1],
                                        seg_indptr_host=indptr, seg_slot_host=seg, num_tokens=indptr[-1], has_lora=has))
        self._aux_dev[:4 * n].copy_(host[:4 * n], non_blocking=True)
        if self.cuda:
            self._aux_events[i].record()
        return out

    def _allocate_aux(self, size: int) -> None:
        with torch.inference_mode(False):
            self._aux_host = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]
            if self.cuda:
                self._aux_host = [h.pin_memory() for h in self._aux_host]
                with torch.cuda.device(self.device):
                    self._aux_events = [torch.cuda.Event(), torch.cuda.Event()]
            self._aux_dev = torch.zeros(size, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _segments(h32: np.ndarray, lay: Layout, lengths: list[int], slots: list[int], delora: bool) -> tuple:
        """Runs of neighbouring sequences of one slot, written to the layout's LoRA fields:
        (indptr, slots, has_lora) on the host."""
        indptr, seg, has = segment_runs(lengths, slots)
        at_i, at_s = (lay.di, lay.ds) if delora else (lay.pi, lay.ps)
        h32[at_i:at_i + len(indptr)] = indptr
        h32[at_s:at_s + len(seg)] = seg
        return indptr, seg, has

    @staticmethod
    def _mapping(lay: Layout, segs: tuple, delora: bool) -> LoraBatchMapping:
        indptr, seg, has = segs
        d_i, d_s = lay.lora_views(len(seg), delora)
        return LoraBatchMapping(seg_indptr=d_i, seg_slot=d_s, seg_indptr_host=indptr, seg_slot_host=seg,
                                num_tokens=indptr[-1], has_lora=has)
