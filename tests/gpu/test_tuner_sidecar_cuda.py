"""The ATMM tuner sidecar on a GPU: it profiles in a child process while this one goes on, and its
entries are swapped in over the committed table without dropping that table's other shapes."""
from __future__ import annotations

import pytest
import torch

from vlora.atmm import AtmmKernels, atmm
from vlora.atmm.tiling import read_table, table_path
from vlora.atmm.tuner import TunerSidecar
from vlora.atmm.mapping import LoraBatchMapping

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vlora_atmm_ext", reason="vlora_atmm_ext not built (pip install ./csrc)")


def test_sidecar_swaps_tuned_entries_over_the_table(tmp_path):
    kernels = AtmmKernels()
    base = table_path(torch.cuda.get_device_name())
    out = tmp_path / "tuned.json"
    car = TunerSidecar(kernels, out, ["--widths", "4096", "--ranks", "16", "--tokens", "96", "--segments", "1",
                                      "--cache-dir", str(tmp_path / "cache"), "--budget-s", "120"],
                       base=base if base.exists() else None)
    car.start()
    # Serving goes on while the child profiles: an ATMM call here still runs, on the table in use.
    T, d, r = 96, 4096, 16
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(1, r, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5
    b = torch.randn(1, d, r, device="cuda", dtype=torch.bfloat16) / r ** 0.5
    y = torch.zeros(T, d, device="cuda", dtype=torch.bfloat16)
    mapping = LoraBatchMapping.from_segments([0, T], [0], "cuda")
    atmm(y, x, a, b, (r,), (1.0,), mapping)
    car.proc.wait(timeout=300)
    assert car.poll(), car.state() + "\n" + car.log_path.read_text()[-2000:]
    _, tuned = read_table(out)
    assert {(e.direction, e.tokens, e.width, e.rank) for e in tuned} == {("shrink", 96, 4096, 16), ("expand", 96, 4096, 16)}
    hit = kernels.lookup("shrink", "bf16", 96, 4096, 16, 1)
    assert hit["exact"] and hit["config"] == next(e.config for e in tuned if e.direction == "shrink")
    if base.exists():  # the committed table's other shapes are still there
        _, committed = read_table(base)
        other = next(e for e in committed if (e.tokens, e.width, e.rank) != (96, 4096, 16))
        assert kernels.lookup(other.direction, other.dtype, other.tokens, other.width, other.rank, other.segments)["exact"]
    ref = (x.float() @ a[0].float().T @ b[0].float().T)
    y2 = torch.zeros_like(y)
    atmm(y2, x, a, b, (r,), (1.0,), mapping)  # the swapped table serves, and still right
    assert (y2.float() - ref).norm() / ref.norm() < 1e-2
