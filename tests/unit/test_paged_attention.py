"""Paged attention (vlora.engine.attention) on the CPU.

The PyTorch references are checked against a naive per-token softmax (fp32, one query head and one key
at a time, slots looked up by hand) for MHA and GQA, shuffled non-contiguous block tables, lengths
around the block size, decode with padding rows, and prefill of fresh and continued prompts. The
Triton kernels run under Triton's interpreter against the references when triton is importable and
TRITON_INTERPRET=1 (for example ``TRITON_INTERPRET=1 PYTHONPATH=/path/to/triton pytest ...``);
otherwise those tests skip.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from helpers import shuffled_block_tables
from vlora.engine import attention as attn
from vlora.engine.attention import (AttentionMetadata, choose_num_splits, get_attention_backend, paged_decode_reference,
                                    paged_prefill_reference)

LENGTHS = (1, "bs-1", "bs", "bs+1", 37, 100)
HEADS = [pytest.param(4, 4, id="mha"), pytest.param(8, 2, id="gqa4")]


def resolve(length, block_size: int) -> int:
    return {"bs-1": block_size - 1, "bs": block_size, "bs+1": block_size + 1}.get(length, length)


class Cache:
    """Shuffled, non-contiguous block tables for sequences of the given lengths, and pools holding random
    values at their positions."""

    def __init__(self, seq_lens: list[int], n_kv: int, head_dim: int, block_size: int, seed: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(seed)
        self.tables, num_blocks = shuffled_block_tables(seq_lens, block_size, g, spare=3)  # 3 blocks nobody owns
        # NaN everywhere but the live positions: a kernel that reads past a sequence's end, or a block
        # that is not in its table, turns the result into NaN.
        shape = (num_blocks * block_size, n_kv, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=device)
        for table, L in zip(self.tables, seq_lens):
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(L)], dtype=torch.long)
            self.k[slots] = torch.randn(L, n_kv, head_dim, generator=g).to(dtype=dtype, device=device)
            self.v[slots] = torch.randn(L, n_kv, head_dim, generator=g).to(dtype=dtype, device=device)
        self.block_size = block_size
        self.seq_lens = seq_lens


def naive(q_rows: torch.Tensor, q_pos: list[int], table: list[int], cache: Cache, scale: float) -> torch.Tensor:
    """fp32 softmax attention of q_rows [n, H, D] (query i at position q_pos[i]) over one sequence's cache."""
    n, H, D = q_rows.shape
    n_kv = cache.k.shape[1]
    groups = H // n_kv
    bs = cache.block_size
    out = torch.zeros(n, H, D)
    for i in range(n):
        for h in range(H):
            kv = h // groups
            scores, values = [], []
            for p in range(q_pos[i] + 1):
                slot = table[p // bs] * bs + p % bs
                scores.append(float(q_rows[i, h].float() @ cache.k[slot, kv].float()) * scale)
                values.append(cache.v[slot, kv].float())
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[i, h] = sum(w / total * v for w, v in zip(weights, values))
    return out


def decode_case(block_size: int, H: int, n_kv: int, D: int, seed: int, lengths=LENGTHS, dtype=torch.float32):
    """Decode batch of every length, with padding rows (seq_len 0) in the middle and at the end."""
    lens = [resolve(x, block_size) for x in lengths]
    lens = lens[:2] + [0] + lens[2:] + [0]
    cache = Cache(lens, n_kv, D, block_size, seed, dtype)
    meta = AttentionMetadata.for_decode(cache.tables, lens, torch.device("cpu"))
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return cache, meta, q


def prefill_case(block_size: int, H: int, n_kv: int, D: int, seed: int, dtype=torch.float32):
    """Fresh prompts of every length, and prompts continuing cached prefixes, packed in one batch."""
    fresh = [resolve(x, block_size) for x in LENGTHS]
    continued = [(block_size + 1, 1), (block_size, block_size - 1), (37, 5), (100, 63), (2 * block_size, block_size)]
    seq_lens = fresh + [L for L, _ in continued]
    q_lens = fresh + [n for _, n in continued]
    cache = Cache(seq_lens, n_kv, D, block_size, seed, dtype)
    meta = AttentionMetadata.for_prefill(cache.tables, q_lens, seq_lens, torch.device("cpu"))
    q = torch.randn(sum(q_lens), H, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return cache, meta, q, q_lens


# -- the references against the naive oracle ---------------------------------------------------------


@pytest.mark.parametrize("H, n_kv", HEADS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_reference_matches_naive(H, n_kv, block_size):
    D, scale = 16, 16 ** -0.5
    cache, meta, q = decode_case(block_size, H, n_kv, D, seed=block_size + H)
    out = paged_decode_reference(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, block_size)
    for b, L in enumerate(cache.seq_lens):
        if L == 0:
            assert torch.equal(out[b], torch.zeros(H, D)), "a padding row must give zeros"
            continue
        want = naive(q[b:b + 1], [L - 1], cache.tables[b], cache, scale)[0]
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-5, msg=f"decode row {b} (seq_len {L})")


@pytest.mark.parametrize("H, n_kv", HEADS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_reference_matches_naive(H, n_kv, block_size):
    D, scale = 16, 0.3
    cache, meta, q, q_lens = prefill_case(block_size, H, n_kv, D, seed=3 * block_size + H)
    out = paged_prefill_reference(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                  meta.max_q_len, scale, block_size)
    off = 0
    for s, (n, L) in enumerate(zip(q_lens, cache.seq_lens)):
        want = naive(q[off:off + n], list(range(L - n, L)), cache.tables[s], cache, scale)
        torch.testing.assert_close(out[off:off + n], want, rtol=1e-5, atol=1e-5,
                                   msg=f"prefill sequence {s} (q_len {n}, seq_len {L})")
        off += n


def test_decode_is_prefill_of_one_token():
    block_size, H, n_kv, D = 16, 8, 2, 32
    cache, meta, q = decode_case(block_size, H, n_kv, D, seed=11, lengths=(5, 37, 100))
    live = [b for b, L in enumerate(cache.seq_lens) if L]
    dec = paged_decode_reference(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, 0.2, block_size)
    pre_meta = AttentionMetadata.for_prefill([cache.tables[b] for b in live], [1] * len(live),
                                             [cache.seq_lens[b] for b in live], torch.device("cpu"))
    pre = paged_prefill_reference(q[live], cache.k, cache.v, pre_meta.cu_seqlens_q, pre_meta.seq_lens,
                                  pre_meta.block_tables, 1, 0.2, block_size)
    torch.testing.assert_close(dec[live], pre, rtol=1e-6, atol=1e-6)


# -- metadata, launch rule, backend choice -------------------------------------------------------------


def test_fill_decode_keeps_addresses_and_pads():
    meta = AttentionMetadata.allocate_decode(max_batch=4, max_blocks=3, device=torch.device("cpu"))
    ptrs = (meta.block_tables.data_ptr(), meta.seq_lens.data_ptr())
    meta.fill_decode([[5, 2], [7]], [20, 3])
    assert (meta.block_tables.data_ptr(), meta.seq_lens.data_ptr()) == ptrs
    assert meta.seq_lens.tolist() == [20, 3, 0, 0]
    assert meta.block_tables.tolist() == [[5, 2, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]]
    bucket = meta.rows(2)
    assert bucket.block_tables.data_ptr() == ptrs[0] and bucket.seq_lens.shape == (2,)
    meta.fill_decode([[1]], [4])
    assert meta.seq_lens.tolist() == [4, 0, 0, 0] and meta.block_tables[1].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="buffers hold 3"):
        meta.fill_decode([[1, 2, 3, 4]], [60])
    with pytest.raises(ValueError, match="5 sequences"):
        meta.fill_decode([[1]] * 5, [1] * 5)


def test_metadata_validation():
    with pytest.raises(ValueError, match="q_len=0"):
        AttentionMetadata.for_prefill([[0]], [0], [4], torch.device("cpu"))
    with pytest.raises(ValueError, match="q_len=5 seq_len=4"):
        AttentionMetadata.for_prefill([[0]], [5], [4], torch.device("cpu"))
    with pytest.raises(ValueError, match="block_tables must be int32"):
        AttentionMetadata(block_tables=torch.zeros(2, 3, dtype=torch.int64), seq_lens=torch.zeros(2, dtype=torch.int32))
    meta = AttentionMetadata.for_prefill([[3, 1], [2]], [4, 2], [20, 2], torch.device("cpu"))
    assert meta.is_prefill and meta.max_q_len == 4 and meta.cu_seqlens_q.tolist() == [0, 4, 6]


def test_num_splits_depends_on_static_shapes_only():
    assert choose_num_splits(batch=64, n_kv_heads=32, max_context=4096, num_sms=132) == 1
    assert choose_num_splits(batch=1, n_kv_heads=32, max_context=4096, num_sms=132) == 9
    assert choose_num_splits(batch=1, n_kv_heads=8, max_context=256, num_sms=132) == 1  # too short to split
    assert choose_num_splits(batch=1, n_kv_heads=1, max_context=1 << 20, num_sms=132) == attn.MAX_SPLITS


def test_backend_choice_on_cpu():
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu).name == "torch"
    assert get_attention_backend("torch", cpu).name == "torch"
    with pytest.raises(RuntimeError, match="'triton' is not available on cpu"):
        get_attention_backend("triton", cpu)
    with pytest.raises(RuntimeError, match="'flash' is not available on cpu"):
        get_attention_backend("flash", cpu)
    with pytest.raises(ValueError, match="unknown"):
        get_attention_backend("flashinfer", cpu)


@pytest.mark.parametrize("name", ["triton", "flash"])
def test_an_engine_refuses_a_backend_its_device_cannot_run_naming_the_setting(tiny_model_dir, name):
    """At load, with the setting named: not a RuntimeError from the first step."""
    from vlora.config import ConfigError, EngineConfig
    from vlora.engine.builder import build_engine

    cfg = EngineConfig().with_overrides({"model.path": str(tiny_model_dir), "model.device": "cpu",
                                         "model.dtype": "float32", "engine.attention": name})
    with pytest.raises(ConfigError, match=f"engine.attention={name}: attention backend '{name}' is not available on cpu"):
        build_engine(cfg)


def test_torch_backend_runs_metadata():
    block_size, H, n_kv, D = 8, 8, 2, 16
    cache, meta, q = decode_case(block_size, H, n_kv, D, seed=5, lengths=(3, 17))
    backend = get_attention_backend("torch", torch.device("cpu"))
    out = torch.full_like(q, float("nan"))
    backend.decode(q, cache.k, cache.v, meta, 0.25, block_size, out=out)
    want = paged_decode_reference(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, 0.25, block_size)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "from vlora.engine import attention as a\n"
            "import torch\n"
            "assert not a.triton_available()\n"
            "assert a.get_attention_backend('auto', torch.device('cpu')).name == 'torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- the Triton kernels under the interpreter ---------------------------------------------------------

# Skipped unless triton is importable and TRITON_INTERPRET=1 (tests/conftest.py); `make test` runs them
# in a second pytest run under the interpreter.
interpreter = pytest.mark.interpreter


@interpreter
@pytest.mark.parametrize("H, n_kv", HEADS + [pytest.param(6, 2, id="gqa3"), pytest.param(32, 1, id="mqa")])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_triton_decode_matches_reference(H, n_kv, block_size, num_splits):
    D, scale = 32, 32 ** -0.5
    cache, meta, q = decode_case(block_size, H, n_kv, D, seed=7 * block_size + H)
    want = paged_decode_reference(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, block_size)
    out = torch.full_like(q, float("nan"))
    splits = num_splits or 1
    ws = attn.decode_workspace(q.shape[0], H, D, splits, q.device).fill_(float("nan")) if splits > 1 else None
    attn.paged_decode(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, block_size, out=out,
                      workspace=ws, num_splits=num_splits)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@interpreter
def test_triton_decode_many_splits_short_sequences():
    """More splits than key tiles: the empty splits must weigh nothing in the reduce."""
    block_size, H, n_kv, D = 16, 4, 2, 16
    cache, meta, q = decode_case(block_size, H, n_kv, D, seed=21, lengths=(1, 70, 130))
    want = paged_decode_reference(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, 0.5, block_size)
    out = attn.paged_decode(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, 0.5, block_size, num_splits=8)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("H, n_kv", HEADS + [pytest.param(6, 2, id="gqa3")])
@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_prefill_matches_reference(H, n_kv, block_size):
    D, scale = 32, 32 ** -0.5
    cache, meta, q, _ = prefill_case(block_size, H, n_kv, D, seed=5 * block_size + H)
    want = paged_prefill_reference(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                   meta.max_q_len, scale, block_size)
    out = torch.full_like(q, float("nan"))
    attn.paged_prefill(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_q_len,
                       scale, block_size, out=out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("heavy_first, split_mask", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 16), (16, 32)])
def test_triton_prefill_launch_shapes_match_reference(heavy_first, split_mask, block_m, block_n):
    """Every launch the prefill probe compares (grid order, causal mask split, tile sizes) computes the
    same: small tiles put the diagonal inside, at the edge of and past the prompts' key tiles."""
    D, scale, block_size = 16, 16 ** -0.5, 8
    cache, meta, q, _ = prefill_case(block_size, 4, 2, D, seed=11)
    want = paged_prefill_reference(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                   meta.max_q_len, scale, block_size)
    cfg = attn.PrefillConfig(block_m=block_m, block_n=block_n, heavy_first=heavy_first, split_mask=split_mask)
    out = torch.full_like(q, float("nan"))
    attn.paged_prefill(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_q_len,
                       scale, block_size, out=out, cfg=cfg)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@interpreter
def test_triton_backend_checks_shapes():
    q = torch.zeros(2, 4, 24)
    pool = torch.zeros(32, 2, 24)
    meta = AttentionMetadata.allocate_decode(2, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="head_dim=24"):
        attn.paged_decode(q, pool, pool, meta.block_tables, meta.seq_lens, 1.0, 16)


@interpreter
def test_triton_fp16_under_interpreter():
    """16-bit inputs (P rounded to fp16 before P @ V). bf16 is left to the GPU tests: Triton's interpreter
    computes tl.dot on bf16 operands wrongly (seen with triton 3.9)."""
    block_size, H, n_kv, D, scale = 16, 8, 2, 32, 32 ** -0.5
    cache, meta, q = decode_case(block_size, H, n_kv, D, seed=31, lengths=(1, 17, 100), dtype=torch.float16)
    want = paged_decode_reference(q.float(), cache.k.float(), cache.v.float(), meta.block_tables, meta.seq_lens,
                                  scale, block_size)
    for splits in (1, 2):
        out = attn.paged_decode(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, block_size,
                                num_splits=splits)
        torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=2e-3)
    cache, meta, q, _ = prefill_case(block_size, H, n_kv, D, seed=32, dtype=torch.float16)
    want = paged_prefill_reference(q.float(), cache.k.float(), cache.v.float(), meta.cu_seqlens_q, meta.seq_lens,
                                   meta.block_tables, meta.max_q_len, scale, block_size)
    out = attn.paged_prefill(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                             meta.max_q_len, scale, block_size)
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=2e-3)


def test_cudnn_buckets_bound_padding_and_are_few():
    """cuDNN builds a plan per sequence length, so prompts are padded to a fixed set of lengths: never
    shorter than the prompt, at most 12.5% (or 63 tokens) longer, and few enough for the warm start."""
    from vlora.engine.attention.flash import CUDNN_MIN_SEQ_TOKENS, cudnn_bucket, cudnn_buckets

    for n in range(CUDNN_MIN_SEQ_TOKENS, 20000):
        b = cudnn_bucket(n)
        assert n <= b <= max(n + 63, int(n * 1.125) + 1), n
    buckets = cudnn_buckets(8192)
    assert len(buckets) == 40 and buckets[-1] == 8192 and buckets == sorted(set(buckets))
    assert {cudnn_bucket(n) for n in range(CUDNN_MIN_SEQ_TOKENS, 8193)} == set(buckets)
    assert cudnn_bucket(1500) == 1536 and cudnn_bucket(2300) == 2304 and cudnn_bucket(4000) == 4096
