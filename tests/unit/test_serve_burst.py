"""benchmarks/serve_burst.py: its pure parts (new prompt lengths, percentiles, a burst's figures, the adapter read
lines), and its smallest configuration end to end (about 30 s on 2 cores): a real `vlora serve` on the tiny model, each row a
burst of gRPC streams sent at once, every request answered, the engine's counters read around each burst."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import serve_burst as sb

ROOT = Path(__file__).resolve().parents[2]


def test_spread_gives_distinct_lengths_in_the_range():
    assert sb.spread(20, 80, 32)[0] == 20 and sb.spread(20, 80, 32)[-1] == 80
    assert len(set(sb.spread(20, 80, 32))) == 32
    assert sb.spread(4, 6, 5) == [4, 5, 6, 7, 8]  # wider than the range when it must be
    assert sb.spread(3, 9, 1) == [3]


def test_new_prompts_have_distinct_lengths_and_no_common_start():
    count = lambda text: len(text.split())  # noqa: E731 (a stand-in tokenizer: one token a word)
    prompts = sb.new_prompts(count, [5, 5, 6, 9], seed=1)
    lengths = [n for _, n in prompts]
    assert len(set(lengths)) == 4 and all(n >= w for n, w in zip(lengths, [5, 5, 6, 9]))
    assert all(count(text) == n for text, n in prompts)
    assert len({text.split()[0] for text, _ in prompts}) == 4
    assert sb.new_prompts(count, [5], seed=2)[0][0] != prompts[0][0]


def test_burst_figures_time_each_request_from_its_own_send():
    results = [{"t_send": 10.0 + i * 0.001, "t_first": 10.1 + i * 0.1, "t_end": 11.0 + i, "n_in": 20 + i, "n_out": 16,
                "finish_reason": "length"} for i in range(4)]
    f = sb.burst_figures(results)
    assert f["ttft_ms_sorted"] == [100.0, 199.0, 298.0, 397.0]
    assert f["ttft_ms_p50"] == pytest.approx(248.5) and f["ttft_ms_max"] == 397.0
    assert f["send_spread_ms"] == 3.0 and f["wall_s"] == 4.0 and f["output_tok_per_s"] == 16.0
    assert f["requests_per_s"] == 1.0 and f["input_tokens"] == [20, 21, 22, 23]
    assert sb.pct([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)


def test_adapter_reads_parses_the_managers_log_line():
    line = ('I1128 09:37:08.212493 24810 manager.py:498] "loaded adapter burst-r64-040 from /a/burst-r64-040 '
            '(rank 64, 134.2 MB) in 45 ms (2.98 GB/s)"\n')
    other = line.replace("burst-r64-040", "burst-r64-001")
    reads = sb.adapter_reads(line + other, {"burst-r64-040"})
    assert reads["reads"] == 1 and reads["gb"] == 0.134 and reads["gb_per_s_per_read"] == pytest.approx(2.98, abs=0.01)
    assert sb.adapter_reads("nothing here", {"burst-r64-040"}) is None


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_burst_smallest_configuration(tmp_path, tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serve_burst", "--model", str(tiny_model_dir), "--tiny",
                           "--device", "cpu", "--rows", "text32,cold32,image64", "--requests", "3", "--images", "2",
                           "--max-tokens", "4", "--no-record", "--out", str(tmp_path), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "serve-burst-cpu.json").read_text())
    rows = result["rows"]
    assert list(rows) == ["text32", "cold32", "image64"] and result["server_log_errors"] == 0
    text = rows["text32"]
    assert text["requests"] == 3 and len(set(text["prompt_words_tokens"])) == 3
    assert text["output_tokens"] == 3 * 16 and text["finish_reasons"] == ["length"]
    assert 1 <= text["prefill_steps"] <= 3 and text["execute_calls"] == 3 and text["floor_ms"] > 0
    assert text["prefill_tokens"] == sum(text["input_tokens"])  # new prompts: no prefix-cache hit
    cold = rows["cold32"]
    assert cold["host_loads"] == 3 and cold["gpu_loads"] == 3 and cold["adapter_file_bytes"] > 0
    assert cold["output_tokens"] == 3 * 4 and cold["gb_per_s_lower_bound"] > 0
    image = rows["image64"]  # lora32's decode bursts are cold32's code with resident adapters (not run here)
    assert image["requests"] == 2 and image["host_loads"] == 0 and image["vision_ms_mean"] > 0
    assert image["roofline"]["roofline_rps"] > 0
