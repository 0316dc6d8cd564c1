"""Model families: the ones vlora serves (:data:`FAMILIES`), and loading a folder by its config.json
``model_type`` (:func:`load_model`).

The interface and the loading helpers the families share are in :mod:`vlora.models.base`; each family
module (:mod:`vlora.models.loader` for LLaVA-1.5, :mod:`vlora.models.qwen2_vl` for Qwen2-VL and
Qwen2.5-VL) imports it, and this module imports the families, so no import runs back from the interface to
a family. To add a family: subclass :class:`~vlora.models.base.ModelFamily` in a module of its own and list
it here.
"""
from __future__ import annotations

from pathlib import Path

import torch

from vlora.models.base import LoadedModel, ModelFamily, ModelLoadError, read_model_type
from vlora.models.loader import LlavaFamily
from vlora.models.qwen2_vl import Qwen2VLFamily

FAMILIES: tuple[ModelFamily, ...] = (LlavaFamily(), Qwen2VLFamily())


def family_for(path: str | Path) -> ModelFamily:
    """The family that serves the folder's ``model_type``; ModelLoadError naming the supported ones."""
    model_type = read_model_type(Path(path))
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f"{t!r} ({f.name})" for f in FAMILIES for t in f.model_types)
    raise ModelLoadError(f"{str(path)!r}: model_type {model_type!r} is not supported; vlora serves {supported}")


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """Load any supported family's folder (chosen by its config.json ``model_type``)."""
    family = family_for(path)
    loaded = family.load(Path(path), dtype, device)
    loaded.family = family
    return loaded
