"""The packed decoder forward: prefill and decode tokens of many requests in one pass over the layers.

It reuses the Hugging Face modules of the loaded model (embeddings, RMSNorm, rotary embedding, the
projections, the MLP, the LM head); only the attention is ours, so that it can read a paged KV cache
in place and serve sequences of different lengths without padding the whole batch. LoRA projections
are :class:`~vlora.lora.layers.LoraLinear` wrappers driven by the step's :class:`LoraBatchMapping`.
The vision tower and projector take LoRA the same way (:class:`VisionLora`): the images of a step are
encoded in one forward, each image's rows in the segment of its adapter's slot.

Each step is described once by a :class:`~vlora.engine.plan.StepPlan` (token ids, positions, KV slot
mapping, block tables, lengths, LoRA segments, the previous step's rows), written by its one writer
(:class:`~vlora.engine.plan.PlanBuilder`, made with the KV cache) into pinned host memory and copied in one
transfer to a preallocated device buffer, for eager and graphed steps alike; the layers only read it, and
the LoRA backend prepares its launches from it once per step (:meth:`LoraContext.bind`). Decode-only steps replay CUDA graphs captured per batch-size bucket
(:mod:`vlora.engine.graphs`); steps that hold a prefill run eagerly with the varlen prefill attention.
Steps of at most ``engine.gemv_max_rows`` rows run their projections and the LM head through the
memory-bound kernels of :mod:`vlora.engine.gemv` (SiLU * up fused into gate/up where a layer has no LoRA
work), which give a row the same bits in any such step: the eager step and its graph's padded bucket agree.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from vlora.engine import gemv
from vlora.engine.attention import get_attention_backend
from vlora.engine.fused_ops import (add_rms_norm, fused_available, quick_gelu, rms_norm, rotary_and_cache, silu_mul,
                                    vision_rotary)
from vlora.engine.kv_cache import PagedKVCache, SequenceBlocks
from vlora.engine.plan import PlanBuilder, StepPlan
from vlora.lora.adapter import VisionSites
from vlora.engine.vision import EncoderCache, VisionLora  # noqa: F401  (importable from here too)
from vlora.engine.weight_groups import WeightGroup
from vlora.lora.layers import GroupSlots, LoraContext, LoraLinear

log = logging.getLogger(__name__)

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# The projections that run as one GEMM (their weights concatenated along d_out), and the others.
WEIGHT_GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)),
                 ("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",)))


@dataclass
class SeqInput:
    """One sequence's share of a step: the new tokens to run and where they go."""

    token_ids: list[int]
    start_pos: int  # position of token_ids[0]
    blocks: SequenceBlocks
    slot: int = -1  # adapter slot whose delta this sequence adds, -1: none
    delora_slot: int = -1  # merged slot whose delta this sequence subtracts (mixture mode), -1: none
    pixel_values: Optional[torch.Tensor] = None  # a prefill's images, as its model family's vision tower takes them
    image_keys: tuple[bytes, ...] = ()  # content hashes, so one image shared by requests is encoded once
    image_grid_thw: Optional[torch.Tensor] = None  # [n_images, 3] (Qwen2-VL)
    mrope_positions: Optional[torch.Tensor] = None  # [3, prompt length] M-RoPE positions of the prompt
    rope_delta: int = 0  # tokens past the prompt sit at their index plus this (M-RoPE)
    video: bool = False  # pixel_values are one video's frames
    vision_slot: int = -1  # adapter slot whose vision-side delta encodes the images, -1: the plain encoder
    vision_identity: str = ""  # the vision-side weights: the adapter's name@version, "" for the base model's
    # A decode token still on the device: row ``pending_row`` of the previous step's sampled ids (the
    # ``prev_tokens`` that :meth:`ModelRunner.forward` takes), read there instead of token_ids[0].
    pending_row: int = -1
    # A chunk of a prompt with images (chunked prefill): how many of the prompt's placeholder tokens lie before
    # start_pos (None: the step runs to the prompt's end, so all those not among token_ids), and the request's
    # features of images whose placeholders go on past this chunk, kept between its chunks (None: not chunked).
    placeholders_before: Optional[int] = None
    held_features: Optional[dict] = None


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [n_seqs, vocab] float32, at each sequence's last new token
    hidden: torch.Tensor  # [n_seqs, hidden] final-norm hidden state there (for task heads)
    num_images_encoded: int = 0


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
                 target_modules: tuple[str, ...], loaded=None, vision_lora: bool = False) -> None:
        self.model = model
        self.loaded = loaded  # the LoadedModel: its family encodes images (vlora.models.family)
        if loaded is not None and loaded.family is None:
            raise ValueError("ModelRunner: the LoadedModel has no family (load it with vlora.models.family.load_model)")
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
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise TypeError(f"{type(model).__name__}: hidden_act={act!r}; the fused decoder layer serves silu (LLaMA)")
        self.lora_ctx = LoraContext()
        self.lora_layers: dict[tuple[int, str], LoraLinear] = {}
        self._wrap_lora(target_modules, num_slots, max_rank)
        joint = self._attention_buffer()
        self.groups: dict[str, WeightGroup] = {name: self._stack(name, mods, joint.get(name)) for name, mods in WEIGHT_GROUPS}
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.intermediate = self.groups["gate_up"].modules[0][2]
        self.kv: Optional[PagedKVCache] = None  # allocate_kv() once the weights and LoRA buffers are placed
        self._plans: Optional[PlanBuilder] = None  # the step plan's writer, made with the KV cache
        self._attn_scale = float(getattr(self.lm.layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        self.attention = get_attention_backend("auto", self.device)
        self.gemv_max_rows = 0  # set_gemv_max_rows()
        self.gemv_table = self._load_gemv_table(None)
        self.graphs = None  # DecodeGraphs (vlora.engine.graphs) once captured
        self.prefill_graphs = None  # PrefillGraphs (vlora.engine.graphs) once captured
        self.vision_graphs = None  # VisionGraphs (vlora.engine.vision_graphs) once captured
        self.grid_graphs = None  # GridGraphs (vlora.engine.vision_graphs): a tower of many grids (Qwen2-VL)
        self._vision_timers: list = []  # (start, end) of each step's image encodes: CUDA events, or seconds on a CPU
        self.encoder_cache: Optional[EncoderCache] = None  # set_encoder_cache()
        # The family's vision-side projections that adapters may target; wrapped for LoRA with ``vision_lora``.
        self.vision_sites = loaded.family.vision_lora_sites(loaded) if loaded is not None else []
        self.vision_lora = VisionLora(model, self.vision_sites, num_slots, max_rank) if vision_lora and self.vision_sites else None
        # A tower of many grids (Qwen2-VL) runs its rotary and MLP activation as fused kernels on CUDA (the same
        # bits as eager: vlora.engine.fused_ops), in its graphs and its eager encodes alike.
        tower = loaded.family.grid_vision(loaded) if loaded is not None else None
        if tower is not None and fused_available(p):
            tower.use_ops(vision_rotary, quick_gelu, silu_mul)

    # -- setup ---------------------------------------------------------------------------------
    def _wrap_lora(self, targets: tuple[str, ...], num_slots: int, max_rank: int) -> None:
        """Wrap the targeted projections; their slot buffers are views of one stack per weight group
        (:class:`GroupSlots`, in ``self.slot_stacks``)."""
        L = len(self.lm.layers)
        self.slot_stacks: dict[str, GroupSlots] = {}
        views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module -> (A [L, S, r, d_in], B [L, S, d_out, r])
        for group, modules in WEIGHT_GROUPS:
            mods = tuple(m for m in modules if m in targets)
            if not mods:
                continue
            first = [getattr(self.lm.layers[0].self_attn if m in ATTN_TARGETS else self.lm.layers[0].mlp, m) for m in mods]
            bad = [(m, type(x).__name__) for m, x in zip(mods, first) if not isinstance(x, nn.Linear)]
            if bad:
                raise TypeError(f"layer 0: {bad[0][0]} is {bad[0][1]}, not nn.Linear")
            w, d_in = first[0].weight, first[0].in_features
            outs = [x.out_features for x in first]
            a = torch.zeros(L, len(mods), num_slots, max_rank, d_in, dtype=w.dtype, device=w.device)
            b = (torch.zeros(L, len(mods), num_slots, outs[0], max_rank, dtype=w.dtype, device=w.device)
                 if len(set(outs)) == 1 else None)
            parts = tuple(b[:, k] if b is not None else torch.zeros(L, num_slots, d, max_rank, dtype=w.dtype, device=w.device)
                          for k, d in enumerate(outs))
            self.slot_stacks[group] = GroupSlots(mods, a, b, parts)
            views.update({m: (a[:, k], parts[k]) for k, m in enumerate(mods)})
        for i, layer in enumerate(self.lm.layers):
            for name in targets:
                parent = layer.self_attn if name in ATTN_TARGETS else layer.mlp
                base = getattr(parent, name)
                if not isinstance(base, nn.Linear):
                    raise TypeError(f"layer {i}: {name} is {type(base).__name__}, not nn.Linear")
                a, b = views[name]
                wrapper = LoraLinear(base, self.lora_ctx, num_slots, max_rank, lora_a=a[i], lora_b=b[i])
                setattr(parent, name, wrapper)
                self.lora_layers[(i, name)] = wrapper

    def _attention_buffer(self) -> dict[str, torch.Tensor]:
        """Where q/k/v and o are square and of one width (no GQA), their stacks share one buffer [4L, d, d],
        q/k/v's layers first: the swift switcher merges all four projections of every layer in one call."""
        layer = self.lm.layers[0]
        lins = [getattr(layer.self_attn, m) for m in ATTN_TARGETS]
        lins = [x.base if isinstance(x, LoraLinear) else x for x in lins]
        if not all(isinstance(x, nn.Linear) for x in lins):
            return {}
        d = lins[0].in_features
        if any(x.in_features != d or x.out_features != d for x in lins):
            return {}
        L, w = self.num_layers, lins[0].weight
        buf = torch.empty(4 * L, d, d, dtype=w.dtype, device=w.device)
        return {"qkv": buf[:3 * L].view(L, 3 * d, d), "o": buf[3 * L:]}

    def _stack(self, name: str, modules: tuple[str, ...], stack: Optional[torch.Tensor] = None) -> WeightGroup:
        """Move ``modules``' weights of every layer into one contiguous stack (one layer at a time: peak
        memory grows by the stack, and each old weight is freed as its module takes a view). ``stack``: a
        preallocated one [L, sum of d_out, d_in] (see ``_attention_buffer``)."""
        def linear(li: int, m: str) -> nn.Linear:
            layer = self.lm.layers[li]
            mod = getattr(layer.self_attn if m in ATTN_TARGETS else layer.mlp, m)
            return mod.base if isinstance(mod, LoraLinear) else mod

        first = [linear(0, m) for m in modules]
        d_in = first[0].in_features
        if any(lin.in_features != d_in for lin in first) or any(not isinstance(lin, nn.Linear) for lin in first):
            raise TypeError(f"{name}: {modules} do not share d_in, or are not nn.Linear")
        has_bias = [lin.bias is not None for lin in first]
        if any(has_bias) and not all(has_bias):
            raise TypeError(f"{name}: some of {modules} have a bias and some do not")
        offsets, off = [], 0
        for m, lin in zip(modules, first):
            offsets.append((m, off, lin.out_features))
            off += lin.out_features
        w0 = first[0].weight
        if stack is None:
            stack = torch.empty(self.num_layers, off, d_in, dtype=w0.dtype, device=w0.device)
        elif tuple(stack.shape) != (self.num_layers, off, d_in) or stack.dtype != w0.dtype:
            raise ValueError(f"{name}: preallocated stack {tuple(stack.shape)} {stack.dtype}, needs "
                             f"{(self.num_layers, off, d_in)} {w0.dtype}")
        bias = torch.empty(self.num_layers, off, dtype=w0.dtype, device=w0.device) if has_bias[0] else None
        lora = []
        for li in range(self.num_layers):
            wrappers = []
            for m, o, d in offsets:
                lin = linear(li, m)
                stack[li, o:o + d].copy_(lin.weight.data)
                lin.weight = nn.Parameter(stack[li, o:o + d], requires_grad=False)
                if bias is not None:
                    bias[li, o:o + d].copy_(lin.bias.data)
                    lin.bias = nn.Parameter(bias[li, o:o + d], requires_grad=False)
                wrapper = self.lora_layers.get((li, m))
                if wrapper is not None:
                    wrappers.append((o, d, wrapper))
            lora.append(tuple(wrappers))
        return WeightGroup(name, stack, bias, tuple(offsets), lora, self.slot_stacks.get(name))

    def allocate_kv(self, num_blocks: Optional[int], block_size: int, memory_fraction: float) -> PagedKVCache:
        """Allocate the KV pool. ``num_blocks=None``: 4096 blocks on CPU; on CUDA, whatever keeps the
        device's use under ``memory_fraction`` of its total after the weights and LoRA buffers."""
        per_block = PagedKVCache.bytes_per_block(self.num_layers, block_size, self.n_kv, self.head_dim, self.dtype)
        if num_blocks is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - (1.0 - memory_fraction) * total
                num_blocks = int(budget // per_block) - 1  # one more is the scratch block
                if num_blocks < 16:
                    raise MemoryError(f"KV cache: only {budget / 2**30:.2f} GiB left for the cache on {self.device}; "
                                      "lower lora.max_gpu_adapters or raise cache.gpu_memory_fraction")
            else:
                num_blocks = 4096
        self.kv = PagedKVCache(self.num_layers, num_blocks, block_size, self.n_kv, self.head_dim, self.dtype, self.device)
        self._plans = PlanBuilder(self.device, self.kv)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, block_size, num_blocks * per_block / 2**30)
        return self.kv

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every LoRA-targetable projection: the decoder's, and the vision side's by target."""
        layer = self.lm.layers[0]
        dims = {}
        for name in ATTN_TARGETS + MLP_TARGETS:
            parent = layer.self_attn if name in ATTN_TARGETS else layer.mlp
            m = getattr(parent, name)
            m = m.base if isinstance(m, LoraLinear) else m
            dims[name] = (m.in_features, m.out_features)
        for site in self.vision_sites:
            m = self.model.get_submodule(site.path)
            m = m.base if isinstance(m, LoraLinear) else m
            if dims.setdefault(site.target, (m.in_features, m.out_features)) != (m.in_features, m.out_features):
                raise TypeError(f"{site.path}: {m.in_features} -> {m.out_features}, but other blocks' {site.target} "
                                f"is {dims[site.target][0]} -> {dims[site.target][1]}")
        return dims

    @property
    def lora_wrappers(self) -> dict[tuple[int, str], LoraLinear]:
        """Every LoRA wrapper by (layer, target): the decoder's and the vision side's (what an adapter slot fills)."""
        return {**self.lora_layers, **(self.vision_lora.layers if self.vision_lora is not None else {})}

    def vision_lora_sites(self) -> VisionSites:
        """The vision-side projections an adapter's keys may name (whether or not vision LoRA is on here)."""
        family = self.loaded.family if self.loaded is not None else None
        return VisionSites(paths={s.path: (s.layer, s.target) for s in self.vision_sites},
                           aliases=family.vision_lora_aliases if family is not None else ())

    # -- vision --------------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: Optional[torch.Tensor] = None,
                      vision_slots: Optional[list[int]] = None) -> torch.Tensor:
        """The model family's vision tower and projector: each image's features, joined (LLaVA
        [n, tokens, hidden]; Qwen2-VL [all tokens, hidden]). ``vision_slots``: see :meth:`encode`."""
        feats = self.encode(pixel_values, image_grid_thw, vision_slots)
        return torch.stack(feats) if len({f.shape[0] for f in feats}) == 1 else torch.cat(feats)

    def encode(self, pixel_values: torch.Tensor, image_grid_thw: Optional[torch.Tensor] = None,
               vision_slots: Optional[list[int]] = None, video: bool = False) -> list[torch.Tensor]:
        """Each image's (or video's) features, [tokens, hidden], from one forward of the vision tower and
        projector, as the family's ``encode_images``. ``vision_slots[i]``: the adapter slot whose
        vision-side LoRA encodes item i (-1 or None: the plain encoder); items of one slot should be
        neighbours (one LoRA segment each run). No LoRA work when no item has a slot."""
        family, loaded = self.loaded.family, self.loaded
        if self.vision_graphs is not None and self.vision_graphs.serves(pixel_values, image_grid_thw, video):
            return self.vision_graphs.run(pixel_values, vision_slots)
        if vision_slots is None or all(s < 0 for s in vision_slots):
            if self.grid_graphs is not None and image_grid_thw is not None:
                return self.grid_graphs.run(pixel_values, image_grid_thw)
            return family.encode_images(loaded, pixel_values, image_grid_thw, video=video)
        if self.vision_lora is None:
            raise RuntimeError("vision-side LoRA is off on this runner, but an image asks for an adapter slot")
        rows = family.vision_lora_rows(loaded, pixel_values, image_grid_thw, video)
        with self.vision_lora.bind(rows, vision_slots, self.lora_ctx.backend, self.plans):
            return family.encode_images(loaded, pixel_values, image_grid_thw, video=video)

    # -- the step ------------------------------------------------------------------------------
    def set_encoder_cache(self, budget_mb: float) -> None:
        """Keep projected image features on the device, LRU within ``budget_mb`` (0: no cache)."""
        self.encoder_cache = EncoderCache(int(budget_mb * 2**20)) if budget_mb > 0 else None

    def set_attention(self, name: str) -> None:
        """Choose the paged attention backend by name (``auto``, ``triton``, ``torch``)."""
        self.attention = get_attention_backend(name, self.device)

    def warm_attention(self, max_len: int) -> int:
        """Build the attention backend's per-shape plans for prompts of up to ``max_len`` tokens (cuDNN's,
        per padded length: :func:`vlora.engine.attention.flash.cudnn_bucket`); returns how many."""
        return self.attention.warm_plans(self.dtype, self.n_heads, self.n_kv, self.head_dim, max_len)

    def _load_gemv_table(self, path: Optional[str]) -> gemv.GemvTable:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        return gemv.GemvTable.load(path, name)

    def set_gemv_max_rows(self, rows: int, table: Optional[str] = None) -> None:
        """Steps of at most ``rows`` rows (0..16) run the projections and the LM head through
        :mod:`vlora.engine.gemv` where it serves (``engine.gemv_max_rows``; 0: cuBLAS), with the launches of
        ``table`` (``engine.gemv_table``: a file over the committed table; None: the package's for this GPU,
        see :meth:`vlora.engine.gemv.GemvTable.load`). Captured graphs keep the kernels they were captured
        with: set this before capturing (or capture again)."""
        if not 0 <= rows <= gemv.MAX_ROWS:
            raise ValueError(f"gemv_max_rows must be in [0, {gemv.MAX_ROWS}], got {rows}")
        self.gemv_max_rows = rows
        if table is not None:
            self.gemv_table = self._load_gemv_table(table)
        for g in self.groups.values():
            g.gemv_rows, g.gemv_table = rows, self.gemv_table

    @property
    def plans(self) -> PlanBuilder:
        """The step plan's one writer (:mod:`vlora.engine.plan`), over this runner's KV cache."""
        if self._plans is None or self._plans.kv is not self.kv:
            self._plans = PlanBuilder(self.device, self.kv)
        return self._plans

    def plan(self, seqs: list[SeqInput]) -> StepPlan:
        """The eager step's metadata, built once on the host and copied to the device: every layer reads it."""
        return self.plans.build(seqs)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], prev_tokens: Optional[torch.Tensor] = None) -> ForwardOutput:
        """One packed step. A decode-only step replays a captured CUDA graph where one fits; any other
        runs eagerly (the same layer code, with the prefill attention).

        ``prev_tokens`` [B'] int64: the previous step's sampled ids, still on the device (-1 for a row
        that sampled none; read as 0), where the sequences with a ``pending_row`` find their token: the
        engine launches a step before it has read the last one's tokens back (step overlap)."""
        if any(s.pending_row >= 0 for s in seqs) and prev_tokens is None:
            raise ValueError("forward: a sequence reads its token from the previous step, but prev_tokens is None")
        if self.graphs is not None and self.graphs.serves(seqs):
            return self.graphs.run(seqs, prev_tokens)
        if self.prefill_graphs is not None and self.prefill_graphs.serves(seqs):
            return self.prefill_graphs.run(seqs, prev_tokens)
        plan = self.plan(seqs)
        ids = plan.ids
        if plan.src is not None:
            ids = torch.where(plan.src >= 0, prev_tokens.index_select(0, plan.src.clamp(min=0)).clamp(min=0), ids)
        hidden = self.lm.embed_tokens(ids)
        n_enc = self._insert_images(seqs, ids, hidden)
        kv, scale = self.kv, self._attn_scale
        run = self.attention.decode if plan.decode_only else self.attention.prefill

        def attend(q: torch.Tensor, li: int) -> torch.Tensor:
            return run(q, kv.k[li], kv.v[li], plan.attn, scale, kv.block_size)
        self.lora_ctx.bind(plan.lora, plan.delora)  # the backend prepares the step's launches here, once
        try:
            logits, h_last = self._decoder(hidden, plan.positions, plan.slot_mapping, attend, plan.last_index)
        finally:
            self.lora_ctx.clear()
        return ForwardOutput(logits=logits, hidden=h_last, num_images_encoded=n_enc)

    def _decoder(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, attend,
                 last_index: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer, the final norm and the LM head at ``last_index`` (None: every row).

        Each residual add is fused with the RMSNorm after it (:mod:`vlora.engine.fused_ops`: one kernel
        on CUDA, whose variance sum differs from eager's only in its last bits; the eager ops elsewhere),
        so a layer hands the next its MLP output still to be added."""
        # [T] (1-D) or [3, T] (M-RoPE); the model's rotary embedding takes a batch of one. An M-RoPE
        # embedding (``mrope_section``) gets 1-D positions (text prompts, every decode step and its CUDA
        # graph) as three equal axes: transformers before 5.2x indexes its position ids as [3, batch, T].
        if positions.dim() == 1 and hasattr(self.lm.rotary_emb, "mrope_section"):
            positions = positions.expand(3, -1)
        cos, sin = self.lm.rotary_emb(hidden[None], positions[None] if positions.dim() == 1 else positions[:, None])
        cos, sin = cos[0], sin[0]
        ctx = self.lora_ctx
        lora = (ctx.mapping is not None and ctx.mapping.has_lora) or (ctx.delora is not None and ctx.delora.has_lora)
        # The fused kernels add the residual in place (one allocation less per norm); the eager reference
        # would add a copy for it.
        inplace = fused_available(hidden)
        pending = None
        for li in range(self.num_layers):
            hidden, pending = self._layer(li, hidden, pending, cos, sin, slot_mapping, attend, lora, inplace)
        if last_index is not None:
            hidden, pending = hidden.index_select(0, last_index), pending.index_select(0, last_index)
        norm = self.lm.norm
        h_last, _ = add_rms_norm(pending, hidden, norm.weight, norm.variance_epsilon)
        head = self.lm_head
        if (h_last.shape[0] <= self.gemv_max_rows and type(head) is nn.Linear and head.weight.dtype == h_last.dtype
                and gemv.available(h_last)):
            return gemv.linear_rows(h_last, head.weight, head.bias, impl="triton", table=self.gemv_table).float(), h_last
        return head(h_last).float(), h_last

    def _insert_images(self, seqs: list[SeqInput], ids: torch.Tensor, hidden: torch.Tensor) -> int:
        """Put the vision features of this step's prompts at their placeholder tokens; each distinct image
        (or video) is encoded once, images and videos in one call each. Returns how many were encoded.
        The placeholders are found in the prompts' host token ids (``ids`` is not read: no device sync)."""
        with_images = [s for s in seqs if s.pixel_values is not None and len(s.pixel_values)]
        if not with_images:
            return 0
        family, loaded = self.loaded.family, self.loaded
        cache = self.encoder_cache
        # An item is (vision-side weights, video, content hash): the encoder-cache key. One image asked about
        # through two vision-side adapters is two items; through language-only adapters, the base one.
        items: list[list[tuple]] = []  # per sequence: (item, its first and end feature row in the step), in order
        feature_of: dict[tuple[str, bool, bytes], torch.Tensor] = {}
        todo: dict[bool, list[tuple[tuple[str, bool, bytes], torch.Tensor, Optional[torch.Tensor], int]]] = {False: [], True: []}
        queued: set[tuple[str, bool, bytes]] = set()
        cacheable: set[tuple[str, bool, bytes]] = set()
        # per prompt with images: where its step's tokens hold placeholders (host token ids)
        marks = [np.flatnonzero(np.asarray(s.token_ids) == family.placeholder_id(loaded, s.video)) for s in with_images]
        for s, at in zip(with_images, marks):
            per_item = family.patches(s.pixel_values, s.image_grid_thw)
            keys = s.image_keys or tuple(bytes([i]) + id(s).to_bytes(8, "little") for i in range(len(per_item)))
            if len(keys) != len(per_item):
                raise RuntimeError(f"{len(keys)} image keys for {len(per_item)} images")
            # The prompt's placeholders this step holds: [lo, hi) in the order of all the prompt's placeholders.
            # Items wholly before lo have their keys and values in the cache (a cached prefix, earlier chunks);
            # items from hi on come in a later chunk.
            counts = family.item_tokens(loaded, s.pixel_values, s.image_grid_thw, s.video)
            total = sum(counts)
            lo = total - len(at) if s.placeholders_before is None else s.placeholders_before
            hi = lo + len(at)
            if lo < 0 or hi > total:
                raise RuntimeError(f"image placeholders ({len(at)} tokens after {lo}) do not match image "
                                   f"features ({total})")
            mine = []
            first = 0
            held = s.held_features
            for i, (key, pv, n) in enumerate(zip(keys, per_item, counts)):
                a, first = first, first + n
                if max(a, lo) >= min(a + n, hi):
                    continue  # none of its placeholders is among this step's tokens
                item = (s.vision_identity, s.video, key)
                mine.append((item, max(lo - a, 0), min(hi - a, n)))
                if item in feature_of or item in queued:
                    continue
                if held is not None and item in held:  # encoded at the chunk where its placeholders began
                    feature_of[item] = held[item]
                    continue
                hit = cache.get(item) if cache is not None and s.image_keys else None
                if hit is not None:
                    feature_of[item] = hit
                    continue
                queued.add(item)
                todo[s.video].append((item, pv, None if s.image_grid_thw is None else s.image_grid_thw[i], s.vision_slot))
                if s.image_keys:  # content hashes only: the fallback keys name no content
                    cacheable.add(item)
            items.append(mine)
        encoded = 0
        timer = self._vision_timer_start(hidden) if any(todo.values()) else None
        for video, work in todo.items():
            if not work:
                continue
            work.sort(key=lambda w: w[3])  # the items of one vision-side adapter together: one LoRA segment
            grids = [g for _, _, g, _ in work if g is not None]
            out = self.encode(family.join([pv for _, pv, _, _ in work]), torch.stack(grids) if grids else None,
                              [slot for _, _, _, slot in work], video=video)
            encoded += len(work)
            for (item, _, _, _), f in zip(work, out):
                feature_of[item] = f
                if cache is not None and item in cacheable:
                    cache.put(item, f)
        if timer is not None:
            if len(self._vision_timers) >= 1024:  # nobody reads them (a runner driven without the engine)
                self._vision_timers.pop(0)
            self._vision_timers.append((timer, self._vision_timer_start(hidden)))
        # Placeholders are looked for only in the prompts that bring their images in this step: a decode
        # token that happens to be the image token id (a random model samples it now and then) is text,
        # and must neither take an image's features nor fail the whole step. A prompt that continues a
        # cached prefix, or a chunk of a prompt, takes the features of the placeholders it holds: an image
        # whose placeholders straddle chunks is encoded at the first and held for the next (``held_features``).
        # Found in the prompts' host token ids, so that nothing here waits for the device (a boolean mask
        # or a count read back would sync the step); the rows go in with one index_copy_.
        index: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        off, k = 0, 0
        for s in seqs:
            n = len(s.token_ids)
            if s.pixel_values is not None and len(s.pixel_values):
                if getattr(s, "pending_row", -1) >= 0:
                    raise RuntimeError("a prompt with images reads its token from the previous step")
                at = marks[k]
                if len(at):
                    rows.append(torch.cat([feature_of[item][a:e] for item, a, e in items[k]]))
                    index.append(at + off)
                held = s.held_features
                if held is not None:  # keep the items that go on into the next chunk, forget those done
                    for item, _, e in items[k]:
                        if e < len(feature_of[item]):
                            held[item] = feature_of[item]
                        else:
                            held.pop(item, None)
                k += 1
            off += n
        feats = torch.cat(rows).to(hidden.dtype) if rows else hidden.new_zeros(0, hidden.shape[-1])
        n_slots_img = sum(len(a) for a in index)
        if n_slots_img != feats.shape[0]:
            raise RuntimeError(f"image placeholders ({n_slots_img} tokens) do not match image features ({feats.shape[0]})")
        if n_slots_img:
            at = torch.from_numpy(np.concatenate(index).astype(np.int64))
            if hidden.is_cuda:
                at = at.pin_memory().to(hidden.device, non_blocking=True)
            hidden.index_copy_(0, at, feats.to(hidden.device))
        return encoded

    @staticmethod
    def _vision_timer_start(like: torch.Tensor):
        """A point in time on ``like``'s device: a recorded CUDA event (no sync), or the host clock."""
        if like.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(like.device))  # that device's stream, whichever device is current
            return ev
        return time.perf_counter()

    def vision_times(self) -> list[float]:
        """Seconds of each image encode whose end the device has reached (CUDA: an event query, no sync), oldest
        first; those are forgotten. The engine reads them once a step's tokens are back."""
        done = []
        while self._vision_timers:
            start, end = self._vision_timers[0]
            if isinstance(end, float):
                done.append(end - start)
            elif end.query():
                done.append(start.elapsed_time(end) / 1e3)
            else:
                break
            self._vision_timers.pop(0)
        return done

    def _layer_params(self) -> tuple:
        """Per layer, what :meth:`_layer` reads from the modules, looked up once: (input norm weight, eps,
        post-attention norm weight, eps, k pool, v pool) and the weight groups."""
        cached = getattr(self, "_layer_params_cache", None)
        if cached is None or cached[0] is not self.kv:
            rows = []
            for li, layer in enumerate(self.lm.layers):
                ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
                rows.append((ln1.weight, ln1.variance_epsilon, ln2.weight, ln2.variance_epsilon,
                             self.kv.k[li], self.kv.v[li]))
            g = self.groups
            cached = (self.kv, tuple(rows), (g["qkv"], g["o"], g["gate_up"], g["down"]))
            self._layer_params_cache = cached
        return cached

    def _layer(self, li: int, h: torch.Tensor, pending: Optional[torch.Tensor], cos: torch.Tensor,
               sin: torch.Tensor, slot_mapping: torch.Tensor, attend, lora: bool = True,
               inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: (residual stream, the previous layer's MLP output still to add) ->
        (residual stream after attention, this layer's MLP output). ``lora``: whether the step has LoRA work
        (False skips the wrappers); ``inplace``: the residual add writes ``h`` in place (fused kernels; ``h``
        must be this step's own buffer)."""
        _, rows, (qkv_g, o_g, gate_up_g, down_g) = self._layer_params()
        w1, eps1, w2, eps2, k_pool, v_pool = rows[li]
        T = h.shape[0]
        if pending is None:
            x = rms_norm(h, w1, eps1)
        else:
            x, h = add_rms_norm(pending, h, w1, eps1, residual_out=h if inplace else None)
        qkv = qkv_g.forward(li, x, lora)
        # q, k and v as head views of the fused output (strided rows; the kernels read them in place)
        q, k, v = qkv.view(T, self.n_heads + 2 * self.n_kv, self.head_dim).split(
            (self.n_heads, self.n_kv, self.n_kv), dim=1)
        q = rotary_and_cache(q, k, v, cos, sin, k_pool, v_pool, slot_mapping)
        o = attend(q, li)
        attn = o_g.forward(li, o.reshape(T, self.q_size), lora)
        x, h = add_rms_norm(attn, h, w2, eps2, residual_out=h if inplace else None)
        act = gate_up_g.forward_silu(li, x, lora)
        return h, down_g.forward(li, act, lora)
