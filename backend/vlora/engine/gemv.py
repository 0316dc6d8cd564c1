"""Memory-bound projections for decode rows: ``y = x @ w.T (+ bias)`` for at most :data:`MAX_ROWS` rows, and
the LLaMA MLP's gate/up projection with ``silu(gate) * up`` in its epilogue. A decode step of one to sixteen
sequences reads every weight once and does almost no arithmetic on it, so its projections are as fast as
the weights stream from HBM; cuBLAS's kernels for such shapes stream them at 0.74-0.94 of the copy rate and
add split-K reduce kernels (an H200 profile of the 7B step at batch 1). These kernels are the engine's
projections for steps of up to ``engine.gemv_max_rows`` rows (:class:`vlora.config.RunnerConfig`).

Each program owns ``block_n`` output columns over the whole of K (``split_k`` = 1) and streams its
[block_n, block_k] weight tiles, coalesced along K, through a ``num_stages`` deep pipeline of shared
memory (cp.async of 16 bytes, ``num_stages - 1`` tiles in flight per program); the rows, padded to 16,
multiply on the tensor cores (``tl.dot``: mma.sync m16n8k16, or wgmma with ``swap`` and 64-column tiles;
fp32 accumulation). ``split_k`` > 1 splits K over that many programs per column block, writes fp32
partial sums and adds them in a second kernel in a fixed order (deterministic; for the probe to weigh).
The 16-byte copies need what Triton specialises at launch: x and w 16-byte aligned with row pitches of a
multiple of 16 elements (every LLaMA width; the engine's activations and weight stacks are); elsewhere
Triton emits plain loads without the pipeline (the same results, slower).

**Bit-stability across rows:** a row's result depends only on that row and the weights: the rows are
always padded to 16 and reduced by the same ``tl.dot`` chain for every M, and the launch (block sizes,
warps, split) is chosen per (N, K), never per M. So the eager path (T rows) and a CUDA graph's padded
bucket give the same bits for the same row (a tensor core computes each output element from its own row
and column; tests/gpu/test_gemv_gpu.py checks the bits). The fused gate/up keeps eager's roundings: gate and up are
rounded to the dtype, ``silu`` (``g / (1 + expf(-g))``, libdevice expf as in PyTorch) is rounded, then the
product (see :func:`vlora.engine.fused_ops.silu_mul`). With a bias, ``acc + bias`` is rounded once, as in
cuBLAS's epilogue. Against cuBLAS the results differ only in the fp32 summation order (a last bit of
the bf16 output here and there); so do the fused gate/up and the plain one (LoRA steps) where the table
gives their two kinds different launches.

Launch parameters come from a :class:`GemvTable`, loaded once when the runner is built (:meth:`GemvTable.load`)
and passed to every call: :data:`TABLE` (committed, keyed by kind and (N, K)) with, over it, the entries of the
file ``engine.gemv_table`` names, else of ``$VLORA_GEMV_TABLE`` (what ``benchmarks/gemv_probe.py`` writes, for
the benchmarks; read at load, never per call), else of the package's ``gemv_tables/<gpu>.json`` for this GPU
(as the ATMM tiling tables are found); :func:`default_config` for shapes none of them has.
No autotuning: it would time at the first call, inside a graph capture. Static shapes only, no host
sync, nothing allocated but the output (and split-K's partial sums) from shapes: the calls capture in
CUDA graphs.

bf16 and fp16 only: an fp32 ``tl.dot`` would round its inputs to tf32, so fp32 (and CPU tensors, rows
beyond :data:`MAX_ROWS`, or no triton) takes the torch reference (``F.linear``) under ``impl="auto"``.
Under ``TRITON_INTERPRET=1`` CPU tensors take the kernels too (the CPU tests): there the tile products are
summed by numpy instead of ``tl.dot`` (see :func:`_mma`), and bf16 casts truncate, so the interpreter checks
the kernels' indexing, masking and row independence, fp16 to a rounding and bf16 to within a step.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from vlora.engine.fused_ops import silu_mul_reference

try:  # optional dependency: CPU CI has no triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

log = logging.getLogger(__name__)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
MAX_ROWS = 16  # rows are padded to one 16-row tensor-core tile
TABLE_ENV = "VLORA_GEMV_TABLE"
KINDS = ("linear", "silu")  # linear_rows; gate_up_silu (N is then 2 x the intermediate size)


@dataclass(frozen=True)
class GemvConfig:
    """One launch: ``block_n`` output columns per program (the silu kind: that many gate and as many up
    columns), K in tiles of ``block_k``, ``split_k`` programs along K (1: none), and the W tile as the
    tensor-core A operand (``swap``: acc [block_n, 16]) or as B (acc [16, block_n])."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    swap: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1 or not 1 <= self.split_k <= 64:
            raise ValueError(f"GemvConfig: bad num_warps/num_stages/split_k in {self}")

    def label(self) -> str:
        return (f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
                + (f"x{self.split_k}" if self.split_k > 1 else "") + ("T" if self.swap else ""))

    @classmethod
    def from_dict(cls, d: dict) -> "GemvConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: (bool(v) if k == "swap" else int(v)) for k, v in d.items() if k in known})


def table_key(kind: str, N: int, K: int) -> str:
    """The table's key of a call: ``"linear:12288x4096"``; for ``silu``, N is the gate/up stack's rows (2I)."""
    if kind not in KINDS:
        raise ValueError(f"gemv: kind must be one of {KINDS}, got {kind!r}")
    return f"{kind}:{N}x{K}"


# The committed launch table for the LLaVA-1.5-7B (LLaMA-7B) decode shapes: the best of
# benchmarks/gemv_probe.py's candidates on an H200 (two runs, results/gemv-probe-nvidia-h200.json), as fractions
# of the copy rate at M=1 against cuBLAS's: q/k/v 0.89 (cuBLAS 0.89), o 0.80 (0.74), gate/up + SiLU 0.89,
# down 0.86 (0.78), LM head 1.05 (1.02; the copy rate counts a read and a write per byte moved, a GEMV only reads).
TABLE: dict[str, GemvConfig] = {
    "linear:12288x4096": GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True),  # q/k/v
    "linear:4096x4096": GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),              # o
    "linear:22016x4096": GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True),  # gate/up (LoRA steps)
    "silu:22016x4096": GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True),    # gate/up + silu * up
    "linear:4096x11008": GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),             # down
    "linear:32064x4096": GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True),  # LM head
}


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def default_config(kind: str, N: int, K: int) -> GemvConfig:
    """The rule for shapes the table lacks, after what the H200 probe measured at 7B: at least one 64-column
    program per SM of a 132-SM part (and K >= 128): 64 columns, K in tiles of 128, the W tile as the tensor
    cores' A operand (``swap``); fewer columns: 32 per program, ``block_k`` 256 (or K's power of two, at
    least 16)."""
    cols = N // 2 if kind == "silu" else N
    if cols >= 64 * 132 and K >= 128:
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True)
    bk = min(256, max(16, _pow2_at_least(K)))
    return GemvConfig(block_n=32, block_k=bk, num_warps=4, num_stages=4 if bk >= 128 else 2)


def read_table(path) -> dict[str, GemvConfig]:
    """A table file's entries: ``{"configs": {"linear:4096x4096": {"block_n": 16, ...}, ...}}`` (extra keys are
    ignored); a key of an unknown kind is refused."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    out = {}
    for key, cfg in data.get("configs", data).items():
        kind, _, shape = key.partition(":")
        n, _, k = shape.partition("x")
        out[table_key(kind, int(n), int(k))] = GemvConfig.from_dict(cfg)
    return out


def default_table_dir() -> Path:
    """The per-GPU tables shipped with this package (``<gpu>.json``, named as the ATMM tiling tables are)."""
    return Path(__file__).resolve().parent / "gemv_tables"


def load_table(path: Optional[str] = None) -> dict[str, GemvConfig]:
    """The committed :data:`TABLE` with the entries of ``path`` over it."""
    table = dict(TABLE)
    if path:
        table.update(read_table(path))
    return table


class GemvTable:
    """The launches of one engine: (kind, N, K) -> :class:`GemvConfig`, and each call's launch plan made once.
    Built at load (:meth:`load`) and handed to every call (``table=``): no global is read on the hot path."""

    def __init__(self, configs: Optional[dict[str, GemvConfig]] = None, source: str = "committed") -> None:
        self.configs = dict(TABLE) if configs is None else dict(configs)
        self.source = source
        self._launches: dict[tuple[str, int, int], tuple] = {}

    @classmethod
    def load(cls, path: Optional[str] = None, device_name: Optional[str] = None,
             table_dir: Optional[Path] = None) -> "GemvTable":
        """:data:`TABLE` with a file's entries over it: ``path`` (``engine.gemv_table``), else
        ``$VLORA_GEMV_TABLE`` (benchmarks), else ``<table_dir>/<gpu>.json`` for ``device_name`` where it exists."""
        from vlora.atmm.tiling import gpu_slug

        path = path or os.environ.get(TABLE_ENV) or None
        if path is None and device_name:
            found = (table_dir or default_table_dir()) / f"{gpu_slug(device_name)}.json"
            path = str(found) if found.exists() else None
        table = cls(load_table(path), source=str(path) if path else "committed")
        if path:
            log.info("gemv: launch table %s loaded over the committed one", path)
        return table

    def config_for(self, kind: str, N: int, K: int) -> GemvConfig:
        """The launch of a (kind, N, K) call: the table's entry or the default rule."""
        return self.configs.get(table_key(kind, N, K)) or default_config(kind, N, K)

    def launch(self, kind: str, N: int, K: int) -> tuple:
        """:func:`_plan` of a (kind, N, K) call; N is the output columns (silu: the intermediate size)."""
        key = (kind, N, K)
        plan = self._launches.get(key)
        if plan is None:
            plan = self._launches[key] = _plan(self.config_for(kind, 2 * N if kind == "silu" else N, K), N, K)
        return plan


class _Default:
    """The table of calls that pass none (tests, benchmarks, tools), built on first use."""

    table: Optional[GemvTable] = None


def default_table() -> GemvTable:
    if _Default.table is None:
        _Default.table = GemvTable.load()
    return _Default.table


def config_for(kind: str, N: int, K: int) -> GemvConfig:
    """The launch of a (kind, N, K) call under :func:`default_table` (tools and benchmarks)."""
    return default_table().config_for(kind, N, K)


def reload_table() -> None:
    """Forget :func:`default_table` (after changing ``VLORA_GEMV_TABLE``)."""
    _Default.table = None


def table_json(configs: dict[str, GemvConfig], **meta) -> dict:
    """A table file's content (what :func:`load_table` reads)."""
    return {**meta, "configs": {k: asdict(v) for k, v in sorted(configs.items())}}


# -- torch references --------------------------------------------------------------------------------


def linear_rows_reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def gate_up_silu_reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu_mul(F.linear(x, w_gate_up))``: the eager LLaMA MLP's activation of a fused gate/up stack."""
    return silu_mul_reference(F.linear(x, w, bias))


# -- Triton kernels ----------------------------------------------------------------------------------

if triton is not None:
    from vlora.engine.fused_ops import _exp

    @triton.jit
    def _epilogue(acc, acc_u, b_ptr, rn, N, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, DT: tl.constexpr):
        """fp32 sums [16, BN] (gate and up for SILU) -> the output tile in DT, with eager's roundings."""
        if HAS_BIAS:
            bm = rn < N
            acc = acc + tl.load(b_ptr + rn, mask=bm, other=0.0).to(tl.float32)[None, :]
            if SILU:
                acc_u = acc_u + tl.load(b_ptr + N + rn, mask=bm, other=0.0).to(tl.float32)[None, :]
        if SILU:
            g = acc.to(DT).to(tl.float32)
            u = acc_u.to(DT).to(tl.float32)
            s = tl.div_rn(g, 1.0 + _exp(-g)).to(DT).to(tl.float32)  # F.silu, rounded
            y = (s * u).to(DT)
        else:
            y = acc.to(DT)
        return y

    @triton.jit
    def _mma(xv, wv, acc, SWAP: tl.constexpr, UPCAST: tl.constexpr):
        """acc += x tile [16, BK] times w tile [BN, BK] transposed, the W tile as the A operand with SWAP.
        UPCAST (the interpreter): exact fp32 products summed per output element by numpy (its dot reads
        bf16 as raw integer bits, and its BLAS sums a row differently by its position in the tile)."""
        if UPCAST:
            xf = xv.to(tl.float32)
            wf = wv.to(tl.float32)
            if SWAP:
                out = acc + tl.sum(wf[:, None, :] * xf[None, :, :], axis=2)
            else:
                out = acc + tl.sum(xf[:, None, :] * wf[None, :, :], axis=2)
        else:
            if SWAP:
                out = tl.dot(wv, tl.trans(xv), acc)
            else:
                out = tl.dot(xv, tl.trans(wv), acc)
        return out

    @triton.jit(do_not_specialize=["M"])
    def _rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
                     stride_ws_s, stride_ws_m,
                     HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                     UPCAST: tl.constexpr):
        """y[:M, n-block] of x [M, K] @ w[N, K].T; SILU: silu(x @ w[:N].T) * (x @ w[N:2N].T), both tiles in one
        K loop. SPLIT > 1: the fp32 sums of one K range into ws [SPLIT, M, N (2N for SILU)] instead."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, 16)
        rk = tl.arange(0, BLOCK_K)
        if EVEN_N:
            rn_w = rn
        else:
            rn_w = tl.minimum(rn, N - 1)  # columns past N load row N-1 (unmasked, vectorised); not stored
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        x_rows = x_ptr + rm[:, None] * stride_xm
        w_rows = w_ptr + rn_w.to(tl.int64)[:, None] * stride_wn
        row_ok = rm[:, None] < M
        DT = y_ptr.dtype.element_ty
        if SWAP:
            acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        else:
            acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        if SILU:
            u_rows = w_rows + N * stride_wn  # the up rows: N below the gate rows
            acc_u = tl.zeros_like(acc)
        for k in range(k_lo, k_hi, BLOCK_K):
            kk = k + rk
            if EVEN_K:
                xv = tl.load(x_rows + kk[None, :], mask=row_ok, other=0.0)
                wv = tl.load(w_rows + kk[None, :])
                if SILU:
                    uv = tl.load(u_rows + kk[None, :])
            else:
                km = kk < k_hi
                xv = tl.load(x_rows + kk[None, :], mask=row_ok & km[None, :], other=0.0)
                wv = tl.load(w_rows + kk[None, :], mask=km[None, :], other=0.0)
                if SILU:
                    uv = tl.load(u_rows + kk[None, :], mask=km[None, :], other=0.0)
            acc = _mma(xv, wv, acc, SWAP, UPCAST)
            if SILU:
                acc_u = _mma(xv, uv, acc_u, SWAP, UPCAST)
        if SWAP:
            acc = tl.trans(acc)
            if SILU:
                acc_u = tl.trans(acc_u)
        if not SILU:
            acc_u = acc
        mask = row_ok & (rn[None, :] < N)
        if SPLIT > 1:
            ws = ws_ptr + pid_k * stride_ws_s + rm[:, None] * stride_ws_m + rn[None, :]
            tl.store(ws, acc, mask=mask)
            if SILU:
                tl.store(ws + N, acc_u, mask=mask)
        else:
            y = _epilogue(acc, acc_u, b_ptr, rn, N, HAS_BIAS, SILU, DT)
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=mask)

    @triton.jit
    def _split_reduce_kernel(ws_ptr, b_ptr, y_ptr, N, stride_ws_s, stride_ws_m, stride_ym,
                             HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """y[m, block] from the SPLIT partial sums, added in split order (deterministic), with the epilogue."""
        m = tl.program_id(1)
        rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        nm = rn < N
        base = ws_ptr + m * stride_ws_m + rn
        acc = tl.load(base, mask=nm, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc = acc + tl.load(base + s * stride_ws_s, mask=nm, other=0.0)
        if SILU:
            acc_u = tl.load(base + N, mask=nm, other=0.0)
            for s in tl.static_range(1, SPLIT):
                acc_u = acc_u + tl.load(base + N + s * stride_ws_s, mask=nm, other=0.0)
        else:
            acc_u = acc
        y = _epilogue(acc[None, :], acc_u[None, :], b_ptr, rn, N, HAS_BIAS, SILU, y_ptr.dtype.element_ty)
        tl.store(y_ptr + m * stride_ym + rn[None, :], y, mask=nm[None, :])


# -- public API ----------------------------------------------------------------------------------------


def triton_available() -> bool:
    return triton is not None


def available(x: torch.Tensor) -> bool:
    """True where the kernels serve ``x``'s rows under ``impl="auto"``: triton imports, x is bf16/fp16, on
    CUDA (or any device under TRITON_INTERPRET=1). The row count is checked by the callers (<= MAX_ROWS)."""
    return triton is not None and x.dtype in _KERNEL_DTYPES and (x.is_cuda or _INTERPRET)


def _use_kernel(impl: str, x: torch.Tensor, w: torch.Tensor, name: str) -> bool:
    if impl == "torch":
        return False
    if impl == "auto":
        return available(x) and x.dim() == 2 and x.shape[0] <= MAX_ROWS and w.dtype == x.dtype
    if impl != "triton":
        raise ValueError(f"{name}: impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if triton is None:
        raise RuntimeError(f"{name}: impl='triton' but triton is not installed")
    if x.dtype not in _KERNEL_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"{name}: the kernel takes bf16/fp16 x and w of one dtype (fp32 would run tf32), "
                        f"got {x.dtype} and {w.dtype}")
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"{name}: x must be [M <= {MAX_ROWS}, K], got {tuple(x.shape)}")
    return True


def _plan(cfg: GemvConfig, N: int, K: int) -> tuple:
    """(config, grid, K per split, EVEN_K, EVEN_N, reduce block) of a launch over N output columns."""
    split = max(1, min(cfg.split_k, -(-K // cfg.block_k)))
    k_split = -(-(-(-K // split)) // cfg.block_k) * cfg.block_k  # a whole number of K tiles per split
    grid = (-(-N // cfg.block_n), split)
    return cfg, grid, k_split, K % cfg.block_k == 0, N % cfg.block_n == 0, min(1024, _pow2_at_least(N))


def _run(kind: str, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], N: int,
         out: Optional[torch.Tensor], config: Optional[GemvConfig], table: Optional[GemvTable]) -> torch.Tensor:
    """One launch."""
    M, K = x.shape
    if w.shape[1] != K:
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} disagree on K")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias must be {x.dtype} [{w.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"gemv: out must be {x.dtype} [{M}, {N}] with a contiguous last dim")
    if M == 0 or N == 0:
        return out
    # the table's launch, or an explicit one (the probe, tests)
    if config is not None:
        cfg, grid, k_split, even_k, even_n, rblock = _plan(config, N, K)
    else:
        cfg, grid, k_split, even_k, even_n, rblock = (table or default_table()).launch(kind, N, K)
    split = grid[1]
    silu = kind == "silu"
    b = bias if bias is not None else w
    upcast = _INTERPRET  # see _mma
    if split > 1:
        ws = torch.empty((split, M, 2 * N if silu else N), dtype=torch.float32, device=x.device)
        _rows_kernel[grid](x, w, b, out, ws, M, N, K, k_split, x.stride(0), w.stride(0), out.stride(0),
                           ws.stride(0), ws.stride(1), HAS_BIAS=bias is not None, SILU=silu, SPLIT=split,
                           SWAP=cfg.swap, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=even_k, EVEN_N=even_n,
                           UPCAST=upcast, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
        _split_reduce_kernel[(-(-N // rblock), M)](ws, b, out, N, ws.stride(0), ws.stride(1), out.stride(0),
                                                   HAS_BIAS=bias is not None, SILU=silu, SPLIT=split, BLOCK=rblock,
                                                   num_warps=4, enable_fp_fusion=False)
    else:
        _rows_kernel[grid](x, w, b, out, out, M, N, K, k_split, x.stride(0), w.stride(0), out.stride(0), 0, 0,
                           HAS_BIAS=bias is not None, SILU=silu, SPLIT=1, SWAP=cfg.swap, BLOCK_N=cfg.block_n,
                           BLOCK_K=cfg.block_k, EVEN_K=even_k, EVEN_N=even_n, UPCAST=upcast,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    return out


def _into(out: Optional[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """A reference's result ``y``, copied into ``out`` where the caller gave one."""
    if out is None:
        return y
    out.copy_(y)
    return out


def linear_rows(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                out: Optional[torch.Tensor] = None, impl: str = "auto",
                config: Optional[GemvConfig] = None, table: Optional[GemvTable] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for x [M <= 16, K] (rows may be strided, last dim contiguous), w [N, K],
    bias [N] or None -> [M, N] in x's dtype. ``impl``: "auto" (the kernel where :func:`available` and
    M <= 16, else F.linear), "triton" (the kernel or an error: fp32 is refused), "torch". ``config``: an
    explicit launch instead of the table's; ``table``: the engine's launches (None: :func:`default_table`)."""
    if not _use_kernel(impl, x, w, "linear_rows"):
        return _into(out, linear_rows_reference(x, w, bias))
    return _run("linear", x, w, bias, w.shape[0], out, config, table)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 out: Optional[torch.Tensor] = None, impl: str = "auto",
                 config: Optional[GemvConfig] = None, table: Optional[GemvTable] = None) -> torch.Tensor:
    """``silu_mul(F.linear(x, w, bias))`` for a fused gate/up stack w [2I, K] (gate rows first, then up) and
    x [M <= 16, K] -> [M, I]: one kernel, the activation in its epilogue. ``impl`` and ``config`` as in
    :func:`linear_rows` (the table's key is ``silu:{2I}x{K}``)."""
    if w.shape[0] % 2:
        raise ValueError(f"gate_up_silu: w must stack gate and up rows (an even count), got {tuple(w.shape)}")
    if not _use_kernel(impl, x, w, "gate_up_silu"):
        return _into(out, gate_up_silu_reference(x, w, bias))
    return _run("silu", x, w, bias, w.shape[0] // 2, out, config, table)
