"""The packed decoder forward: prefill and decode tokens of many requests in one pass over the layers.

It reuses the Hugging Face modules of the loaded model (embeddings, RMSNorm, rotary embedding, the
projections, the MLP, the LM head); only the attention is ours, so that it can read a paged KV cache
and serve sequences of different lengths without padding the whole batch. LoRA projections are
:class:`~vlora.lora.layers.LoraLinear` wrappers driven by the step's :class:`LoraBatchMapping`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from vlora.engine.kv_cache import PagedKVCache, SequenceBlocks
from vlora.lora.layers import LoraContext, LoraLinear
from vlora.lora.mapping import LoraBatchMapping

log = logging.getLogger(__name__)

# cuDNN's SDPA builds a graph for every new shape: about 2 ms of CPU per call on an H100 (measured with
# torch.profiler: 57% of a decode step), and decode shapes change every step. Flash / memory-efficient
# kernels have no such cost.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class SeqInput:
    """One sequence's share of a step: the new tokens to run and where they go."""

    token_ids: list[int]
    start_pos: int  # position of token_ids[0]
    blocks: SequenceBlocks
    slot: int = -1  # adapter slot whose delta this sequence adds, -1: none
    delora_slot: int = -1  # merged slot whose delta this sequence subtracts (mixture mode), -1: none
    pixel_values: Optional[torch.Tensor] = None  # [n_images, 3, H, W] for a prefill with images
    image_keys: tuple[bytes, ...] = ()  # content hashes, so one image shared by requests is encoded once


@dataclass
class StepResult:
    logits: torch.Tensor  # [n_seqs, vocab] float32, at each sequence's last new token
    hidden: torch.Tensor  # [n_seqs, hidden] final-norm hidden state there (for task heads)
    num_images_encoded: int = 0
    extra: dict = field(default_factory=dict)


def language_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder, lm_head) of a LlavaForConditionalGeneration, across transformers 5.x layouts."""
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None) if inner is not None else None
    if lm is None or not hasattr(lm, "layers"):
        raise TypeError(f"{type(model).__name__}: expected model.model.language_model with .layers (a LLaVA model)")
    return lm, model.lm_head


class ModelRunner:
    """Owns the model on its device, the LoRA slot buffers inside it, and the KV cache."""

    def __init__(self, model: nn.Module, *, image_token_id: int, num_slots: int, max_rank: int,
                 target_modules: tuple[str, ...]) -> None:
        self.model = model
        self.image_token_id = image_token_id
        self.lm, self.lm_head = language_parts(model)
        cfg = self.lm.config
        self.num_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = self.lm_head.out_features
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.lora_ctx = LoraContext()
        self.lora_layers: dict[tuple[int, str], LoraLinear] = {}
        self._wrap_lora(target_modules, num_slots, max_rank)
        self.kv: Optional[PagedKVCache] = None  # allocate_kv() once the weights and LoRA buffers are placed
        vcfg = model.config
        self.vision_feature_layer = vcfg.vision_feature_layer
        self.vision_select = vcfg.vision_feature_select_strategy

    # -- setup ---------------------------------------------------------------------------------
    def _wrap_lora(self, targets: tuple[str, ...], num_slots: int, max_rank: int) -> None:
        for i, layer in enumerate(self.lm.layers):
            for name in targets:
                parent = layer.self_attn if name in ATTN_TARGETS else layer.mlp
                base = getattr(parent, name)
                if not isinstance(base, nn.Linear):
                    raise TypeError(f"layer {i}: {name} is {type(base).__name__}, not nn.Linear")
                wrapper = LoraLinear(base, self.lora_ctx, num_slots, max_rank)
                setattr(parent, name, wrapper)
                self.lora_layers[(i, name)] = wrapper

    def allocate_kv(self, num_blocks: Optional[int], block_size: int, memory_fraction: float) -> PagedKVCache:
        """Allocate the KV pool. ``num_blocks=None``: 4096 blocks on CPU; on CUDA, whatever keeps the
        device's use under ``memory_fraction`` of its total after the weights and LoRA buffers."""
        per_block = PagedKVCache.bytes_per_block(self.num_layers, block_size, self.n_kv, self.head_dim, self.dtype)
        if num_blocks is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - (1.0 - memory_fraction) * total
                num_blocks = int(budget // per_block)
                if num_blocks < 16:
                    raise MemoryError(f"KV cache: only {budget / 2**30:.2f} GiB left for the cache on {self.device}; "
                                      "lower lora.max_gpu_adapters or raise cache.gpu_memory_fraction")
            else:
                num_blocks = 4096
        self.kv = PagedKVCache(self.num_layers, num_blocks, block_size, self.n_kv, self.head_dim, self.dtype, self.device)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, block_size, num_blocks * per_block / 2**30)
        return self.kv

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every LoRA-targetable projection."""
        layer = self.lm.layers[0]
        dims = {}
        for name in ATTN_TARGETS + MLP_TARGETS:
            parent = layer.self_attn if name in ATTN_TARGETS else layer.mlp
            m = getattr(parent, name)
            m = m.base if isinstance(m, LoraLinear) else m
            dims[name] = (m.in_features, m.out_features)
        return dims

    # -- vision --------------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, tokens_per_image, hidden], as LlavaModel.get_image_features does."""
        vm = self.model.model
        out = vm.vision_tower(pixel_values.to(self.device, self.dtype), output_hidden_states=True)
        layers = self.vision_feature_layer if isinstance(self.vision_feature_layer, (list, tuple)) else [self.vision_feature_layer]
        feats = []
        for li in layers:
            h = out.hidden_states[li]
            feats.append(h[:, 1:] if self.vision_select == "default" else h)
        return vm.multi_modal_projector(torch.cat(feats, dim=-1))

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> StepResult:
        if not seqs:
            raise ValueError("forward: empty step")
        dev = self.device
        lengths = [len(s.token_ids) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long, device=dev)
        positions = torch.tensor([p for s in seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))], dtype=torch.long, device=dev)
        slot_mapping = torch.tensor([x for s in seqs for x in self.kv.slots(s.blocks, s.start_pos, s.start_pos + len(s.token_ids))],
                                    dtype=torch.long, device=dev)
        hidden = self.lm.embed_tokens(ids)
        n_enc = self._insert_images(seqs, ids, hidden)
        attn = _AttentionPlan.build(seqs, lengths, self.kv, dev)
        cos, sin = self.lm.rotary_emb(hidden[None], positions[None])
        self.lora_ctx.mapping = LoraBatchMapping.from_token_slots(lengths, [s.slot for s in seqs], dev)
        if any(s.delora_slot >= 0 for s in seqs):
            self.lora_ctx.delora = LoraBatchMapping.from_token_slots(lengths, [s.delora_slot for s in seqs], dev)
        try:
            with sdpa_kernel(SDPA_BACKENDS):
                for li, layer in enumerate(self.lm.layers):
                    hidden = self._layer(li, layer, hidden, cos, sin, slot_mapping, attn)
        finally:
            self.lora_ctx.mapping = None
            self.lora_ctx.delora = None
        last = torch.tensor(attn.last_index, dtype=torch.long, device=dev)
        h_last = self.lm.norm(hidden.index_select(0, last))
        logits = self.lm_head(h_last).float()
        return StepResult(logits=logits, hidden=h_last, num_images_encoded=n_enc)

    def _insert_images(self, seqs: list[SeqInput], ids: torch.Tensor, hidden: torch.Tensor) -> int:
        with_images = [s for s in seqs if s.pixel_values is not None and len(s.pixel_values)]
        if not with_images:
            return 0
        # Encode each distinct image once; keep the order in which placeholders appear.
        order: list[int] = []
        unique: dict[bytes, int] = {}
        pixels: list[torch.Tensor] = []
        for s in with_images:
            keys = s.image_keys or tuple(bytes([i]) + id(s).to_bytes(8, "little") for i in range(len(s.pixel_values)))
            for key, pv in zip(keys, s.pixel_values):
                if key not in unique:
                    unique[key] = len(pixels)
                    pixels.append(pv)
                order.append(unique[key])
        feats = self.encode_images(torch.stack(pixels))
        feats = feats[torch.tensor(order, device=feats.device)].reshape(-1, feats.shape[-1]).to(hidden.dtype)
        # Placeholders are looked for only in the prompts that bring their images in this step: a decode
        # token that happens to be the image token id (a random model samples it now and then) is text,
        # and must neither take an image's features nor fail the whole step.
        in_image_prompts = torch.zeros_like(ids, dtype=torch.bool)
        off = 0
        for s in seqs:
            n = len(s.token_ids)
            if s.pixel_values is not None and len(s.pixel_values):
                in_image_prompts[off:off + n] = True
            off += n
        mask = (ids == self.image_token_id) & in_image_prompts
        n_slots_img = int(mask.sum())
        if n_slots_img != feats.shape[0]:
            raise RuntimeError(f"image placeholders ({n_slots_img} tokens) do not match image features ({feats.shape[0]})")
        hidden[mask] = feats
        return len(pixels)

    def _layer(self, li: int, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slot_mapping: torch.Tensor, plan: "_AttentionPlan") -> torch.Tensor:
        T = h.shape[0]
        sa = layer.self_attn
        x = layer.input_layernorm(h)
        q = sa.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = sa.k_proj(x).view(T, self.n_kv, self.head_dim)
        v = sa.v_proj(x).view(T, self.n_kv, self.head_dim)
        q, k = _rotary(q, k, cos[0], sin[0])
        kc, vc = self.kv.k[li], self.kv.v[li]
        kc.index_copy_(0, slot_mapping, k)
        vc.index_copy_(0, slot_mapping, v)
        o = plan.attend(q, k, v, kc, vc, sa.scaling, self.n_heads // self.n_kv)
        h = h + sa.o_proj(o.reshape(T, self.n_heads * self.head_dim))
        return h + layer.mlp(layer.post_attention_layernorm(h))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaMA rotary embedding on [T, heads, dim] with cos/sin [T, dim] (same math as HF's apply_rotary_pos_emb)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@dataclass
class _AttentionPlan:
    """Index work for attention, built once per step and used by every layer.

    Decode tokens (one new token, context in the cache) run as one padded SDPA over gathered cache
    slots. Prefills that start at position 0 attend causally over their own new keys; a prefill that
    continues a cached prefix gathers the prefix from the cache like a decode.
    """

    last_index: list[int]
    decode_tok: Optional[torch.Tensor]  # [Bd] token indices in the packed batch
    decode_gather: Optional[torch.Tensor]  # [Bd, Lmax] pool slots
    decode_mask: Optional[torch.Tensor]  # [Bd, 1, 1, Lmax] bool
    prefills: list[tuple[int, int]]  # (first token index, length) of fresh prefills
    continued: list[tuple[int, int, torch.Tensor, int]]  # (first, length, pool slots of [0, end), start_pos)

    @classmethod
    def build(cls, seqs: list[SeqInput], lengths: list[int], kv: PagedKVCache, dev: torch.device) -> "_AttentionPlan":
        last_index, decode_idx, decode_ctx, prefills, continued = [], [], [], [], []
        off = 0
        for s, n in zip(seqs, lengths):
            last_index.append(off + n - 1)
            end = s.start_pos + n
            if n == 1:
                decode_idx.append(off)
                decode_ctx.append(kv.slots(s.blocks, 0, end))
            elif s.start_pos == 0:
                prefills.append((off, n))
            else:
                continued.append((off, n, torch.tensor(kv.slots(s.blocks, 0, end), dtype=torch.long, device=dev), s.start_pos))
            off += n
        dec_tok = dec_gather = dec_mask = None
        if decode_idx:
            lmax = max(len(c) for c in decode_ctx)
            gather = torch.zeros(len(decode_ctx), lmax, dtype=torch.long)
            mask = torch.zeros(len(decode_ctx), lmax, dtype=torch.bool)
            for i, c in enumerate(decode_ctx):
                gather[i, : len(c)] = torch.tensor(c, dtype=torch.long)
                mask[i, : len(c)] = True
            dec_tok = torch.tensor(decode_idx, dtype=torch.long, device=dev)
            dec_gather = gather.to(dev)
            dec_mask = mask.to(dev)[:, None, None, :]
        return cls(last_index, dec_tok, dec_gather, dec_mask, prefills, continued)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               scale: float, groups: int) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] of this step; kc/vc the layer's pool. Returns [T, H, D]."""
        out = torch.empty_like(q)
        for off, n in self.prefills:
            qs = q[off:off + n].transpose(0, 1)
            ks = _expand_kv(k[off:off + n].transpose(0, 1), groups)
            vs = _expand_kv(v[off:off + n].transpose(0, 1), groups)
            out[off:off + n] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
        for off, n, slots, start in self.continued:
            qs = q[off:off + n].transpose(0, 1)
            ks = _expand_kv(kc[slots].transpose(0, 1), groups)
            vs = _expand_kv(vc[slots].transpose(0, 1), groups)
            L = slots.shape[0]
            qpos = torch.arange(start, start + n, device=q.device)[:, None]
            mask = torch.arange(L, device=q.device)[None, :] <= qpos
            out[off:off + n] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1)
        if self.decode_tok is not None:
            qd = q.index_select(0, self.decode_tok)[:, :, None, :]  # [B, H, 1, D]
            kd = _expand_kv(kc[self.decode_gather].transpose(1, 2), groups)  # [B, H, L, D]
            vd = _expand_kv(vc[self.decode_gather].transpose(1, 2), groups)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, scale=scale)
            out.index_copy_(0, self.decode_tok, od[:, :, 0, :])
        return out


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat KV heads for grouped-query attention: [..., Hkv, L, D] -> [..., Hkv*groups, L, D]."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)
