"""CUDA graphs of the vision tower: of a fixed-size tower and its projector (LLaVA's CLIP), one per image-count
bucket (:class:`VisionGraphs`), and of a tower of many grids (Qwen2-VL), one per item grid and bucket
(:class:`GridGraphs`).

An eager CLIP-L forward issues about 450 launches from Python and is bound by its host: one 336 px image
took 22 ms on an H200 against 0.5 ms of FLOPs (benchmarks/RESULTS.md). A family whose tower takes one
fixed image size (:meth:`vlora.models.base.ModelFamily.fixed_pixels`) is captured here per bucket of images
(``engine.vision_graph_images``) and replayed with the images copied into the graph's input buffer; a batch
pads up to the next bucket (padding images are encoded and dropped), and a batch larger than the largest
bucket runs as several replays.

Two variants per bucket: ``base`` (no LoRA work) and, where vision-side LoRA is on, ``lora``: every image's
rows in each stage (tower, projector) form one segment of a fixed size, and the segments' adapter slots sit in
a device buffer written before each replay (slot -1: the plain encoder for that image). The LoRA backend's
graph-safe path serves them (:meth:`vlora.lora.backends.LoraBackend.add_rows`, every slot at the buffers'
``r_max``: the slot buffers are zero past each adapter's rank), so a replay serves images of any adapters.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Optional

import torch

from vlora.atmm.mapping import LoraBatchMapping
from vlora.engine.graphs import capture_graph, smallest_at_least

if TYPE_CHECKING:
    from vlora.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


class VisionGraphs:
    def __init__(self, runner: "ModelRunner", sizes: tuple[int, ...], pool=None) -> None:
        loaded = runner.loaded
        family = loaded.family
        hw = family.fixed_pixels(loaded)
        if hw is None:
            raise ValueError(f"{family.name}: the vision tower takes images of many sizes; no vision graphs")
        self.runner, self.family, self.loaded = runner, family, loaded
        self.sizes = tuple(sorted(set(int(s) for s in sizes)))
        self.max_images = self.sizes[-1]
        dev, dtype = runner.device, runner.dtype
        self.pixels = torch.zeros(self.max_images, 3, *hw, dtype=dtype, device=dev)
        self.slots = torch.full((self.max_images,), -1, dtype=torch.int32, device=dev)
        # rows each image puts through each stage's projections (the same for every image here)
        self.rows = {stage: n[0] for stage, n in family.vision_lora_rows(loaded, self.pixels[:1], None).items()}
        self.variants = ("base", "lora") if runner.vision_lora is not None else ("base",)
        self.pool = pool
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.replays = 0

    def serves(self, pixel_values: torch.Tensor, image_grid_thw: Optional[torch.Tensor], video: bool) -> bool:
        return (not video and image_grid_thw is None and pixel_values.dim() == 4
                and tuple(pixel_values.shape[1:]) == tuple(self.pixels.shape[1:]))

    def _mappings(self, b: int) -> dict[str, LoraBatchMapping]:
        """Per stage: ``b`` segments of that stage's rows per image, their slots read from ``self.slots`` on
        the device (the host tuples are placeholders: the graph-safe path reads the device buffers only)."""
        out = {}
        for stage, r in self.rows.items():
            indptr = torch.arange(0, (b + 1) * r, r, dtype=torch.int32, device=self.runner.device)
            out[stage] = LoraBatchMapping(seg_indptr=indptr, seg_slot=self.slots[:b],
                                          seg_indptr_host=tuple(range(0, (b + 1) * r, r)), seg_slot_host=(0,) * b,
                                          num_tokens=b * r, has_lora=True)
        return out

    def _body(self, b: int, variant: str) -> torch.Tensor:
        r = self.runner
        vl = r.vision_lora
        if variant == "lora":
            for stage, mapping in self._mappings(b).items():
                ctx = vl.contexts[stage]
                ctx.backend = r.lora_ctx.backend
                ctx.bind(mapping, rows=True)
        try:
            return self.family.encode_batch(self.loaded, self.pixels[:b])
        finally:
            if vl is not None:
                for ctx in vl.contexts.values():
                    ctx.clear()

    @torch.inference_mode()
    def _capture(self, b: int, variant: str) -> None:
        g, out, self.pool = capture_graph(self.runner.device, lambda: self._body(b, variant), self.pool)
        self.graphs[(b, variant)] = (g, out)

    def capture_all(self) -> None:
        t0 = time.perf_counter()
        for b in reversed(self.sizes):
            for v in self.variants:
                self._capture(b, v)
        torch.cuda.synchronize(self.runner.device)
        self.capture_s = time.perf_counter() - t0
        log.info("CUDA graphs: %d vision-tower graphs (images %s, variants %s) in %.1f s", len(self.graphs),
                 list(self.sizes), list(self.variants), self.capture_s)

    @torch.inference_mode()
    def run(self, pixel_values: torch.Tensor, vision_slots: Optional[list[int]] = None) -> list[torch.Tensor]:
        """Each image's projected features, [tokens, hidden] (copies: the graph's output buffer is reused)."""
        n = pixel_values.shape[0]
        slots = list(vision_slots) if vision_slots is not None else [-1] * n
        out: list[torch.Tensor] = []
        for lo in range(0, n, self.max_images):
            hi = min(n, lo + self.max_images)
            b = smallest_at_least(self.sizes, hi - lo)
            chunk = slots[lo:hi]
            variant = "lora" if any(s >= 0 for s in chunk) else "base"
            if variant == "lora" and self.runner.vision_lora is None:
                raise RuntimeError("vision-side LoRA is off on this runner, but an image asks for an adapter slot")
            self.pixels[:hi - lo].copy_(pixel_values[lo:hi], non_blocking=True)
            if variant == "lora":
                host = torch.tensor(chunk + [-1] * (b - len(chunk)), dtype=torch.int32)
                self.slots[:b].copy_(host.pin_memory() if pixel_values.is_cuda else host, non_blocking=True)
            g, feats = self.graphs[(b, variant)]
            g.replay()
            self.replays += 1
            out.extend(feats[:hi - lo].clone().unbind(0))
        return out


class GridGraphs:
    """CUDA graphs of a vision tower that takes items of many grids (Qwen2-VL / Qwen2.5-VL), one per (item grid,
    bucket of items of that grid): the tower's device work (:meth:`QwenVisionForward.run
    <vlora.models.qwen_vision.QwenVisionForward.run>`) over a fixed pixel buffer, with the plan of its grids
    (rotary tables, window order, attention runs: made once at capture) kept beside it.

    An eager forward issues about 25 launches per block from Python and is bound by its host: one 448x448
    image took 20-26 ms on an H200 against a 1.9 ms FLOP floor (benchmarks/RESULTS.md). The grids of a
    step's items are known on the host (``image_grid_thw`` is a CPU tensor from preprocessing), so each run
    of neighbouring items of one grid replays the graph of its bucket (``engine.vision_graph_images``; the
    padding items' rows are encoded and dropped: attention never crosses items), a run longer than the
    largest bucket as several replays.

    Which grids: those of ``engine.vision_graph_grids`` at load (images at every bucket; videos, given as frames x
    size, at one item), and any other on the second time a step meets it (the first runs eagerly: a one-off size
    never pays a capture), then at one item only, at most ``max_graphs`` at once, least recently used out. A run
    of a grid whose bucket has no graph replays the grid's captured buckets instead (:func:`compose`: several
    videos of a step replay the one-video graph once each), so that a grid costs one capture, however many
    items of it later steps bring (a capture stalls the engine thread for about three tower runs, and each new
    item count used to cost an eager tower first and a capture at its second sighting).
    ``captures``, ``replays`` and ``eager_items`` count what happened. Items with vision-side LoRA run eagerly
    (the runner does not send them here)."""

    def __init__(self, runner: "ModelRunner", sizes: tuple[int, ...], pool=None, max_graphs: int = 32) -> None:
        loaded = runner.loaded
        self.forward = loaded.family.grid_vision(loaded)
        if self.forward is None:
            raise ValueError(f"{loaded.family.name}: no grid vision tower; no grid graphs")
        self.runner, self.loaded = runner, loaded
        visual = self.forward.visual
        p = next(visual.parameters())
        self.device, self.dtype = p.device, p.dtype
        pe = visual.patch_embed
        self.patch_dim = int(pe.in_channels * pe.temporal_patch_size * pe.patch_size ** 2)
        self.sizes = tuple(sorted(set(int(s) for s in sizes)))
        self.max_items = self.sizes[-1]
        self.max_graphs = max_graphs
        self.pool = pool
        self.graphs: "OrderedDict[tuple, tuple]" = OrderedDict()  # (grid, bucket) -> (graph, pixels, out, plan)
        self.seen: Counter = Counter()  # grids met once without a graph
        self.captures = self.replays = self.eager_items = 0
        self.capture_s = 0.0

    def key_grids(self, grids: list[tuple[int, int, int]]) -> list[tuple]:
        """The (grid, bucket) keys that encoding ``grids`` (in order) replays."""
        keys, i = [], 0
        while i < len(grids):
            j = i
            while j < len(grids) and grids[j] == grids[i] and j - i < self.max_items:
                j += 1
            keys.append((grids[i], smallest_at_least(self.sizes, j - i), i, j))
            i = j
        return keys

    def capture_grids(self, grids: list[tuple[int, int, int]], video: bool = False) -> None:
        """Capture each grid at every bucket (a video's: one item), before serving."""
        t0 = time.perf_counter()
        for g in grids:
            for b in ((1,) if video else self.sizes):
                self._capture((tuple(g), b))
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0
        log.info("CUDA graphs: %d grid vision graphs (grids %s, items %s) in %.1f s", len(self.graphs),
                 sorted({k[0] for k in self.graphs}), list(self.sizes), self.capture_s)

    @torch.inference_mode()
    def _capture(self, key: tuple, reason: str = "") -> tuple:
        """Capture the graph of ``key`` (grid, bucket); ``reason``: why, while serving (logged with its time)."""
        grid, b = key
        t0 = time.perf_counter()
        rows = b * grid[0] * grid[1] * grid[2]
        pixels = torch.zeros(rows, self.patch_dim, dtype=self.dtype, device=self.device)
        plan = self.forward.plan([grid] * b, self.device)
        g, out, self.pool = capture_graph(self.device, lambda: self.forward.run(pixels, plan), self.pool)
        entry = self.graphs[key] = (g, pixels, out, plan)
        self.seen.pop(grid, None)
        self.captures += 1
        if reason:
            dt = time.perf_counter() - t0
            self.capture_s += dt
            log.info("CUDA graphs: captured the vision tower for grid %s at %s (%.0f ms)", list(grid), reason, 1e3 * dt)
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return entry

    def _replays(self, grid: tuple, n: int) -> Optional[list[tuple[int, int]]]:
        """(bucket, items) replays that encode a run of ``n`` items of ``grid``: the bucket's own graph, else
        the grid's captured buckets composed; None: the run goes eagerly (the grid's first sighting, which is
        remembered: at the second, its one-item graph is captured)."""
        have = sorted(b for g, b in self.graphs if g == grid)
        if not have:
            if self.seen[grid] < 1:
                if len(self.seen) > 4096:  # the grids met once: a bounded memory of them
                    self.seen.clear()
                self.seen[grid] += 1
                return None
            self._capture((grid, 1), reason="its second sighting")
            have = [1]
        plan = compose(have, n, smallest_at_least(self.sizes, n))
        for b, _ in plan:
            self.graphs.move_to_end((grid, b))
        return plan

    @torch.inference_mode()
    def run(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Each item's merged features, [tokens, hidden] (copies where a graph's output buffer holds them)."""
        grids = [tuple(int(x) for x in g) for g in image_grid_thw.tolist()]  # a CPU tensor: no sync
        pix = pixel_values.to(self.device, self.dtype)
        starts = [0]
        for t, h, w in grids:
            starts.append(starts[-1] + t * h * w)
        out: list[torch.Tensor] = []
        unit = self.forward.unit
        for grid, _, i, j in self.key_grids(grids):
            rows = grid[0] * grid[1] * grid[2]
            tokens = rows // unit
            plan = self._replays(grid, j - i)
            if plan is None:
                merged = self.forward.run(pix[starts[i]:starts[j]], self.forward.plan([grid] * (j - i), self.device))
                self.eager_items += j - i
                out.extend(torch.split(merged, tokens))
                continue
            k = i
            for b, n in plan:
                g, pixels, feats, _ = self.graphs[(grid, b)]
                pixels[:n * rows].copy_(pix[starts[k]:starts[k + n]], non_blocking=True)
                g.replay()
                self.replays += 1
                out.extend(torch.split(feats[:n * tokens].clone(), tokens))
                k += n
        return out


def compose(have: list[int], n: int, bucket: Optional[int] = None) -> list[tuple[int, int]]:
    """(bucket, items) replays of the captured buckets ``have`` (ascending, not empty) that encode ``n`` items:
    ``bucket`` alone where it was captured (the run's own graph), else the largest captured bucket that the
    items left fill, again and again, and the rest padded up to the smallest that holds it (padding items are
    encoded and dropped)."""
    if bucket is not None and bucket in have:
        return [(bucket, n)]
    plan, left = [], n
    while left > 0:
        fits = [b for b in have if b <= left]
        b = fits[-1] if fits else next(b for b in have if b >= left)
        plan.append((b, min(b, left)))
        left -= min(b, left)
    return plan
