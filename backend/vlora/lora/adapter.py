"""PEFT LoRA adapter folders: finding them safely under the adapter root, reading and checking them.

An adapter is a folder ``<root>/<name>/`` holding ``adapter_config.json`` and
``adapter_model.safetensors`` as PEFT writes them, and optionally vision task heads
(``vlora_heads.json`` + ``vlora_heads.safetensors``, see :mod:`vlora.heads`). Nothing else in the folder is read; pickle weights
(``adapter_model.bin``) are refused, because unpickling can run code.

Key names and the safetensors file's checks: peft_format.py; the LoRA settings of adapter_config.json
(rank, scale, rank_pattern / alpha_pattern): peft_config.py.

Reading. Each file is opened once, without following a final symlink, and read through that one
descriptor (:mod:`vlora.files`, :mod:`vlora.lora.files`): the bytes read are the bytes parsed and the bytes hashed into the
adapter's ``version``, so a file changed or swapped while it is read cannot pair its old weights with a
new version. The safetensors header is read first and every key and shape checked against the served
model; the tensor data is read only then, and only up to what those shapes can hold (8 bytes an element),
so a file padded out is refused before it is read into memory.

Magnitude. A module's delta is ``scale * B @ A``; its gain (operator norm) is at most
``|scale| * ||B||_F * ||A||_F``. An adapter is refused at load when a scale is not finite or above
``MAX_LORA_SCALE``, or when that bound exceeds ``MAX_LORA_GAIN`` (1e4; the demo adapters are below 20):
such an adapter would drive activations to inf/NaN and fail every batch it joins. The norms are taken in fp32
(fp64 for fp64 weights) for all of an adapter's weights at once, in a few batched torch calls
(peft_format._l2_norms), then checked in load order. On CUDA a request's read leaves the values' checks to its
slot copy, which takes the same norms on the device from what it wrote (``check_slot_norms``; the norms were
about half of a read's host time): the adapter is refused before any step reads the slot.
"""
from __future__ import annotations

import math
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from vlora.files import FileTooLarge, NotARegularFile, OneRead, json_object, read_once
from vlora.lora.files import ContentVersion
from vlora.lora.peft_config import _lora_settings, _pattern_value
from vlora.lora.peft_format import (  # noqa: F401 (ATTN_MODULES, MLP_MODULES: re-exported)
    _KEY,
    ATTN_MODULES,
    CONFIG_FILE,
    MLP_MODULES,
    WEIGHTS_FILE,
    AdapterError,
    VisionSites,
    _ST_DTYPES,
    _parse_safetensors,
    _safetensors_header,
    _record_weight,
    _target_of,
    HostArena,
    _l2_norms,
    _tensor,
    _whole_file,
)

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 1 << 20
MAX_LORA_SCALE = 1e4  # |lora_alpha / r| (or / sqrt(r) with rsLoRA)
MAX_LORA_GAIN = 1e4  # |scale| * ||B||_F * ||A||_F, an upper bound on how much a module's delta amplifies x


@dataclass(frozen=True)
class LoraPair:
    """One module's LoRA weights in one layer: ``delta_y = (x @ a.T) @ b.T * scale``.

    Shape: a [r, d_in], b [d_out, r], float32 on the CPU.
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class AdapterWeights:
    """A checked adapter, ready to be copied into a GPU slot.

    ``pairs`` is keyed by (layer index, module name such as "q_proj"); layers or modules the adapter
    does not touch are absent. ``ranks`` is the largest rank of each target module over its layers.
    """

    name: str
    dir: Path
    pairs: dict[tuple[int, str], LoraPair]
    ranks: dict[str, int]
    max_rank: int
    target_modules: tuple[str, ...]
    config: Mapping[str, Any] = field(default_factory=dict, repr=False)
    heads: Mapping[str, Any] = field(default_factory=dict, repr=False)  # task -> vlora.heads.TaskHead
    vision_targets: tuple[str, ...] = ()  # the targets of target_modules on the vision tower and projector
    # What these weights were read from: the sha256 of the bytes of adapter_config.json, the safetensors
    # file and the task-head files, as read (vlora.lora.files.ContentVersion). The prefix and encoder caches
    # key on name@version: changed content (even with the same size, mtime and inode) gets new keys; the
    # same bytes reloaded keep theirs, as their cached keys and values are still exact. "" for weights
    # built in memory: LoraManager.register gives those a version of their own.
    version: str = ""
    # Whether the values were checked on the host (finite, and each module's gain bound; see the module
    # docstring). False: read with ``check_values=False``, for a slot copy that checks them on the device
    # (LoraManager on CUDA) before any request reads the slot.
    values_checked: bool = True

    def scale(self, layer: int, module: str) -> float:
        return self.pairs[(layer, module)].scale

    @property
    def num_parameters(self) -> int:
        return sum(p.a.numel() + p.b.numel() for p in self.pairs.values())


def validate_adapter_name(name: Any) -> str:
    """Return ``name`` if it is a well-formed adapter name, else raise AdapterError."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name) or name in (".", ".."):
        shown = repr(name)[:80] if isinstance(name, str) else type(name).__name__
        raise AdapterError(f"invalid adapter name {shown}: use 1 to 128 characters from A-Z a-z 0-9 . _ - "
                           f"(not '.' or '..')")
    return name


def resolve_adapter_dir(root: Path, name: str, root_resolved: Optional[Path] = None) -> Path:
    """The folder of adapter ``name`` under ``root``, resolved; refuses anything that leaves ``root``.

    The name is checked against ``[A-Za-z0-9._-]{1,128}`` first, so separators and absolute paths never
    reach the file system. Symlinks are followed, and the target must still be inside the resolved
    root. An adapter that does not exist and one that escapes both read "unknown adapter": the
    message shows nothing about the file system.

    ``root_resolved``: ``root`` already resolved by the caller (a load resolves it once). A folder that is no
    symlink costs one ``lstat``: every system call releases the GIL and takes it back, which on a loader thread
    beside a busy engine thread waits for it each time (benchmarks/NOTES.md).
    """
    validate_adapter_name(name)
    root_resolved = Path(root).resolve() if root_resolved is None else root_resolved
    candidate = root_resolved / name
    try:
        mode = os.lstat(candidate).st_mode
    except OSError:
        raise AdapterError(f"unknown adapter {name!r}") from None
    if stat.S_ISDIR(mode):  # a folder of the resolved root, not a link: resolved as it is
        return candidate
    try:
        resolved = candidate.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise AdapterError(f"unknown adapter {name!r}") from None
    if not resolved.is_relative_to(root_resolved) or resolved == root_resolved or not resolved.is_dir():
        raise AdapterError(f"unknown adapter {name!r}")
    return resolved


def list_adapters(root: Path) -> list[str]:
    """Names of the folders under ``root`` that look like adapters (have adapter_config.json)."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = []
    for child in sorted(root.iterdir()):
        if ADAPTER_NAME.fullmatch(child.name) and child.name not in (".", ".."):
            try:
                d = resolve_adapter_dir(root, child.name)
            except AdapterError:
                continue
            if (d / CONFIG_FILE).is_file():
                names.append(child.name)
    return names


def load_adapter(
    root: Path,
    name: str,
    *,
    num_layers: int,
    module_dims: Mapping[str, tuple[int, int]],
    max_rank: int,
    supported_modules: Iterable[str],
    vision: Optional[VisionSites] = None,
    dtype: torch.dtype = torch.float32,
    pin_memory: bool = False,
    one_buffer: Optional[bool] = None,
    check_values: bool = True,
) -> AdapterWeights:
    """Read and check adapter ``name`` under ``root`` against the served model.

    The LoRA weights come back in ``dtype`` (the slots' dtype, so staging them is one copy from the parsed
    file), in pinned host memory when ``pin_memory`` (on CUDA: the copy into a slot is then async), carved from
    one buffer per adapter (``one_buffer``, by default with ``pin_memory``: one page-locked allocation, not one
    per tensor).

    ``module_dims`` maps each target (decoder projections "q_proj", ...; vision-side targets of
    ``vision``) to its (d_in, d_out); ``supported_modules`` are the targets the server can apply LoRA
    to; ``vision`` describes the model's vision-side projections (None: none are known, so keys naming
    them are refused); ``max_rank`` is the largest rank a slot holds. Raises AdapterError naming the
    key, module, shape or setting at fault.

    ``check_values=False`` leaves out the checks of the values (non-finite ones, each module's gain bound: the
    norms, about half of a read's host time) for a caller that makes them on the device after its slot copy
    (:meth:`vlora.lora.manager.LoraManager._fill_slot`); everything else is checked. The weights come back with
    ``values_checked`` False.
    """
    root = Path(root).resolve()  # once: each resolve is a system call per path component
    adir = resolve_adapter_dir(root, name, root_resolved=root)
    where = f"adapter {name!r}"
    config_path = _inside(adir, CONFIG_FILE, root, where)
    weights_path = _inside(adir, WEIGHTS_FILE, root, where)
    if weights_path is None:
        if any((adir / p).exists() for p in PICKLE_FILES):
            raise AdapterError(f"{where}: has only {'/'.join(PICKLE_FILES)} weights; pickle weights are not loaded; "
                               f"convert to safetensors ({WEIGHTS_FILE})")
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is missing")
    if config_path is None:
        raise AdapterError(f"{where}: {CONFIG_FILE} is missing")
    version = ContentVersion()  # every byte parsed below is added, as it was read
    try:
        config_bytes = _read_file(config_path, CONFIG_FILE, MAX_CONFIG_BYTES, where)
    except FileTooLarge:
        raise AdapterError(f"{where}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes") from None
    version.add(CONFIG_FILE, config_bytes)
    config = _parse_config(config_bytes, where)

    supported = tuple(supported_modules)
    base_r, base_alpha, use_rslora, rank_pattern, alpha_pattern = _lora_settings(config, where)

    with _open_file(weights_path, WEIGHTS_FILE, where) as f:
        header, header_bytes = _safetensors_header(f, where)
        keys = sorted(k for k in header if k != "__metadata__")
        if not keys:
            raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no tensors")
        found: dict[tuple[int, str], dict[str, tuple[str, tuple[str, str]]]] = {}
        for key in keys:
            m = _KEY.match(key)
            if m is None:
                raise AdapterError(f"{where}: unsupported target module or weight {key!r}: only LoRA A/B weights "
                                   f"of the projections {list(supported)} are served "
                                   f"(not embeddings, lm_head, biases or DoRA)")
            layer, module, names = _target_of(m["path"], key, where, supported, num_layers, vision)
            _record_weight(found, layer, module, m["ab"], key, names, where)

        plan: list[tuple[int, str, str, str, str, float]] = []
        for (layer, module), ab in sorted(found.items()):
            if set(ab) != {"A", "B"}:
                have, miss = next(iter(ab)), ({"A", "B"} - set(ab)).pop()
                raise AdapterError(f"{where}: {ab[have][0]!r} has no matching lora_{miss} weight")
            key_a, (module_name, current) = ab["A"]
            key_b = ab["B"][0]
            if module not in module_dims:
                raise AdapterError(f"{where}: the served model has no dimensions for module {module!r}")
            d_in, d_out = module_dims[module]
            shape_a = tuple(header[key_a]["shape"])
            shape_b = tuple(header[key_b]["shape"])
            if len(shape_a) != 2 or shape_a[1] != d_in:
                raise AdapterError(f"{where}: {key_a!r} has shape {list(shape_a)}, expected [r, {d_in}]")
            r = shape_a[0]
            if r < 1 or r > max_rank:
                raise AdapterError(f"{where}: rank {r} of {key_a!r} is outside [1, {max_rank}] (the server's max_rank)")
            if shape_b != (d_out, r):
                raise AdapterError(f"{where}: {key_b!r} has shape {list(shape_b)}, expected [{d_out}, {r}] "
                                   f"(lora_A is {list(shape_a)})")
            cfg_r = _pattern_value(rank_pattern, module_name, base_r, current)
            if cfg_r != r:
                raise AdapterError(f"{where}: {key_a!r} has rank {r}, but adapter_config.json gives r={cfg_r}")
            alpha = _pattern_value(alpha_pattern, module_name, base_alpha, current)
            scale = float(alpha / math.sqrt(r) if use_rslora else alpha / r)
            plan.append((layer, module, module_name, key_a, key_b, scale))
        # Every key is a checked LoRA weight now: the data holds at most 8 bytes per element of their shapes.
        weights_bytes = _whole_file(f, header, header_bytes, where)
    # The version's hash of the weights (hashlib releases the GIL) runs beside the parse and the checks.
    hashing = threading.Thread(target=version.add, args=(WEIGHTS_FILE, weights_bytes), name="vlora-adapter-hash")
    hashing.start()
    try:
        tensors = _parse_safetensors(weights_bytes, header, len(header_bytes), where)
        arena = None
        if pin_memory if one_buffer is None else one_buffer:
            # each pair's lora_A and lora_B key, in load order, that needs converting (the others stay views of the
            # file's buffer, _tensor)
            keys = [k for step in plan for k in step[3:5]
                    if pin_memory or _ST_DTYPES.get(header[k].get("dtype")) != dtype]
            arena = HostArena([(tuple(header[k]["shape"]), dtype) for k in keys], pin_memory=pin_memory)
        # Every weight's norm, in a few batches of torch calls (each torch call releases the GIL); the checks
        # below read them in load order, so the first bad tensor is still the one named.
        order = [k for step in plan for k in step[3:5]]
        norms = (dict(zip(order, _l2_norms([tensors.get(k) for k in order]))) if check_values
                 else dict.fromkeys(order, 0.0))  # a norm of 0 passes the checks below (the scale's is still made)
        pairs: dict[tuple[int, str], LoraPair] = {}
        for layer, module, module_name, key_a, key_b, scale in plan:
            a, norm_a = _tensor(tensors, header, key_a, where, dtype, arena, norms[key_a])
            b, norm_b = _tensor(tensors, header, key_b, where, dtype, arena, norms[key_b])
            _check_magnitude(where, module_name, scale, norm_a, norm_b)
            pairs[(layer, module)] = LoraPair(a=a, b=b, scale=scale)
        del tensors
    finally:
        hashing.join()
    del weights_bytes

    ranks: dict[str, int] = {}
    for (_, module), pair in pairs.items():
        ranks[module] = max(ranks.get(module, 0), pair.rank)
    targets = tuple(m for m in supported if m in ranks)
    on_vision = set(vision.targets) if vision is not None else set()
    vision_targets = tuple(m for m in targets if m in on_vision)
    heads = (_load_heads(adir, root, where, hidden_size=module_dims["q_proj"][0], version=version)
             if "q_proj" in module_dims else {})
    return AdapterWeights(name=name, dir=adir, pairs=pairs, ranks=ranks, max_rank=max(ranks.values()),
                          version=version.hexdigest(), target_modules=targets, config=config, heads=heads,
                          vision_targets=vision_targets, values_checked=check_values)



def _load_heads(adir: Path, root_resolved: Path, where: str, hidden_size: int, version: ContentVersion) -> dict[str, Any]:
    """The adapter's vision task heads (vlora_heads.json + .safetensors beside the PEFT files), if any; the
    bytes of both files, read once each, are added to ``version``."""
    from vlora.heads import HeadError, load_heads

    def read(filename: str, limit: int) -> Optional[bytes]:
        path = _inside(adir, filename, root_resolved, where)  # refuses a file symlinked out of the root
        if path is None:
            return None
        data = _read_file(path, filename, limit, where)
        version.add(filename, data)
        return data

    try:
        return load_heads(adir, hidden_size=hidden_size, where=where, read=read)
    except HeadError as e:
        raise AdapterError(str(e)) from None


def _inside(adir: Path, filename: str, root_resolved: Path, where: str) -> Optional[Path]:
    """``adir/filename`` resolved, or None if absent; refuses a file symlinked out of the root (``adir``: a folder
    that ``resolve_adapter_dir`` gave). A regular file that is no symlink costs one ``lstat``."""
    p = adir / filename
    try:
        mode = os.lstat(p).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):  # in a resolved folder, and not a link: resolved as it is
        return p
    if stat.S_ISLNK(mode) and not p.exists():  # a dangling link reads as absent
        return None
    resolved = p.resolve()
    if not resolved.is_relative_to(root_resolved) or not resolved.is_file():
        raise AdapterError(f"{where}: {filename} is not a regular file inside the adapter root")
    return resolved


def _open_file(path: Path, filename: str, where: str) -> OneRead:
    """``path`` (checked by ``_inside``) opened for one read; refuses what is no longer a regular file
    (a symlink swapped in since the check is not followed)."""
    try:
        return OneRead(path)
    except NotARegularFile:
        raise AdapterError(f"{where}: {filename} is not a regular file inside the adapter root") from None


def _read_file(path: Path, filename: str, limit: int, where: str) -> bytes:
    """The bytes of ``path``, read once (FileTooLarge beyond ``limit``); see ``_open_file``."""
    try:
        return read_once(path, limit)
    except NotARegularFile:
        raise AdapterError(f"{where}: {filename} is not a regular file inside the adapter root") from None


def _parse_config(raw: bytes, where: str) -> dict[str, Any]:
    try:
        return json_object(raw, CONFIG_FILE)
    except ValueError as e:
        raise AdapterError(f"{where}: {e}") from None



def _check_magnitude(where: str, module_name: str, scale: float, norm_a: float, norm_b: float) -> None:
    """Refuse a module whose delta could overflow activations (see the module docstring)."""
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        raise AdapterError(f"{where}: module {module_name}: scale {scale:g} (lora_alpha over r) is outside "
                           f"[-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}]")
    gain = abs(scale) * norm_b * norm_a
    if not gain <= MAX_LORA_GAIN:
        raise AdapterError(f"{where}: module {module_name}: |scale| * ||B|| * ||A|| = {gain:g} exceeds "
                           f"{MAX_LORA_GAIN:g}: the adapter's weights or lora_alpha are far too large")



def check_slot_norms(name: str, modules: Sequence[tuple[int, str]], norms: Sequence[float]) -> None:
    """The checks of the values that ``load_adapter(check_values=False)`` left out, made on the L2 norms of an
    adapter's copy in a device slot: ``modules`` are its (layer, module) in the copy's order, ``norms`` two per
    module, of its A and of its ``scale * B`` as the slot holds them (in the slots' dtype). Raises AdapterError
    naming the first module at fault: a norm that is not finite (a non-finite value, or squares past fp32), or
    ``|scale| * ||B|| * ||A||`` past ``MAX_LORA_GAIN`` (the scale's own bound was checked at the read)."""
    where = f"adapter {name!r}"
    for i, (layer, module) in enumerate(modules):
        norm_a, norm_b = norms[2 * i], norms[2 * i + 1]
        label = f"{module} of layer {layer}"
        for which, norm in (("lora_A", norm_a), ("lora_B", norm_b)):
            if not math.isfinite(norm):
                raise AdapterError(f"{where}: module {label}: {which} holds non-finite values "
                                   f"(or values whose squares overflow fp32)")
        _check_magnitude(where, label, 1.0, norm_a, norm_b)  # the slot's B holds scale * B


def decoder_module_dims(text_config: Any) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each LLaMA decoder projection, from a text config object or dict."""
    get = text_config.get if isinstance(text_config, Mapping) else (lambda k, d=None: getattr(text_config, k, d))
    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or hidden // heads)
    inter = int(get("intermediate_size"))
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
