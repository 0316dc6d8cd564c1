"""PEFT LoRA adapter folders: finding them safely under the adapter root, reading and checking them.

An adapter is a folder ``<root>/<name>/`` holding ``adapter_config.json`` and
``adapter_model.safetensors`` as PEFT writes them, and optionally vision task heads
(``vlora_heads.json`` + ``vlora_heads.safetensors``, see :mod:`vlora.heads`). Nothing else in the folder is read; pickle weights
(``adapter_model.bin``) are refused, because unpickling can run code.

Key names. PEFT saves ``base_model.model.<module path>.lora_{A,B}.weight``. For
``LlavaForConditionalGeneration`` under transformers 5 the module path of a decoder projection is
``model.language_model.layers.N.{self_attn,mlp}.X_proj``; adapters trained under transformers 4
(before the LLaVA refactor) use ``language_model.model.layers.N...``. Both are read. Vision-side
projections (the vision tower's blocks, the projector or merger) are read where the server describes
them (:class:`VisionSites`, built by the model family from the loaded model's own module names); they
are kept as (layer, target) pairs like the decoder's, the target a family-given name such as
``vision.self_attn.q_proj`` or ``projector.linear_1``. Every other key (embeddings, lm_head, the patch
embedding, DoRA magnitudes, biases, a module the served model does not have) is refused by name.

Scale (as PEFT's LoraLayer): ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``,
where ``r`` and ``lora_alpha`` come from ``rank_pattern`` / ``alpha_pattern`` when a pattern matches
the module's name (PEFT's rule: the pattern matches a dotted suffix of the name). Patterns can differ
by layer, so rank and scale are kept per (layer, module) pair.

Pattern keys are matched safely. A plain key (only ``A-Z a-z 0-9 _ .``), as PEFT configs mostly hold,
matches literally: the name equals the key or ends with ``"." + key`` (PEFT's regex reads each dot as
"any character", which only differs on names no model has). Any other key is a regular expression,
matched as PEFT does (``re.match(rf"(.*\\.)?({key})$", name)``) once it passes checks that keep the
match fast: at most ``MAX_PATTERN_KEY_CHARS`` characters, no backreferences, no repeat inside a repeat
(``(x+)+``, ``(.*)*``), no alternation inside a repeat, and at most ``MAX_PATTERN_REPEATS`` repeats.
A pattern holds at most ``MAX_PATTERN_KEYS`` keys, of which at most ``MAX_PATTERN_REGEX_KEYS`` regexes.

Reading. Each file is opened once, without following a final symlink, and read through that one
descriptor (:mod:`vlora.files`, :mod:`vlora.lora.files`): the bytes read are the bytes parsed and the bytes hashed into the
adapter's ``version``, so a file changed or swapped while it is read cannot pair its old weights with a
new version. The safetensors header is read first and every key and shape checked against the served
model; the tensor data is read only then, and only up to what those shapes can hold (8 bytes an element),
so a file padded out is refused before it is read into memory.

Magnitude. A module's delta is ``scale * B @ A``; its gain (operator norm) is at most
``|scale| * ||B||_F * ||A||_F``. An adapter is refused at load when a scale is not finite or above
``MAX_LORA_SCALE``, or when that bound exceeds ``MAX_LORA_GAIN`` (1e4; the demo adapters are below 20):
such an adapter would drive activations to inf/NaN and fail every batch it joins.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch

from vlora.errors import InvalidRequest
from vlora.files import FileTooLarge, NotARegularFile, OneRead, json_object, read_once
from vlora.lora.files import ContentVersion

try:  # the parser behind re, used to vet regex keys of rank_pattern / alpha_pattern before running them
    from re import _constants as _sre_constants, _parser as _sre_parse
except ImportError:  # Python 3.10
    import sre_constants as _sre_constants
    import sre_parse as _sre_parse

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 1 << 20
MAX_SAFETENSORS_HEADER_BYTES = 16 << 20  # a PEFT adapter's header is a few hundred bytes per tensor
MAX_LORA_SCALE = 1e4  # |lora_alpha / r| (or / sqrt(r) with rsLoRA)
MAX_LORA_GAIN = 1e4  # |scale| * ||B||_F * ||A||_F, an upper bound on how much a module's delta amplifies x
MAX_PATTERN_KEYS = 1024  # keys of rank_pattern, and of alpha_pattern
MAX_PATTERN_REGEX_KEYS = 32  # of which regular expressions (the plain keys are matched without one)
MAX_PATTERN_KEY_CHARS = 256
MAX_PATTERN_REPEATS = 2  # quantifiers in one regex key: matching costs up to ~name_length ** (repeats + 1)

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")

# base_model.model.<module path>.lora_A|B.weight
_KEY = re.compile(r"^base_model\.model\.(?P<path>[A-Za-z0-9_.]+)\.lora_(?P<ab>[AB])\.weight$")
# A decoder projection's module path: one of the two LLaVA decoder prefixes + layers.N.<block>.<proj>
_DECODER_PATH = re.compile(
    r"^(?P<prefix>model\.language_model|language_model\.model)\.layers\.(?P<layer>\d{1,6})\."
    r"(?P<block>self_attn|mlp)\.(?P<module>[A-Za-z0-9_]+)$"
)

# Config fields that change what the weights mean; an adapter using them is refused, not misread.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias (lora_bias)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
}
_UNSUPPORTED_PRESENT = {
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable_token_indices",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "target_parameters": "target_parameters",
    "megatron_config": "megatron_config",
}


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


def resolve_adapter_dir(root: Path, name: str) -> Path:
    """The folder of adapter ``name`` under ``root``, resolved; refuses anything that leaves ``root``.

    The name is checked against ``[A-Za-z0-9._-]{1,128}`` first, so separators and absolute paths never
    reach the file system. Symlinks are followed, and the target must still be inside the resolved
    root. An adapter that does not exist and one that escapes both read "unknown adapter": the
    message shows nothing about the file system.
    """
    validate_adapter_name(name)
    root_resolved = Path(root).resolve()
    candidate = root_resolved / name
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
) -> AdapterWeights:
    """Read and check adapter ``name`` under ``root`` against the served model.

    ``module_dims`` maps each target (decoder projections "q_proj", ...; vision-side targets of
    ``vision``) to its (d_in, d_out); ``supported_modules`` are the targets the server can apply LoRA
    to; ``vision`` describes the model's vision-side projections (None: none are known, so keys naming
    them are refused); ``max_rank`` is the largest rank a slot holds. Raises AdapterError naming the
    key, module, shape or setting at fault.
    """
    adir = resolve_adapter_dir(root, name)
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
            found.setdefault((layer, module), {})[m["ab"]] = (key, names)

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
    version.add(WEIGHTS_FILE, weights_bytes)
    tensors = _parse_safetensors(weights_bytes, where)
    del weights_bytes

    pairs: dict[tuple[int, str], LoraPair] = {}
    for layer, module, module_name, key_a, key_b, scale in plan:
        a = _tensor(tensors, header, key_a, where)
        b = _tensor(tensors, header, key_b, where)
        _check_magnitude(where, module_name, scale, a, b)
        pairs[(layer, module)] = LoraPair(a=a, b=b, scale=scale)
    del tensors

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
                          vision_targets=vision_targets)


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


def _load_heads(adir: Path, root: Path, where: str, hidden_size: int, version: ContentVersion) -> dict[str, Any]:
    """The adapter's vision task heads (vlora_heads.json + .safetensors beside the PEFT files), if any; the
    bytes of both files, read once each, are added to ``version``."""
    from vlora.heads import HeadError, load_heads

    def read(filename: str, limit: int) -> Optional[bytes]:
        path = _inside(adir, filename, root, where)  # refuses a file symlinked out of the root
        if path is None:
            return None
        data = _read_file(path, filename, limit, where)
        version.add(filename, data)
        return data

    try:
        return load_heads(adir, hidden_size=hidden_size, where=where, read=read)
    except HeadError as e:
        raise AdapterError(str(e)) from None


def _inside(adir: Path, filename: str, root: Path, where: str) -> Optional[Path]:
    """``adir/filename`` resolved, or None if absent; refuses a file symlinked out of the root."""
    p = adir / filename
    if not p.exists():
        return None
    resolved = p.resolve()
    if not resolved.is_relative_to(Path(root).resolve()) or not resolved.is_file():
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


def _invalid_weights(where: str, why: str) -> AdapterError:
    return AdapterError(f"{where}: {WEIGHTS_FILE} is not a valid safetensors file ({why})")


def _safetensors_header(f: OneRead, where: str) -> tuple[dict[str, Any], bytes]:
    """The header of the safetensors file ``f`` (read from its start: the 8-byte length, then the JSON) and
    the bytes read. Every entry but ``__metadata__`` must have a ``shape`` of non-negative integers; the
    rest (dtypes, offsets) is checked by safetensors itself when the whole file is parsed."""
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


def _whole_file(f: OneRead, header: Mapping[str, Any], header_bytes: bytes, where: str) -> bytes:
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
    if not data.startswith(header_bytes):
        raise AdapterError(f"{where}: {WEIGHTS_FILE} changed while it was read; load it again")
    return data


def _parse_safetensors(data: bytes, where: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a malformed file
        raise _invalid_weights(where, str(e)) from None


def _lora_settings(config: Mapping[str, Any], where: str):
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r} is not supported; only LORA adapters are served")
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if config.get(flag):
            raise AdapterError(f"{where}: {what} is not supported")
    for key, what in _UNSUPPORTED_PRESENT.items():
        if config.get(key):
            raise AdapterError(f"{where}: {what} is not supported")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"{where}: bias={bias!r} is not supported (only 'none')")
    r = config.get("r")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {r!r}")
    if not _is_number(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"{where}: use_rslora must be true or false")
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    compiled = []
    for pname, pattern, ok in (("rank_pattern", rank_pattern, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                               ("alpha_pattern", alpha_pattern, _is_number)):
        if not isinstance(pattern, dict) or not all(isinstance(k, str) and ok(v) for k, v in pattern.items()):
            raise AdapterError(f"{where}: {pname} must map module-name patterns to numbers")
        compiled.append(_compile_pattern(pattern, f"{where}: {pname}"))
    return r, float(alpha), use_rslora, compiled[0], compiled[1]


@dataclass(frozen=True)
class _PatternKey:
    """One key of rank_pattern / alpha_pattern: matched literally (``regex`` None) or as a checked regex."""

    key: str
    regex: Optional[re.Pattern]
    value: Any

    def matches(self, name: str) -> bool:
        if self.regex is None:
            return name == self.key or name.endswith("." + self.key)
        return self.regex.match(name) is not None


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.]+")


def _compile_pattern(pattern: Mapping[str, Any], where: str) -> tuple[_PatternKey, ...]:
    """The keys of a rank/alpha pattern, in order, ready to match; refuses keys that could match slowly."""
    if len(pattern) > MAX_PATTERN_KEYS:
        raise AdapterError(f"{where} has {len(pattern)} keys; at most {MAX_PATTERN_KEYS} are accepted")
    out = []
    n_regex = 0
    for key, value in pattern.items():
        if not key or len(key) > MAX_PATTERN_KEY_CHARS:
            raise AdapterError(f"{where} key {key[:40]!r}{'...' if len(key) > 40 else ''} has {len(key)} "
                               f"characters; 1 to {MAX_PATTERN_KEY_CHARS} are accepted")
        if _PLAIN_KEY.fullmatch(key):
            out.append(_PatternKey(key, None, value))
            continue
        n_regex += 1
        if n_regex > MAX_PATTERN_REGEX_KEYS:
            raise AdapterError(f"{where} has more than {MAX_PATTERN_REGEX_KEYS} regular-expression keys")
        try:
            parsed = _sre_parse.parse(key)
            regex = re.compile(rf"(.*\.)?({key})$")
        except (re.error, RecursionError, OverflowError) as e:
            raise AdapterError(f"{where} key {key!r} is not a valid pattern ({e})") from None
        problem = _slow_regex(parsed)
        if problem:
            raise AdapterError(f"{where} key {key!r} is refused: it has {problem}, which can make matching "
                               f"take very long; write the module names out, or a simpler pattern")
        out.append(_PatternKey(key, regex, value))
    return tuple(out)


_REPEATS = {_sre_constants.MAX_REPEAT, _sre_constants.MIN_REPEAT} | (
    {_sre_constants.POSSESSIVE_REPEAT} if hasattr(_sre_constants, "POSSESSIVE_REPEAT") else set())


def _slow_regex(parsed) -> Optional[str]:
    """Why the parsed regex could backtrack catastrophically, or None: a backreference, a repeat inside
    a repeat, an alternation inside a repeat, or more than MAX_PATTERN_REPEATS repeats in all."""
    repeats = 0

    def walk(items, in_repeat: bool) -> Optional[str]:
        nonlocal repeats
        for op, av in items:
            if op in (_sre_constants.GROUPREF, _sre_constants.GROUPREF_EXISTS):
                return "a backreference"
            if op in _REPEATS:
                lo, hi, body = av
                if hi > 1:
                    if in_repeat:
                        return "a repeat inside a repeat (such as (x+)+ or (.*)*)"
                    repeats += 1
                    if repeats > MAX_PATTERN_REPEATS:
                        return f"more than {MAX_PATTERN_REPEATS} repeats (*, +, {{m,n}})"
                found = walk(body, in_repeat or hi > 1)
            elif op == _sre_constants.BRANCH:
                if in_repeat:
                    return "an alternation inside a repeat (such as (a|ab)*)"
                found = next((w for w in (walk(b, in_repeat) for b in av[1]) if w), None)
            elif op == _sre_constants.SUBPATTERN:
                found = walk(av[-1], in_repeat)
            elif op in (_sre_constants.ASSERT, _sre_constants.ASSERT_NOT):
                found = walk(av[1], in_repeat)
            elif op == getattr(_sre_constants, "ATOMIC_GROUP", None):
                found = walk(av, in_repeat)
            else:
                found = None
            if found:
                return found
        return None

    return walk(parsed, False)


def _pattern_value(pattern: tuple[_PatternKey, ...], module_name: str, default, current: Optional[str] = None):
    """PEFT's get_pattern_key: the value of the first key that matches a dotted suffix of the module's name.

    Tried on the name as the adapter spells it and as the served model (transformers 5) does, ``current``
    (default: the decoder's transformers-5 spelling of ``module_name``), so that a pattern written for
    either naming applies.
    """
    if not pattern:
        return default
    names = (module_name, current if current is not None else _modern_name(module_name))
    for key in pattern:
        if any(key.matches(n) for n in names):
            return key.value
    return default


def _modern_name(module_name: str) -> str:
    old = "language_model.model."
    return "model.language_model." + module_name[len(old):] if module_name.startswith(old) else module_name


def _tensor(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any], key: str, where: str) -> torch.Tensor:
    t = tensors.get(key)
    if t is None or list(t.shape) != header[key]["shape"]:  # parsed from the bytes the header was read from
        raise _invalid_weights(where, f"tensor {key!r} does not match its header")
    if not t.is_floating_point():
        raise AdapterError(f"{where}: {key!r} has dtype {t.dtype}; expected a floating-point tensor")
    t = t.to(torch.float32).contiguous()
    if not torch.isfinite(t).all():
        raise AdapterError(f"{where}: {key!r} holds non-finite values")
    return t


def _check_magnitude(where: str, module_name: str, scale: float, a: torch.Tensor, b: torch.Tensor) -> None:
    """Refuse a module whose delta could overflow activations (see the module docstring)."""
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        raise AdapterError(f"{where}: module {module_name}: scale {scale:g} (lora_alpha over r) is outside "
                           f"[-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}]")
    gain = abs(scale) * float(torch.linalg.vector_norm(b)) * float(torch.linalg.vector_norm(a))
    if not gain <= MAX_LORA_GAIN:
        raise AdapterError(f"{where}: module {module_name}: |scale| * ||B|| * ||A|| = {gain:g} exceeds "
                           f"{MAX_LORA_GAIN:g}: the adapter's weights or lora_alpha are far too large")


def _is_number(x: Any) -> bool:
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


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
