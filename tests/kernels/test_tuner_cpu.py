"""The tuner on a machine without CUDA: it does nothing, says so, and succeeds."""
from __future__ import annotations

import pytest
import torch

from vlora.atmm import tuner


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_tuner_without_cuda_does_nothing(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert tuner.main(["--out", str(out), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert not out.exists()
    assert "no CUDA" in capsys.readouterr().err


def test_cache_key_depends_on_every_input():
    base = ("GPU", "bf16", [4096], [8, 16], [32, 64], [1, 4], ["a", "b"])
    keys = {tuner.cache_key(*base)}
    for i, changed in enumerate([("GPU2",), ("fp16",), ([5120],), ([8],), ([32],), ([1],), (["a"],)]):
        args = list(base)
        args[i] = changed[0]
        keys.add(tuner.cache_key(*args))
    assert len(keys) == 8
    assert tuner.cache_key("GPU", "bf16", [4096], [16, 8], [64, 32], [4, 1], ["a", "b"]) == tuner.cache_key(*base)


def test_shape_grid_skips_more_segments_than_tokens():
    grid = list(tuner.shape_grid([4096], [16], [1, 64], [1, 4]))
    assert grid == [(4096, 16, 1, 1), (4096, 16, 64, 1), (4096, 16, 64, 4)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_sidecar_without_cuda_swaps_nothing(tmp_path):
    from vlora.atmm import AtmmKernels

    kernels = AtmmKernels(load_table=False)
    car = tuner.TunerSidecar(kernels, tmp_path / "table.json", ["--cache-dir", str(tmp_path / "cache")])
    car.start()
    car.proc.wait(timeout=120)
    assert car.proc.returncode == 0
    assert car.poll() is False
    assert kernels.table_source == "built-in default rule"
