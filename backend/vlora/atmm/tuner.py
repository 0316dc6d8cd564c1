"""Profile-based tiling search: time every feasible compiled configuration per shape, keep the fastest.

Run as a sidecar process at model load (``TunerSidecar``): serving starts at once on the default
rule or the committed table, and the tuned table is swapped in when the process finishes.

    python -m vlora.atmm.tuner --widths 4096 --ranks 8,16,32,64,128 --dtype bf16 --max-tokens 8192

Results are cached per (GPU, dtype, widths, ranks, token and segment grids, compiled configs) in
``--cache-dir``; the table is written to ``configs/tiling/<gpu>.json`` (or ``--out``).
On a machine without CUDA it does nothing and says so.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from vlora.atmm.dispatch import PHASE_EXPAND, PHASE_PREP, PHASE_SHRINK, AtmmKernels
from vlora.atmm.tiling import default_table_dir, gpu_slug, read_table, table_path, write_table
from vlora.atmm.timing import graph_time_us, sets_needed
from vlora.atmm.mapping import LoraBatchMapping

log = logging.getLogger(__name__)

SPLITS = (1, 2, 4, 8, 16, 32)
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def feasible_configs(kernels: AtmmKernels, direction: str, smem_limit: int) -> list[dict]:
    """Compiled configs that can run here. CUTLASS tiles: sides powers of two >= 16 and the stages
    fit in shared memory; fused expand tiles: operand tiles of rank 128 fit in shared memory;
    streaming kernels: their stages fit in shared memory."""
    out = []
    for c in kernels.ext.configs():
        if not c[direction]:
            continue
        if c["kind"] == "cutlass":
            sides = (c["tb_m"], c["tb_n"], c["tb_k"], c["warp_m"], c["warp_n"], c["warp_k"])
            if any(s < 16 or s & (s - 1) for s in sides):
                continue
            if c["stages"] * (c["tb_m"] + c["tb_n"]) * c["tb_k"] * 2 > smem_limit:
                continue
        elif c["kind"] == "fused" and (c["tb_m"] + c["tb_n"]) * 136 * 2 > smem_limit:
            continue
        elif c.get("smem_bytes", 0) > smem_limit:
            continue
        out.append(c)
    return out


def serves_rank(c: dict, padded_rank: int) -> bool:
    """Whether a config serves a call whose largest padded rank is ``padded_rank``."""
    return not c.get("max_rank") or padded_rank <= c["max_rank"]


@dataclass
class Problem:
    """Rotated input sets for one shape: S equal segments over T tokens, one slot of rank r each (and, padded,
    empty segments of no slot after them)."""

    mapping: LoraBatchMapping
    ranks: tuple[int, ...]
    scales: tuple[float, ...]
    sets: list[tuple[torch.Tensor, ...]]  # (y, x, lora_a, lora_b, workspace)


def make_problem(kernels: AtmmKernels, T: int, d_in: int, d_out: int, seg_ranks: list[int], dtype: str,
                 max_split: int = max(SPLITS), min_bytes: int = 256 << 20, pad_to: int = 0) -> Problem:
    """``pad_to``: segments in all, the ones past ``seg_ranks`` empty and of no slot: the layout of a prefill
    graph's call (``AtmmKernels.run_rows``: one segment per sequence the step could hold, the others empty)."""
    S = len(seg_ranks)
    lengths = [T // S + (1 if i < T % S else 0) for i in range(S)]
    pad = max(0, pad_to - S)
    mapping = LoraBatchMapping.from_segments([sum(lengths[:i]) for i in range(S + 1)] + [T] * pad,
                                             list(range(S)) + [-1] * pad, "cuda")
    r_max = max(8, max(seg_ranks))
    tdt = _TORCH_DTYPES[dtype]
    ws_bytes = kernels.ext.workspace_size(S + pad, max_split, T, r_max, dtype)
    per_set = 2 * (T * d_in + 2 * T * d_out + S * r_max * (d_in + d_out))
    sets = []
    for _ in range(sets_needed(per_set, min_bytes)):
        a = torch.randn(S, r_max, d_in, device="cuda", dtype=tdt) / d_in ** 0.5
        b = torch.randn(S, d_out, r_max, device="cuda", dtype=tdt) / r_max ** 0.5
        for s, r in enumerate(seg_ranks):
            a[s, r:] = 0
            b[s, :, r:] = 0
        sets.append((torch.randn(T, d_out, device="cuda", dtype=tdt), torch.randn(T, d_in, device="cuda", dtype=tdt),
                     a, b, torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")))
    return Problem(mapping, tuple(seg_ranks), tuple(1.0 for _ in seg_ranks), sets)


def time_option(kernels: AtmmKernels, p: Problem, shrink: tuple[str, int], expand: str, phases: int) -> float:
    """Microseconds per call of the given phases, graph-replayed over the problem's input sets."""
    def call(s, ph):
        y, x, a, b, ws = s
        return lambda: kernels.run(y, x, a, b, p.ranks, p.scales, p.mapping, shrink=shrink, expand=expand,
                                   phases=ph, workspace=ws)
    if not phases & PHASE_PREP:
        for s in p.sets:  # the later phases read the metadata a full call leaves in the workspace
            call(s, PHASE_PREP | PHASE_SHRINK | PHASE_EXPAND)()
    return graph_time_us([call(s, phases) for s in p.sets])


def pair_shrinks(shrink: dict, kinds: dict, n: int, within: float = 1.2) -> list:
    """The shrinks an expand is paired with: the ``n`` fastest alone, and the fastest of every other kind
    within ``within`` of the fastest. A whole call's time also depends on how the shrink hands v over (v
    itself or partials; whether it lets a dependent expand start early), which its time alone does not
    show: on the H100 the Triton shrink was faster alone at decode-64 but the stream shrink made the faster
    call, and ranking by time alone dropped it."""
    ranked = sorted(shrink, key=shrink.get)
    out = ranked[:max(1, n)]
    seen = {kinds.get(k[0]) for k in out}
    for k in ranked[len(out):]:
        if shrink[k] > within * shrink[ranked[0]]:
            break
        if kinds.get(k[0]) not in seen:
            out.append(k)
            seen.add(kinds.get(k[0]))
    return out


def profile_shape(kernels: AtmmKernels, p: Problem, shrink_cfgs: list[dict], expand_cfgs: list[dict],
                  splits=SPLITS, pair_candidates: int = 3) -> dict:
    """Every feasible option for one shape:

    - "shrink": {(cfg, split): us}, each shrink timed alone;
    - "expand": {cfg: us}, each expand's best whole call with one of the shrinks ``pair_shrinks`` picks
      (the ``pair_candidates`` fastest, and the fastest of each other kind close to them; on Hopper an
      expand launched as a programmatic dependent overlaps its prologue with
      the shrink, and with split-K partials the best pair is not always built on the fastest shrink);
    - "pair": the fastest whole call, ((shrink cfg, split), expand cfg); "pair_us": its time, "shrink_us":
      its shrink alone.

    The gemv shrink is skipped for segments longer than 32 tokens (it re-reads lora_A per 4 rows)."""
    longest = max(p.mapping.seg_indptr_host[i + 1] - p.mapping.seg_indptr_host[i] for i in range(p.mapping.num_segments))
    rank = -(-max(p.ranks) // 8) * 8
    expand_cfgs = [c for c in expand_cfgs if serves_rank(c, rank)]
    fused = [c for c in expand_cfgs if c["kind"] == "fused"]
    base_expand = (fused or expand_cfgs)[0]["name"]
    shrink = {}
    for c in shrink_cfgs:
        if (c["kind"] == "gemv" and longest > 32) or not serves_rank(c, rank):
            continue
        for k in splits:
            t = _timed_or_none(kernels, p, (c["name"], k), base_expand, PHASE_PREP | PHASE_SHRINK)
            if t is not None:
                shrink[(c["name"], k)] = t
    if not shrink:
        raise RuntimeError("atmm tuner: no shrink configuration ran for this shape")
    whole = PHASE_PREP | PHASE_SHRINK | PHASE_EXPAND
    expand: dict[str, float] = {}
    pairs: dict[tuple, float] = {}
    for sk in pair_shrinks(shrink, {c["name"]: c["kind"] for c in shrink_cfgs}, pair_candidates):
        for c in expand_cfgs:
            t = _timed_or_none(kernels, p, sk, c["name"], whole)
            if t is not None:
                pairs[(sk, c["name"])] = t
                expand[c["name"]] = min(t, expand.get(c["name"], t))
    if not expand:
        raise RuntimeError("atmm tuner: no expand configuration ran for this shape")
    pair = min(pairs, key=pairs.get)
    return {"shrink": shrink, "expand": expand, "pair": pair, "pair_us": pairs[pair], "shrink_us": shrink[pair[0]]}


def table_entries(prof: dict, **shape) -> list[dict]:
    """The two table entries (shrink, expand) of one profiled shape (``shape``: dtype, tokens, width,
    rank, segments). The expand's time is the whole call's."""
    (sc, sk), ec = prof["pair"]
    return [dict(direction="shrink", **shape, config=sc, split_k=sk, time_us=round(prof["shrink_us"], 2)),
            dict(direction="expand", **shape, config=ec, split_k=1, time_us=round(prof["pair_us"], 2))]


def _timed_or_none(kernels: AtmmKernels, p: Problem, shrink: tuple[str, int], expand: str, phases: int) -> float | None:
    """time_option, or None (logged) when the extension refuses the option: one broken
    configuration must not stop a tuning run."""
    try:
        return time_option(kernels, p, shrink, expand, phases)
    except RuntimeError as e:
        log.warning("atmm tuner: skipped shrink %s/%d expand %s: %s", shrink[0], shrink[1], expand, e)
        torch.cuda.synchronize()
        return None


def shape_grid(projections: list[tuple[int, int]], ranks: list[int], tokens: list[int], segments: list[int],
               shapes: list[tuple[int, int]] | None = None):
    """(d_in, d_out, rank, tokens, segments) to profile: every tokens x segments pair with no more segments than
    tokens, or the (tokens, segments) pairs of ``shapes`` (the calls an engine makes: a decode graph's one segment
    a row), for each (d_in, d_out) projection."""
    pairs = shapes if shapes is not None else [(T, S) for T in tokens for S in segments if S <= T]
    # Rank outermost, in the order given: a run cut short by its budget has covered every projection and shape at
    # the first rank (the sidecar lists the largest first: its kernels serve every smaller rank, the nearest key).
    for r in ranks:
        for d_in, d_out in projections:
            for T, S in pairs:
                yield d_in, d_out, r, T, S


def squares(widths: list[int]) -> list[tuple[int, int]]:
    """``--widths``: square projections, d_in = d_out = each width."""
    return [(d, d) for d in widths]


def widths_of(projections: list[tuple[int, int]]) -> list[int]:
    """The table widths the projections' entries are keyed by: every d_in (shrink) and d_out (expand)."""
    return sorted({w for p in projections for w in p})


def paused_seconds(path: Path | None) -> float:
    """The seconds the serving engine has held this process stopped so far, as its sidecar writes them to
    ``path`` (0 without one, or while it cannot be read)."""
    if path is None:
        return 0.0
    try:
        return max(0.0, float(path.read_text() or 0.0))
    except (OSError, ValueError):
        return 0.0


def tune(kernels: AtmmKernels, dtype: str, widths: list[int], ranks: list[int], tokens: list[int],
         segments: list[int], progress: Callable[[str], None] = lambda s: None,
         budget_s: float | None = None, paused_file: Path | None = None,
         shapes: list[tuple[int, int]] | None = None, projections: list[tuple[int, int]] | None = None,
         pad_segments: int = 0) -> list[dict]:
    """Profile the grid; return table entries (both directions) with their measured times.

    ``projections``: the (d_in, d_out) calls to profile, in order of priority (default: ``widths`` as squares).
    A projection's shrink entry is keyed by its d_in and its expand entry by its d_out, so two projections can
    name one key (LLaVA's q_proj and gate_proj share d_in): the first one listed keeps it. An expand tuned on a
    square call can be 3x off on the engine's (Qwen2-VL's gate_proj, 3,584 -> 18,944, on an H200: the whole call
    of the square 18,944 problem hides a different expand behind its long shrink).
    ``pad_segments``: one-segment shapes are timed as a prefill graph makes them, with this many segments in all
    (``scheduler.max_batch_size``; the table's one-segment key serves both, and the graphs are the usual prefill):
    a stream expand splits its columns over the row tiles of every segment, empty ones too, so with 31 empty
    segments it ran 3x slower on an H200 than the unpadded call the tuner had chosen it on.
    With ``budget_s``, stop after the shape that crosses it (the table is then partial); the time the serving
    engine held this process stopped (``paused_file``, TunerSidecar.pause) does not count."""
    smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    shrink_cfgs = feasible_configs(kernels, "shrink", smem)
    expand_cfgs = feasible_configs(kernels, "expand", smem)
    grid = list(shape_grid(projections or squares(widths), ranks, tokens, segments, shapes))
    entries: list[dict] = []
    seen: set[tuple] = set()
    t0 = time.monotonic()
    for i, (d_in, d_out, r, T, S) in enumerate(grid):
        p = make_problem(kernels, T, d_in, d_out, [r] * S, dtype, pad_to=pad_segments if S == 1 else 0)
        res = profile_shape(kernels, p, shrink_cfgs, expand_cfgs)
        (sc, sk), ec = res["pair"]
        for e in table_entries(res, dtype=dtype, tokens=T, width=0, rank=r, segments=S):
            e["width"] = d_in if e["direction"] == "shrink" else d_out
            key = (e["direction"], e["dtype"], e["tokens"], e["width"], e["rank"], e["segments"])
            if key not in seen:
                seen.add(key)
                entries.append(e)
        progress(f"[{i + 1}/{len(grid)}] {dtype} {d_in}x{d_out} r={r} T={T} S={S}: shrink {sc}/{sk} "
                 f"{res['shrink_us']:.1f} us, expand {ec}, whole call {res['pair_us']:.1f} us "
                 f"({time.monotonic() - t0:.0f} s)")
        del p
        if budget_s is not None and time.monotonic() - t0 - paused_seconds(paused_file) > budget_s:
            progress(f"time budget of {budget_s:.0f} s spent after {i + 1} of {len(grid)} shapes; the table is partial")
            break
    return entries


def run_key(args: argparse.Namespace, gpu: str, tokens: list[int], projections: list[tuple[int, int]],
            configs: list[str]) -> str:
    """The cache key of one tuner run's grid (:func:`cache_key` over its projections, token and segment grid or
    explicit shapes, and padding)."""
    grid = ([str(s) for s in args.segments] if args.shapes is None else [f"{t}:{seg}" for t, seg in args.shapes])
    return cache_key(gpu, args.dtype, [f"{a}x{b}" for a, b in projections], args.ranks,
                     tokens if args.shapes is None else [], grid + [f"pad{args.pad_segments}"], configs)


def cache_key(gpu: str, dtype: str, widths, ranks, tokens, segments, configs) -> str:
    blob = json.dumps([gpu, dtype, sorted(widths), sorted(ranks), sorted(tokens), sorted(segments), configs])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def _projections(s: str) -> list[tuple[int, int]]:
    """``"4096x4096,4096x11008"`` -> [(4096, 4096), (4096, 11008)]: (d_in, d_out) projections."""
    out = []
    for v in filter(None, s.split(",")):
        d_in, _, d_out = v.partition("x")
        out.append((int(d_in), int(d_out or d_in)))
    return out


def _pairs(s: str) -> list[tuple[int, int]]:
    """``"1:1,32:32,512:1"`` -> [(1, 1), (32, 32), (512, 1)]: (tokens, segments) pairs."""
    out = []
    for v in filter(None, s.split(",")):
        t, _, seg = v.partition(":")
        out.append((int(t), int(seg or 1)))
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vlora.atmm.tuner", description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=_ints, default=[4096], help="model widths (d_in of shrink, d_out of expand)")
    ap.add_argument("--projections", type=_projections, default=None,
                    help="the engine's (d_in x d_out) projections, most frequent first, e.g. 4096x4096,4096x11008,"
                         "11008x4096 (overrides --widths: their squares)")
    ap.add_argument("--ranks", type=_ints, default=[8, 16, 32, 64, 128])
    ap.add_argument("--dtype", choices=sorted(_TORCH_DTYPES), default="bf16")
    ap.add_argument("--max-tokens", type=int, default=8192, help="largest batch in tokens")
    ap.add_argument("--token-step", type=int, default=32)
    ap.add_argument("--tokens", type=_ints, default=None, help="explicit token counts (overrides the 32-step grid)")
    ap.add_argument("--segments", type=_ints, default=[1, 4, 16, 64])
    ap.add_argument("--shapes", type=_pairs, default=None,
                    help="explicit tokens:segments pairs, e.g. 1:1,32:32,1024:1 (overrides --tokens x --segments)")
    ap.add_argument("--pad-segments", type=int, default=0,
                    help="time one-segment shapes as a prefill graph calls them: this many segments in all, the "
                         "others empty (scheduler.max_batch_size)")
    ap.add_argument("--out", type=Path, default=None, help="table file (default configs/tiling/<gpu>.json)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "vlora" / "tiling")
    ap.add_argument("--budget-s", type=float, default=None, help="stop profiling after this many seconds")
    ap.add_argument("--paused-file", type=Path, default=None,
                    help="where the serving engine writes the seconds it held this process stopped (not counted)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    if not torch.cuda.is_available():
        print("vlora.atmm.tuner: no CUDA device here; nothing to tune (the PyTorch reference serves ATMM)",
              file=sys.stderr)
        return 0
    kernels = AtmmKernels(load_table=False)
    if not kernels.available:
        print(f"vlora.atmm.tuner: {kernels.unavailable_reason}; nothing to tune", file=sys.stderr)
        return 0
    gpu = torch.cuda.get_device_name()
    tokens = args.tokens or list(range(args.token_step, args.max_tokens + 1, args.token_step))
    out = args.out or table_path(gpu, default_table_dir())
    projections = args.projections or squares(args.widths)
    widths = widths_of(projections)
    key = run_key(args, gpu, tokens, projections, kernels.config_names)
    cached = args.cache_dir / f"{gpu_slug(gpu)}-{args.dtype}-{key}.json"
    if cached.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cached, out)
        print(f"vlora.atmm.tuner: cached table {cached} -> {out}", file=sys.stderr)
        return 0
    entries = tune(kernels, args.dtype, args.widths, args.ranks, tokens, args.segments,
                   progress=lambda s: print(s, file=sys.stderr, flush=True), budget_s=args.budget_s,
                   paused_file=args.paused_file, shapes=args.shapes, projections=projections,
                   pad_segments=args.pad_segments)
    grid_shapes = list(shape_grid(projections, args.ranks, tokens, args.segments, args.shapes))
    keys = {(d, r, T, S, direction) for d_in, d_out, r, T, S in grid_shapes
            for d, direction in ((d_in, "shrink"), (d_out, "expand"))}
    complete = len(entries) == len(keys)
    grid = ({"segments": args.segments, "token_grid": [min(tokens), max(tokens), len(tokens)]} if args.shapes is None
            else {"shapes": [[t, seg] for t, seg in args.shapes]})
    header = {"gpu": gpu, "cuda_archs": kernels.ext.CUDA_ARCHS, "dtype": args.dtype, "widths": widths,
              **({"projections": [[a, b] for a, b in projections]} if args.projections else {}),
              "ranks": args.ranks, **grid, **({"pad_segments": args.pad_segments} if args.pad_segments else {}),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "timing": "CUDA-graph replay, >256 MB rotated inputs", "complete": complete}
    write_table(out, header, entries)
    if complete:  # a partial table is written but never cached
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, cached)
    print(f"vlora.atmm.tuner: wrote {len(entries)} entries to {out}", file=sys.stderr)
    return 0


def _die_with_parent() -> None:
    """In the sidecar, before exec: ask the kernel for SIGKILL when the process that started it ends
    (Linux ``PR_SET_PDEATHSIG``). A server or test process that exits without stopping its engine would
    otherwise leave the tuner profiling on the GPU for up to ``atmm.tune_budget_s``, under whatever runs
    there next (seen as every kernel of a later benchmark running 4-12x slow). SIGKILL, not SIGTERM: a sidecar
    stopped by :meth:`TunerSidecar.pause` would hold a SIGTERM pending, and its GPU memory, for ever."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


class TunerSidecar:
    """Runs the tuner in a child process and swaps its table into ``kernels`` when it finishes.

    The tuned entries go over the table in use (``base``), so a run cut short by its time budget
    only replaces the shapes it profiled. The child's progress goes to ``<out>.log``.

    The child shares the serving GPU, so the engine holds it stopped (:meth:`pause`, SIGSTOP) while requests
    run and lets it go on (:meth:`resume`) once the engine has been idle a while: beside a running tuner an
    H200 measured a one-image LLaVA-7B prefill step at 27.8 ms against 16.7 alone, its kernels waiting
    2.2-2.6 ms at a time for the tuner's time slices. Work the child had already queued on the GPU when it
    was stopped still runs (a few ms). Its ``atmm.tune_budget_s`` counts the time it ran: the seconds it was
    stopped are written to ``<out>.paused``, which the child reads at each budget check.
    """

    def __init__(self, kernels: AtmmKernels, out: Path, tuner_args: list[str], base: Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.kernels = kernels
        self.out = Path(out)
        self.args = tuner_args
        self.base = base
        self.env = dict(env) if env is not None else None  # the child's whole environment; None: this process's
        self.log_path = self.out.with_suffix(".log")
        self.proc: subprocess.Popen | None = None
        self.swapped = False
        self.failed: str | None = None
        self._log = None
        self._lock = threading.Lock()  # pause() comes from request threads, resume() from the engine loop
        self.paused = False
        self.pauses = 0  # how many times requests stopped it
        self.paused_s = 0.0  # seconds stopped so far, written to paused_file for the child's budget
        self.paused_file = self.out.with_suffix(".paused")
        self._paused_at = 0.0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "vlora.atmm.tuner", "--out", str(self.out), "--paused-file", str(self.paused_file),
               *self.args]
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.paused_file.unlink(missing_ok=True)  # an earlier run's
        self._log = open(self.log_path, "w")  # a pipe nobody reads would fill and stall the child
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True, env=self.env,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        log.info("atmm: tuner sidecar started (pid %d): %s; progress in %s", self.proc.pid, " ".join(cmd), self.log_path)

    def pause(self) -> None:
        """Stop the child (SIGSTOP) while the engine serves requests; a no-op when stopped or ended."""
        with self._lock:
            if self.paused or self.proc is None or self.proc.poll() is not None:
                return
            try:
                os.kill(self.proc.pid, signal.SIGSTOP)
            except OSError:
                return
            self.paused = True
            self.pauses += 1
            self._paused_at = time.monotonic()

    def resume(self) -> None:
        """Let a paused child go on (SIGCONT)."""
        with self._lock:
            if not self.paused:
                return
            self.paused = False
            self.paused_s += time.monotonic() - self._paused_at
            try:  # before it goes on: its budget check reads it (a whole file, never half a number)
                tmp = self.paused_file.with_suffix(".paused.tmp")
                tmp.write_text(f"{self.paused_s:.3f}")
                os.replace(tmp, self.paused_file)
            except OSError:
                pass
            if self.proc is not None and self.proc.poll() is None:
                try:
                    os.kill(self.proc.pid, signal.SIGCONT)
                except OSError:
                    pass

    def poll(self) -> bool:
        """True once the tuned table is in use; cheap, call from the engine loop between steps."""
        if self.swapped or self.failed or self.proc is None or self.proc.poll() is None:
            return self.swapped
        self._close_log()
        if self.proc.returncode != 0 or not self.out.exists():
            self.failed = (f"tuner exited with {self.proc.returncode}" if self.proc.returncode
                           else "the tuner wrote no table") + f"; see {self.log_path}"
            log.warning("atmm: %s; serving keeps %s", self.failed, self.kernels.table_source)
            return False
        if self.kernels.available:
            try:
                if self.base is not None and self.base.exists():
                    self.kernels.load_table(self.base, overlay=self.out)
                else:
                    self.kernels.load_table(self.out)
            except ValueError as e:
                self.failed = f"tuned table refused: {e}"
                log.warning("atmm: %s", self.failed)
                return False
            self.swapped = True
            log.info("atmm: tuned tiling table in use: %s", self.kernels.table_source)
        return self.swapped

    def state(self) -> str:
        if self.swapped:
            return "swapped in"
        if self.failed:
            return self.failed
        if self.proc is None or self.proc.poll() is not None:
            return "not started"
        return f"{'paused' if self.paused else 'running'} (paused {self.pauses} times for requests)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # a stopped process would hold the SIGTERM pending
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def start_at_load(kernels: AtmmKernels, *, mode: str, widths: list[int], ranks: list[int], max_tokens: int,
                  segments: list[int], dtype: str, budget_s: float, cache_dir: Path, work_dir: Path,
                  device_name: str | None, env: Mapping[str, str] | None = None,
                  projections: list[tuple[int, int]] | None = None, pad_segments: int = 0,
                  shapes: list[tuple[int, int]] | None = None) -> TunerSidecar | None:
    """Start the tuner sidecar when the model loads (the engine calls this); None when nothing is tuned.

    ``mode`` is ``atmm.tune_at_load``: ``auto`` tunes only when the committed table for this GPU is
    missing, is for another dtype, or lacks one of ``widths`` (other ranks take the nearest key).
    ``projections``: the model's (d_in, d_out) LoRA calls, most frequent first, which the sidecar profiles
    (None: ``widths`` as squares); ``pad_segments``: the prefill graphs' segments (:func:`tune`); ``shapes``: the
    (tokens, segments) calls to profile (None: tokens every 32 up to ``max_tokens`` times ``segments``). ``env`` is
    the sidecar's environment (None: this process's), e.g. one that shows it one GPU."""
    if mode == "never":
        return None
    if device_name is None:
        log.info("atmm: no CUDA device here: the tuner sidecar has nothing to tune (the PyTorch reference serves)")
        return None
    if not kernels.available:
        log.info("atmm: %s: no tuner sidecar (the PyTorch reference serves)", kernels.unavailable_reason)
        return None
    if dtype not in _TORCH_DTYPES:
        log.info("atmm: dtype %s is served by the reference: no tuner sidecar", dtype)
        return None
    base = table_path(device_name, kernels._table_dir)
    if mode == "auto" and base.exists():
        try:
            header, _ = read_table(base)
        except ValueError:
            header = {}
        if set(widths) <= set(header.get("widths", [])) and header.get("dtype") == dtype:
            log.info("atmm: %s covers widths %s: no tuning at load (atmm.tune_at_load=always tunes anyway)", base, widths)
            return None
    slug = f"{gpu_slug(device_name)}-{dtype}-w{'_'.join(map(str, widths))}-r{'_'.join(map(str, ranks))}"
    shape = (["--projections", ",".join(f"{a}x{b}" for a, b in projections)] if projections
             else ["--widths", ",".join(map(str, widths))])
    if pad_segments:
        shape += ["--pad-segments", str(pad_segments)]
    if shapes:
        shape += ["--shapes", ",".join(f"{t}:{seg}" for t, seg in shapes)]
    args = [*shape, "--ranks", ",".join(map(str, ranks)), "--dtype", dtype,
            "--max-tokens", str(max_tokens), "--segments", ",".join(map(str, segments)),
            "--cache-dir", str(cache_dir), "--budget-s", str(budget_s)]
    # The tuned entries go over the table in use: this GPU's, or another GPU's of the same capability that
    # serves until then (tiling.resolve_table).
    car = TunerSidecar(kernels, work_dir / f"{slug}.json", args, base=kernels.table_file or base, env=env)
    car.start()
    return car


if __name__ == "__main__":
    sys.exit(main())
