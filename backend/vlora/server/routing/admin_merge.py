"""One answer to an adapter action from the answers of every engine model (the router sends ``list``, ``load`` and
``unload`` to each; vlora.server.admin answers them there). Pure functions of the engines' answers.

- ``list``: the union of the engines' adapters. An adapter's entry is the first engine's, with ``tier`` the
  warmest tier it has on any engine (``gpu`` > ``cpu-slot`` > ``cpu`` > ``disk``), ``tiers`` each engine's tier,
  ``running`` and ``waiting`` summed, ``loaded`` true when any engine has it loaded, ``state`` ``unloading`` when
  any engine is still unloading it. (Ids are given per engine in the order each first saw a name, so engines may
  differ; the first engine's is shown.)
- ``load`` and ``unload``: the same merge of the one adapter's entries; ``engines`` says what each engine
  answered (its entry's tier or state, or its error). When every engine refused, the answer is the first
  engine's error, with its code, as a single engine answers it; when only some refused, the answer is the merged
  entry with ``"partial": true`` and their errors under ``engines``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

TIER_ORDER = ("gpu", "cpu-slot", "cpu", "disk")


@dataclass(frozen=True)
class EngineError:
    """An engine's error answer: its message (with its ``[CODE]`` prefix) and its Triton error code."""

    message: str
    code: Any = None


Answer = Union[dict, EngineError]


def _tier_rank(tier: Any) -> int:
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)


def merge_entries(entries: dict[str, dict]) -> dict:
    """One adapter's entries, by engine name (in engine order), as one entry."""
    first = next(iter(entries.values()))
    merged = dict(first)
    tiers = {engine: entry.get("tier") for engine, entry in entries.items()}
    merged["tier"] = min(tiers.values(), key=_tier_rank)
    merged["tiers"] = tiers
    for key in ("running", "waiting"):
        if all(isinstance(e.get(key), int) for e in entries.values()):
            merged[key] = sum(e[key] for e in entries.values())
    if all("loaded" in e for e in entries.values()):
        merged["loaded"] = any(e["loaded"] for e in entries.values())
    states = [e.get("state") for e in entries.values()]
    if "unloading" in states:
        merged["state"] = "unloading"
    elif "loaded" in states and merged.get("loaded"):
        merged["state"] = "loaded"
    if any(e.get("merged") for e in entries.values()):
        merged["merged"] = True
    merged.pop("slot", None)  # a slot index means something on one engine only
    merged.pop("ready", None)
    readies = [e["ready"] for e in entries.values() if "ready" in e]
    if readies:
        merged["ready"] = any(readies)
    return merged


def merge_admin(action: str, answers: dict[str, Answer]) -> Union[dict, EngineError]:
    """The router's answer to ``action`` from each engine's (``answers``: engine name -> its JSON answer, or
    its error, in engine order): a JSON-able dict, or the error to send."""
    oks = {engine: a for engine, a in answers.items() if not isinstance(a, EngineError)}
    errors = {engine: a for engine, a in answers.items() if isinstance(a, EngineError)}
    if not oks:
        return next(iter(errors.values())) if errors else EngineError("[INTERNAL] no engine answered")
    if action == "list":
        by_name: dict[str, dict[str, dict]] = {}
        for engine, answer in oks.items():
            for entry in answer.get("adapters", []):
                by_name.setdefault(entry.get("name"), {})[engine] = entry
        adapters = [merge_entries(entries) for entries in by_name.values()]
        adapters.sort(key=lambda e: (e.get("id") if isinstance(e.get("id"), int) else 1 << 30, str(e.get("name"))))
        payload: dict[str, Any] = {"adapters": adapters}
    else:
        key = "loaded" if action == "load" else "unloaded"
        entries = {engine: answer[key] for engine, answer in oks.items() if isinstance(answer.get(key), dict)}
        if not entries:
            return EngineError("[INTERNAL] the engines' answers carry no adapter entry")
        payload = {key: merge_entries(entries)}
    per_engine: dict[str, Any] = {}
    for engine in answers:
        if engine in errors:
            per_engine[engine] = {"error": errors[engine].message}
        elif action != "list":
            entry = oks[engine].get("loaded" if action == "load" else "unloaded", {})
            per_engine[engine] = entry.get("tier") if action == "load" else entry.get("state")
    if per_engine:
        payload["engines"] = per_engine
    if errors:
        payload["partial"] = True
    return payload
