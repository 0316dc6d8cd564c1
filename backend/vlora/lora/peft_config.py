"""``adapter_config.json``'s LoRA settings, as PEFT reads them: refusing the features that change what the
weights mean (DoRA, LoRA bias, modules_to_save, ...), and the rank and scale of each module.

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
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from vlora.lora.peft_format import AdapterError, _modern_name

try:  # the parser behind re, used to vet regex keys of rank_pattern / alpha_pattern before running them
    from re import _constants as _sre_constants, _parser as _sre_parse
except ImportError:  # Python 3.10
    import sre_constants as _sre_constants
    import sre_parse as _sre_parse

MAX_PATTERN_KEYS = 1024  # keys of rank_pattern, and of alpha_pattern
MAX_PATTERN_REGEX_KEYS = 32  # of which regular expressions (the plain keys are matched without one)
MAX_PATTERN_KEY_CHARS = 256
MAX_PATTERN_REPEATS = 2  # quantifiers in one regex key: matching costs up to ~name_length ** (repeats + 1)

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


def _is_number(x: Any) -> bool:
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False

