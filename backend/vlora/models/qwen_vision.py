"""The Qwen2-VL / Qwen2.5-VL vision tower's forward without host syncs, over the Hugging Face modules.

transformers' own forward reads the sequence lengths back from the device in every block (``cu_seqlens``
``.tolist()`` to split the attention per image), and builds the rotary positions and window indices from a
device grid: about 100 host syncs per encode, so the host and the GPU take turns. One 448x448 image took
45-51 ms on an H200 against a 2 ms FLOP floor (benchmarks/RESULTS.md). Here the grid is read on the host
once (the request's ``image_grid_thw`` is a CPU tensor from preprocessing): the rotary positions, the
sequence and window boundaries and the window order are built there and copied once; each block runs
attention as one SDPA call per run of equal-length sequences (a video's frames, an image's full windows),
with the backends that need no plan per shape (FlashAttention, memory-efficient; cuDNN's fused attention
builds a plan for each new length). Every projection, norm, MLP and the merger are the model's own modules,
so vision-side LoRA wrappers inside them work unchanged.

The same arithmetic as transformers' forward (``apply_rotary_pos_emb_vision`` in fp32, the merger's window
order undone at the end); tests/unit/test_qwen_vision.py holds it to the model's own forward.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb_vision``: q, k [N, heads, hd] rotated in fp32; cos, sin [N, hd]."""
    dtype = q.dtype
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    q, k = q.float(), k.float()
    return (q * cos + _rotate_half(q) * sin).to(dtype), (k * cos + _rotate_half(k) * sin).to(dtype)


def position_ids(grids: Sequence[Sequence[int]], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of every patch, in the tower's order (merge x merge blocks together), per frame."""
    out = []
    for t, h, w in grids:
        hpos = torch.arange(h).unsqueeze(1).expand(-1, w).reshape(h // merge, merge, w // merge, merge)
        wpos = torch.arange(w).unsqueeze(0).expand(h, -1).reshape(h // merge, merge, w // merge, merge)
        pos = torch.stack([hpos.permute(0, 2, 1, 3).flatten(), wpos.permute(0, 2, 1, 3).flatten()], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def window_index(grids: Sequence[Sequence[int]], merge: int, window: int, patch: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window order of the merged tokens and the windows' row boundaries (as transformers'
    ``get_vision_window_index``, on the host)."""
    index, bounds, base = [], [0], 0
    ws = window // merge // patch
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = ws - gh % ws, ws - gw % ws
        nh, nw = (gh + ph) // ws, (gw + pw) // ws
        padded = F.pad(idx, (0, pw, 0, ph), "constant", -100)
        padded = padded.reshape(t, nh, ws, nw, ws).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, ws, ws)
        lengths = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        index.append(flat[flat != -100] + base)
        for n in (lengths.cumsum(0) * unit + bounds[-1]).tolist():
            if n != bounds[-1]:  # an empty window adds no boundary (transformers: unique_consecutive)
                bounds.append(n)
        base += t * gh * gw
    return torch.cat(index), bounds


def _runs(bounds: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, sequences, length) of each run of neighbouring sequences of equal length."""
    runs: list[tuple[int, int, int]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        n = hi - lo
        if runs and runs[-1][2] == n:
            start, count, _ = runs[-1]
            runs[-1] = (start, count + 1, n)
        else:
            runs.append((lo, 1, n))
    return runs


class VisionPlan:
    """What one forward over a list of grids reads besides the pixels, all made from the grids on the host:
    the rotary cos/sin per patch and (Qwen2.5-VL) the window order and its inverse on the device, and the
    runs of equal-length attention sequences (full and windowed) on the host. A CUDA graph of the tower
    keeps the plan of its grids: a replay reads the same tensors."""

    __slots__ = ("cos", "sin", "order", "inverse", "full_runs", "window_runs", "rows")

    def __init__(self, cos, sin, order, inverse, full_runs, window_runs, rows) -> None:
        self.cos, self.sin, self.order, self.inverse = cos, sin, order, inverse
        self.full_runs, self.window_runs, self.rows = full_runs, window_runs, rows


class QwenVisionForward:
    """``visual(pixel_values, grid)`` of a loaded Qwen2-VL / Qwen2.5-VL model: the merged features of all
    items, in order, [tokens, out_hidden]. ``grids``: the items' (t, h, w) on the host. In two parts:
    :meth:`plan` (from the grids alone) and :meth:`run` (the pixels through the tower: device work only,
    no host sync and nothing made on the host, so it can be captured in a CUDA graph)."""

    def __init__(self, visual: nn.Module) -> None:
        self.visual = visual
        cfg = visual.config
        self.merge = int(cfg.spatial_merge_size)
        self.unit = self.merge * self.merge
        self.blocks = list(visual.blocks)
        attn = self.blocks[0].attn
        self.heads = int(attn.num_heads)
        self.full_blocks = set(getattr(visual, "fullatt_block_indexes", None) or ())
        self.windowed = hasattr(visual, "fullatt_block_indexes")  # Qwen2.5-VL
        self.window, self.patch = getattr(cfg, "window_size", 0), int(cfg.patch_size)
        self.inv_freq = visual.rotary_pos_emb.inv_freq
        self.rotary = rotary  # the eager ops until use_ops: a fused kernel set replaces them
        self.quick_gelu = self.silu_mul = None
        self.mlp_kind = [_mlp_kind(b.mlp) for b in self.blocks]

    def use_ops(self, rotary_fn=None, quick_gelu_fn=None, silu_mul_fn=None) -> None:
        """Run the rotary, and the activation between the MLP's projections (Qwen2-VL's QuickGELU between fc1
        and fc2, Qwen2.5-VL's SiLU gate times up), with these functions instead of the eager ops: the engine
        passes :mod:`vlora.engine.fused_ops`' kernels on CUDA, which give the same bits in one launch each
        (eager takes about a dozen fp32 kernels per block for the rotary, three for QuickGELU). The
        projections stay the model's modules, so vision-side LoRA wrappers inside them work unchanged. A CUDA
        graph captured before keeps the ops it was captured with."""
        self.rotary = rotary_fn or rotary
        self.quick_gelu, self.silu_mul = quick_gelu_fn, silu_mul_fn

    def __call__(self, pixel_values: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.run(pixel_values, self.plan(grids, pixel_values.device))

    def plan(self, grids: Sequence[Sequence[int]], device: torch.device) -> VisionPlan:
        grids = tuple(tuple(int(x) for x in g) for g in grids)
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # one attention sequence per frame
        full = [0]
        for n in lengths:
            full.append(full[-1] + n)
        pos = _to(position_ids(grids, self.merge), device)
        freqs = pos.unsqueeze(-1).float() * self.inv_freq.float()  # [N, 2, hd/4]
        emb = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([emb, emb], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        order = inverse = None
        windows = full
        if self.windowed:
            index, windows = window_index(grids, self.merge, self.window, self.patch)
            order = _to(index, device)
            inverse = torch.argsort(order)
            n_rows = full[-1]
            cos, sin = (t.reshape(n_rows // self.unit, self.unit, -1)[order].reshape(n_rows, -1) for t in (cos, sin))
        return VisionPlan(cos, sin, order, inverse, _runs(full), _runs(windows), full[-1])

    def run(self, pixel_values: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        v = self.visual
        x = v.patch_embed(pixel_values)
        n_rows = x.shape[0]
        if plan.order is not None:
            x = x.reshape(n_rows // self.unit, self.unit, -1)[plan.order].reshape(n_rows, -1)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            for i, blk in enumerate(self.blocks):
                runs = plan.window_runs if self.windowed and i not in self.full_blocks else plan.full_runs
                x = x + self._attention(blk.attn, blk.norm1(x), plan.cos, plan.sin, runs)
                x = x + self._mlp(blk.mlp, self.mlp_kind[i], blk.norm2(x))
        merged = v.merger(x)
        if plan.inverse is not None:
            merged = merged[plan.inverse]
        return merged

    def _mlp(self, mlp: nn.Module, kind: str, h: torch.Tensor) -> torch.Tensor:
        if kind == "quick_gelu" and self.quick_gelu is not None:
            return mlp.fc2(self.quick_gelu(mlp.fc1(h)))
        if kind == "silu_gate" and self.silu_mul is not None:
            return mlp.down_proj(self.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        return mlp(h)

    def _attention(self, attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   runs: list[tuple[int, int, int]]) -> torch.Tensor:
        n = h.shape[0]
        q, k, val = attn.qkv(h).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = self.rotary(q, k, cos, sin)
        hd = q.shape[-1]
        scale = getattr(attn, "scaling", hd ** -0.5)
        parts = []
        for start, count, length in runs:
            rows = slice(start, start + count * length)

            def seqs(t: torch.Tensor) -> torch.Tensor:  # [count, heads, length, hd]
                return t[rows].reshape(count, length, self.heads, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(seqs(q), seqs(k), seqs(val), scale=scale)
            parts.append(o.transpose(1, 2).reshape(count * length, self.heads * hd))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return attn.proj(out)


def _mlp_kind(mlp: nn.Module) -> str:
    """How a block's MLP computes, where :meth:`QwenVisionForward.use_ops` may fuse its activation:
    ``quick_gelu`` (Qwen2-VL's fc1, QuickGELU, fc2), ``silu_gate`` (Qwen2.5-VL's down(silu(gate) * up)), or
    ``module`` (anything else: the module's own forward)."""
    # By class name: transformers' SiLU activation is nn.SiLU in some releases and its own class in others.
    act = type(getattr(mlp, "act", None)).__name__
    if act == "QuickGELUActivation" and hasattr(mlp, "fc1") and hasattr(mlp, "fc2"):
        return "quick_gelu"
    act = type(getattr(mlp, "act_fn", None)).__name__
    if act in ("SiLU", "SiLUActivation") and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "silu_gate"
    return "module"


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built index tensor on ``device``, copied without waiting for the device."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def encode_features(forward: QwenVisionForward, pixel_values: torch.Tensor, grid: torch.Tensor,
                    merge: int) -> list[torch.Tensor]:
    """Each item's merged features, split on the host-known grid."""
    rows = grid.tolist()
    merged = forward(pixel_values, rows)
    return list(torch.split(merged, [t * h * w // (merge * merge) for t, h, w in rows]))


def vision_forward(visual: nn.Module) -> QwenVisionForward:
    """The model's :class:`QwenVisionForward`, made once and kept on the module."""
    f = visual.__dict__.get("_vlora_forward")
    if f is None:
        f = visual.__dict__["_vlora_forward"] = QwenVisionForward(visual)
    return f
