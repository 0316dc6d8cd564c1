"""What ``vlora doctor`` reports about ATMM: is the extension active, and which tiling table serves."""
from __future__ import annotations

import torch

from vlora.atmm.dispatch import default_kernels
from vlora.atmm.tiling import default_table_dir, resolve_table, shipped_tables


def doctor_report() -> dict:
    """A JSON-able summary. Prints nothing: the CLI renders it."""
    kernels = default_kernels()
    cuda = torch.cuda.is_available()
    report: dict = {
        "cuda_available": cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "extension_importable": kernels.available,
        "extension_reason": kernels.unavailable_reason or None,
        # The extension's kernels (streaming, CUTLASS, hand-written), chosen per shape by the table.
        "atmm_backend": "cuda-extension" if kernels.available and cuda else "pytorch-reference",
        "tiling_table": kernels.table_source if kernels.available else None,
        # Where the tables are looked up, and which GPUs have one: answers "which table serves" on any machine.
        "tiling_table_dir": str(default_table_dir()),
        "tiling_tables_shipped": shipped_tables(),
    }
    if cuda:
        path, why = resolve_table(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
        report["tiling_table_for_gpu"] = f"{path} ({why})" if path is not None else f"none ({why})"
    if kernels.available:
        report["extension_archs"] = kernels.ext.CUDA_ARCHS
        report["configs"] = kernels.config_names
        report["config_kinds"] = sorted({c["kind"] for c in kernels.ext.configs()})
        report["extension_file"] = getattr(kernels.ext, "__file__", None)
    return report
