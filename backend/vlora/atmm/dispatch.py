"""Dispatch from :func:`vlora.atmm.atmm` to the CUDA extension ``vlora_atmm_ext`` when it can serve.

The extension is optional (``pip install ./csrc`` on a CUDA machine). Without it, or for inputs it
does not support (CPU tensors, fp32, widths not multiples of 8, ...), the PyTorch reference runs.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import torch

from vlora.atmm.reference import atmm_reference
from vlora.atmm.tiling import TABLE_ENV, read_table, resolve_table
from vlora.atmm.mapping import LoraBatchMapping

log = logging.getLogger(__name__)

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
PHASE_PREP, PHASE_SHRINK, PHASE_EXPAND, PHASE_ALL = 1, 2, 4, 7


def load_extension() -> tuple[ModuleType | None, str]:
    """Import the compiled module: (module or None, why not)."""
    try:
        return importlib.import_module("vlora_atmm_ext"), ""
    except ImportError as e:
        return None, f"vlora_atmm_ext not importable: {e}"


# Config-name prefixes of kernel families that are built only where the build could (tile_configs.def):
# the Triton kernels need the triton package at build time, the CUTLASS 3 ones an sm_90a build.
OPTIONAL_FAMILIES = {"tr_": "triton", "h9": "cutlass3"}


class AtmmKernels:
    """The extension, its tiling table, and the checks that decide whether a call can use them.

    The engine's LoRA backend holds one instance, built once (:class:`vlora.lora.backends.AtmmBackend`,
    the process's :func:`default_kernels` unless given one), and plans each step's launches through
    :meth:`plan_call` once per step and layer shape. The table can be swapped while serving (the tuner
    sidecar does this): the swap replaces the table object in one assignment and bumps
    :attr:`table_version`, so a lookup needs no lock and a holder of cached plans knows to drop them.
    """

    def __init__(self, ext: ModuleType | None = None, table_dir: Path | None = None, load_table: bool = True) -> None:
        if ext is None:
            ext, self.unavailable_reason = load_extension()
        else:
            self.unavailable_reason = ""
        self.ext = ext
        self.table_version = 0
        self._table: Any = ext.TilingTable() if ext is not None else None
        self.table_source = "built-in default rule"
        self._table_dir = table_dir
        self._names: tuple[str, ...] = tuple(c["name"] for c in ext.configs()) if ext is not None else ()
        self._kinds: dict[str, str] = {c["name"]: c.get("kind", "") for c in ext.configs()} if ext is not None else {}
        # What the tools' and tests' calls (run(), through atmm()) reuse: the launch plan of a call
        # signature and one growing workspace per device. The engine's backend keeps its own.
        self._plans: dict[tuple, tuple] = {}
        self._workspace: dict[Any, torch.Tensor] = {}
        # Plans of the graph-safe per-row calls (run_rows), each with its own workspace, never freed:
        # a captured CUDA graph keeps the workspace's address.
        self._row_plans: dict[tuple, tuple] = {}
        # A prefill graph's expand by name instead of the table's and mixed_step_expand's (benchmarks/atmm_tables.py
        # --prefill-graph-expand times the candidates); set before the graphs' plans are made.
        self.prefill_graph_expand: str | None = None
        # Call signatures the extension refused (RuntimeError): the PyTorch reference serves them.
        self._refused: dict[tuple, str] = {}
        self._warned: set[tuple] = set()
        # The table file in use (None: the default rule): what a tuner sidecar's entries go over.
        self.table_file: Path | None = None
        if ext is not None and load_table and torch.cuda.is_available():
            path, why = resolve_table(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), table_dir,
                                      os.environ.get(TABLE_ENV))
            if path is not None:
                self.load_table(path)
                self.table_source = f"{path} ({why})"
            else:
                log.info("atmm: %s", why)

    @property
    def available(self) -> bool:
        return self.ext is not None

    @property
    def config_names(self) -> list[str]:
        return list(self._names)

    @property
    def expand_config_names(self) -> list[str]:
        """The compiled configs that serve the expand direction."""
        return [c["name"] for c in self.ext.configs() if c.get("expand")] if self.ext is not None else []

    def load_table(self, path: Path, overlay: Path | None = None) -> int:
        """Load ``path`` into a fresh table and swap it in; with ``overlay``, its entries replace the
        ones of the same shape (a tuner run that covered part of the grid). Raises ValueError naming
        a refused entry."""
        _, entries = read_table(Path(path))
        source = str(path)
        if overlay is not None:
            _, tuned = read_table(Path(overlay))
            key = lambda e: (e.direction, e.dtype, e.tokens, e.width, e.rank, e.segments)  # noqa: E731
            merged = {key(e): e for e in entries}
            merged.update((key(e), e) for e in tuned)
            entries = list(merged.values())
            source = f"{overlay} over {path}"
        table = self.ext.TilingTable()
        # Families a build may lack (no triton at build time, no sm_90a): their entries are skipped, once
        # warned, and the nearest remaining entry serves those shapes. Any other unknown name is refused.
        missing = {prefix: kind for prefix, kind in OPTIONAL_FAMILIES.items() if kind not in set(self._kinds.values())}
        skipped = [e for e in entries if e.config not in self._kinds and any(e.config.startswith(p) for p in missing)]
        skip = {id(e) for e in skipped}
        for e in entries:
            if id(e) not in skip:
                table.add(e.direction, e.dtype, e.tokens, e.width, e.rank, e.segments, e.config, e.split_k)
        if skipped:
            log.warning("atmm: tiling table %s: %d entries name kernels this build lacks (%s: %s); the nearest other "
                        "entries serve those shapes", source, len(skipped), ", ".join(sorted(set(missing.values()))),
                        ", ".join(sorted({e.config for e in skipped})))
        self._table, self.table_source, self._plans = table, source, {}  # one reference swap: readers need no lock
        self.table_file = Path(path)
        self.table_version += 1
        log.info("atmm: tiling table %s loaded (%d entries)", source, len(entries))
        return len(entries)

    def lookup(self, direction: str, dtype: str, tokens: int, width: int, rank: int, segments: int) -> dict:
        hit = self._table.lookup(direction, dtype, tokens, width, rank, segments)
        if not hit["exact"]:
            log.debug("atmm: no tiling entry for %s %s T=%d width=%d rank=%d segments=%d; %s %s (split_k=%d)",
                      direction, dtype, tokens, width, rank, segments,
                      "default rule" if hit["default"] else f"nearest {hit['matched']}", hit["config"], hit["split_k"])
        return hit

    def unsupported(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    ranks: tuple[int, ...], scales: tuple[float, ...], mapping: LoraBatchMapping) -> str:
        """Why the extension cannot serve this call ("" when it can)."""
        if self.ext is None:
            return self.unavailable_reason
        if not (y.is_cuda and x.is_cuda and mapping.seg_indptr.is_cuda):
            return "inputs not all on CUDA"
        why = self.check_buffers(lora_a, lora_b)
        if why:
            return why
        n_slots, r_max, d_in = lora_a.shape
        d_out = lora_b.shape[1]
        if y.dtype != lora_a.dtype or x.dtype != lora_a.dtype:
            return f"dtypes {x.dtype}/{lora_a.dtype}/{lora_b.dtype}/{y.dtype}: need one of fp16, bf16"
        if y.device != lora_a.device or x.device != lora_a.device or mapping.seg_indptr.device != lora_a.device:
            return "inputs on different devices"
        if x.dim() != 2 or y.dim() != 2:
            return "x, y must be 2-D and lora_a, lora_b 3-D"
        if x.shape[1] != d_in or y.shape[1] != d_out or x.shape[0] != y.shape[0]:
            return f"shapes x{tuple(x.shape)} y{tuple(y.shape)} A{tuple(lora_a.shape)} B{tuple(lora_b.shape)} disagree"
        if not x.is_contiguous():
            return "x, lora_a, lora_b must be contiguous"
        if y.stride(1) != 1 or y.stride(0) % 8:
            return "y rows must be contiguous with a stride that is a multiple of 8"
        if x.data_ptr() % 16 or y.data_ptr() % 16:
            return "operands must be 16-byte aligned"
        if len(ranks) != n_slots or len(scales) != n_slots:
            return f"{len(ranks)} ranks, {len(scales)} scales for {n_slots} slots (max {self.ext.MAX_SLOTS})"
        if mapping.num_tokens != x.shape[0]:
            return f"mapping covers {mapping.num_tokens} tokens, x has {x.shape[0]}"
        return ""

    def check_buffers(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> str:
        """Why the extension cannot take these slot buffers ("" when it can): checked once per pair by their
        owner (the buffers are allocated once), not per call."""
        if self.ext is None:
            return self.unavailable_reason
        if not (lora_a.is_cuda and lora_b.is_cuda):
            return "inputs not all on CUDA"
        if lora_a.dtype not in _DTYPES or lora_a.dtype != lora_b.dtype:
            return f"dtypes {lora_a.dtype}/{lora_b.dtype}: need one of fp16, bf16"
        if lora_a.device != lora_b.device:
            return "inputs on different devices"
        if lora_a.dim() != 3 or lora_b.dim() != 3:
            return "x, y must be 2-D and lora_a, lora_b 3-D"
        n_slots, r_max, d_in = lora_a.shape
        d_out = lora_b.shape[1]
        if tuple(lora_b.shape) != (n_slots, d_out, r_max):
            return f"shapes A{tuple(lora_a.shape)} B{tuple(lora_b.shape)} disagree"
        if d_in % 8 or d_out % 8 or r_max % 8:
            return f"d_in={d_in} d_out={d_out} r_max={r_max}: need multiples of 8"
        if not (lora_a.is_contiguous() and lora_b.is_contiguous()):
            return "x, lora_a, lora_b must be contiguous"
        if lora_a.data_ptr() % 16 or lora_b.data_ptr() % 16:
            return "operands must be 16-byte aligned"
        if n_slots > self.ext.MAX_SLOTS:
            return f"{n_slots} slots (max {self.ext.MAX_SLOTS})"
        return ""

    def run(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
            ranks: tuple[int, ...], scales: tuple[float, ...], mapping: LoraBatchMapping, *,
            shrink: tuple[str, int] | None = None, expand: str | None = None, phases: int = PHASE_ALL,
            workspace: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
        """Run the kernels (checked by :meth:`unsupported` first). ``shrink=(config, split_k)`` and
        ``expand=config`` force configurations (tuner, benchmarks); otherwise the table decides.
        ``pdl``: on Hopper, the expand may start while the shrink runs (it prefetches y and lora_B,
        then waits for v): a programmatic dependent launch."""
        dtype = _DTYPES[y.dtype]
        n_slots, r_max, d_in = lora_a.shape
        d_out = y.shape[1]
        T, S = x.shape[0], mapping.num_segments
        key = (dtype, T, d_in, d_out, r_max, mapping.seg_slot_host, ranks, shrink, expand)
        if key in self._refused:
            return atmm_reference(y, x, lora_a, lora_b, ranks, scales, mapping)
        plan = self._plans.get(key)
        if plan is None:
            plan = self.plan_call(dtype, T, d_in, d_out, r_max, ranks, S, mapping.seg_slot_host, shrink, expand)
            if len(self._plans) > 8192:
                self._plans.clear()
            self._plans[key] = plan
        shrink_idx, split_k, expand_idx, ranks_list, need = plan
        if workspace is None:
            workspace = self._workspace.get(y.device)
            if workspace is None or workspace.numel() < need:
                # One buffer per device, grown as needed: launches on one stream never overlap.
                workspace = torch.empty(max(need, 1 << 20), dtype=torch.uint8, device=y.device)
                self._workspace[y.device] = workspace
        elif workspace.numel() < need:
            workspace = torch.empty(need, dtype=torch.uint8, device=y.device)
        if y.device.index is not None and y.device.index != torch.cuda.current_device():
            with torch.cuda.device(y.device):  # the extension launches on the current device
                return self.run(y, x, lora_a, lora_b, ranks, scales, mapping, shrink=shrink, expand=expand,
                                phases=phases, workspace=workspace, pdl=pdl)
        stream = torch.cuda.current_stream(y.device).cuda_stream if y.is_cuda else 0
        try:
            self.ext.forward(
                y.data_ptr(), x.data_ptr(), lora_a.data_ptr(), lora_b.data_ptr(),
                mapping.seg_indptr.data_ptr(), mapping.seg_slot.data_ptr(), workspace.data_ptr(), workspace.numel(),
                T, d_in, d_out, r_max, x.stride(0), y.stride(0), S, ranks_list, [float(s) for s in scales], dtype,
                shrink_idx, split_k, expand_idx, stream, phases, pdl)
        except RuntimeError as e:
            if shrink is not None or expand is not None or phases != PHASE_ALL:
                raise  # forced configurations (the tuner, benchmarks) must see the refusal
            # y is written only by the expand, the last launch: a refused call left it untouched, and
            # the reference serves this signature from now on. A CUDA error that poisoned the context
            # fails the reference too and reaches the caller.
            if len(self._refused) > 4096:
                self._refused.clear()
            self._refused[key] = str(e)
            pair = (shrink_idx, split_k, expand_idx)
            if pair not in self._warned:  # once per kernel pair, not once per token count
                self._warned.add(pair)
                log.warning("atmm: the extension refused a call (%s); the PyTorch reference serves it and "
                            "every later call of the same signature", e)
            return atmm_reference(y, x, lora_a, lora_b, ranks, scales, mapping)
        return y


    def run_rows(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 mapping: LoraBatchMapping, sign: float, stream: int | None = None) -> bool:
        """The graph-safe call of a captured step: segments at fixed bounds (a decode graph: one per row,
        ``mapping.seg_indptr`` 0..T; a vision graph: one per image) or bounds read on the device (a prefill
        graph: one per sequence, ``mapping.even`` False), their slots read on the device
        (``mapping.seg_slot``, -1: none), every slot at rank ``r_max`` and scale ``sign`` (the slot buffers
        hold scale * B, zero past each rank), so the launch arguments do not depend on which adapters the
        slots hold. The tiling is the table's for (T, width, r_max, S segments), chosen once. False (nothing launched) when the extension refuses the launch. The caller
        has checked the inputs (:meth:`check_buffers` and the activations' layout, as the backend does);
        ``stream``: the step's CUDA stream (None: the current one)."""
        dtype = _DTYPES[y.dtype]
        n_slots, r_max, d_in = lora_a.shape
        d_out = y.shape[1]
        T = x.shape[0]
        S = mapping.seg_slot.shape[0]  # segments: T in a decode graph; a vision graph's images; a prefill graph's sequences
        key = (y.device, dtype, T, S, d_in, d_out, r_max, n_slots, float(sign))
        plan = self._row_plans.get(key)
        if plan is None:
            shrink, expand = self.row_kernels(dtype, T, d_in, d_out, r_max, S, mapping.even)
            split_k = int(shrink[1])
            need = self.ext.workspace_size(S, split_k, T, r_max, dtype)
            workspace = torch.empty(max(need, 256), dtype=torch.uint8, device=y.device)
            plan = (self._names.index(shrink[0]), split_k, self._names.index(expand), [r_max] * n_slots,
                    [float(sign)] * n_slots, workspace)
            self._row_plans[key] = plan
        if plan is False:
            return False
        shrink_idx, split_k, expand_idx, ranks_list, scales_list, workspace = plan
        if stream is None:
            stream = torch.cuda.current_stream(y.device).cuda_stream
        try:
            self.ext.forward(
                y.data_ptr(), x.data_ptr(), lora_a.data_ptr(), lora_b.data_ptr(),
                mapping.seg_indptr.data_ptr(), mapping.seg_slot.data_ptr(), workspace.data_ptr(), workspace.numel(),
                T, d_in, d_out, r_max, x.stride(0), y.stride(0), S, ranks_list, scales_list, dtype,
                shrink_idx, split_k, expand_idx, stream, PHASE_ALL, True)
        except RuntimeError as e:  # refused before any launch: the caller's PyTorch path serves this shape
            log.warning("atmm: the extension refused a per-row call (T=%d d_in=%d d_out=%d r_max=%d: %s); "
                        "the PyTorch per-row path serves it", T, d_in, d_out, r_max, e)
            self._row_plans[key] = False
            return False
        return True

    def row_kernels(self, dtype: str, T: int, d_in: int, d_out: int, r_max: int, S: int,
                    even: bool) -> tuple[tuple[str, int], str]:
        """((shrink config, split_k), expand config) of a :meth:`run_rows` call over ``S`` segments of T rows.
        A prefill graph's segments (not ``even``) change length every step, most of them empty: its kernels are
        the table's for one segment of all T rows, the usual prefill (every kernel finds each block's segment on
        the device, so any bounds are served; the grid covers T / BM + S row tiles), except its expand:
        ``prefill_graph_expand`` where set, else :func:`mixed_step_expand` of the table's where the graph holds
        several sequences (a graph of one sequence never replays a mixed step)."""
        plan_s = S if even else 1
        hit = self.lookup("shrink", dtype, T, d_in, r_max, plan_s)
        expand = self.lookup("expand", dtype, T, d_out, r_max, plan_s)["config"]
        if not even and self.prefill_graph_expand is not None:
            expand = self.prefill_graph_expand
        elif not even and S > 1:
            expand = mixed_step_expand(expand, r_max, self._names)
        return (hit["config"], hit["split_k"]), expand

    def plan_call(self, dtype: str, T: int, d_in: int, d_out: int, r_max: int, ranks: tuple[int, ...], S: int,
                  seg_slot_host: tuple[int, ...], shrink: tuple[str, int] | None = None,
                  expand: str | None = None) -> tuple:
        """(shrink config index, split_k, expand config index, ranks list, workspace bytes) of a call over
        ``S`` segments of slots ``seg_slot_host``: the tiling table's choice (or ``shrink``/``expand``)."""
        used_slots = {s for s in seg_slot_host if 0 <= s < len(ranks)}
        rank = max(((ranks[s] + 7) // 8 * 8 for s in used_slots), default=8) or 8
        # Slots no segment of this call uses go to the extension as rank 0: it then checks the chosen
        # kernels against the ranks the call really has (a resident rank-128 adapter that this batch
        # does not use must not refuse a rank-64 kernel).
        ranks_list = [r if i in used_slots else 0 for i, r in enumerate(ranks)]
        if shrink is None:
            hit = self.lookup("shrink", dtype, T, d_in, rank, S)
            shrink = (hit["config"], hit["split_k"])
        if expand is None:
            expand = self.lookup("expand", dtype, T, d_out, rank, S)["config"]
        split_k = int(shrink[1])
        need = self.ext.workspace_size(S, split_k, T, r_max, dtype)
        return self._names.index(shrink[0]), split_k, self._names.index(expand), ranks_list, need


# A prefill graph also replays steps that carry decode rows beside the prompts (one short segment each, first in
# the step). The column-stationary expand (tr_c_*) as it was before 4591a80 walked the segments of its run of rows
# one after another, so 30 one-row segments took a call from 17-27 us to 124-173 us (H200, T = 1,024, rank 64,
# 8 slots, the q/o, gate/up and down widths, timed through run_rows on that layout, as benchmarks/atmm_tables.py's
# prefill-mixed calls are), about 11 ms more per mixed 32-block step with q/k/v/o adapters. The row-tile expand
# gives each segment its own tiles: 36-53 us on that mixed step, 28-35 us on one prompt of all T rows. Under load
# nearly every prefill step is mixed, so prefill graphs take the row-tile one. Since 4591a80 tr_c shares its work
# out by segments' runs of rows, which may serve both cases; until that is timed on a GPU (atmm_tables
# --prefill-graph-expand), this choice stays.
ROW_TILE_EXPANDS = ((64, "tr_e_m64n128_r64_c1024_w4s3"), (128, "tr_e_m64n128_r128_c1024_w4s2"))


def mixed_step_expand(config: str, r_max: int, compiled: Sequence[str]) -> str:
    """The expand a prefill graph's LoRA calls use: ``config`` (the table's for one prompt of the graph's tokens),
    unless it is column-stationary, whose cost grows with the step's short segments: then the row-tile Triton
    expand for ``r_max``, where one is among the ``compiled`` configs (else ``config``)."""
    if not config.startswith("tr_c_"):
        return config
    return next((name for rank, name in ROW_TILE_EXPANDS if r_max <= rank and name in compiled), config)


class _Default:
    """Holder of the process's default :class:`AtmmKernels`, created on first use: what the tools, the tuner
    sidecar and the engine's backend (once, when it is built) share, so a tuned table reaches the engine."""

    lock = threading.Lock()
    kernels: AtmmKernels | None = None


def default_kernels() -> AtmmKernels:
    with _Default.lock:
        if _Default.kernels is None:
            _Default.kernels = AtmmKernels()
        return _Default.kernels


def set_default_kernels(kernels: AtmmKernels) -> None:
    with _Default.lock:
        _Default.kernels = kernels
