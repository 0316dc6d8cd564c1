"""The Triton paged-attention kernels (vlora.engine.attention) on CUDA against the fp32 reference, at the
7B model's shapes (H=32, Hkv=32 and 8, D=128, block 16): decode up to B=64 and 4096-token contexts with
and without split-K, variable-length prefill up to 8192 packed tokens (fresh and continued prompts),
pools past 2^31 elements, and decode captured once in a CUDA graph and replayed with new lengths and
block tables. Pools hold NaN everywhere but the live positions, so a read past a sequence's end or of
a block outside its table shows up as NaN."""
from __future__ import annotations

import pytest
import torch

from helpers import require_cuda, shuffled_block_tables

pytestmark = pytest.mark.gpu
require_cuda(triton=True)

from vlora.engine import attention as attn  # noqa: E402
from vlora.engine.attention import AttentionMetadata  # noqa: E402

DEV = torch.device("cuda")
H, D, BS = 32, 128, 16
SCALE = D ** -0.5
# Output against the fp32 reference on the same (rounded) inputs: p is rounded to the input dtype before
# the P @ V product and the output is rounded once.
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.float32: dict(atol=1e-4, rtol=1e-4)}
DTYPES = [torch.bfloat16, torch.float16]
KV_HEADS = [pytest.param(32, id="mha"), pytest.param(8, id="gqa4")]


class Cache:
    """Shuffled block tables for the given lengths; pools NaN except at live positions."""

    def __init__(self, seq_lens: list[int], n_kv: int, dtype: torch.dtype, seed: int, spare: int = 7,
                 high_ids_from: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tables, num_blocks = shuffled_block_tables(seq_lens, BS, g, spare, first_id=high_ids_from)
        shape = (num_blocks * BS, n_kv, D)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
        write_live(self.k, self.v, seq_lens, self.tables, seed)


def write_live(k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], tables: list[list[int]], seed: int) -> None:
    """Random K/V at the live positions of each sequence."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    for table, L in zip(tables, seq_lens):
        if L:
            pos = torch.arange(L, device=DEV)
            slots = torch.tensor(table, dtype=torch.long, device=DEV)[pos // BS] * BS + pos % BS
            k[slots] = torch.randn(L, *k.shape[1:], generator=g, device=DEV).to(k.dtype)
            v[slots] = torch.randn(L, *v.shape[1:], generator=g, device=DEV).to(v.dtype)


def fp32_oracle(k: torch.Tensor, v: torch.Tensor, tables: list[list[int]]):
    """fp32 copies of only the blocks in ``tables`` (pools can be many GB), and the tables renumbered."""
    used = sorted({b for t in tables for b in t}) or [0]
    index = {b: i for i, b in enumerate(used)}
    ids = torch.tensor(used, device=DEV)
    shape = (-1, BS) + tuple(k.shape[1:])
    k32 = k.view(shape)[ids].reshape(-1, *k.shape[1:]).float()
    v32 = v.view(shape)[ids].reshape(-1, *v.shape[1:]).float()
    return k32, v32, [[index[b] for b in t] for t in tables]


def decode_oracle(q, cache_k, cache_v, tables, seq_lens):
    k32, v32, t32 = fp32_oracle(cache_k, cache_v, tables)
    meta = AttentionMetadata.for_decode(t32, seq_lens, DEV, max_blocks=max(1, max(len(t) for t in t32)))
    return attn.paged_decode_reference(q.float(), k32, v32, meta.block_tables, meta.seq_lens, SCALE, BS)


def prefill_oracle(q, cache_k, cache_v, tables, q_lens, seq_lens):
    k32, v32, t32 = fp32_oracle(cache_k, cache_v, tables)
    meta = AttentionMetadata.for_prefill(t32, q_lens, seq_lens, DEV)
    return attn.paged_prefill_reference(q.float(), k32, v32, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                        meta.max_q_len, SCALE, BS)


def check(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not out.isnan().any(), f"{what}: NaN in the output"
    torch.testing.assert_close(out.float(), want, **TOL[dtype], msg=lambda m: f"{what}: {m}")


def decode_lengths(B: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    edge = [1, BS - 1, BS, BS + 1, 4096, 0]
    rand = torch.randint(1, 4097, (max(0, B - len(edge)),), generator=g).tolist()
    return (edge + rand)[:B] if B >= len(edge) else [4096, 1, 37, 0][:B]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("B", [1, 4, 64])
def test_decode(dtype, n_kv, B):
    lens = decode_lengths(B, seed=B)
    cache = Cache(lens, n_kv, dtype, seed=B + n_kv)
    meta = AttentionMetadata.for_decode(cache.tables, lens, DEV, max_blocks=4096 // BS)
    q = torch.randn(B, H, D, device=DEV).to(dtype)
    out = attn.paged_decode(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, SCALE, BS)
    check(out, decode_oracle(q, cache.k, cache.v, cache.tables, lens), dtype, f"decode B={B} Hkv={n_kv}")
    assert not out[torch.tensor(lens, device=DEV) == 0].any(), "padding rows must be zeros"


@pytest.mark.parametrize("num_splits", [1, 2, 7, 16, 64])
def test_decode_forced_splits(num_splits):
    dtype, n_kv = torch.bfloat16, 8
    lens = [4096, 1, 300, 0, 2049]
    cache = Cache(lens, n_kv, dtype, seed=num_splits)
    meta = AttentionMetadata.for_decode(cache.tables, lens, DEV, max_blocks=4096 // BS)
    q = torch.randn(len(lens), H, D, device=DEV).to(dtype)
    ws = attn.decode_workspace(len(lens), H, D, num_splits, DEV).fill_(float("nan")) if num_splits > 1 else None
    out = attn.paged_decode(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, SCALE, BS, workspace=ws,
                            num_splits=num_splits)
    check(out, decode_oracle(q, cache.k, cache.v, cache.tables, lens), dtype, f"decode splits={num_splits}")


def test_decode_fp32_is_exact_enough_for_parity():
    lens = [1, 100, 4096, 0]
    cache = Cache(lens, 8, torch.float32, seed=3)
    meta = AttentionMetadata.for_decode(cache.tables, lens, DEV)
    q = torch.randn(len(lens), H, D, device=DEV)
    out = attn.paged_decode(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, SCALE, BS)
    check(out, decode_oracle(q, cache.k, cache.v, cache.tables, lens), torch.float32, "decode fp32")


PREFILL_MIXES = {
    # (seq_len, q_len): fresh prompts have q_len == seq_len
    "fresh": [(4096, 4096), (1000, 1000), (17, 17), (1, 1), (3000, 3000), (78, 78)],
    "continued": [(4096, 2048), (3000, 1000), (200, 30), (BS + 1, 1), (4096, 4096), (1024, 1000)],
    "mixed": [(4096, 4096), (1000, 1000), (17, 17), (1, 1), (3000, 1000), (4096, 2048), (200, 30)],  # T = 8192
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("mix", list(PREFILL_MIXES))
def test_prefill(dtype, n_kv, mix):
    seq_lens = [L for L, _ in PREFILL_MIXES[mix]]
    q_lens = [n for _, n in PREFILL_MIXES[mix]]
    cache = Cache(seq_lens, n_kv, dtype, seed=len(mix) + n_kv)
    meta = AttentionMetadata.for_prefill(cache.tables, q_lens, seq_lens, DEV)
    q = torch.randn(sum(q_lens), H, D, device=DEV).to(dtype)
    out = torch.full_like(q, float("nan"))
    attn.paged_prefill(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_q_len,
                       SCALE, BS, out=out)
    check(out, prefill_oracle(q, cache.k, cache.v, cache.tables, q_lens, seq_lens), dtype, f"prefill {mix} Hkv={n_kv}")


def fresh_rows(tables: list[list[int]], q_lens: list[int]) -> torch.Tensor:
    """The pool row of every new token of fresh prompts (position p at table[p // BS] * BS + p % BS)."""
    rows = [t[p // BS] * BS + p % BS for t, n in zip(tables, q_lens) for p in range(n)]
    return torch.tensor(rows, dtype=torch.long, device=DEV)


@pytest.mark.skipif(not attn.flash_available(DEV), reason="no FlashAttention-2 kernel on this GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("q_lens", [pytest.param([1], id="one"), pytest.param([600], id="600"),
                                    pytest.param([37, 1, 16, 300, 2048], id="mixed")])
def test_flash_prefill_fresh(dtype, n_kv, q_lens):
    """The flash backend on fresh prompts against the fp32 reference; continued prompts and fp32 fall
    back to the Triton kernel (same result as paged_prefill)."""
    cache = Cache(q_lens, n_kv, dtype, seed=sum(q_lens) + n_kv)
    meta = AttentionMetadata.for_prefill(cache.tables, q_lens, q_lens, DEV)
    meta.fresh_rows = fresh_rows(cache.tables, q_lens)
    q = torch.randn(sum(q_lens), H, D, device=DEV).to(dtype)
    backend = attn.get_attention_backend("flash", DEV)
    backend.min_tokens = 1  # every length through FlashAttention-2 here
    backend.cudnn_min_tokens = 1 << 30
    out = backend.prefill(q, cache.k, cache.v, meta, SCALE, BS)
    check(out, prefill_oracle(q, cache.k, cache.v, cache.tables, q_lens, q_lens), dtype, f"flash prefill {q_lens} Hkv={n_kv}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv", [pytest.param(32, id="mha")])
@pytest.mark.parametrize("q_lens", [pytest.param([1], id="one"), pytest.param([600], id="600"),
                                    pytest.param([37, 1, 16, 300, 2048], id="mixed"),
                                    pytest.param([1500, 2300, 17], id="padded")])
def test_cudnn_prefill_fresh(dtype, n_kv, q_lens):
    """The flash backend's cuDNN path (one SDPA call per fresh prompt) against the fp32 reference (the
    backend takes it without GQA only)."""
    if not attn.cudnn_attention_available(DEV, dtype, H, n_kv, D):
        pytest.skip(f"no cuDNN attention for {dtype} H={H} Hkv={n_kv} on this GPU")
    cache = Cache(q_lens, n_kv, dtype, seed=sum(q_lens) + n_kv + 1)
    meta = AttentionMetadata.for_prefill(cache.tables, q_lens, q_lens, DEV)
    meta.fresh_rows = fresh_rows(cache.tables, q_lens)
    q = torch.randn(sum(q_lens), H, D, device=DEV).to(dtype)
    backend = attn.get_attention_backend("flash", DEV)
    backend.cudnn_min_tokens = 1  # every length through cuDNN here
    out = backend.prefill(q, cache.k, cache.v, meta, SCALE, BS)
    check(out, prefill_oracle(q, cache.k, cache.v, cache.tables, q_lens, q_lens), dtype, f"cudnn prefill {q_lens} Hkv={n_kv}")


@pytest.mark.skipif(not attn.flash_available(DEV), reason="no FlashAttention-2 kernel on this GPU")
def test_flash_backend_falls_back_for_continued_prompts():
    seq_lens, q_lens = [300, 1000, 5], [300, 200, 5]
    cache = Cache(seq_lens, 8, torch.bfloat16, seed=11)
    meta = AttentionMetadata.for_prefill(cache.tables, q_lens, seq_lens, DEV)  # fresh_rows None: not fresh
    q = torch.randn(sum(q_lens), H, D, device=DEV).to(torch.bfloat16)
    out = attn.get_attention_backend("flash", DEV).prefill(q, cache.k, cache.v, meta, SCALE, BS)
    want = attn.paged_prefill(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_q_len,
                              SCALE, BS)
    assert torch.equal(out, want)


def test_prefill_fp32():
    seq_lens, q_lens = [300, 1000, 5], [300, 200, 5]
    cache = Cache(seq_lens, 8, torch.float32, seed=9)
    meta = AttentionMetadata.for_prefill(cache.tables, q_lens, seq_lens, DEV)
    q = torch.randn(sum(q_lens), H, D, device=DEV)
    out = attn.paged_prefill(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_q_len,
                             SCALE, BS)
    check(out, prefill_oracle(q, cache.k, cache.v, cache.tables, q_lens, seq_lens), torch.float32, "prefill fp32")


def test_pool_past_int32_offsets():
    """Blocks whose element offsets exceed 2^31 (4.3 GB pools): the kernels must address with int64."""
    n_kv, dtype = 8, torch.bfloat16
    first_high = (1 << 31) // (BS * n_kv * D) + 1  # every block from here starts past element 2^31
    seq_lens, q_lens = [700, 33], [700, 10]
    cache = Cache(seq_lens, n_kv, dtype, seed=1, high_ids_from=first_high)
    assert min(b for t in cache.tables for b in t) * BS * n_kv * D >= 1 << 31
    meta = AttentionMetadata.for_prefill(cache.tables, q_lens, seq_lens, DEV)
    q = torch.randn(sum(q_lens), H, D, device=DEV).to(dtype)
    out = attn.paged_prefill(q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_q_len,
                             SCALE, BS)
    check(out, prefill_oracle(q, cache.k, cache.v, cache.tables, q_lens, seq_lens), dtype, "prefill high blocks")
    dmeta = AttentionMetadata.for_decode(cache.tables, seq_lens, DEV)
    qd = torch.randn(2, H, D, device=DEV).to(dtype)
    for splits in (1, 4):
        out = attn.paged_decode(qd, cache.k, cache.v, dmeta.block_tables, dmeta.seq_lens, SCALE, BS, num_splits=splits)
        check(out, decode_oracle(qd, cache.k, cache.v, cache.tables, seq_lens), dtype, f"decode high blocks splits={splits}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("B", [4, 64])
def test_decode_cuda_graph_replay(dtype, n_kv, B):
    """Capture decode once with buffers at fixed addresses, then replay with new lengths, tables and q."""
    max_blocks = 4096 // BS
    num_blocks = B * max_blocks + 8
    k = torch.full((num_blocks * BS, n_kv, D), float("nan"), dtype=dtype, device=DEV)
    v = torch.full_like(k, float("nan"))
    meta = AttentionMetadata.allocate_decode(B, max_blocks, DEV)
    q = torch.zeros(B, H, D, dtype=dtype, device=DEV)
    out = torch.zeros_like(q)
    cfg = attn.decode_config(B, n_kv, H // n_kv, D, max_blocks * BS, dtype, attn.num_sms(DEV))
    ws = attn.decode_workspace(B, H, D, cfg.num_splits, DEV) if cfg.num_splits > 1 else None

    def step():
        attn.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, SCALE, BS, out=out, workspace=ws)

    def new_round(r: int) -> tuple[list[list[int]], list[int]]:
        g = torch.Generator().manual_seed(100 + r)
        live = B - r  # fewer live sequences each round: the rest are padding rows
        lens = torch.randint(1, max_blocks * BS + 1, (live,), generator=g).tolist()
        lens[0] = [1, BS, 4096, BS + 1][r % 4]
        perm = torch.randperm(num_blocks, generator=g).tolist()
        tables, at = [], 0
        for L in lens:
            n = -(-L // BS)
            tables.append(perm[at:at + n])
            at += n
        k.fill_(float("nan"))
        v.fill_(float("nan"))
        write_live(k, v, lens, tables, seed=200 + r)
        meta.fill_decode(tables, lens)
        q.copy_(torch.randn(B, H, D, generator=g).to(dtype))
        return tables, lens

    new_round(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for r in range(4):
        tables, lens = new_round(r)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.zeros(B, H, D, device=DEV)
        want[: len(lens)] = decode_oracle(q[: len(lens)], k, v, tables, lens)
        check(out, want, dtype, f"graph replay {r} (splits={cfg.num_splits})")
        assert not out[len(lens):].any(), "padding rows must be zeros after replay"
