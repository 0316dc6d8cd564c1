"""Prepare a runnable copy of ``model_repository/`` whose config carries this launch's settings.

The committed ``config.pbtxt`` runs unchanged with defaults. A launch writes a copy with
``parameters`` holding the flat ``section.field`` engine overrides (read back by ``model.py`` through
``EngineConfig.with_overrides``), the ingress queue size, and the instance placement.

With adapter-aware routing (vlora.server.routing), the copy holds one engine model per GPU, ``vlora_gpu<i>`` (the
committed ``vlora`` model, one instance pinned to GPU i, its config also naming the routing board and its record),
and the router under the public name ``vlora``: the same inputs and outputs, a few CPU instances, and a
``model.py`` written here that imports :mod:`vlora.server.routing.router`. The router's code never sits in the
committed repository, so Triton's container loads only the engine model from it.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from vlora.config import EngineConfig
from vlora.server.routing import ENGINE_PREFIX, engine_model_name

MODEL_NAME = "vlora"
ROUTER_MODEL_PY = (
    '"""The router of adapter-aware routing, written by `vlora serve` (see vlora.server.routing.router)."""\n'
    "from vlora.server.routing.router import TritonPythonModel  # noqa: F401\n"
)

_INSTANCE_RE = re.compile(r"instance_group\s*\[\s*\{[^}]*\}\s*\]")


def source_repository() -> Path:
    """``model_repository/`` of the source checkout this package runs from (an editable install),
    else the copy a regular install puts under ``<prefix>/share/vlora/`` (when packaged that way)."""
    checkout = Path(__file__).resolve().parents[3] / "model_repository"
    installed = Path(sys.prefix) / "share" / "vlora" / "model_repository"
    if not (checkout / MODEL_NAME / "config.pbtxt").is_file() and (installed / MODEL_NAME / "config.pbtxt").is_file():
        return installed
    return checkout


def flat_overrides(config: EngineConfig, base: Optional[EngineConfig] = None) -> dict[str, str]:
    """The ``section.field`` values where ``config`` differs from ``base``, as YAML scalars.

    Values are JSON-encoded (JSON is YAML), so a path such as ``2024`` stays a string when read back.
    ``None`` is written as the empty string, which ``with_overrides`` reads as ``None``.
    """
    base = base or EngineConfig()
    mine, theirs = config.to_dict(), base.to_dict()
    out: dict[str, str] = {}
    for section, fields in mine.items():
        for name, value in fields.items():
            if theirs[section][name] != value:
                out[f"{section}.{name}"] = "" if value is None else json.dumps(_plain(value))
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def instance_group_for(device: str) -> Optional[str]:
    """The ``instance_group`` block for a device setting; None keeps the committed one (auto)."""
    if device == "cpu":
        return "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]"
    if device == "cuda":
        return "instance_group [\n  {\n    count: 1\n    kind: KIND_GPU\n  }\n]"
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        return f"instance_group [\n  {{\n    count: 1\n    kind: KIND_GPU\n    gpus: [ {index} ]\n  }}\n]"
    return None


def engine_instance_group(index: int, device: str) -> str:
    """The instance_group of engine model ``index``: one instance pinned to GPU ``index`` (on the CPU: one CPU
    instance, the test-only way to run several engine models without GPUs)."""
    if device == "cpu":
        return "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]"
    return f"instance_group [\n  {{\n    count: 1\n    kind: KIND_GPU\n    gpus: [ {int(index)} ]\n  }}\n]"


def router_instance_group(count: int) -> str:
    return f"instance_group [\n  {{\n    count: {int(count)}\n    kind: KIND_CPU\n  }}\n]"


def routed_engines(routing: str, device: str, gpus: int, cpu_engines: int = 0) -> int:
    """How many engine models a launch routes over; 0: none (today's single ``vlora`` model).

    ``routing``: ``off``; ``auto`` (the default) and ``adapter`` route when the device setting reaches several
    GPUs (``auto`` or ``cuda`` with ``gpus`` >= 2; ``cuda:N`` names one GPU). ``cpu_engines`` (a hidden test
    option) runs that many engine models on the CPU, with ``--device cpu``."""
    if routing == "off":
        return 0
    if cpu_engines:
        return cpu_engines if device == "cpu" else 0
    if device in ("auto", "cuda") and gpus >= 2:
        return gpus
    return 0


def render_config(
    template: str,
    parameters: Mapping[str, str],
    instance_group: Optional[str] = None,
) -> str:
    """``template`` (config.pbtxt text) with the instance group and parameters applied."""
    text = template
    if instance_group is not None:
        text, n = _INSTANCE_RE.subn(instance_group, text)
        if n != 1:
            raise ValueError("config.pbtxt must contain exactly one single-entry instance_group block")
    if parameters:
        lines = ["", "# Written by `vlora serve`."]
        for key, value in parameters.items():
            lines.append(f"parameters {{ key: {_pbtxt_string(key)} value: {{ string_value: {_pbtxt_string(value)} }} }}")
        text = text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    return text


def _pbtxt_string(s: str) -> str:
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def prepare_routed_repository(source: Path, dest: Path, engine_configs: list[str], router_config: str) -> Path:
    """Copy the ``vlora`` model of ``source`` into ``dest`` once per engine, ``vlora_gpu<i>`` with
    ``engine_configs[i]``, and write the router as ``vlora`` with ``router_config``."""
    src_model = source / MODEL_NAME
    if not (src_model / "config.pbtxt").is_file() or not (src_model / "1" / "model.py").is_file():
        raise FileNotFoundError(f"{src_model} is not a vlora model (config.pbtxt and 1/model.py expected)")
    dest.mkdir(parents=True, exist_ok=True)
    for old in [dest / MODEL_NAME, *dest.glob(f"{ENGINE_PREFIX}*")]:
        if old.is_dir():
            shutil.rmtree(old)
    for i, text in enumerate(engine_configs):
        dst_model = dest / engine_model_name(i)
        shutil.copytree(src_model, dst_model, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (dst_model / "config.pbtxt").write_text(text, encoding="utf-8")
    router = dest / MODEL_NAME
    (router / "1").mkdir(parents=True)
    (router / "1" / "model.py").write_text(ROUTER_MODEL_PY, encoding="utf-8")
    (router / "config.pbtxt").write_text(router_config, encoding="utf-8")
    return dest


def prepare_repository(source: Path, dest: Path, config_text: str) -> Path:
    """Copy the ``vlora`` model of ``source`` into ``dest`` with ``config_text`` as its config."""
    src_model = source / MODEL_NAME
    if not (src_model / "config.pbtxt").is_file() or not (src_model / "1" / "model.py").is_file():
        raise FileNotFoundError(f"{src_model} is not a vlora model (config.pbtxt and 1/model.py expected)")
    dst_model = dest / MODEL_NAME
    if dst_model.exists():
        shutil.rmtree(dst_model)
    for old in dest.glob(f"{ENGINE_PREFIX}*"):  # engine models of an earlier routed launch in this workspace
        if old.is_dir():
            shutil.rmtree(old)
    shutil.copytree(src_model, dst_model, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dst_model / "config.pbtxt").write_text(config_text, encoding="utf-8")
    return dest
