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
    grid = list(tuner.shape_grid(tuner.squares([4096]), [16], [1, 64], [1, 4]))
    assert grid == [(4096, 4096, 16, 1, 1), (4096, 4096, 16, 64, 1), (4096, 4096, 16, 64, 4)]


def test_run_key_of_every_grid_form():
    """The key a run caches its table under, for the default grid, explicit shapes, projections and padding: each
    form gives a key (a list of int segments beside a padding tag once failed to sort, on a GPU only), and each
    setting changes it."""
    def key(*argv):
        args = tuner.parser().parse_args(list(argv))
        return tuner.run_key(args, "GPU", args.tokens or [32, 64], args.projections or tuner.squares(args.widths), ["c"])
    keys = {key(), key("--pad-segments", "32"), key("--shapes", "1:1,256:1"), key("--projections", "4096x11008"),
            key("--widths", "4096,11008"), key("--segments", "1,4")}
    assert len(keys) == 6 and key() == key()


def test_shape_grid_of_explicit_pairs():
    """--shapes names the calls an engine makes (a decode graph's one segment a row, a prefill graph's one)."""
    assert tuner._pairs("1:1,32:32,1024") == [(1, 1), (32, 32), (1024, 1)]
    assert tuner._projections("3584x18944,512") == [(3584, 18944), (512, 512)]
    grid = list(tuner.shape_grid([(3584, 512), (512, 512)], [64], [7], [9], [(32, 32), (1024, 1)]))
    assert grid == [(3584, 512, 64, 32, 32), (3584, 512, 64, 1024, 1), (512, 512, 64, 32, 32), (512, 512, 64, 1024, 1)]


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


class _FakeKernels:
    """What start_at_load reads of AtmmKernels, for a machine without the extension."""

    def __init__(self, table_dir, available=True):
        self.available = available
        self.unavailable_reason = "" if available else "vlora_atmm_ext not importable"
        self._table_dir = table_dir
        self.table_source = "built-in default rule"
        self.table_file = None  # the table in use (resolve_table), None: the default rule


def _at_load(kernels, tmp_path, mode="auto", widths=(4096,), device="NVIDIA Test GPU"):
    return tuner.start_at_load(kernels, mode=mode, widths=list(widths), ranks=[16, 64], max_tokens=64,
                               segments=[1], dtype="bf16", budget_s=5, cache_dir=tmp_path / "cache",
                               work_dir=tmp_path / "runs", device_name=device)


def test_tuner_at_load_does_nothing_without_cuda_or_extension(tmp_path, caplog):
    caplog.set_level("INFO", logger="vlora.atmm.tuner")
    assert _at_load(_FakeKernels(tmp_path), tmp_path, device=None) is None
    assert "no CUDA device here" in caplog.text
    assert _at_load(_FakeKernels(tmp_path, available=False), tmp_path) is None
    assert _at_load(_FakeKernels(tmp_path), tmp_path, mode="never") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour (the child would tune)")
def test_tuner_at_load_auto_skips_a_covering_table_and_tunes_otherwise(tmp_path):
    from vlora.atmm.tiling import write_table

    write_table(tmp_path / "nvidia-test-gpu.json", {"dtype": "bf16", "widths": [4096], "ranks": [16]}, [])
    assert _at_load(_FakeKernels(tmp_path), tmp_path) is None  # covered: serve with the committed table
    car = _at_load(_FakeKernels(tmp_path), tmp_path, widths=(4096, 11008))  # a width the table lacks
    try:
        assert car is not None and car.base == tmp_path / "nvidia-test-gpu.json"
        assert car.args[:2] == ["--widths", "4096,11008"] and "--budget-s" in car.args
        car.proc.wait(timeout=120)
        assert car.poll() is False and "wrote no table" in car.state()  # no CUDA in this process's child
        assert "nothing to tune" in car.log_path.read_text()
    finally:
        car.stop()
    always = _at_load(_FakeKernels(tmp_path), tmp_path, mode="always")
    assert always is not None
    always.stop()
    # A GPU without its own table, served by another's of the same capability: tuned (auto), over that table.
    fallback = _FakeKernels(tmp_path)
    fallback.table_file = tmp_path / "nvidia-test-gpu.json"
    car = _at_load(fallback, tmp_path, device="NVIDIA Other GPU")
    try:
        assert car is not None and car.base == tmp_path / "nvidia-test-gpu.json"
    finally:
        car.stop()


def test_pair_shrinks_keeps_the_fastest_of_each_close_kind():
    """An expand is paired with the n fastest shrinks and with the fastest shrink of every other kind
    within 20% of the fastest (its hand-over of v can make the faster call), never with slower ones."""
    shrink = {("tr_a", 2): 15.6, ("tr_b", 2): 16.2, ("tr_a", 4): 16.3, ("xs_a", 4): 16.4, ("xs_b", 4): 16.5,
              ("t64", 2): 19.0, ("gemv", 1): 40.0}
    kinds = {"tr_a": "triton", "tr_b": "triton", "xs_a": "stream", "xs_b": "stream", "t64": "cutlass", "gemv": "gemv"}
    assert tuner.pair_shrinks(shrink, kinds, 3) == [("tr_a", 2), ("tr_b", 2), ("tr_a", 4), ("xs_a", 4)]
    assert tuner.pair_shrinks(shrink, kinds, 1, within=1.25) == [("tr_a", 2), ("xs_a", 4), ("t64", 2)]
    assert tuner.pair_shrinks(shrink, kinds, 10) == sorted(shrink, key=shrink.get)


def test_shape_grid_puts_ranks_outermost():
    """A run cut short by its budget has every projection and shape at the first rank listed (the sidecar lists
    the largest first: the graphs' calls look up lora.max_rank, and its kernels serve every smaller rank)."""
    grid = list(tuner.shape_grid([(8, 16), (16, 8)], [64, 16], [], [], [(32, 32), (512, 1)]))
    assert [g[2] for g in grid] == [64] * 4 + [16] * 4
    assert grid[:2] == [(8, 16, 64, 32, 32), (8, 16, 64, 512, 1)]


def test_sidecar_tunes_the_engines_own_calls(tmp_path):
    """At load the sidecar profiles the calls the engine makes (decode graphs' one segment a row, one-sequence
    prefills up to the step budget, eager steps of more sequences), not the 32-token grid times the segments."""
    from vlora.config import EngineConfig
    from vlora.engine.builder import tuner_shapes

    shapes = tuner_shapes(EngineConfig())
    assert shapes[:7] == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (24, 24), (32, 32)]
    assert shapes[7:15] == [(256, 1), (384, 1), (512, 1), (640, 1), (768, 1), (1024, 1), (1536, 1), (2048, 1)]
    assert shapes[15:] == [(1024, 4), (1024, 16), (1024, 64), (2048, 4), (2048, 16), (2048, 64)]
    small = EngineConfig.from_dict({"scheduler": {"max_num_batched_tokens": 512, "max_batch_size": 8}})
    assert tuner_shapes(small) == [(1, 1), (2, 2), (4, 4), (8, 8), (256, 1), (384, 1), (512, 1), (512, 4), (512, 16),
                                   (512, 64)]
    car = tuner.start_at_load(_FakeKernels(tmp_path), mode="always", widths=[4096], ranks=[64, 16], max_tokens=512,
                              segments=[1], dtype="bf16", budget_s=5, cache_dir=tmp_path / "cache",
                              work_dir=tmp_path / "runs", device_name="NVIDIA Test GPU",
                              projections=[(4096, 4096), (4096, 11008)], pad_segments=32, shapes=[(1, 1), (512, 1)])
    try:
        args = car.args
        assert args[args.index("--projections") + 1] == "4096x4096,4096x11008"
        assert args[args.index("--pad-segments") + 1] == "32" and args[args.index("--shapes") + 1] == "1:1,512:1"
        assert args[args.index("--ranks") + 1] == "64,16"
    finally:
        car.stop()
