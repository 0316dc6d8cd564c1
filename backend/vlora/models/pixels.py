"""Image preprocessing on the model's device, bit-exact against Pillow's resize.

The slow Hugging Face processors resize with Pillow (bicubic, on 8-bit pixels) and then rescale and normalise
in NumPy on the CPU: 7-36 ms of a 336 px LLaVA request's first token on an H200's host, and 80+ ms of a
16-frame Qwen2-VL video. Here the decoded pixels (uint8, from the image workers) go to the device once and
everything after runs there:

- :func:`resize_uint8` is Pillow's 8-bit convolution resize (``Resample.c``): the same filter weights,
  computed in double precision in the same order and rounded to Pillow's 22-bit fixed point, applied as a
  horizontal then a vertical pass, each rounded and clipped to 8 bits as Pillow does. The passes run as
  float64 matrix products over the image's rows (every product and sum is an integer below 2**53, so the
  result is exact), on any device; tests/unit/test_pixels.py holds it equal to Pillow byte for byte. On a
  CPU, Pillow itself runs (the same bytes, faster there).
- rescale and normalise in float32 as the processors do (``x * (1/255)`` in float64, then ``(x - mean) / std``).
- LLaVA's CLIP layout (shortest edge, centre crop) and Qwen2-VL's patches (``smart_resize``'s size, frames
  paired along time, the merge-blocked patch order) are built from these in the families.
"""
from __future__ import annotations

import math
import threading
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
BICUBIC_SUPPORT = 2.0
_A = -0.5  # Pillow's bicubic parameter
ROW_CHUNK = 512  # rows per horizontal-pass product (bounds the float64 copy of a large image)


def _bicubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    near = ((_A + 2.0) * x - (_A + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * _A
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@lru_cache(maxsize=256)
def resize_weights(in_size: int, out_size: int) -> np.ndarray:
    """[out_size, in_size] float64 of Pillow's integer coefficients (22-bit fixed point) for a bicubic resize
    of one axis: ``precompute_coeffs`` and ``normalize_coeffs_8bpc`` of Pillow's Resample.c."""
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = BICUBIC_SUPPORT * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    xx = np.arange(out_size, dtype=np.float64)
    center = (xx + 0.5) * scale
    ss = 1.0 / filterscale
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    taps = np.arange(ksize)
    live = taps[None, :] < xmax[:, None]
    w = _bicubic(((taps[None, :] + xmin[:, None]).astype(np.float64) - center[:, None] + 0.5) * ss)
    w = np.where(live, w, 0.0)
    ww = np.cumsum(w, axis=1)[:, -1]  # Pillow sums the weights in order
    w = np.where(ww[:, None] != 0.0, w / np.where(ww == 0.0, 1.0, ww)[:, None], w)
    one = float(1 << PRECISION_BITS)
    k = np.where(w < 0, np.trunc(-0.5 + w * one), np.trunc(0.5 + w * one))
    k = np.where(live, k, 0.0)
    out = np.zeros((out_size, in_size), dtype=np.float64)
    cols = taps[None, :] + xmin[:, None]
    rows = np.broadcast_to(np.arange(out_size)[:, None], cols.shape)
    out[rows[live], cols[live]] = k[live]
    return out


def _clip8(acc: torch.Tensor) -> torch.Tensor:
    """Pillow's ``clip8``: the fixed-point sum (rounding bias included) to 8 bits."""
    return torch.floor(acc * (1.0 / (1 << PRECISION_BITS))).clamp_(0, 255)


def _pass(x: torch.Tensor, weights: np.ndarray) -> torch.Tensor:
    """One axis: x [..., n] float64 of 8-bit values -> [..., m] rounded and clipped as Pillow does."""
    w = torch.from_numpy(weights).to(x.device, non_blocking=True).t()
    bias = float(1 << (PRECISION_BITS - 1))
    if x.dim() == 2 or x.shape[0] <= ROW_CHUNK:
        return _clip8(x @ w + bias)
    return torch.cat([_clip8(x[i:i + ROW_CHUNK] @ w + bias) for i in range(0, x.shape[0], ROW_CHUNK)])


def resize_uint8(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[H, W, C] uint8 -> [height, width, C] uint8, as ``PIL.Image.resize((width, height), BICUBIC)``, on
    the image's device."""
    h, w, c = image.shape
    if (h, w) == (height, width):
        return image
    x = image.to(torch.float64)
    if w != width:  # Pillow runs the horizontal pass first, and only the passes whose size changes
        x = _pass(x.permute(0, 2, 1), resize_weights(w, width)).permute(0, 2, 1)  # [h, width, c]
    if h != height:
        x = _pass(x.permute(2, 1, 0), resize_weights(h, height)).permute(2, 1, 0)  # [height, width, c]
    return x.to(torch.uint8)


def pil_resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The same through Pillow (CPU tensors)."""
    from PIL import Image

    if tuple(image.shape[:2]) == (height, width):
        return image
    out = Image.fromarray(image.numpy()).resize((width, height), Image.BICUBIC)
    return torch.from_numpy(np.asarray(out).copy())


def resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Pillow's bicubic resize of an [H, W, 3] uint8 tensor: Pillow itself on a CPU, :func:`resize_uint8`
    on an accelerator; the same bytes either way."""
    if image.device.type == "cpu":
        return pil_resize(image, height, width)
    return resize_uint8(image, height, width)


def normalized(images: torch.Tensor, rescale: float, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """[N, H, W, C] uint8 -> [N, C, H, W] float32: ``x * rescale`` (in float64, as the processors do), then
    ``(x - mean) / std`` in float32."""
    x = images.permute(0, 3, 1, 2).to(torch.float64).mul_(rescale).to(torch.float32)
    m = torch.tensor(list(mean), dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(list(std), dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)  # in place: the same arithmetic, two fewer image-sized temporaries


def to_device(image, device: torch.device) -> torch.Tensor:
    """A decoded RGB PIL image (or HxWx3 array) as an [H, W, 3] uint8 tensor on ``device``."""
    if hasattr(image, "convert") and image.mode != "RGB":  # decoded images are RGB already: no copy of them
        image = image.convert("RGB")
    arr = np.array(image, dtype=np.uint8)
    t = torch.from_numpy(arr)
    return t if device.type == "cpu" else t.to(device)


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """transformers' ``get_resize_output_image_size(default_to_square=False)``: the short side to ``edge``,
    the long side scaled and truncated."""
    short, long = (height, width) if height <= width else (width, height)
    new_short, new_long = edge, int(edge * long / short)
    return (new_short, new_long) if height <= width else (new_long, new_short)


def center_crop(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """transformers' ``center_crop`` of an [H, W, C] image (zero padding where it is smaller)."""
    h, w = image.shape[:2]
    if h < height or w < width:
        padded = image.new_zeros((max(h, height), max(w, width), image.shape[2]))
        top, left = (max(h, height) - h) // 2, (max(w, width) - w) // 2
        padded[top:top + h, left:left + w] = image
        image, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - height) // 2, (w - width) // 2
    return image[top:top + height, left:left + width]


def patchify(frames: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2-VL's patches of one image or clip: [T, C, H, W] (T padded to a multiple of ``temporal`` by
    repeating the last frame) -> ([grid_t * grid_h * grid_w, C * temporal * patch * patch], [t, h, w])."""
    if pad := -frames.shape[0] % temporal:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t, c, h, w = frames.shape
    gt, gh, gw = t // temporal, h // patch, w // patch
    x = frames.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * temporal * patch * patch).contiguous(), [gt, gh, gw]


# -- the families' layouts ----------------------------------------------------------------------------------

BICUBIC = 3  # PIL.Image.BICUBIC, as the processors store ``resample``


def _setting(obj, key: str):
    """A processor's size field (a dict in some transformers releases, a SizeDict in others)."""
    if obj is None:
        return None
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _bicubic_setting(resample) -> bool:
    """A processor's ``resample``: PIL's BICUBIC (3, as an int or enum) or torchvision's ``InterpolationMode.BICUBIC``."""
    value = getattr(resample, "value", resample)
    return value == BICUBIC or (isinstance(value, str) and value.lower() == "bicubic")


def clip_layout(processor) -> "tuple[int, tuple[int, int], float, tuple, tuple] | None":
    """(shortest edge, (crop height, width), rescale factor, mean, std) of a CLIP-style image processor that
    this module reproduces (bicubic, shortest-edge resize, centre crop, rescale, normalise, RGB); None for any
    other setting (the processor itself then runs)."""
    edge = _setting(processor.size, "shortest_edge")
    crop = (_setting(processor.crop_size, "height"), _setting(processor.crop_size, "width"))
    if (not edge or None in crop or not _bicubic_setting(getattr(processor, "resample", None))
            or not getattr(processor, "do_resize", True) or not getattr(processor, "do_center_crop", True)
            or not getattr(processor, "do_rescale", True) or not getattr(processor, "do_normalize", True)):
        return None
    return int(edge), (int(crop[0]), int(crop[1])), float(processor.rescale_factor), tuple(processor.image_mean), tuple(processor.image_std)


def clip_pixel_values(images: Sequence, layout, device: torch.device) -> torch.Tensor:
    """LLaVA's pixel_values [N, 3, crop h, crop w] float32 on ``device`` for decoded RGB images, as the CLIP
    image processor makes them (:func:`clip_layout`)."""
    edge, (ch, cw), rescale, mean, std = layout
    out = []
    for image in images:
        x = to_device(image, device)
        h, w = shortest_edge_size(x.shape[0], x.shape[1], edge)
        out.append(center_crop(resize(x, h, w), ch, cw))
    return normalized(torch.stack(out), rescale, mean, std)


def qwen_layout(processor) -> "dict | None":
    """The Qwen2-VL image processor's settings this module reproduces (bicubic, ``smart_resize`` within its pixel
    bounds, rescale, normalise, patches); None for any other setting."""
    lo = _setting(processor.size, "shortest_edge") or getattr(processor, "min_pixels", None)
    hi = _setting(processor.size, "longest_edge") or getattr(processor, "max_pixels", None)
    if (not lo or not hi or not _bicubic_setting(getattr(processor, "resample", None))
            or getattr(processor, "cap_pixels_per_frame", None)
            or not getattr(processor, "do_resize", True) or not getattr(processor, "do_rescale", True)
            or not getattr(processor, "do_normalize", True)):
        return None
    return {"min_pixels": int(lo), "max_pixels": int(hi), "patch": int(processor.patch_size),
            "merge": int(processor.merge_size), "temporal": int(processor.temporal_patch_size),
            "rescale": float(processor.rescale_factor), "mean": tuple(processor.image_mean), "std": tuple(processor.image_std)}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: both sides multiples of ``factor``, the area within the pixel bounds, the
    aspect ratio kept as closely as that allows (images past an aspect ratio of 200 never get here:
    ``vlora.models.images`` refuses those past 100)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_size(height: int, width: int, layout: dict) -> tuple[int, int]:
    """The size Qwen2-VL's image processor resizes an image to."""
    return smart_resize(height, width, layout["patch"] * layout["merge"], layout["min_pixels"], layout["max_pixels"])


def qwen_image_patches(images: Sequence, layout: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [patches, C * temporal * patch^2] float32 on ``device``, image_grid_thw [n, 3] int64 on the
    CPU) of decoded RGB images, as Qwen2-VL's image processor makes them (each image its own frame pair)."""
    patches, grids = [], []
    for image in images:
        x = to_device(image, device)
        h, w = qwen_size(x.shape[0], x.shape[1], layout)
        frame = normalized(resize(x, h, w)[None], layout["rescale"], layout["mean"], layout["std"])
        flat, grid = patchify(frame, layout["patch"], layout["merge"], layout["temporal"])
        patches.append(flat)
        grids.append(grid)
    return torch.cat(patches), torch.tensor(grids, dtype=torch.int64)


def qwen_video_patches(frames: Sequence, layout: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_videos, video_grid_thw [1, 3] on the CPU) of one video's decoded frames (all of one size),
    as Qwen2-VL's video processor makes them: every frame resized to the first one's ``smart_resize`` size,
    frames paired along time (the last repeated to an even count)."""
    xs = [to_device(f, device) for f in frames]
    h, w = qwen_size(xs[0].shape[0], xs[0].shape[1], layout)
    clip = normalized(torch.stack([resize(x, h, w) for x in xs]), layout["rescale"], layout["mean"], layout["std"])
    flat, grid = patchify(clip, layout["patch"], layout["merge"], layout["temporal"])
    return flat, torch.tensor([grid], dtype=torch.int64)


def video_fast_path(processor, frames: Sequence, layout: dict) -> bool:
    """Whether :func:`qwen_video_patches` gives what ``processor`` (a video processor whose :func:`qwen_layout`
    is ``layout``) gives for ``frames``. A processor that resizes with Pillow's bicubic
    (``resizes_with_pillow``: :class:`vlora.models.qwen_processing.QwenVideoProcessorPil`, what machines without
    torchvision use) always; transformers' own video processor (torchvision's antialiased bicubic, which this
    module does not reproduce) only when no frame is resized: every frame already at the size the processor
    keeps (sides multiples of patch x merge, within the pixel bounds), as a camera's fixed frame size is."""
    if getattr(processor, "resizes_with_pillow", False):
        return True
    sizes = {(f.size[1], f.size[0]) if hasattr(f, "size") and not hasattr(f, "shape") else tuple(f.shape[:2]) for f in frames}
    return len(sizes) == 1 and qwen_size(*next(iter(sizes)), layout) == next(iter(sizes))


_streams = threading.local()  # each thread's preprocessing stream (DeviceWork)


class DeviceWork:
    """Preprocessing on ``device`` from any thread: a CUDA stream per thread, so an image worker's kernels run
    beside the engine's step; on exit the stream is waited for (the tensors are complete when the request is
    submitted) and each tensor handed out with :meth:`done` is marked as used by the engine's stream (the
    caching allocator must not hand its memory to this stream's next allocation while the step reads it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ctx = None

    def __enter__(self) -> "DeviceWork":
        if self.device.type == "cuda":
            stream = getattr(_streams, "stream", None)
            if stream is None or stream.device != self.device:
                stream = _streams.stream = torch.cuda.Stream(self.device)
            self._ctx = torch.cuda.stream(stream)
            self._ctx.__enter__()
        return self

    def done(self, t: "torch.Tensor | None") -> "torch.Tensor | None":
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.default_stream(t.device))
        return t

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            stream = torch.cuda.current_stream(self.device)
            self._ctx.__exit__(*exc)
            stream.synchronize()
