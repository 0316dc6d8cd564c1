"""Attention over the paged KV cache, read in place: decode and variable-length prefill.

Two backends share one interface and are chosen by name (:func:`get_attention_backend`):

- ``"triton"``: Triton kernels that fetch keys and values through the block table (no gather copy, no
  padded copy, no ``repeat_interleave`` for GQA). Decode runs one program per (sequence, kv head,
  context split) and handles all query heads of a kv head together, so K/V are read once per group;
  with more than one split a small reduce kernel combines the partial results (flash-decoding).
  Prefill is flash-attention style with online softmax over BLOCK_M x BLOCK_N tiles.
- ``"flash"``: the Triton kernels, except that a prefill of fresh prompts (no cached context) in fp16/bf16
  runs a library kernel on the step's K/V read back packed: cuDNN's fused attention through SDPA, one
  call per prompt, for a few prompts of 1,024 tokens or more (no GQA); else PyTorch's FlashAttention-2
  varlen kernel for prompts of 4,096 tokens or more.
- ``"torch"``: per-sequence gather + ``F.scaled_dot_product_attention``; exact, runs everywhere, is the
  CPU path and the test oracle.

Pool layout (see :mod:`vlora.engine.kv_cache`): ``k_pool``/``v_pool`` are [num_blocks * block_size,
n_kv_heads, head_dim]; token ``p`` of a sequence lives at row
``block_table[p // block_size] * block_size + p % block_size``. The step's new K/V are already in the
pools when attention runs.

Triton is optional: this package imports where it is not installed and then offers only ``"torch"``.

One module per concern; they import in this order, none back up it:

- ``metadata``: :class:`AttentionMetadata`, the per-step device tensors, and the pool checks.
- ``launch``: launch configuration from static shapes (decode splits, tiles, the split-K workspace).
- ``reference``: the PyTorch reference (the ``"torch"`` backend's kernels).
- ``triton_kernels``: the Triton kernels and their launchers :func:`paged_decode`, :func:`paged_prefill`.
- ``flash``: cuDNN's fused attention and FlashAttention-2 for fresh prompts, with their availability checks.
- ``backends``: the :class:`AttentionBackend` registry and its three backends.
"""
from vlora.engine.attention.metadata import AttentionMetadata
from vlora.engine.attention.launch import (MAX_SPLITS, MIN_TOKENS_PER_SPLIT, SMEM_BUDGET, DecodeConfig,
                                           PrefillConfig, _large_smem, choose_num_splits, decode_config,
                                           decode_workspace, num_sms, prefill_config, triton_next_pow2)
from vlora.engine.attention.reference import paged_decode_reference, paged_prefill_reference
from vlora.engine.attention.triton_kernels import LOG2E, NEG, paged_decode, paged_prefill, triton_available
from vlora.engine.attention.flash import (CUDNN_HEAD_DIMS, CUDNN_MAX_SEQS, CUDNN_MIN_SEQ_TOKENS, CUDNN_MIN_TOKENS,
                                          FLASH_MIN_TOKENS, cudnn_attention_available, cudnn_prefill,
                                          flash_available, flash_prefill)
from vlora.engine.attention.backends import (AttentionBackend, FlashPrefillBackend, TorchAttentionBackend,
                                             TritonAttentionBackend, get_attention_backend)

__all__ = [
    "AttentionMetadata",
    "MAX_SPLITS", "MIN_TOKENS_PER_SPLIT", "SMEM_BUDGET", "DecodeConfig", "PrefillConfig", "choose_num_splits",
    "decode_config", "decode_workspace", "num_sms", "prefill_config", "triton_next_pow2",
    "paged_decode_reference", "paged_prefill_reference",
    "LOG2E", "NEG", "paged_decode", "paged_prefill", "triton_available",
    "CUDNN_HEAD_DIMS", "CUDNN_MAX_SEQS", "CUDNN_MIN_SEQ_TOKENS", "CUDNN_MIN_TOKENS", "FLASH_MIN_TOKENS",
    "cudnn_attention_available", "cudnn_prefill", "flash_available", "flash_prefill",
    "AttentionBackend", "FlashPrefillBackend", "TorchAttentionBackend", "TritonAttentionBackend",
    "get_attention_backend",
]
