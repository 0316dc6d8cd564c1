"""What the hardware needs at least, for ``benchmarks/engine_floor.py``: a model's dimensions from its config (the
decoder; the vision tower of LLaVA's CLIP or of Qwen2-VL / Qwen2.5-VL), the bytes and FLOPs they imply, and the floors:

- decode = bytes / copy rate; bytes = decoder weights (every layer's projections and norms) + final norm + LM head +
  the KV cache read for B sequences of that context + B new tokens' KV written (+ the distinct adapters' A and B of
  every targeted projection); embedding rows are left out.
- prefill = FLOPs / matmul rate; FLOPs = 2 * decoder projection parameters * T + causal attention
  2 * 2 * layers * heads * head_dim * T^2 / 2 + the LM head for the last token only (2 * vocab * hidden).
- vision = FLOPs / matmul rate: patch embedding, the encoder layers the feature layer needs (the last one is skipped
  by ``vision_feature_layer = -2``), attention over all patch tokens, the projector. Qwen2-VL / Qwen2.5-VL
  (:class:`QwenVisionDims`): the Conv3d patch embedding, every ViT block's projections and MLP, attention within
  each frame (Qwen2.5-VL: within 112 px windows but in its full-attention blocks), the 2x2 patch merger.
- media = the vision floor of a request's pixels + the prefill floor of its prompt tokens (a TTFT floor;
  preprocessing on the host has none).

The rates are measured in the run (:func:`measure_rates`: a device-to-device copy, read + written; an 8192^3 bf16
matmul).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.common import free_memory

GIB = 2 ** 30
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class ModelDims:
    """The decoder's sizes, from the checkpoint's config.json, and the bytes and FLOPs they imply."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    elt: int  # bytes per weight/cache element

    @classmethod
    def from_config(cls, text: dict, elt: int) -> "ModelDims":
        heads = text["num_attention_heads"]
        return cls(layers=text["num_hidden_layers"], hidden=text["hidden_size"], heads=heads,
                   kv_heads=text.get("num_key_value_heads") or heads,
                   head_dim=text.get("head_dim") or text["hidden_size"] // heads,
                   inter=text["intermediate_size"], vocab=text["vocab_size"], elt=elt)

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each projection."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.inter), "up_proj": (self.hidden, self.inter),
                "down_proj": (self.inter, self.hidden)}

    @property
    def linear_params(self) -> int:
        """Parameters of every layer's projections (what a token's matmuls read)."""
        return self.layers * sum(i * o for i, o in self.module_dims().values())

    @property
    def decoder_bytes(self) -> int:
        return (self.linear_params + 2 * self.layers * self.hidden) * self.elt

    @property
    def head_bytes(self) -> int:
        """LM head and the final norm."""
        return (self.vocab + 1) * self.hidden * self.elt

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.elt

    def adapter_bytes(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        dims = self.module_dims()
        return self.layers * sum(rank * (dims[m][0] + dims[m][1]) for m in targets) * self.elt


@dataclass(frozen=True)
class VisionDims:
    layers: int  # encoder layers that the feature layer needs
    hidden: int
    inter: int
    image_size: int
    patch: int
    class_token: bool
    feature_layers: int  # hidden states concatenated into the projector
    text_hidden: int

    @classmethod
    def from_config(cls, cfg: dict) -> "VisionDims":
        v = cfg["vision_config"]
        fl = cfg.get("vision_feature_layer", -2)
        fls = fl if isinstance(fl, list) else [fl]
        n = v["num_hidden_layers"]
        needed = max((n + 1 + x) if x < 0 else x for x in fls)  # hidden_states[k]: the output of k layers
        return cls(layers=needed, hidden=v["hidden_size"], inter=v["intermediate_size"], image_size=v["image_size"],
                   patch=v["patch_size"], class_token=v.get("model_type", "clip_vision_model") == "clip_vision_model",
                   feature_layers=len(fls), text_hidden=cfg["text_config"]["hidden_size"])

    def flops_per_image(self) -> int:
        patches = (self.image_size // self.patch) ** 2
        t = patches + (1 if self.class_token else 0)
        per_layer = 4 * self.hidden ** 2 + 2 * self.hidden * self.inter
        enc = 2 * t * per_layer * self.layers + self.layers * 2 * 2 * self.hidden * t * t
        embed = 2 * patches * 3 * self.patch ** 2 * self.hidden
        proj = 2 * patches * (self.hidden * self.feature_layers * self.text_hidden + self.text_hidden ** 2)
        return enc + embed + proj


QWEN_TYPES = {"qwen2_vl": "qwen", "qwen2_5_vl": "qwen2.5"}  # model_type -> the results' name suffix
QWEN_IMAGE_SIDE = 448  # px: a multiple of 28 within the processors' bounds, so 32 x 32 patches, 256 tokens


@dataclass(frozen=True)
class QwenVisionDims:
    """Qwen2-VL / Qwen2.5-VL's vision tower: a Conv3d patch embedding over temporal_patch x patch x patch
    pixels, ``depth`` ViT blocks, and the patch merger (merge x merge patches -> one text-width token
    through two linear layers). Attention runs within each frame (temporal slice of the grid); Qwen2.5-VL's
    blocks other than ``full_blocks`` attend within windows of ``window`` x ``window`` merged tokens."""

    model_type: str
    depth: int
    hidden: int
    mlp_params: int  # per token: Qwen2-VL fc1 + fc2 (2 x d x mlp_ratio d), Qwen2.5-VL gate/up/down (3 x d x I)
    patch: int
    temporal_patch: int
    merge: int
    in_channels: int
    text_hidden: int
    window: int  # merged tokens per window side (0: no windowed attention)
    full_blocks: int  # blocks with attention over the whole frame

    @classmethod
    def from_config(cls, cfg: dict) -> "QwenVisionDims":
        v = cfg["vision_config"]
        if cfg["model_type"] == "qwen2_5_vl":
            d = v["hidden_size"]
            return cls(model_type="qwen2_5_vl", depth=v["depth"], hidden=d, mlp_params=3 * d * v["intermediate_size"],
                       patch=v["patch_size"], temporal_patch=v["temporal_patch_size"], merge=v["spatial_merge_size"],
                       in_channels=v.get("in_channels", 3), text_hidden=v["out_hidden_size"],
                       window=v["window_size"] // v["spatial_merge_size"] // v["patch_size"],
                       full_blocks=len(v.get("fullatt_block_indexes") or ()))
        d = v["embed_dim"]
        return cls(model_type="qwen2_vl", depth=v["depth"], hidden=d, mlp_params=2 * d * int(d * v["mlp_ratio"]),
                   patch=v["patch_size"], temporal_patch=v["temporal_patch_size"], merge=v["spatial_merge_size"],
                   in_channels=v.get("in_channels", 3), text_hidden=v["hidden_size"], window=0, full_blocks=v["depth"])

    def _windows_sq(self, h: int, w: int) -> int:
        """Sum over one frame's windows of (patches in the window)^2; windows start at the top left corner."""
        lh, lw, ws = h // self.merge, w // self.merge, self.window
        rows = [min(ws, lh - i) for i in range(0, lh, ws)]
        cols = [min(ws, lw - j) for j in range(0, lw, ws)]
        return sum((r * c * self.merge ** 2) ** 2 for r in rows for c in cols)

    def flops(self, grids: list) -> int:
        """FLOPs of encoding items of grid (t, h, w) patches each (an image has t = 1)."""
        d, total = self.hidden, 0
        for t, h, w in grids:
            n = t * h * w
            embed = 2 * n * self.in_channels * self.temporal_patch * self.patch ** 2 * d
            linear = 2 * n * (4 * d * d + self.mlp_params) * self.depth
            full = 4 * d * t * (h * w) ** 2
            windowed = 4 * d * t * self._windows_sq(h, w) if self.window else full
            attn = self.full_blocks * full + (self.depth - self.full_blocks) * windowed
            c = d * self.merge ** 2
            merger = 2 * (n // self.merge ** 2) * (c * c + c * self.text_hidden)
            total += embed + linear + attn + merger
        return total

    def flops_per_image(self, side: int = QWEN_IMAGE_SIDE) -> int:
        return self.flops([(1, side // self.patch, side // self.patch)])


def vision_dims(cfg: dict):
    """The vision tower's dimensions of the checkpoint's family (LLaVA or Qwen2-VL)."""
    return QwenVisionDims.from_config(cfg) if cfg.get("model_type") in QWEN_TYPES else VisionDims.from_config(cfg)


def decode_floor(d: ModelDims, batch: int, context: int, bw_gbs: float, adapters: int = 0, rank: int = 0,
                 targets: tuple[str, ...] = LORA_TARGETS) -> dict:
    """The least time of one decode step: every byte it must move, at the measured copy rate."""
    parts = {"weights": d.decoder_bytes + d.head_bytes, "kv_read": batch * context * d.kv_bytes_per_token,
             "kv_write": batch * d.kv_bytes_per_token, "adapters": adapters * d.adapter_bytes(rank, targets) if adapters else 0}
    total = sum(parts.values())
    return {"floor_ms": total / (bw_gbs * 1e9) * 1e3, "bytes": total, "parts": parts}


def prefill_floor(d: ModelDims, tokens: int, tflops: float) -> dict:
    """The least time of one prompt's prefill: its FLOPs at the measured matmul rate."""
    parts = {"projections": 2 * d.linear_params * tokens,
             "attention": 2 * 2 * d.layers * d.heads * d.head_dim * tokens * tokens // 2,
             "lm_head": 2 * d.vocab * d.hidden}
    total = sum(parts.values())
    return {"floor_ms": total / (tflops * 1e12) * 1e3, "flops": total, "parts": parts}


def vision_floor(v: VisionDims, images: int, tflops: float) -> dict:
    flops = images * v.flops_per_image()
    return {"floor_ms": flops / (tflops * 1e12) * 1e3, "flops": flops}


def plan_slots(want: int, total_bytes: int, fraction: float, weight_bytes: int, slot_bytes: int, reserve: int) -> int:
    """Adapter slots that fit beside the weights and ``reserve`` in ``fraction`` of the device (>= 1)."""
    room = fraction * total_bytes - weight_bytes - reserve
    return max(1, min(want, int(room // max(slot_bytes, 1))))


def media_floor(dims: ModelDims, vdims, row: dict, tflops: float) -> dict:
    """The vision tower's FLOPs on the row's pixels + the prefill's on its prompt, at the matmul rate."""
    if isinstance(vdims, QwenVisionDims):
        vision = vdims.flops([tuple(g) for g in row["grid"]])
    else:
        vision = row["images"] * vdims.flops_per_image()
    pre = prefill_floor(dims, row["prompt_tokens"], tflops)
    return {"vision_floor_ms": vision / (tflops * 1e12) * 1e3, "vision_flops": vision,
            "prefill_floor_ms": pre["floor_ms"], "floor_ms": vision / (tflops * 1e12) * 1e3 + pre["floor_ms"]}


def measure_rates(device) -> dict:
    """Copy rate (GB/s, read + written) and bf16 matmul rate (TFLOP/s) of this device. On a CPU, small
    eager measurements (the smoke test's), so that the floor arithmetic runs end to end."""
    import torch

    if device.type == "cuda":
        from vlora.atmm.timing import copy_bandwidth_gbs, matmul_tflops

        with torch.cuda.device(device):
            bw = copy_bandwidth_gbs(2 * GIB)  # a 1 GiB source copied into a 1 GiB destination
            tf = matmul_tflops(8192, torch.bfloat16)
        free_memory(device)
        return {"copy_gbs": bw, "matmul_tflops": tf, "copy_bytes": 2 * GIB, "matmul": "8192^3 bf16"}
    a = torch.ones(8 << 20, dtype=torch.float32)
    b = torch.empty_like(a)
    t = _best_of(lambda: b.copy_(a), 5)
    m = torch.randn(256, 256)
    tm = _best_of(lambda: m @ m, 5)
    return {"copy_gbs": 2 * a.numel() * 4 / t / 1e9, "matmul_tflops": 2 * 256 ** 3 / tm / 1e12,
            "copy_bytes": 2 * a.numel() * 4, "matmul": "256^3 fp32 (CPU)"}


def _best_of(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)
