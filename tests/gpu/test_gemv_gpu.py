"""vlora.engine.gemv on CUDA: the decode-row kernels at the LLaVA-1.5-7B shapes (q/k/v 12288x4096, o
4096x4096, gate/up 22016x4096 plain and with SiLU * up fused, down 4096x11008, LM head 32064x4096) for M in
{1, 2, 3, 4, 8, 16} against an fp32 reference and cuBLAS; a row's bits independent of M and of the other
rows (the table's launch, split-K and the swapped operands); a CUDA-graph capture; and the engine with
``engine.gemv_max_rows`` 16 (tiny model, bf16): decode steps replayed from graphs against the same steps
run eagerly, token for token where no LoRA kernel touches a row, and within bf16's tolerance of the cuBLAS
engine."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import require_cuda

pytestmark = pytest.mark.gpu
require_cuda(triton=True)

from vlora.engine import gemv  # noqa: E402
from vlora.engine.fused_ops import silu_mul, silu_mul_reference  # noqa: E402

DEV = torch.device("cuda")
SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32064, 4096)}
ROWS = [1, 2, 3, 4, 8, 16]
BF16_STEP = 2.0 ** -7
OTHER_CONFIGS = [pytest.param(None, id="table"),
                 pytest.param(gemv.GemvConfig(block_n=32, block_k=256, split_k=2), id="split2"),
                 pytest.param(gemv.GemvConfig(block_n=64, block_k=128, swap=True), id="swap")]


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, device=DEV)).to(dtype)


@pytest.fixture(scope="module")
def weights():
    """Each shape's weight, scaled like a trained layer's (outputs of order one)."""
    return {name: randn(n, k, seed=i, scale=k ** -0.5) for i, (name, (n, k)) in enumerate(SHAPES.items())}


def close(got, want, steps=2):
    """Within ``steps`` bf16 roundings of the output (plus a floor for outputs near zero)."""
    torch.testing.assert_close(got.float(), want.float(), rtol=steps * BF16_STEP, atol=steps * BF16_STEP * 0.05)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("M", ROWS)
def test_linear_rows_at_7b_shapes(weights, name, M):
    w = weights[name]
    x = randn(M, w.shape[1], seed=100 + M)
    got = gemv.linear_rows(x, w, impl="triton")
    assert got.dtype == torch.bfloat16 and got.shape == (M, w.shape[0])
    want = x.float() @ w.float().T
    close(got, want)
    close(got, F.linear(x, w))  # cuBLAS: the same sums in another order
    # most elements round alike
    assert (got == want.to(torch.bfloat16)).float().mean() > 0.9


@pytest.mark.parametrize("M", ROWS)
def test_gate_up_silu_at_7b_shapes(weights, M):
    w = weights["gate_up"]
    x = randn(M, w.shape[1], seed=200 + M)
    got = gemv.gate_up_silu(x, w, impl="triton")
    assert got.shape == (M, w.shape[0] // 2)
    close(got, silu_mul_reference((x.float() @ w.float().T).to(torch.bfloat16)), steps=3)
    close(got, silu_mul(F.linear(x, w)), steps=3)  # the engine's unfused path
    # the fused epilogue is eager's activation, bit for bit, on the kernel's own projection
    assert torch.equal(got, silu_mul(gemv.linear_rows(x, w, impl="triton", config=gemv.config_for("silu", *w.shape))))


def test_bias_and_fp16(weights):
    w = weights["o"]
    b = randn(w.shape[0], seed=7)
    x = randn(3, w.shape[1], seed=8)
    close(gemv.linear_rows(x, w, b, impl="triton"), x.float() @ w.float().T + b.float())
    xh, wh = x.half(), w.half()
    got = gemv.linear_rows(xh, wh, impl="triton")
    torch.testing.assert_close(got.float(), xh.float() @ wh.float().T, rtol=2 * 2.0 ** -10, atol=1e-3)


@pytest.mark.parametrize("name", list(SHAPES) + ["silu"])
@pytest.mark.parametrize("config", OTHER_CONFIGS)
def test_a_rows_bits_do_not_depend_on_M(weights, name, config):
    """Row i alone, among 8, among 16, or with other neighbours: the same bits (what lets a graph's padded
    bucket and the eager step agree)."""
    w = weights["gate_up" if name == "silu" else name]
    fn = gemv.gate_up_silu if name == "silu" else gemv.linear_rows
    x = randn(16, w.shape[1], seed=300)
    full = fn(x, w, impl="triton", config=config)
    assert torch.equal(fn(x[:8], w, impl="triton", config=config), full[:8])
    for M in (1, 2, 3):
        for i in (0, 5, 16 - M):
            assert torch.equal(fn(x[i:i + M], w, impl="triton", config=config), full[i:i + M]), (M, i)
    assert torch.equal(fn(x.flip(0), w, impl="triton", config=config), full.flip(0))
    assert torch.equal(fn(x, w, impl="triton", config=config), full)  # deterministic


def test_strided_rows(weights):
    w = weights["o"]
    big = randn(4, 3 * 4096, seed=9)
    x = big[:, 4096:8192]
    assert torch.equal(gemv.linear_rows(x, w, impl="triton"), gemv.linear_rows(x.contiguous(), w, impl="triton"))


def test_kernels_capture_in_a_cuda_graph(weights):
    wq, wg = weights["qkv"], weights["gate_up"]
    x = randn(8, 4096, seed=10)
    split = gemv.GemvConfig(block_n=32, split_k=2)
    y, a = gemv.linear_rows(x, wq, impl="triton"), gemv.gate_up_silu(x, wg, impl="triton")
    gemv.linear_rows(x, wq, impl="triton", config=split)  # compiled before the capture, as the engine's warm-up does
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gy = gemv.linear_rows(x, wq, impl="triton")
        ga = gemv.gate_up_silu(x, wg, impl="triton")
        gs = gemv.linear_rows(x, wq, impl="triton", config=split)
    x.copy_(randn(8, 4096, seed=11))
    g.replay()
    assert torch.equal(gy, gemv.linear_rows(x, wq, impl="triton")) and not torch.equal(gy, y)
    assert torch.equal(ga, gemv.gate_up_silu(x, wg, impl="triton")) and not torch.equal(ga, a)
    close(gs, gy)


# -- the engine -----------------------------------------------------------------------------------------

from vlora.engine.builder import build_engine  # noqa: E402
from vlora.orchestrator.policies import MERGE, MIXTURE, UNMERGE  # noqa: E402
from engine_parity import ScriptedPolicy, add_greedy, rel_err, step_recording  # noqa: E402
from helpers import tiny_config  # noqa: E402

MAX_NEW = 64
PROMPTS = ["Count the circles.", "Is there a red square in the corner?", "Describe the scene.",
           "Which way does it move?", "Hello there, what is this?"]
# script name -> (requests: id -> adapter, the policy's script, requests whose rows no LoRA kernel touches)
CASES = {
    "base": ({"p0": None, "p1": None, "p2": None}, [(UNMERGE, None)], ("p0", "p1", "p2")),
    "unmerged": ({"qv": "demo-r8-qv", "attn": "demo-r16-attn", "mlp": "demo-r32-mlp", "base": None},
                 [(UNMERGE, None)], ("base",)),
    "merged": ({"m1": "demo-r8-qv", "m2": "demo-r8-qv"}, [(MERGE, "demo-r8-qv")], ("m1", "m2")),
    "mixture": ({"mlp": "demo-r32-mlp", "qv": "demo-r8-qv", "base": None}, [(MIXTURE, "demo-r32-mlp")], ("mlp",)),
}


def make(tiny_model_dir, demo_adapter_root, graphs: bool, rows: int = 16, targets=None):
    """bf16, the Triton attention in both; a context of 256 tokens, so that decode attention takes one split
    in the graphs (as wide as the context) and eagerly alike."""
    over = {"model.device": "cuda", "model.dtype": "bfloat16", "model.max_model_len": "256", "lora.max_gpu_adapters": "4", "cache.num_blocks": "256", "orchestrator.policy": "vlora",
            "scheduler.max_batch_size": "8", "engine.cuda_graphs": "auto" if graphs else "off",
            "engine.attention": "triton", "engine.overlap": "on" if graphs else "off",
            "engine.gemv_max_rows": str(rows)}
    if targets is not None:
        over["lora.target_modules"] = "[" + ", ".join(targets) + "]"
    return build_engine(tiny_config(tiny_model_dir, demo_adapter_root, **over))


def run(engine, requests, script):
    engine.orchestrator.policy = ScriptedPolicy(script)
    logits, seqs = {}, {}
    for i, (rid, adapter) in enumerate(requests.items()):
        seqs[rid] = add_greedy(engine, rid, adapter, PROMPTS[i % len(PROMPTS)], max_new=MAX_NEW)
    while engine.has_work():
        step_recording(engine, seqs, logits)
    engine.flush()
    engine.orchestrator.enter(UNMERGE, None)
    return {rid: s.output_ids for rid, s in seqs.items()}, logits


def first_logits_close(tokens, logits, ref_tokens, ref_logits, rtol=6e-2):
    """The prefill's logits and the first decode step's (whose input token both chose alike)."""
    for (rid, i), want in ref_logits.items():
        if i > 1 or (i == 1 and tokens[rid][0] != ref_tokens[rid][0]):
            continue
        rel = rel_err(logits[(rid, i)], want)
        assert rel <= rtol, f"{rid} step {i}: relative error {rel:.2e}"


@pytest.mark.parametrize("targets", [None, ("q_proj", "k_proj", "v_proj", "o_proj")], ids=["all-targets", "attn-targets"])
def test_graphs_match_eager_steps_with_gemv(tiny_model_dir, demo_adapter_root, monkeypatch, targets):
    calls = []
    for fn in ("linear_rows", "gate_up_silu"):
        orig = getattr(gemv, fn)
        monkeypatch.setattr(gemv, fn, lambda *a, _f=orig, _n=fn, **k: calls.append(_n) or _f(*a, **k))
    fast = make(tiny_model_dir, demo_adapter_root, graphs=True, targets=targets)
    eager = make(tiny_model_dir, demo_adapter_root, graphs=False, targets=targets)
    cublas = make(tiny_model_dir, demo_adapter_root, graphs=True, rows=0, targets=targets)
    assert fast.runner.graphs is not None and eager.runner.graphs is None
    assert {"linear_rows", "gate_up_silu"} <= set(calls)  # captured into the graphs (and run eagerly below)
    for name, (requests, script, untouched) in CASES.items():
        if targets is not None and "demo-r32-mlp" in requests.values():
            requests = {k: ("demo-r16-attn" if v == "demo-r32-mlp" else v) for k, v in requests.items()}
            script = [(m, "demo-r16-attn" if a == "demo-r32-mlp" else a) for m, a in script]
        tokens, logits = run(fast, requests, script)
        ref_tokens, ref_logits = run(eager, requests, script)
        assert all(len(t) == MAX_NEW for t in tokens.values())
        for rid in untouched:  # only the gemv kernels and row-wise kernels: the same bits, the same tokens
            assert tokens[rid] == ref_tokens[rid], (name, rid)
        first_logits_close(tokens, logits, ref_tokens, ref_logits)
        cb_tokens, cb_logits = run(cublas, requests, script)
        first_logits_close(tokens, logits, cb_tokens, cb_logits)
    replayed = {v for (_, v), n in fast.runner.graphs.replays.items() if n}
    assert replayed >= {"base", "lora", "mixture"}
