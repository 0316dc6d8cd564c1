"""benchmarks/reliability.py (issue 26): the soak's adapters for any model, the soak shortened to a budget, and
one CPU run end to end on the tiny model: soak, then an overload through the load harness at several times
its measured capacity, on one real server; every request answered or rejected explicitly, none lost."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str):
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(scope="module")
def rel():
    return _module("reliability")


def test_soak_minutes_fit_the_budget(rel):
    args = rel.parse_args(["--soak-minutes", "4", "--probe-s", "15", "--capacity-s", "15", "--overload-s", "60"])
    assert rel.soak_minutes(args, 100.0) == 4.0  # no budget: as asked
    args.budget_s = 1000.0
    assert rel.soak_minutes(args, 100.0) == 4.0  # room to spare: as asked
    args.budget_s = 400.0
    fixed = (15 + 60 + rel.OVERLOAD_EXTRA_S) + (15 + rel.SOAK_EXTRA_S)
    assert rel.soak_minutes(args, 100.0) == round((400.0 - 100.0 - fixed) / 60.0, 2)
    args.budget_s = 150.0
    assert rel.soak_minutes(args, 100.0) == rel.MIN_SOAK_MINUTES  # never below the floor


def test_soak_adapters_for_another_model(rel, tiny_model_dir, tmp_path):
    soak = rel.soak
    from vlora.heads import load_heads
    from vlora_load.heads import HeadPolicy

    root = soak.write_soak_adapters(tiny_model_dir, tmp_path / "adapters")
    names = sorted(p.name for p in root.iterdir() if (p / "adapter_config.json").is_file())
    assert names == sorted([*soak.DEMO_ADAPTERS, soak.CYCLE_ADAPTER, *soak.DEMO_HEADS])
    hidden = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]["hidden_size"]
    assert soak.read_heads(str(root)) == {a: {t: (labels, prompt) for t, (labels, prompt) in tasks.items()}
                                          for a, tasks in soak.DEMO_HEADS.items()}
    heads = load_heads(root / "demo-count-circles", hidden_size=hidden)
    assert heads["count-circles"].task_type == "counting" and heads["count-circles"].labels == tuple("123456")
    # the load harness answers its detection requests with that head
    assert HeadPolicy.from_adapter_root(root, ("demo-count-circles", "demo-r8-qv")).to_dict() == {
        "demo-count-circles": {"detection": "count-circles"}}
    before = (root / "demo-shapes" / "vlora_heads.safetensors").stat().st_mtime_ns
    soak.write_soak_adapters(tiny_model_dir, root)  # existing folders are kept
    assert (root / "demo-shapes" / "vlora_heads.safetensors").stat().st_mtime_ns == before


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_soak_then_overload_on_one_server(rel, tmp_path, vlora_cache):
    code = rel.main(["--device", "cpu", "--soak-minutes", "0.15", "--probe-s", "4", "--capacity-s", "6",
                     "--overload-s", "6", "--overload-factor", "4", "--no-record", "--out", str(tmp_path / "out"),
                     "--work", str(tmp_path / "work"), "--serve-arg", f"--set model.cache_dir={vlora_cache}"])
    soak = json.loads((tmp_path / "out" / "soak-cpu.json").read_text())
    over = json.loads((tmp_path / "out" / "overload-cpu.json").read_text())
    assert code == 0, (soak.get("failures"), over.get("checks"), over.get("overload"))
    assert soak["passed"] and soak["outcomes"]["all"]["unexpected"] == 0 and soak["outcomes"]["all"]["lost"] == 0
    assert soak["probe"]["capacity_rps"] > 0 and soak["rate_rps"] == pytest.approx(0.8 * soak["probe"]["capacity_rps"], rel=1e-2)
    o = over["overload"]
    assert over["passed"] and all(over["checks"].values()), over["checks"]
    assert o["requests"] == o["scheduled"] and o["lost"] == 0 and o["timeout"] == 0
    assert o["ok"] > 0 and o["rejected"] > 0 and o["ok"] + o["rejected"] == o["requests"]
    assert over["rate_rps"] == pytest.approx(4 * over["capacity"]["rps"])
    assert "exit_code" in over["server_stop"]
    assert (tmp_path / "out" / "harness" / "overload" / "requests.csv").is_file()
