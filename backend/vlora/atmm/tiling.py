"""The tiling table's data side: where ``configs/tiling/<gpu>.json`` lives and how it is read.

The tables are package data in ``vlora/atmm/tables/`` so that a regular (non-editable) install
serves them; ``configs/tiling`` of the checkout is a link to that folder, the one copy.

The table itself (128-bit keys, nearest-key fallback, validation against the compiled kernels) is
the C++ ``TilingTable`` of the extension; this module turns the JSON file into its entries.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE_FORMAT = 1


def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: the table's file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_table_dir() -> Path:
    """The committed tables shipped with this package (``configs/tiling`` of a checkout links here)."""
    return Path(__file__).resolve().parent / "tables"


def shipped_tables(table_dir: Path | None = None) -> list[str]:
    """The GPU slugs that have a table in ``table_dir`` (default: the shipped ones)."""
    return sorted(p.stem for p in (table_dir or default_table_dir()).glob("*.json"))


def table_path(gpu_name: str, table_dir: Path | None = None) -> Path:
    return (table_dir or default_table_dir()) / f"{gpu_slug(gpu_name)}.json"


TABLE_ENV = "VLORA_ATMM_TABLE"  # the benchmarks': a table file to serve instead, or "none" (the default rule)


def arch_of(cuda_archs: str) -> str:
    """``"90a"`` or ``"sm_90a"`` -> ``"90"``: the compute capability a table's header names, without the
    architecture-specific suffix (a table's kernels are chosen among one build's, on one capability)."""
    return re.sub(r"[^0-9]", "", str(cuda_archs).split(";")[0].split(",")[0])


def resolve_table(gpu_name: str, capability: tuple[int, int] | None, table_dir: Path | None = None,
                  env: str | None = None) -> tuple[Path | None, str]:
    """Which tiling table serves this GPU: (its file or None for the built-in default rule, why).

    In order: ``env`` (``$VLORA_ATMM_TABLE``: a file, or ``none``); the table of this GPU
    (``<table_dir>/<gpu>.json``); else a shipped table tuned on another GPU of the same compute capability
    (an H200 takes the H100's: the same SM count, shared memory and kernels; the rule for shapes no entry
    names, by contrast, is a guess: an H200 measured a LoRA prefill of 600 rows at 42 us a projection on it).
    Of several same-capability tables, the one with the most entries."""
    if env:
        if env.strip().lower() == "none":
            return None, f"${TABLE_ENV}=none: the built-in default rule"
        if not Path(env).is_file():
            raise FileNotFoundError(f"${TABLE_ENV}={env}: no such table file (or 'none' for the default rule)")
        return Path(env), f"${TABLE_ENV}"
    own = table_path(gpu_name, table_dir)
    if own.exists():
        return own, f"this GPU's ({own.name})"
    if capability is None:
        return None, f"no table for {gpu_name}: the built-in default rule"
    want = f"{capability[0]}{capability[1]}"
    best: tuple[int, Path, str] | None = None
    for path in sorted((table_dir or default_table_dir()).glob("*.json")):
        try:
            header, entries = read_table(path)
        except (OSError, ValueError):
            continue
        if arch_of(header.get("cuda_archs", "")) == want and (best is None or len(entries) > best[0]):
            best = (len(entries), path, str(header.get("gpu", path.stem)))
    if best is None:
        return None, f"no table for {gpu_name} or for its capability sm_{want}: the built-in default rule"
    return best[1], f"no table for {gpu_name}; {best[2]}'s, the same capability sm_{want}"


@dataclass(frozen=True)
class TableEntry:
    """One shape -> configuration pair. ``width`` is d_in for shrink and d_out for expand."""

    direction: str
    dtype: str
    tokens: int
    width: int
    rank: int
    segments: int
    config: str
    split_k: int = 1

    def __post_init__(self) -> None:
        if self.direction not in ("shrink", "expand"):
            raise ValueError(f"tiling entry {self}: direction must be shrink or expand")
        if self.dtype not in ("fp16", "bf16"):
            raise ValueError(f"tiling entry {self}: dtype must be fp16 or bf16")
        if min(self.tokens, self.width, self.rank, self.segments, self.split_k) < 1:
            raise ValueError(f"tiling entry {self}: sizes must be positive")


def read_table(path: Path) -> tuple[dict[str, Any], list[TableEntry]]:
    """Read a table file: (its header fields, its entries). Raises ValueError naming a bad entry."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: tiling table format {doc.get('format')!r}, expected {TABLE_FORMAT}")
    fields = {"direction", "dtype", "tokens", "width", "rank", "segments", "config", "split_k"}
    entries = []
    for i, raw in enumerate(doc.get("entries", [])):
        try:
            entries.append(TableEntry(**{k: raw[k] for k in fields if k in raw}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: entry {i} {raw}: {e}") from e
    header = {k: v for k, v in doc.items() if k != "entries"}
    return header, entries


def write_table(path: Path, header: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    doc = {"format": TABLE_FORMAT, **header, "entries": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
