"""``vlora doctor``: what this machine can run, in a few lines, and whether serving can start."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options yet


def collect() -> list[tuple[str, str, bool]]:
    """(what, finding, ok) rows."""
    rows: list[tuple[str, str, bool]] = []
    rows.append(("python", f"{platform.python_version()} at {sys.executable}", True))
    try:
        import torch

        cuda = torch.cuda.is_available()
        detail = f"{torch.__version__}; CUDA {'available: ' + torch.cuda.get_device_name(0) if cuda else 'not available (CPU only)'}"
        rows.append(("torch", detail, True))
    except ImportError as e:
        rows.append(("torch", f"not importable: {e}", False))
    try:
        from vlora.server.triton_dist import TritonDistribution, TritonNotFound

        try:
            dist = TritonDistribution.locate()
            rows.append(("tritonserver", f"{dist.binary} (stub {dist.stub.parent.name})", True))
        except TritonNotFound as e:
            rows.append(("tritonserver", str(e), False))
    except ImportError as e:
        rows.append(("tritonserver", f"launcher not importable: {e}", False))
    try:
        rows.append(("tritonclient", importlib.metadata.version("tritonclient"), True))
    except importlib.metadata.PackageNotFoundError:
        rows.append(("tritonclient", "not installed (needed by vlora-client)", False))
    rows.append(("atmm extension", _atmm_report(), True))
    try:
        from vlora.server.launcher import shm_room

        enough, finding = shm_room()
        rows.append(("shared memory", finding, enough))
    except ImportError as e:
        rows.append(("shared memory", f"launcher not importable: {e}", False))
    return rows


def _atmm_report() -> str:
    try:
        doctor = importlib.import_module("vlora.atmm.doctor")
    except ImportError:
        return "extension not built (the PyTorch reference is used)"
    report = doctor.doctor_report()
    if not isinstance(report, dict):
        return str(report)
    backend = report.get("atmm_backend", "?")
    details = "".join(f"\n      {k}: {v}" for k, v in report.items() if k != "atmm_backend" and v is not None)
    return f"{backend}{details}"


def run(args: argparse.Namespace) -> int:
    del args
    rows = collect()
    width = max(len(name) for name, _, _ in rows)
    for name, finding, ok in rows:
        mark = "ok " if ok else "!! "
        print(f"{mark}{name.ljust(width)}  {finding}")
    return 0 if all(ok for _, _, ok in rows) else 1
