"""CPU smoke test of benchmarks/orchestrator.py on the tiny model: a tiny grid in two invocations (the
second merged into the first's JSON), every request answered in full, the result's structure, and
the verdicts computed from all four policies."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("vlora", "merge-only", "unmerge-only", "dlora")


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.orchestrator")


@pytest.fixture(scope="module")
def report():
    return importlib.import_module("benchmarks.orchestrator_report")


def common_args(model_dir: Path) -> list[str]:
    # A drain limit far beyond what the cells need: nothing may be cancelled.
    return ["--device", "cpu", "--model", str(model_dir), "--skewness", "0.9", "--adapters", "3", "--rate", "25",
            "--duration", "0.4", "--drain", "60", "--prompt-tokens", "16", "--output-tokens", "4", "--rank", "8",
            "--max-batch-size", "4", "--slots", "4", "--distinct-weights", "2", "--switch-repeats", "2", "--no-record"]


def test_tiny_grid_in_two_runs(bench, tiny_model_dir, tmp_path):
    first, merged = tmp_path / "first.json", tmp_path / "merged.json"
    assert bench.main(common_args(tiny_model_dir) + ["--policies", "vlora,unmerge-only", "--json-out", str(first)]) == 0
    assert bench.main(common_args(tiny_model_dir) + ["--policies", "merge-only,dlora", "--merge-into", str(first),
                                                     "--json-out", str(merged)]) == 0
    result = json.loads(merged.read_text())

    assert result["settings"]["rank"] == 8 and result["settings"]["output_tokens"] == 4
    assert [c["policy"] for c in result["cells"]] == list(POLICIES)
    for c in result["cells"]:
        assert c["requests"] > 0, c
        assert c["finished"] == c["requests"] and c["lost"] == 0 and c["errors"] == 0 and c["censored"] == 0, c
        assert c["output_tokens"] == 4 * c["requests"]
        assert c["avg_token_latency_ms"] > 0 and c["throughput_tok_s"] > 0 and c["e2e_p99_s"] >= c["e2e_p50_s"] > 0
        assert c["skewness"] == 0.9 and c["num_adapters"] == 3 and c["rate"] == 25
        assert c["steps"] == sum(c["steps_by_mode"].values()) > 0
    by = {c["policy"]: c for c in result["cells"]}
    assert by["unmerge-only"]["switches"] == 0 and set(by["unmerge-only"]["steps_by_mode"]) == {"unmerge"}
    assert by["dlora"]["lora_compute"] == "padded-einsum" and by["dlora"]["switcher"] == "per-layer"
    assert by["vlora"]["lora_compute"] == "atmm" and by["vlora"]["switcher"] == "swift"
    assert set(result["compute_paths"]) == set(POLICIES)
    assert "PyTorch reference" in result["compute_paths"]["unmerge-only"]

    sw = result["switch"]
    for switcher in ("swift", "per-layer"):
        assert all(sw[switcher][k]["median_ms"] > 0 for k in ("merge", "swap", "unmerge"))

    verdict = result["verdicts"]["0.9"]
    assert {x["baseline"] for x in verdict["comparisons"]} == {"merge-only", "unmerge-only", "dlora"}
    assert not verdict["missing"]
    assert verdict["meets_target"] == all(x["cut"] >= 0.2 for x in verdict["comparisons"])
    assert len(result["runs"]) == 2


def test_merge_refuses_other_settings(report):
    old = {"settings": {"rank": 8, "output_tokens": 4}, "cells": []}
    new = {"settings": {"rank": 64, "output_tokens": 4}, "cells": []}
    with pytest.raises(SystemExit, match="rank"):
        report.merge_results(old, new, force=False)


def test_fit_to_budget_fits_every_cell_at_its_worst(bench):
    s = {"device": "cuda", "policies": list(POLICIES), "duration_s": 6.0, "min_duration_s": 2.5, "drain_s": 3.0}
    overhead, warm = bench.CELL_OVERHEAD_S["gpu"], bench.POLICY_WARMUP_S["gpu"]
    fit = bench.fit_to_budget(s, budget_s=400.0, elapsed_s=85.0, n_cells=48)
    window = fit["window_s"]
    assert fit["fits"] and 2.5 <= window < 6.0
    # 48 cells, each at its worst (window, the whole drain, the overhead), and the warm-ups end inside the budget
    assert 85.0 + 4 * warm + 48 * (window + 3.0 + overhead) <= 400.0
    assert fit["last_start_s"] == round(400.0 - fit["worst_cell_s"], 1)
    # plenty of time: the longest window; too little: the shortest, and it says it does not fit
    assert bench.fit_to_budget(s, 3600.0, 85.0, 48)["window_s"] == 6.0
    tight = bench.fit_to_budget(s, 200.0, 85.0, 48)
    assert tight["window_s"] == 2.5 and not tight["fits"]


def test_budget_run_interleaves_policies_and_reports(bench, report, tiny_model_dir, tmp_path):
    out = tmp_path / "budget.json"
    args = common_args(tiny_model_dir)
    args[args.index("--skewness") + 1] = "0.9,0.5"
    assert bench.main(args + ["--policies", "vlora,unmerge-only", "--budget-s", "600", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    budget = result["settings"]["budget"]
    assert budget["fits"] and budget["cells"] == 4 and budget["window_s"] == result["settings"]["duration_s"] == 0.4
    # whole comparisons first: each (skewness, adapters, rate) point runs every policy on the same stream
    assert [(c["skewness"], c["policy"]) for c in result["cells"]] == [
        (0.9, "vlora"), (0.9, "unmerge-only"), (0.5, "vlora"), (0.5, "unmerge-only")]
    for c in result["cells"]:
        assert c["arrival_window_s"] == 0.4 and c["finished"] == c["requests"] > 0
        assert c["token_latency_p99_ms"] >= c["token_latency_p50_ms"] > 0
    by = {(c["skewness"], c["policy"]): c for c in result["cells"]}
    assert by[(0.9, "vlora")]["requests"] == by[(0.9, "unmerge-only")]["requests"]
    md = report.markdown_section(result)
    assert "| skewness | adapters | requests | vlora | unmerge-only | cut vs unmerge-only |" in md
    v, u = by[(0.9, "vlora")], by[(0.9, "unmerge-only")]
    assert f"| 0.9 | 3 | {v['requests']} | {v['avg_token_latency_ms']:.1f} ({v['token_latency_p99_ms']:.1f})" in md
    assert report.fmt_cut(1.0 - v["avg_token_latency_ms"] / u["avg_token_latency_ms"]) in md
