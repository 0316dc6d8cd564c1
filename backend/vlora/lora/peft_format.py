"""PEFT's weights format as the served model reads it: the file names of an adapter folder, the safetensors
file's key names and what each names, the header's and the tensors' checks, and AdapterError, which every
check of an adapter raises.

Key names. PEFT saves ``base_model.model.<module path>.lora_{A,B}.weight``. For
``LlavaForConditionalGeneration`` under transformers 5 the module path of a decoder projection is
``model.language_model.layers.N.{self_attn,mlp}.X_proj``; adapters trained under transformers 4
(before the LLaVA refactor) use ``language_model.model.layers.N...``. Both are read. Vision-side
projections (the vision tower's blocks, the projector or merger) are read where the server describes
them (:class:`VisionSites`, built by the model family from the loaded model's own module names); they
are kept as (layer, target) pairs like the decoder's, the target a family-given name such as
``vision.self_attn.q_proj`` or ``projector.linear_1``. Every other key (embeddings, lm_head, the patch
embedding, DoRA magnitudes, biases, a module the served model does not have) is refused by name.

The safetensors file. Its header is read first (``_safetensors_header``: every entry has a shape); the data
only once every key and shape was checked, and only up to what those shapes can hold (``_whole_file``: 8
bytes an element); each tensor must match its header and hold finite floating-point values (``_tensor``).

GIL. The parse and the checks take a few torch calls per adapter, not a few per tensor: each torch call that
runs an operator releases the GIL and must take it back, which beside a busy thread (the engine's) waits up to
the switch interval (`engine.switch_interval_ms`) each time. The tensors are indexed out of a few row views of the file's buffer
(``_parse_safetensors``), their norms taken in one call per dtype (``_l2_norms``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from vlora.errors import InvalidRequest
from vlora.files import FileTooLarge, OneRead
from vlora.lora.carve import ALIGN, aligned, carve

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_SAFETENSORS_HEADER_BYTES = 16 << 20  # a PEFT adapter's header is a few hundred bytes per tensor

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")

# base_model.model.<module path>.lora_A|B.weight
_KEY = re.compile(r"^base_model\.model\.(?P<path>[A-Za-z0-9_.]+)\.lora_(?P<ab>[AB])\.weight$")
# A decoder projection's module path: one of the two LLaVA decoder prefixes + layers.N.<block>.<proj>
_DECODER_PATH = re.compile(
    r"^(?P<prefix>model\.language_model|language_model\.model)\.layers\.(?P<layer>\d{1,6})\."
    r"(?P<block>self_attn|mlp)\.(?P<module>[A-Za-z0-9_]+)$"
)


class AdapterError(InvalidRequest):
    """An adapter that cannot be served; the message names the adapter and the problem."""


@dataclass(frozen=True)
class VisionSites:
    """The vision-side projections of the served model that an adapter may target.

    ``paths`` maps each projection's module path, as the loaded model names it
    (``model.vision_tower.encoder.layers.3.self_attn.q_proj``), to its (layer, target) pair; the target
    names the projection in every layer (``vision.self_attn.q_proj``; the projector's or merger's have
    layer 0). ``aliases`` are (older prefix, current prefix) pairs: a PEFT key carries the module path of
    the transformers version the adapter was trained with, which the first alias that turns it into a
    path of ``paths`` rewrites.
    """

    paths: Mapping[str, tuple[int, str]]
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({t for _, t in self.paths.values()}))

    def resolve(self, path: str) -> Optional[tuple[str, int, str]]:
        """(current module path, layer, target) of a key's module path, or None if it names no site."""
        if path in self.paths:
            return (path, *self.paths[path])
        for old, new in self.aliases:
            if path.startswith(old) and new + path[len(old):] in self.paths:
                current = new + path[len(old):]
                return (current, *self.paths[current])
        return None


def _target_of(path: str, key: str, where: str, supported: tuple[str, ...], num_layers: int,
               vision: Optional[VisionSites]) -> tuple[int, str, tuple[str, str]]:
    """(layer, target, module names) of the module path of ``key``; the names are the path as the adapter
    spells it and as the served model does, which rank_pattern / alpha_pattern keys are matched against.
    Raises AdapterError naming the module when the server cannot apply LoRA there."""
    m = _DECODER_PATH.match(path)
    if m is not None:
        layer, block, module = int(m["layer"]), m["block"], m["module"]
        expected_block = "self_attn" if module in ATTN_MODULES else "mlp" if module in MLP_MODULES else None
        if expected_block != block or module not in supported:
            raise AdapterError(f"{where}: unsupported target module {block}.{module} in {key!r}; "
                               f"supported: {list(supported)}")
        if layer >= num_layers:
            raise AdapterError(f"{where}: {key!r} names layer {layer}, but the model has {num_layers} layers")
        return layer, module, (path, _modern_name(path))
    site = vision.resolve(path) if vision is not None else None
    if site is None:
        raise AdapterError(f"{where}: unsupported target module {path} in {key!r}: the served model has no such "
                           f"LoRA-targetable projection; supported: {list(supported)}")
    current, layer, target = site
    if target not in supported:
        raise AdapterError(f"{where}: unsupported target module {target} ({path}) in {key!r}: this server applies "
                           f"no LoRA to the vision tower or projector (lora.vision_lora is off); "
                           f"supported: {list(supported)}")
    return layer, target, (path, current)



def _record_weight(found: dict, layer: int, module: str, ab: str, key: str, names: tuple[str, str], where: str) -> None:
    """Note ``key`` as the lora_{ab} weight of (layer, module) in ``found``; AdapterError when another key
    already names the same weight (the old and the new key naming of one module, e.g.
    ``language_model.model.layers.0...`` beside ``model.language_model.layers.0...``): one copy would win
    silently."""
    slot = found.setdefault((layer, module), {})
    if ab in slot:
        raise AdapterError(f"{where}: {slot[ab][0]!r} and {key!r} are the same lora_{ab} weight (of {module} in layer "
                           f"{layer}) under two key namings; keep one")
    slot[ab] = (key, names)


def _modern_name(module_name: str) -> str:
    old = "language_model.model."
    return "model.language_model." + module_name[len(old):] if module_name.startswith(old) else module_name


def _invalid_weights(where: str, why: str) -> AdapterError:
    return AdapterError(f"{where}: {WEIGHTS_FILE} is not a valid safetensors file ({why})")


def _safetensors_header(f: OneRead, where: str) -> tuple[dict[str, Any], bytes]:
    """The header of the safetensors file ``f`` (read from its start: the 8-byte length, then the JSON) and
    the bytes read. Every entry but ``__metadata__`` must have a ``shape`` of non-negative integers; the
    rest (dtypes, offsets) is checked when the whole file is parsed (_parse_safetensors)."""
    head = f.read(8)
    if len(head) < 8:
        raise _invalid_weights(where, f"{len(head)} bytes, shorter than a header")
    n = int.from_bytes(head, "little")
    if n > MAX_SAFETENSORS_HEADER_BYTES or 8 + n > f.size:
        raise _invalid_weights(where, f"a header of {n} bytes in a file of {f.size}")
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise _invalid_weights(where, f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _invalid_weights(where, "its header is not a JSON object")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)):
            raise _invalid_weights(where, f"tensor {key[:80]!r} has no valid shape")
    return header, head + raw


def _whole_file(f: OneRead, header: Mapping[str, Any], header_bytes: bytes, where: str) -> "np.ndarray":
    """All of ``f``, whose header (``header_bytes``, read first) was checked: read in one piece from its
    start, refused unread when its data is larger than the header's tensors can hold (8 bytes an element)
    or grows past that while it is read, and refused when its header is no longer the one checked."""
    limit = 8 * sum(math.prod(e["shape"]) for k, e in header.items() if k != "__metadata__")
    if f.size - len(header_bytes) > limit:
        raise _invalid_weights(where, f"{f.size - len(header_bytes)} bytes of data, more than its tensors' {limit}")
    try:
        data = f.read_all(len(header_bytes) + limit)
    except FileTooLarge:
        raise _invalid_weights(where, f"it grew past {limit} bytes of data while it was read") from None
    if data[:len(header_bytes)].tobytes() != header_bytes:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} changed while it was read; load it again")
    return data


# safetensors' dtype names, as far as this torch has them.
_ST_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("BOOL", "bool")) if hasattr(torch, attr)}


def _parse_safetensors(data, header: Mapping[str, Any], header_len: int, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file read whole into ``data`` (a writable buffer: a uint8 array from
    ``OneRead.read_all``, or a bytearray; its ``header`` parsed from the first
    ``header_len`` bytes), as views of ``data``: no copy. The layout is checked as the safetensors library
    checks it: a known dtype, ``data_offsets`` [begin, end] of exactly the shape's bytes, the tensors one
    after another from the start of the data to its end, with no hole and no overlap. Views at an offset not
    aligned to their element size (a file no safetensors writer makes) are copied out instead.

    A tensor of shape [n, *rest] is rows of a view of the whole buffer as rows of ``rest`` (one per dtype, row
    shape and phase: a few per file), taken by indexing, which keeps the GIL; a ``view(shape)`` per tensor
    would release it and wait to take it back (see the module docstring).

    (safetensors' own ``load`` copies every tensor into a new bytes object, holding the GIL: the adapter loader
    threads, reading side by side, then took turns; on a 2-core machine 8 rank-64 reads at once took 2.5x as
    long as one after another.)"""
    entries = []
    for key, e in header.items():
        if key == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(e.get("dtype"))
        if dtype is None:
            raise _invalid_weights(where, f"tensor {key[:80]!r} has an unknown dtype {str(e.get('dtype'))[:20]!r}")
        offsets = e.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise _invalid_weights(where, f"tensor {key[:80]!r} has no valid data_offsets")
        nbytes = math.prod(e["shape"]) * dtype.itemsize
        if offsets[0] < 0 or offsets[1] - offsets[0] != nbytes:
            raise _invalid_weights(where, f"tensor {key[:80]!r}: data_offsets {offsets} do not hold its shape "
                                          f"{e['shape']} of {e.get('dtype')}")
        entries.append((offsets[0], offsets[1], key, dtype, e["shape"]))
    entries.sort()
    end = 0
    for begin, stop, key, _, _ in entries:
        if begin != end:
            raise _invalid_weights(where, f"tensor {key[:80]!r} starts at {begin}, not where the previous ends ({end})")
        end = stop
    if header_len + end != len(data):
        raise _invalid_weights(where, f"its tensors end at byte {header_len + end} of {len(data)}")
    out: dict[str, torch.Tensor] = {}
    carved: list[tuple[str, tuple[int, torch.dtype, Sequence[int]]]] = []  # aligned tensors, cut out below at once
    for begin, stop, key, dtype, shape in entries:
        at = header_len + begin
        if stop == begin:
            out[key] = torch.empty(shape, dtype=dtype)
        elif at % dtype.itemsize:
            out[key] = torch.frombuffer(bytearray(memoryview(data)[at:stop + header_len]), dtype=dtype).view(shape)
        else:
            carved.append((key, (at // dtype.itemsize, dtype, shape)))
    # torch.frombuffer keeps the GIL; the rows views of carve are a few per file
    views = carve(lambda dtype: torch.frombuffer(data, dtype=dtype, count=len(data) // dtype.itemsize),
                  [item for _, item in carved])
    out.update((key, view) for (key, _), view in zip(carved, views))
    return out


class HostArena:
    """Host buffers that an adapter's converted tensors are carved from, in the order they are loaded: a few
    allocations per adapter instead of one per tensor (256 per rank-64 q/k/v/o adapter), page-locked or not
    (``pin_memory``; the server's host tier is pageable: vlora.lora.transfers.SlotCopies says why). Tensors
    already in the wanted dtype need none: they stay views of the file's buffer. Buffers are ``CHUNK`` bytes, the
    last one the next power of two over what it holds, since PyTorch's pinned memory cache rounds every
    allocation up to a power of two; a tensor larger than a chunk gets its own. The views keep their buffer
    alive."""

    ALIGN = ALIGN  # bytes (vlora.lora.carve.ALIGN): where each tensor starts
    CHUNK = 16 << 20

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]], pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._sizes = [self._aligned(shape, dtype) for shape, dtype in shapes]
        self._next = 0  # index of the next tensor
        self._buffer: Optional[torch.Tensor] = None
        self._offset = 0
        self.buffers = 0  # allocations made (a test's and a benchmark's figure)

    def _aligned(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return aligned(math.prod(shape) * dtype.itemsize)

    def _allocate(self, nbytes: int) -> None:
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._offset = 0
        self.buffers += 1

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor (of ``shape`` and ``dtype``, as declared at construction), a view of a buffer,
        uninitialised."""
        size = self._aligned(shape, dtype)
        if self._next < len(self._sizes) and self._sizes[self._next] != size:
            raise ValueError("HostArena.take: tensors must come in the order they were declared")
        self._next += 1
        if self._buffer is None or self._offset + size > self._buffer.numel():
            rest = sum(self._sizes[self._next - 1:])  # this tensor and those after it
            self._allocate(size if size > self.CHUNK else min(self.CHUNK, 1 << (rest - 1).bit_length()))
        view = self._buffer[self._offset:self._offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        self._offset += size
        return view


def _tensor(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any], key: str, where: str,
            dtype: torch.dtype, arena: Optional[HostArena], norm: float) -> tuple[torch.Tensor, float]:
    """Tensor ``key`` in ``dtype`` (in ``arena`` if given: one copy from the parsed file), and its
    L2 norm ``norm``, taken in fp32 on the file's values by ``_l2_norms`` (every tensor's at once).
    A non-finite value is refused by name.

    The norm is the one pass over the values: it is finite exactly when every value is finite and the
    squares do not overflow fp32; only then is ``isfinite`` (four times the cost) run, to tell the two
    apart. The magnitude check refuses the second."""
    t = tensors.get(key)
    if t is None or list(t.shape) != header[key]["shape"]:  # parsed from the bytes the header was read from
        raise _invalid_weights(where, f"tensor {key!r} does not match its header")
    if not t.is_floating_point():
        raise AdapterError(f"{where}: {key!r} has dtype {t.dtype}; expected a floating-point tensor")
    if not math.isfinite(norm) and not bool(torch.isfinite(t).all()):
        raise AdapterError(f"{where}: {key!r} holds non-finite values")
    if t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu" and (arena is None or not arena.pin_memory):
        return t, norm  # a view of the file's buffer, already one buffer for the adapter: no copy
    if arena is not None:
        out = arena.take(tuple(t.shape), dtype)
        out.copy_(t)
        return out, norm
    return t.to(dtype).contiguous(), norm


def _l2_norms(ts: Sequence[Optional[torch.Tensor]]) -> list[float]:
    """The L2 norm of each tensor of ``ts``, accumulated in fp32 (fp64 for fp64) on its values: NaN where the
    norm is not taken (None, or not floating-point: ``_tensor`` refuses those by name before it reads a
    norm). Infinite when a value is, or when the squares overflow; NaN when a value is.

    One ``_foreach_norm`` per norm dtype, its result in that dtype: the half types are read where they lie, with
    no fp32 copy of the adapter (fp8, which it cannot take, is converted first). A few torch calls per load, not a
    few per tensor: each torch call releases the GIL and must take it back, which beside a busy thread (the
    engine's) waits up to the switch interval each time. The norms come back as one tensor, read with one
    ``tolist``. (Copying the half types into a reused fp32 buffer and norming that took 123 ms for a rank-64
    q/k/v/o adapter of a 7B model, eight loads at once on an H200's host; this, 93 ms.)"""
    out = [math.nan] * len(ts)
    groups: dict[torch.dtype, list[int]] = {}  # norm dtype -> indices
    for i, t in enumerate(ts):
        if t is not None and t.is_floating_point():
            groups.setdefault(_norm_dtype(t), []).append(i)
    order: list[int] = []
    parts: list[torch.Tensor] = []
    for dtype, idx in groups.items():
        srcs = [ts[i] if ts[i].dtype in _FOREACH_NORM_DTYPES else ts[i].to(dtype) for i in idx]
        parts.append(torch.stack(torch._foreach_norm(srcs, 2, dtype=dtype)))
        order += idx
    if parts:
        for i, v in zip(order, torch.cat(parts).tolist()):
            out[i] = v
    return out


_FOREACH_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fp8 it cannot promote


def _norm_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 accumulation for half types and fp32; fp64 stays fp64 (a norm cannot be taken in a narrower type)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
