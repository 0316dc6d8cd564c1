"""vlora.engine.gemv on CPU: the launch table and its file override, the fallbacks, ``engine.gemv_max_rows``
and how the engine routes its projections through the kernels (with the kernels replaced by their torch
references, so that the routing is checked bit for bit without a GPU); and, when triton is importable and
TRITON_INTERPRET=1 (``TRITON_INTERPRET=1 PYTHONPATH=/path/to/triton pytest ...``), the kernels under the
interpreter: against an fp32 reference, a row's bits independent of the other rows and of M, strided rows,
bias, split-K, and a tiny fp16 engine with the kernels on. The interpreter computes the tile products in
numpy (not the tensor cores) and casts to bf16 by truncation: bf16 is checked to within a step there, and
tests/gpu/test_gemv_gpu.py checks the GPU's bits."""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from vlora.config import ConfigError, EngineConfig
from vlora.engine import gemv
from vlora.engine.api import GenerationRequest, SamplingParams
from vlora.engine.fused_ops import silu_mul_reference

STEP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


# -- launch table ------------------------------------------------------------------------------------


def test_config_validation_and_label():
    c = gemv.GemvConfig(block_n=16, block_k=512, num_warps=8, num_stages=3, split_k=2, swap=True)
    assert c.label() == "n16k512w8s3x2T"
    assert gemv.GemvConfig.from_dict({"block_n": 64, "swap": 0, "ignored": 1}) == gemv.GemvConfig(block_n=64)
    for bad in (dict(block_n=24), dict(block_k=8), dict(num_warps=3), dict(split_k=0), dict(num_stages=0)):
        with pytest.raises(ValueError):
            gemv.GemvConfig(**bad)
    with pytest.raises(ValueError, match="kind"):
        gemv.table_key("gelu", 1, 2)


def test_default_rule_and_committed_table():
    gemv.reload_table()
    # the 7B decode shapes are in the committed table
    for key in ("linear:12288x4096", "linear:4096x4096", "silu:22016x4096", "linear:4096x11008"):
        kind, _, shape = key.partition(":")
        n, k = map(int, shape.split("x"))
        assert gemv.config_for(kind, n, k) == gemv.TABLE[key]
    # elsewhere the rule: K tiles of at most 256 and at least 16, more programs for narrow outputs
    assert gemv.default_config("linear", 256, 128) == gemv.GemvConfig(block_n=32, block_k=128, num_stages=4)
    assert gemv.default_config("linear", 40, 8).block_k == 16
    assert gemv.default_config("linear", 5120, 5120) == gemv.GemvConfig(block_n=32, block_k=256, num_stages=4)
    wide = gemv.GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True)
    assert gemv.default_config("linear", 16384, 5120) == wide
    assert gemv.default_config("silu", 2 * 11008, 5120) == wide  # 11008 columns each of gate and up
    assert gemv.default_config("silu", 2 * 4096, 5120).block_n == 32
    assert gemv.config_for("linear", 1000, 300) == gemv.default_config("linear", 1000, 300)


def test_table_file_overrides_the_committed_table(tmp_path, monkeypatch):
    """A runner's table: the committed one, with a file's entries over it; the file is engine.gemv_table's path,
    else $VLORA_GEMV_TABLE (the benchmarks'), else the package's for this GPU. Read at load, held by the table."""
    mine = gemv.GemvConfig(block_n=64, block_k=128, num_warps=8, num_stages=5, split_k=2, swap=True)
    path = tmp_path / "gemv-table.json"
    path.write_text(json.dumps(gemv.table_json({"linear:4096x4096": mine, "silu:512x128": mine}, device="x")))
    monkeypatch.delenv(gemv.TABLE_ENV, raising=False)
    assert gemv.GemvTable.load().config_for("linear", 4096, 4096) == gemv.TABLE["linear:4096x4096"]
    table = gemv.GemvTable.load(str(path))
    assert table.config_for("linear", 4096, 4096) == mine
    assert table.config_for("silu", 512, 128) == mine
    assert table.config_for("linear", 12288, 4096) == gemv.TABLE["linear:12288x4096"]  # kept
    assert table.launch("linear", 4096, 4096)[0] == mine and table.launch("silu", 256, 128)[0] == mine
    assert gemv.load_table(str(path))["linear:4096x4096"] == mine
    # by GPU name from a tables folder, as the ATMM tiling tables
    shipped = tmp_path / "tables"
    shipped.mkdir()
    (shipped / "nvidia-h100-80gb-hbm3.json").write_text(path.read_text())
    assert gemv.GemvTable.load(device_name="NVIDIA H100 80GB HBM3", table_dir=shipped).config_for("silu", 512, 128) == mine
    assert gemv.GemvTable.load(device_name="NVIDIA H200", table_dir=shipped).configs == gemv.TABLE
    # the benchmarks' override, read when a table is loaded (never per call)
    monkeypatch.setenv(gemv.TABLE_ENV, str(path))
    gemv.reload_table()
    try:
        assert gemv.config_for("linear", 4096, 4096) == mine
        assert gemv.GemvTable.load().config_for("linear", 4096, 4096) == mine
    finally:
        monkeypatch.delenv(gemv.TABLE_ENV)
        gemv.reload_table()
    assert gemv.config_for("linear", 4096, 4096) == gemv.TABLE["linear:4096x4096"]
    path.write_text(json.dumps({"configs": {"relu:4x4": {}}}))
    with pytest.raises(ValueError, match="kind"):
        gemv.load_table(str(path))


def test_engine_gemv_table_setting_reaches_the_runner(tmp_path):
    """engine.gemv_table is validated, and set_gemv_max_rows(table=...) loads it into every weight group."""
    from vlora.config import ConfigError, EngineConfig
    from vlora.engine.model_runner import ModelRunner

    with pytest.raises(ConfigError, match="gemv_table"):
        EngineConfig().with_overrides({"engine.gemv_table": "5"})
    mine = gemv.GemvConfig(block_n=16, block_k=64)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(gemv.table_json({"linear:4x4": mine})))
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.groups = {"o": type("G", (), {})()}
    runner.set_gemv_max_rows(4, table=str(path))
    assert runner.groups["o"].gemv_table is runner.gemv_table and runner.groups["o"].gemv_rows == 4
    assert runner.gemv_table.config_for("linear", 4, 4) == mine


# -- fallbacks -----------------------------------------------------------------------------------------


def test_auto_takes_the_reference_where_the_kernels_do_not_serve():
    x, w, b = _randn(3, 64, dtype=torch.float32, seed=0), _randn(96, 64, dtype=torch.float32, seed=1), _randn(96, dtype=torch.float32, seed=2)
    assert not gemv.available(x)  # fp32 never (tf32)
    assert torch.equal(gemv.linear_rows(x, w, b), F.linear(x, w, b))
    assert torch.equal(gemv.gate_up_silu(x, w), silu_mul_reference(F.linear(x, w)))
    out = torch.empty(3, 48)
    assert gemv.gate_up_silu(x, w, impl="torch", out=out) is out
    big = _randn(17, 64, dtype=torch.bfloat16, seed=3)  # more rows than a tile: the reference
    wb = w.to(torch.bfloat16)
    assert torch.equal(gemv.linear_rows(big, wb), F.linear(big, wb))
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not gemv.available(big)  # CPU tensors: only under the interpreter
    with pytest.raises(ValueError, match="even"):
        gemv.gate_up_silu(x, w[:95])


@pytest.mark.skipif(not gemv.triton_available(), reason="needs triton")
def test_triton_impl_refuses_what_it_cannot_run():
    x, w = torch.randn(2, 32), torch.randn(32, 32)
    with pytest.raises(TypeError, match="tf32"):
        gemv.linear_rows(x, w, impl="triton")
    with pytest.raises(ValueError, match="M <= 16"):
        gemv.linear_rows(torch.randn(17, 32).half(), w.half(), impl="triton")
    with pytest.raises(ValueError, match="impl"):
        gemv.linear_rows(x, w, impl="cublas")


# -- engine config ------------------------------------------------------------------------------------


def test_runner_config_gemv_max_rows():
    assert EngineConfig().engine.gemv_max_rows == 16
    assert EngineConfig().with_overrides({"engine.gemv_max_rows": "16"}).engine.gemv_max_rows == 16
    for bad in ("17", "-1", "true", "4.5"):
        with pytest.raises(ConfigError, match="gemv_max_rows"):
            EngineConfig().with_overrides({"engine.gemv_max_rows": bad})


# -- the engine's routing (kernels replaced by their references: exact on CPU) ------------------------

REQUESTS = {"base": None, "qv": "demo-r8-qv", "mlp": "demo-r32-mlp"}
ATTN_REQUESTS = {"base": None, "qv": "demo-r8-qv", "attn": "demo-r16-attn"}  # adapters of q/k/v/o targets only


def _engine(tiny_model_dir, demo_adapter_root, rows: int, targets=None, dtype="float32"):
    from vlora.engine.builder import build_engine

    over = {"model.path": str(tiny_model_dir), "lora.adapter_root": str(demo_adapter_root), "model.device": "cpu",
            "model.dtype": dtype, "lora.max_rank": "32", "lora.max_gpu_adapters": "4",
            "orchestrator.policy": "unmerge-only", "engine.gemv_max_rows": str(rows)}
    if targets is not None:
        over["lora.target_modules"] = json.dumps(list(targets))
    return build_engine(EngineConfig().with_overrides(over))


def _run(engine, requests, max_tokens=5):
    """Greedy tokens and every step's logits, per request, all requests in one batch."""
    seqs, logits = {}, {}
    for rid, adapter in requests.items():
        # prompts of more than 16 tokens: a prefill step never runs its layers through the kernels
        req = GenerationRequest(rid, f"Count the circles and the squares in this picture, then say which are more ({rid}).",
                                lora_name=adapter, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        engine.add_request(engine.inputs.prepare(req), lambda out: None)
        seqs[rid] = engine.waiting[-1]
    while engine.has_work():
        result = engine.step()
        if result is None:
            continue
        for row, rid in enumerate(result.request_ids):
            logits.setdefault(rid, []).append(result.logits[row].clone())
    engine.flush()
    return {rid: s.output_ids for rid, s in seqs.items()}, logits


class _Spy:
    """Stand-ins for the kernels that record each call and compute the torch reference (same bits as the
    engine's cuBLAS path on CPU), with ``gemv.available`` saying yes."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, int, int]] = []
        monkeypatch.setattr(gemv, "available", lambda x: True)
        monkeypatch.setattr(gemv, "linear_rows", self.linear)
        monkeypatch.setattr(gemv, "gate_up_silu", self.silu)

    def linear(self, x, w, bias=None, **kw):
        self.calls.append(("linear", x.shape[0], w.shape[0]))
        return F.linear(x, w, bias)

    def silu(self, x, w, bias=None, **kw):
        self.calls.append(("silu", x.shape[0], w.shape[0]))
        return silu_mul_reference(F.linear(x, w, bias))


def test_gemv_rows_zero_leaves_the_engine_alone(tiny_model_dir, demo_adapter_root, monkeypatch):
    ref_tokens, ref_logits = _run(_engine(tiny_model_dir, demo_adapter_root, 0), REQUESTS)
    spy = _Spy(monkeypatch)
    tokens, logits = _run(_engine(tiny_model_dir, demo_adapter_root, 0), REQUESTS)
    assert spy.calls == []  # even where the kernels would serve, 0 rows keeps cuBLAS's path
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for rid in ref_logits for a, b in zip(logits[rid], ref_logits[rid]))


@pytest.mark.parametrize("targets", [None, ("q_proj", "k_proj", "v_proj", "o_proj")], ids=["all-targets", "attn-targets"])
def test_engine_routes_small_steps_through_the_kernels(tiny_model_dir, demo_adapter_root, monkeypatch, targets):
    """Decode steps (3 rows) run every projection and the LM head through the kernels; gate/up with SiLU fused
    only where the layer has no LoRA work (a base step, or no gate/up wrappers); prefill steps (> 16 tokens)
    only the LM head. Same tokens and logits bit for bit as cuBLAS's path (here both are torch's)."""
    requests = REQUESTS if targets is None else ATTN_REQUESTS
    ref_tokens, ref_logits = _run(_engine(tiny_model_dir, demo_adapter_root, 0, targets), requests)
    engine = _engine(tiny_model_dir, demo_adapter_root, 16, targets)
    runner = engine.runner
    assert runner.gemv_max_rows == 16 and all(g.gemv_rows == 16 for g in runner.groups.values())
    spy = _Spy(monkeypatch)
    tokens, logits = _run(engine, requests)
    assert tokens == ref_tokens
    for rid in ref_logits:
        assert all(torch.equal(a, b) for a, b in zip(logits[rid], ref_logits[rid]))
    L = runner.num_layers
    qkv, o, gu, down = (runner.groups[n].stack.shape[1] for n in ("qkv", "o", "gate_up", "down"))
    vocab = runner.vocab_size
    head = [c for c in spy.calls if c[2] == vocab]
    layers = Counter(c for c in spy.calls if c[2] != vocab)
    assert len(head) >= 5 and all(c[0] == "linear" for c in head)  # every step's LM head (a row per sequence)
    steps = layers[("linear", 3, qkv)] // L  # decode steps of the 3 rows; prefills (> 16 tokens) never
    assert steps >= 3
    want = Counter()
    for n in (qkv, o, down):
        want[("linear", 3, n)] += L * steps
    # gate/up wrappers in every layer and adapters in the batch: LoRA into the projection, then silu_mul
    want[("linear" if targets is None else "silu", 3, gu)] += L * steps
    assert layers == want


def test_a_base_step_fuses_silu_even_with_gate_up_wrappers(tiny_model_dir, demo_adapter_root, monkeypatch):
    """A step without adapters: gate/up with SiLU fused, same bits."""
    ref_tokens, ref_logits = _run(_engine(tiny_model_dir, demo_adapter_root, 0), {"base": None, "base2": None})
    engine = _engine(tiny_model_dir, demo_adapter_root, 16)
    spy = _Spy(monkeypatch)
    tokens, logits = _run(engine, {"base": None, "base2": None})
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for rid in ref_logits for a, b in zip(logits[rid], ref_logits[rid]))
    runner = engine.runner
    L = runner.num_layers
    qkv, gu = (runner.groups[n].stack.shape[1] for n in ("qkv", "gate_up"))
    c = Counter(spy.calls)
    steps = c[("linear", 2, runner.hidden_size)] // (2 * L)  # o and down
    assert steps >= 3
    assert c[("silu", 2, gu)] == c[("linear", 2, qkv)] == L * steps
    assert ("linear", 2, gu) not in c


def test_set_gemv_max_rows_validates(tiny_model_dir, demo_adapter_root):
    runner = _engine(tiny_model_dir, demo_adapter_root, 0).runner
    with pytest.raises(ValueError):
        runner.set_gemv_max_rows(17)
    runner.set_gemv_max_rows(8)
    assert runner.groups["down"].gemv_rows == 8


# -- the kernels under the interpreter ----------------------------------------------------------------

# Skipped unless triton is importable and TRITON_INTERPRET=1 (tests/conftest.py); `make test` runs them
# in a second pytest run under the interpreter.
interpreter = pytest.mark.interpreter

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
CONFIGS = [pytest.param(None, id="table"),
           pytest.param(gemv.GemvConfig(block_n=16, block_k=32, split_k=3), id="split3"),
           pytest.param(gemv.GemvConfig(block_n=32, block_k=64, swap=True), id="swap")]


def _close(got, want, dtype, steps=2):
    """Within ``steps`` roundings of the output (the fp32 sums differ in order from the reference's)."""
    torch.testing.assert_close(got.float(), want.float(), rtol=steps * STEP[dtype], atol=steps * STEP[dtype])


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("M, N, K", [(1, 64, 128), (3, 80, 96), (16, 48, 320)])
def test_linear_rows_against_fp32(dtype, config, M, N, K):
    x, w, b = _randn(M, K, dtype=dtype, seed=M), _randn(N, K, dtype=dtype, seed=N, scale=0.1), _randn(N, dtype=dtype, seed=K)
    want = x.float() @ w.float().T
    got = gemv.linear_rows(x, w, impl="triton", config=config)
    assert got.dtype == dtype and got.shape == (M, N)
    _close(got, want, dtype)
    _close(gemv.linear_rows(x, w, b, impl="triton", config=config), want + b.float(), dtype)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("M, I, K", [(1, 64, 128), (5, 40, 96), (16, 256, 64)])
def test_gate_up_silu_against_reference(dtype, config, M, I, K):
    x, w = _randn(M, K, dtype=dtype, seed=M + 7), _randn(2 * I, K, dtype=dtype, seed=I, scale=0.2)
    got = gemv.gate_up_silu(x, w, impl="triton", config=config)
    assert got.dtype == dtype and got.shape == (M, I)
    gu = (x.float() @ w.float().T).to(dtype)  # the GEMM's output in the dtype, then eager's activation
    steps = 3 if dtype == torch.float16 else 5  # four roundings, each a truncation in the interpreter's bf16
    _close(got, silu_mul_reference(gu), dtype, steps=steps)
    b = _randn(2 * I, dtype=dtype, seed=3)
    _close(gemv.gate_up_silu(x, w, b, impl="triton", config=config),
           silu_mul_reference((x.float() @ w.float().T + b.float()).to(dtype)), dtype, steps=steps)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype, config):
    """Row i alone, inside 8 or 16 rows, at another position, or beside other rows: the same bits."""
    N, K = 96, 320
    x = _randn(16, K, dtype=dtype, seed=1)
    w = _randn(N, K, dtype=dtype, seed=2, scale=0.05)
    b = _randn(N, dtype=dtype, seed=3)
    for fn in (gemv.linear_rows, gemv.gate_up_silu):
        full = fn(x, w, b, impl="triton", config=config)
        eight = fn(x[:8], w, b, impl="triton", config=config)
        assert torch.equal(eight, full[:8])
        for i in (0, 5, 11, 15):
            assert torch.equal(fn(x[i:i + 1], w, b, impl="triton", config=config)[0], full[i])
        other = x.flip(0)  # the same rows in reverse order, other neighbours
        assert torch.equal(fn(other, w, b, impl="triton", config=config), full.flip(0))


@interpreter
def test_strided_rows_out_and_empty():
    K, N = 128, 64
    big = _randn(4, 3 * K, dtype=torch.float16, seed=0)
    x = big[:, K:2 * K]  # row stride 3K, as a column slice of a fused output
    w = _randn(N, K, dtype=torch.float16, seed=1)
    want = gemv.linear_rows(x.contiguous(), w, impl="triton")
    assert torch.equal(gemv.linear_rows(x, w, impl="triton"), want)
    o = _randn(4, 2, K // 2, dtype=torch.float16, seed=2)  # o-proj's input: attention output heads reshaped
    assert torch.equal(gemv.linear_rows(o.reshape(4, K), w, impl="triton"),
                       gemv.linear_rows(o.reshape(4, K).contiguous(), w, impl="triton"))
    out = torch.empty(4, N, dtype=torch.float16)
    assert gemv.linear_rows(x, w, impl="triton", out=out) is out and torch.equal(out, want)
    assert gemv.linear_rows(x[:0], w, impl="triton").shape == (0, N)
    assert gemv.gate_up_silu(x[:0], w, impl="triton").shape == (0, N // 2)
    with pytest.raises(ValueError, match="out"):
        gemv.linear_rows(x, w, impl="triton", out=torch.empty(4, N + 1, dtype=torch.float16))


@interpreter
def test_interpreter_engine_runs_the_kernels(tiny_model_dir, demo_adapter_root, monkeypatch):
    """A tiny fp16 engine on the CPU with the kernels on: they run (decode steps' projections, the LM head),
    and the logits agree with cuBLAS's path (here torch's CPU matmul) to fp16's precision."""
    ref_tokens, ref_logits = _run(_engine(tiny_model_dir, demo_adapter_root, 0, dtype="float16"),
                                  {"base": None, "mlp": "demo-r32-mlp"}, max_tokens=3)
    engine = _engine(tiny_model_dir, demo_adapter_root, 16, dtype="float16")
    launched = []
    run = gemv._run
    monkeypatch.setattr(gemv, "_run", lambda kind, x, *a: launched.append((kind, x.shape[0])) or run(kind, x, *a))
    tokens, logits = _run(engine, {"base": None, "mlp": "demo-r32-mlp"}, max_tokens=3)
    # two decode rows: q/k/v, o, gate/up (LoRA steps: unfused), down of every layer, the LM head (prefill too)
    assert launched.count(("linear", 2)) >= 2 * (4 * engine.runner.num_layers + 1)
    for rid, steps in ref_logits.items():
        for i, (got, want) in enumerate(zip(logits[rid], steps)):
            if i and tokens[rid][:i] != ref_tokens[rid][:i]:
                break  # inputs differ from here on
            rel = (got - want).abs().max() / want.abs().max()
            assert rel <= 2e-2, (rid, i, float(rel))


# -- the benchmarks' gemv parts -----------------------------------------------------------------------


def _load_benchmark(name: str):
    import importlib

    return importlib.import_module(f"benchmarks.{name}")


def test_probe_parses_launch_labels_and_shapes():
    probe = _load_benchmark("gemv_probe")
    assert probe.parse_config("n32k512w8s3x2T") == gemv.GemvConfig(block_n=32, block_k=512, num_warps=8, num_stages=3,
                                                                   split_k=2, swap=True)
    assert all(probe.parse_config(c) for c in (probe.CANDIDATES + "," + probe.SPLIT_CANDIDATES).split(","))
    with pytest.raises(SystemExit):
        probe.parse_config("n32k512")
    shapes = {s["name"]: (s["kind"], s["n"], s["k"]) for s in probe.model_shapes(probe.preset_text("configs/models/llava-1.5-7b.yaml"))}
    assert shapes == {"qkv": ("linear", 12288, 4096), "o": ("linear", 4096, 4096), "gate_up": ("linear", 22016, 4096),
                      "gate_up_silu": ("silu", 22016, 4096), "down": ("linear", 4096, 11008),
                      "lm_head": ("linear", 32064, 4096)}
    # every 7B shape the probe measures has a committed launch
    assert {gemv.table_key(*v) for v in shapes.values()} <= set(gemv.TABLE)


@interpreter
def test_probe_smoke_under_the_interpreter(tmp_path):
    """The probe end to end on the tiny model's shapes (timing on the CPU means nothing; the checks, the
    choice and the files do): its table file loads as VLORA_GEMV_TABLE."""
    probe = _load_benchmark("gemv_probe")
    table = tmp_path / "gemv-table.json"
    assert probe.main(["--device", "cpu", "--tiny", "--rows", "1,2", "--dtype", "float16", "--shapes", "o,gate_up_silu",
                       "--configs", "n16k128w4s4,n32k64w4s2x2", "--out", str(tmp_path), "--table-out", str(table)]) == 0
    res = json.loads((tmp_path / "gemv-probe-cpu.json").read_text())
    assert set(res["shapes"]) == {"o", "gate_up_silu"}
    for st in res["shapes"].values():
        assert st["best"] in ("n16k128w4s4", "n32k64w4s2x2")
        assert all(c["stable"] and c["within_tolerance"] for c in st["candidates"].values())
    loaded = gemv.load_table(str(table))
    assert set(res["table"]) == {"linear:128x128", "silu:512x128"} <= set(loaded)


def test_engine_floor_times_gemv_beside_base(tiny_model_dir, tmp_path):
    """engine_floor --variants base,gemv --gemv-max-rows 0 on a CPU: the gemv rows ran with engine.gemv_max_rows 16
    (the kernels themselves only serve CUDA), base with the engine's 0 (cuBLAS), and the engine is set back."""
    ef = _load_benchmark("engine_floor")
    torch.manual_seed(0)
    rc = ef.main(["--device", "cpu", "--model", str(tiny_model_dir), "--batches", "1,2", "--contexts", "12",
                  "--prefill", "20", "--images", "1", "--steps", "2", "--warmup", "1", "--prefill-reps", "1",
                  "--variants", "base,gemv", "--gemv-max-rows", "0", "--skip-plain", "--no-record",
                  "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "engine-floor-cpu.json").read_text())
    rows = {(r["variant"], r["batch"]): r for r in res["decode"]}
    assert set(rows) == {(v, b) for v in ("base", "gemv") for b in (1, 2)}
    assert all(r["ms"] > 0 for r in rows.values())
    assert {r["gemv_max_rows"] for (v, _), r in rows.items() if v == "gemv"} == {16}
    assert {r["gemv_max_rows"] for (v, _), r in rows.items() if v == "base"} == {0}
    assert any(t["target"].startswith("base decode with gemv bs1") for t in res["targets"])
    assert "with gemv" in res["summary"] and res["engine"]["gemv"]["launches"]["gate_up_silu"]


# -- the kernels compiled for Hopper without a GPU (triton's own ptxas) --------------------------------


def _hopper_ptx(kind: str, cfg, dtype: str = "bf16", even: bool = True) -> tuple[str, int]:
    """(PTX, shared memory bytes) of the rows kernel for sm_90, with the divisibility Triton specialises at
    launch for the engine's tensors (16-byte aligned pointers, row pitches and K tiles of multiples of 16)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton

    names = ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "ws_ptr", "M", "N", "K", "K_SPLIT", "stride_xm", "stride_wn",
             "stride_ym", "stride_ws_s", "stride_ws_m"]
    sig = {n: (f"*{dtype}" if n.endswith("_ptr") else "i32") for n in names}
    if cfg.split_k > 1:
        sig["ws_ptr"] = "*fp32"
    consts = dict(HAS_BIAS=False, SILU=kind == "silu", SPLIT=cfg.split_k, SWAP=cfg.swap, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, EVEN_K=even, EVEN_N=even, UPCAST=False)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n != "M"}
    try:
        src = ASTSource(fn=gemv._rows_kernel, signature=sig, constexprs=consts, attrs=attrs)
    except TypeError as e:  # another triton's ahead-of-time API
        pytest.skip(f"this triton's ASTSource differs: {e}")
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False})
    return k.asm["ptx"], k.metadata.shared


@pytest.mark.skipif(not gemv.triton_available() or gemv._INTERPRET, reason="needs triton (compiled, not interpreted)")
@pytest.mark.parametrize("kind, label", [("linear", "n16k256w4s4"), ("silu", "n16k256w4s4"), ("linear", "n32k256w4s4x2"),
                                         ("linear", "n64k128w4s4T"), ("silu", "n64k128w4s4T")])
def test_kernels_compile_for_hopper_with_a_pipeline(kind, label):
    """What makes the kernel memory-bound-fast, checked in the PTX: the weight and x tiles stream through
    shared memory in 16-byte cp.async copies (no plain global loads in the K loop), num_stages - 1 tiles in
    flight, into tensor-core MMAs (wgmma for the swapped 64-column tile)."""
    import re

    cfg = _load_benchmark("gemv_probe").parse_config(label)
    try:
        ptx, smem = _hopper_ptx(kind, cfg)
    except RuntimeError as e:  # no ptxas in this triton install
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    tiles = 2 if kind == "silu" else 1
    assert smem >= (cfg.num_stages - 1) * (tiles * cfg.block_n + 16) * cfg.block_k * 2
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 0x10", ptx)
    assert not re.search(r"ld\.global", ptx)
    assert ("wgmma.mma_async" if cfg.swap else "mma.sync.aligned.m16n8k16") in ptx
