"""A plain PyTorch LLaMA decode step, what a user could write in an afternoon: the baseline that
benchmarks/engine_floor.py sets the engine's decode step against.

Same weights as the engine's model (read from a Hugging Face LlavaForConditionalGeneration or
LlamaForCausalLM, not generated): q/k/v fused into one matrix and gate/up into another (o and down are
the model's own tensors), RMSNorm and rotary in plain torch ops, a static KV cache
[layers, batch, kv_heads, max_len, head_dim], ``F.scaled_dot_product_attention`` over the cache, the LM
head. On CUDA the whole decode step (batch B, one new token per sequence) is captured in one CUDA graph
and replayed; elsewhere it runs eagerly.

Attention reads the cache in one of two ways (``masked``): the whole cache up to ``max_len`` with a
per-sequence length mask (any mix of lengths: what a general server needs), or exactly
``context_len + 1`` positions with no mask (every sequence at the same length: the flash kernel may
serve it). Both are timed by engine_floor.py.

    from benchmarks.plain_decode import PlainDecoder, check_against_hf
    dec = PlainDecoder(hf_model, max_batch=32, max_len=768)
    dec.prefill_fill(700)
    ms = dec.time_decode_step(32, 700, iters=20)
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(LlamaModel, lm_head) of a LLaVA model (transformers 5 layout) or of a LlamaForCausalLM."""
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None) if inner is not None else None
    if lm is None and inner is not None and hasattr(inner, "layers"):
        lm = inner
    head = getattr(model, "lm_head", None)
    if lm is None or not hasattr(lm, "layers") or head is None:
        raise TypeError(f"{type(model).__name__}: expected a LLaVA model or a LlamaForCausalLM (a decoder with .layers and an lm_head)")
    return lm, head


def _weight(m: nn.Module) -> torch.Tensor:
    """The weight of a linear layer, through a LoRA wrapper (``.base``) if there is one."""
    return getattr(m, "base", m).weight.detach()


def _bias(m: nn.Module) -> Optional[torch.Tensor]:
    b = getattr(getattr(m, "base", m), "bias", None)
    return b.detach() if b is not None else None


def _cat_bias(mods: list[nn.Module]) -> Optional[torch.Tensor]:
    bs = [_bias(m) for m in mods]
    if all(b is None for b in bs):
        return None
    return torch.cat([b if b is not None else _weight(m).new_zeros(_weight(m).shape[0]) for b, m in zip(bs, mods)])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PlainDecoder:
    """Fused weights, a static KV cache, and a decode step captured as one CUDA graph (CUDA only).

    Shape: cache k/v [layers, max_batch, n_kv, max_len, head_dim]; a step reads token ids [B] and
    positions [B] from fixed buffers and returns logits [B, vocab] float32.
    """

    def __init__(self, model: nn.Module, max_batch: int, max_len: int, *, graphs: Optional[bool] = None) -> None:
        lm, head = decoder_parts(model)
        cfg = lm.config
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"PlainDecoder: hidden_act {act!r}; only LLaMA's silu is written here")
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.scale = float(getattr(lm.layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        self.embed = lm.embed_tokens.weight.detach()
        self.norm = lm.norm.weight.detach()
        self.lm_head = _weight(head)
        self.device, self.dtype = self.lm_head.device, self.lm_head.dtype
        self.graphs = (self.device.type == "cuda") if graphs is None else (graphs and self.device.type == "cuda")
        self.layers = []
        with torch.no_grad():
            for layer in lm.layers:
                sa, mlp = layer.self_attn, layer.mlp
                self.layers.append({
                    "in": layer.input_layernorm.weight.detach(),
                    "post": layer.post_attention_layernorm.weight.detach(),
                    "qkv": torch.cat([_weight(sa.q_proj), _weight(sa.k_proj), _weight(sa.v_proj)]).contiguous(),
                    "qkv_b": _cat_bias([sa.q_proj, sa.k_proj, sa.v_proj]),
                    "o": _weight(sa.o_proj), "o_b": _bias(sa.o_proj),
                    "gu": torch.cat([_weight(mlp.gate_proj), _weight(mlp.up_proj)]).contiguous(),
                    "gu_b": _cat_bias([mlp.gate_proj, mlp.up_proj]),
                    "down": _weight(mlp.down_proj), "down_b": _bias(mlp.down_proj),
                })
        self.inter = self.layers[0]["gu"].shape[0] // 2
        self.split = [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
        rot = lm.rotary_emb
        self._inv_freq = rot.inv_freq.detach().to(self.device, torch.float32)
        self._rot_scale = float(getattr(rot, "attention_scaling", 1.0))
        self.max_batch = self.max_len = 0
        self.k = self.v = None
        self.resize(max_batch, max_len)

    def resize(self, max_batch: int, max_len: int) -> None:
        """A new static cache (the old one and every captured graph are dropped first)."""
        self._graphs: dict[tuple, tuple] = {}
        self.k = self.v = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.max_batch, self.max_len = max_batch, max_len
        shape = (self.n_layers, max_batch, self.n_kv, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.arange = torch.arange(max_len, device=self.device)
        freqs = torch.arange(max_len, device=self.device, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # As transformers' LlamaRotaryEmbedding: fp32 angles, scaled, then cast to the activations' dtype.
        self.cos = (emb.cos() * self._rot_scale).to(self.dtype)
        self.sin = (emb.sin() * self._rot_scale).to(self.dtype)

    def release(self) -> None:
        """Drop the cache, the graphs and the fused weights."""
        self._graphs = {}
        self.k = self.v = None
        self.layers = []

    # -- the math ----------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor,
             attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """ids, pos [B, T] -> final-norm hidden [B, T, hidden]; ``attend(layer, q, k, v)`` with
        q [B, H, T, D] and k/v [B, Hkv, T, D] (rotary applied) returns [B, H, T, D]."""
        B, T = ids.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, T, D]
        for li, w in enumerate(self.layers):
            h = self._rms(x, w["in"])
            q, k, v = F.linear(h, w["qkv"], w["qkv_b"]).split(self.split, dim=-1)
            q = q.view(B, T, H, D).transpose(1, 2)
            k = k.view(B, T, Hkv, D).transpose(1, 2)
            v = v.view(B, T, Hkv, D).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attend(li, q, k, v)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, H * D), w["o"], w["o_b"])
            h = self._rms(x, w["post"])
            g, u = F.linear(h, w["gu"], w["gu_b"]).split(self.inter, dim=-1)
            x = x + F.linear(F.silu(g) * u, w["down"], w["down_b"])
        return self._rms(x, self.norm)

    def _sdpa(self, q, k, v, **kw) -> torch.Tensor:
        if self.n_kv != self.n_heads:
            kw["enable_gqa"] = True
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, **kw)

    def _decode_body(self, batch: int, attn_len: int, masked: bool) -> torch.Tensor:
        """One decode step over the fixed buffers ids/pos [:batch]: write each new key and value at its
        position, attend over ``attn_len`` cache positions. Returns logits [batch, vocab] float32."""
        B = batch
        pos = self.pos[:B]
        mask = (self.arange[:attn_len][None, :] <= pos[:, None])[:, None, None, :] if masked else None
        idx = pos.view(B, 1, 1, 1).expand(B, self.n_kv, 1, self.head_dim)

        def attend(li, q, k, v):
            kc, vc = self.k[li, :B], self.v[li, :B]  # [B, Hkv, max_len, D], contiguous
            kc.scatter_(2, idx, k)
            vc.scatter_(2, idx, v)
            return self._sdpa(q, kc[:, :, :attn_len], vc[:, :, :attn_len], attn_mask=mask)

        h = self._run(self.ids[:B, None], pos[:, None], attend)
        return F.linear(h[:, 0], self.lm_head).float()

    # -- public ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Real prefill (eager, causal SDPA) of ids [B, T] from position 0 into the cache; returns the
        last token's logits [B, vocab] float32."""
        B, T = ids.shape
        if B > self.max_batch or T > self.max_len:
            raise ValueError(f"prefill: ids {tuple(ids.shape)} exceed the cache (batch {self.max_batch}, length {self.max_len})")
        pos = torch.arange(T, device=self.device)[None].expand(B, T)

        def attend(li, q, k, v):
            self.k[li, :B, :, :T] = k
            self.v[li, :B, :, :T] = v
            return self._sdpa(q, k, v, is_causal=True)

        h = self._run(ids.to(self.device), pos, attend)
        return F.linear(h[:, -1], self.lm_head).float()

    @torch.inference_mode()
    def prefill_fill(self, context_len: int) -> None:
        """Fill cache positions [0, context_len) of every sequence with random values (decode timing
        only: the values do not change the work)."""
        if context_len + 1 > self.max_len:
            raise ValueError(f"prefill_fill: context {context_len} + 1 > max_len {self.max_len}")
        gen = torch.Generator(device=self.device).manual_seed(0)
        for c in (self.k, self.v):
            c[:, :, :, :context_len].normal_(0.0, 1.0, generator=gen)

    def _attn_len(self, context_len: int, masked: bool) -> int:
        return self.max_len if masked else context_len + 1

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, context_len: int, masked: bool = True) -> torch.Tensor:
        """One decode step for ids [B] at position ``context_len`` (every sequence holds that many
        tokens in the cache): graphed on CUDA, as timed. Returns logits [B, vocab] float32 (a copy)."""
        B = ids.shape[0]
        self._check(B, context_len)
        self.ids[:B].copy_(ids)
        self.pos[:B].fill_(context_len)
        return self._step_fn(B, self._attn_len(context_len, masked), masked)().clone()

    @torch.inference_mode()
    def time_decode_step(self, batch: int, context_len: int, iters: int = 20, masked: bool = True, warmup: int = 3) -> float:
        """Milliseconds per decode step at ``batch`` sequences of ``context_len`` tokens (cache filled by
        :meth:`prefill_fill`): the mean of ``iters`` graph replays timed with CUDA events on CUDA, of
        eager steps on a CPU. Every replay writes the same position, so the context stays fixed."""
        self._check(batch, context_len)
        gen = torch.Generator(device="cpu").manual_seed(batch * 100003 + context_len)
        self.ids[:batch].copy_(torch.randint(0, self.embed.shape[0], (batch,), generator=gen))
        self.pos[:batch].fill_(context_len)
        fn = self._step_fn(batch, self._attn_len(context_len, masked), masked)
        for _ in range(warmup):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return 1e3 * statistics.mean(samples)

    def _check(self, batch: int, context_len: int) -> None:
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside [1, {self.max_batch}] (the cache's max_batch)")
        if context_len + 1 > self.max_len:
            raise ValueError(f"context {context_len} + 1 new token > the cache's max_len {self.max_len}")

    def _step_fn(self, batch: int, attn_len: int, masked: bool) -> Callable[[], torch.Tensor]:
        """The step as a callable returning the logits buffer: a CUDA graph's replay (captured on first
        use per shape), or the eager body."""
        if not self.graphs:
            return lambda: self._decode_body(batch, attn_len, masked)
        key = (batch, attn_len, masked)
        if key not in self._graphs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisation and kernel selection stay out of the graph
                    self._decode_body(batch, attn_len, masked)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = self._decode_body(batch, attn_len, masked)
            self._graphs[key] = (g, out)
        g, out = self._graphs[key]

        def replay() -> torch.Tensor:
            g.replay()
            return out
        return replay


def _excluded_ids(model: nn.Module) -> set[int]:
    cfg = getattr(model, "config", None)
    out = set()
    for name in ("image_token_id", "image_token_index", "video_token_id"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            out.add(v)
    return out


@torch.inference_mode()
def check_against_hf(model: nn.Module, *, batch: int = 2, context: int = 16, seed: int = 0,
                     rtol: Optional[float] = None) -> dict:
    """The plain decode step (graphed on CUDA) against a Hugging Face forward of the same tokens.

    Random prompts of ``context`` tokens (no image placeholder) are prefilled by the plain decoder, then
    one decode step runs for token ``context``; its logits are compared with the HF model's logits at
    that position from one forward over all ``context + 1`` tokens. Passes when max |plain - hf| <=
    rtol * max |hf| (default rtol: 1e-4 in fp32, 5e-2 in bf16/fp16) and each row's greedy token agrees:
    equal, or (bf16/fp16 only) a near tie: hf's logit at plain's argmax within the tolerance of hf's max.
    """
    lm, head = decoder_parts(model)
    dev = _weight(head).device
    dtype = _weight(head).dtype
    if rtol is None:
        rtol = 1e-4 if dtype == torch.float32 else 5e-2
    vocab = _weight(head).shape[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, context + 1), generator=gen)
    for bad in _excluded_ids(model):
        ids[ids == bad] = (bad + 1) % vocab
    ids = ids.to(dev)
    ref = model(input_ids=ids).logits[:, -1].float()
    max_len = -(-(context + 1) // 64) * 64
    dec = PlainDecoder(model, batch, max_len)
    try:
        dec.prefill(ids[:, :context])
        out = {}
        for masked in (True, False):
            got = dec.decode(ids[:, context], context, masked=masked)
            err = (got - ref).abs().max().item()
            scale = ref.abs().max().item()
            am_got, am_ref = got.argmax(-1), ref.argmax(-1)
            equal = bool((am_got == am_ref).all())
            tie_ok = bool((ref.gather(1, am_got[:, None])[:, 0] >= ref.max(-1).values - rtol * scale).all())
            argmax_ok = equal or (dtype != torch.float32 and tie_ok)
            out["masked" if masked else "exact"] = {
                "max_abs_err": err, "rel_err": err / max(scale, 1e-30), "argmax_equal": equal,
                "passed": bool(err <= rtol * scale and argmax_ok)}
    finally:
        dec.release()
        del dec
    return {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."), "rtol": rtol,
            "graphed": dev.type == "cuda", **out, "passed": all(v["passed"] for v in out.values())}
