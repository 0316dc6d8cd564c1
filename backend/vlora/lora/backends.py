"""The LoRA compute backends, chosen by name: one class per kernel family.

A backend is told each step's LoRA metadata once, by :meth:`LoraBackend.prepare` (the runner binds the
step plan's mappings to the :class:`~vlora.lora.layers.LoraContext`, which calls it): that is where it
validates the step and plans its launches (vLLM's ``LoRAKernelMeta.prepare_tensors`` is the pattern), so
that a layer's call (:meth:`LoraBackend.add`, :meth:`LoraBackend.add_rows`) only launches. The metadata's
device tensors are views of the step plan's buffers (:mod:`vlora.engine.plan`), at fixed addresses.

Every backend serves two kinds of step metadata:
- ``segments``: an eager step's :class:`~vlora.atmm.mapping.LoraBatchMapping` (segments of a packed
  batch, with host copies of the segment bounds), the signature of :func:`vlora.atmm.atmm`;
- ``rows``: a captured step's segments with their bounds and slots in buffers at fixed device addresses:
  of equal, fixed length (a decode graph: one token per row; a vision graph: one image's rows per
  segment) or, in a prefill graph, one per sequence of the bucket, of any length (``mapping.even``
  False; empty padding sequences at the end); slot -1 for segments without an adapter. Nothing in it may
  read device values on the host, so that the step can be captured once and replayed as a CUDA graph
  while the buffers' contents change.

The slot buffers hold ``lora_b`` pre-multiplied by each adapter's scale
(:meth:`vlora.lora.layers.LoraLinear.set_slot`): backends pass a unit scale (``sign``: +1 adds the
delta, -1 takes it out again, deLoRA's mixture mode), so a slot can change adapters without changing
a captured launch's arguments. Ranks in the ``rows`` path are the slot buffers' ``r_max``: the buffers
are zero past each adapter's rank.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from vlora.atmm import atmm, atmm_reference
from vlora.atmm.dispatch import _DTYPES, PHASE_ALL, AtmmKernels, default_kernels
from vlora.atmm.mapping import LoraBatchMapping

log = logging.getLogger(__name__)


def lora_rows_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    row_slot: torch.Tensor, sign: float, seg_indptr: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Graph-safe LoRA in plain PyTorch over S segments, each segment's slot read on the device only: of equal
    length T / S (a decode graph's rows: S = T; a vision graph's images of R rows: gathers each segment's
    adapter, so bytes grow with the segments), or, with ``seg_indptr`` [S+1] (a device buffer), of any lengths
    (a prefill graph's sequences; rows past ``seg_indptr[S]`` untouched): every slot's rank-r product for every
    row, each row keeping its own slot's (n_slots times the FLOPs: a fallback where no kernel serves).

    Semantics: y[rows of segment i] += sign * x @ A[s_i]^T @ B[s_i]^T  for segments with s_i = row_slot[i] >= 0
    Shape: y [T, d_out]  x [T, d_in]  lora_a [n, r, d_in]  lora_b [n, d_out, r]  row_slot [S] int32
    """
    idx = row_slot.clamp(min=0).long()
    S, T = row_slot.shape[0], x.shape[0]
    if seg_indptr is not None:
        n, r = lora_a.shape[0], lora_a.shape[1]
        rows = torch.arange(T, device=x.device, dtype=seg_indptr.dtype)
        seg = torch.searchsorted(seg_indptr[1:].contiguous(), rows, right=True)  # S for rows past the last segment
        slot = torch.where(seg < S, row_slot.index_select(0, seg.clamp(max=S - 1)), -1).long()  # [T], -1: none
        keep = torch.nn.functional.one_hot(slot.clamp(min=0), n).to(x.dtype) * (slot >= 0).to(x.dtype).unsqueeze(1)
        v = (x @ lora_a.reshape(n * r, -1).t()).view(T, n, r) * (keep * sign).unsqueeze(2)  # [T, n, r]
        y += torch.einsum("tnr,nor->to", v, lora_b)
        return y
    if S == T:
        keep = (row_slot >= 0).to(y.dtype).unsqueeze(1) * sign
        v = torch.bmm(lora_a.index_select(0, idx), x.unsqueeze(2))  # [T, r, 1]
        y += torch.bmm(lora_b.index_select(0, idx), v).squeeze(2) * keep
        return y
    keep = (row_slot >= 0).to(y.dtype).view(S, 1, 1) * sign
    v = torch.bmm(x.reshape(S, T // S, -1), lora_a.index_select(0, idx).transpose(1, 2))  # [S, R, r]
    y += (torch.bmm(v, lora_b.index_select(0, idx).transpose(1, 2)) * keep).reshape(T, -1)
    return y


def _rows_torch(y, x, lora_a, lora_b, mapping: LoraBatchMapping, sign: float) -> torch.Tensor:
    """:func:`lora_rows_torch` over a captured step's ``mapping`` (even segments or a prefill graph's)."""
    return lora_rows_torch(y, x, lora_a, lora_b, mapping.seg_slot, sign, None if mapping.even else mapping.seg_indptr)


def lora_padded_einsum(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       ranks: tuple[int, ...], scales: tuple[float, ...], mapping: LoraBatchMapping) -> torch.Tensor:
    """Semantics as :func:`vlora.atmm.atmm` (ranks are padded to r_max: the slot buffers are zero there)."""
    segs = [(mapping.seg_indptr_host[i], mapping.seg_indptr_host[i + 1], s) for i, s in enumerate(mapping.seg_slot_host)
            if s >= 0 and ranks[s] > 0 and mapping.seg_indptr_host[i + 1] > mapping.seg_indptr_host[i]]
    if not segs:
        return y
    longest = max(hi - lo for lo, hi, _ in segs)
    xp = x.new_zeros(len(segs), longest, x.shape[1])
    for i, (lo, hi, _) in enumerate(segs):
        xp[i, : hi - lo] = x[lo:hi]
    idx = torch.tensor([s for _, _, s in segs], device=x.device)
    scale = torch.tensor([scales[s] for _, _, s in segs], dtype=x.dtype, device=x.device)
    v = torch.einsum("sld,srd->slr", xp, lora_a.index_select(0, idx))
    out = torch.einsum("slr,sor->slo", v, lora_b.index_select(0, idx)) * scale.view(-1, 1, 1)
    for i, (lo, hi, _) in enumerate(segs):
        y[lo:hi] += out[i, : hi - lo]
    return y


class LoraBackend:
    """Base class. ``segments`` has :func:`vlora.atmm.atmm`'s signature; ``rows`` is the graph-safe path.
    The engine calls :meth:`prepare` once per step and :meth:`add` / :meth:`add_rows` per layer."""

    name = ""

    def prepare(self, ctx) -> None:
        """The step's metadata (a :class:`~vlora.lora.layers.LoraContext`'s ``mapping``, ``delora`` and
        ``rows``), once per step, before any layer."""

    def add(self, y: torch.Tensor, x: torch.Tensor, layer, mapping: LoraBatchMapping,
            sign: float) -> torch.Tensor:
        """y += sign * the deltas of ``layer``'s slots over ``mapping``'s segments (an eager step)."""
        scales = layer.unit_scales_t if sign > 0 else layer.neg_scales_t
        return self.segments(y, x, layer.lora_a, layer.lora_b, layer.ranks_t, scales, mapping)

    def add_rows(self, y: torch.Tensor, x: torch.Tensor, layer, mapping: LoraBatchMapping,
                 sign: float) -> torch.Tensor:
        """The graph-safe per-row call of a captured decode step (``mapping`` per row, read on the device only)."""
        return self.rows(y, x, layer.lora_a, layer.lora_b, mapping, sign)

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping: LoraBatchMapping) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, y, x, lora_a, lora_b, mapping: LoraBatchMapping, sign: float) -> torch.Tensor:
        return _rows_torch(y, x, lora_a, lora_b, mapping, sign)


class SegmentsBackend(LoraBackend):
    """Any object with ``segments`` and ``rows`` (a benchmark's wrapper of a backend), as a backend: no
    preparation, every call through those two. :class:`~vlora.lora.layers.LoraContext` wraps such objects
    when they are set, once."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, getattr(inner, "name", "")

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        return self.inner.segments(y, x, lora_a, lora_b, ranks, scales, mapping)

    def rows(self, y, x, lora_a, lora_b, mapping, sign):
        return self.inner.rows(y, x, lora_a, lora_b, mapping, sign)


_MISS = object()


class AtmmBackend(LoraBackend):
    """ATMM: the CUDA extension where it serves (fp16/bf16 on CUDA), the PyTorch reference elsewhere.

    Owns its :class:`~vlora.atmm.dispatch.AtmmKernels` (the process's default, which the tuner sidecar
    updates, unless given one), taken once when built, and its launch plans: :meth:`prepare` reads the
    step's segments, its stream and device once; a layer's first call of a step shape plans the launch
    (the tiling table's choice for its width and ranks) and every later call of that shape, in this step
    and the next ones of the same segments, reuses it. A slot buffer pair is checked once by its layer
    (``LoraLinear.atmm_check``). Scales are each layer's per-slot list, filled at adapter load.
    """

    name = "atmm"

    def __init__(self, kernels: Optional[AtmmKernels] = None) -> None:
        self.kernels = kernels if kernels is not None else default_kernels()
        self._plans: dict[tuple, object] = {}  # (segment slots, tokens, layer key) -> plan, or None: refused
        self._version = -1  # the kernels' table_version the plans were made under
        self._workspace: Optional[torch.Tensor] = None
        self._warned: set[tuple] = set()
        self._on = False  # this step's inputs are on CUDA and the extension is there
        self._stream = 0
        self._device: Optional[torch.device] = None  # a device to make current per launch (another GPU's step)

    def prepare(self, ctx) -> None:
        k = self.kernels
        if k.table_version != self._version or len(self._plans) > 8192:
            self._plans.clear()  # a new table (the tuner's): plan again
            self._version = k.table_version
        m = ctx.mapping if ctx.mapping is not None else ctx.delora
        self._on = m is not None and k.ext is not None and m.seg_slot.is_cuda
        if not self._on:
            return
        dev = m.seg_slot.device
        self._stream = torch.cuda.current_stream(dev).cuda_stream
        self._device = dev if dev.index is not None and dev.index != torch.cuda.current_device() else None

    def _serves(self, y: torch.Tensor, x: torch.Tensor, layer) -> bool:
        """The extension takes this call: the layer's buffers passed their check, and the activations are
        its dtype, contiguous rows (y: strided rows of a fused output), 16-byte aligned."""
        why = layer.atmm_check
        if why is None:
            why = layer.atmm_check = self.kernels.check_buffers(layer.lora_a, layer.lora_b)
        a = layer.lora_a
        return (not why and x.dtype == a.dtype and y.dtype == a.dtype and x.device == a.device
                and x.is_contiguous() and y.stride(1) == 1 and y.stride(0) % 8 == 0
                and x.data_ptr() % 16 == 0 and y.data_ptr() % 16 == 0)

    def add(self, y, x, layer, mapping, sign):
        if not (mapping.has_lora and self._on and self._serves(y, x, layer)):
            return super().add(y, x, layer, mapping, sign)
        T = x.shape[0]
        key = (mapping.seg_slot_host, T, layer.atmm_key)
        plan = self._plans.get(key, _MISS)
        if plan is _MISS:
            d_in, d_out, r_max, ranks = layer.atmm_key
            plan = self._plans[key] = self.kernels.plan_call(_DTYPES[y.dtype], T, d_in, d_out, r_max, ranks,
                                                             mapping.num_segments, mapping.seg_slot_host)
        if plan is None:
            return atmm_reference(y, x, layer.lora_a, layer.lora_b, layer.ranks_t,
                                  layer.unit_scales_t if sign > 0 else layer.neg_scales_t, mapping)
        if self._device is not None:
            with torch.cuda.device(self._device):  # the extension launches on the current device
                return self._launch(y, x, layer, mapping, sign, plan, key)
        return self._launch(y, x, layer, mapping, sign, plan, key)

    def _launch(self, y, x, layer, mapping, sign, plan, key) -> torch.Tensor:
        shrink_idx, split_k, expand_idx, ranks_list, need = plan
        ws = self._workspace
        if ws is None or ws.numel() < need:
            # one buffer, grown as needed: launches on one stream never overlap
            ws = self._workspace = torch.empty(max(need, 1 << 20), dtype=torch.uint8, device=y.device)
        d_in, d_out, r_max, _ = layer.atmm_key
        try:
            self.kernels.ext.forward(
                y.data_ptr(), x.data_ptr(), layer.lora_a.data_ptr(), layer.lora_b.data_ptr(),
                mapping.seg_indptr.data_ptr(), mapping.seg_slot.data_ptr(), ws.data_ptr(), ws.numel(),
                x.shape[0], d_in, d_out, r_max, x.stride(0), y.stride(0), mapping.num_segments, ranks_list,
                layer.unit_scales if sign > 0 else layer.neg_scales, _DTYPES[y.dtype],
                shrink_idx, split_k, expand_idx, self._stream, PHASE_ALL, True)
        except RuntimeError as e:
            # y is written only by the expand, the last launch: a refused call left it untouched, and the
            # reference serves this signature from now on. A CUDA error that poisoned the context fails
            # the reference too and reaches the caller.
            self._plans[key] = None
            pair = (shrink_idx, split_k, expand_idx)
            if pair not in self._warned:  # once per kernel pair, not once per token count
                self._warned.add(pair)
                log.warning("atmm: the extension refused a call (%s); the PyTorch reference serves it and "
                            "every later call of the same signature", e)
            return atmm_reference(y, x, layer.lora_a, layer.lora_b, layer.ranks_t,
                                  layer.unit_scales_t if sign > 0 else layer.neg_scales_t, mapping)
        return y

    def add_rows(self, y, x, layer, mapping, sign):
        if self._on and self._serves(y, x, layer):
            if self.kernels.run_rows(y, x, layer.lora_a, layer.lora_b, mapping, sign, stream=self._stream):
                return y
        return _rows_torch(y, x, layer.lora_a, layer.lora_b, mapping, sign)

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        return atmm(y, x, lora_a, lora_b, ranks, scales, mapping, kernels=self.kernels)

    def rows(self, y, x, lora_a, lora_b, mapping, sign):
        if y.is_cuda and self.kernels.ext is not None and not self.kernels.unsupported(
                y, x, lora_a, lora_b, (0,) * lora_a.shape[0], (0.0,) * lora_a.shape[0], mapping):
            if self.kernels.run_rows(y, x, lora_a, lora_b, mapping, sign):
                return y
        return _rows_torch(y, x, lora_a, lora_b, mapping, sign)


class ReferenceBackend(LoraBackend):
    """The PyTorch segment loop that every kernel is tested against."""

    name = "reference"

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        return atmm_reference(y, x, lora_a, lora_b, ranks, scales, mapping)


class PaddedEinsumBackend(LoraBackend):
    """dLoRA's baseline: segments padded to the longest, two batched einsums."""

    name = "padded-einsum"

    def segments(self, y, x, lora_a, lora_b, ranks, scales, mapping):
        return lora_padded_einsum(y, x, lora_a, lora_b, ranks, scales, mapping)


BACKENDS: dict[str, Callable[[], LoraBackend]] = {c.name: c for c in (AtmmBackend, ReferenceBackend, PaddedEinsumBackend)}


def get_lora_backend(name: str) -> LoraBackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown LoRA backend {name!r}; known: {sorted(BACKENDS)}") from None
