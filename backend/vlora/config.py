"""Configuration: frozen dataclasses, validated when built, passed down through constructors.

Sources, in order: the defaults below, a YAML file (``configs/serve/*.yaml``), then flat overrides
``{"section.field": value}`` such as the parameters of ``model_repository/vlora/config.pbtxt`` that
``vlora serve`` writes. Nothing is read from environment variables.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = ("auto", "float32", "float16", "bfloat16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    """Which LMM to serve. ``path=None`` is the embedded tiny model, generated on first use."""

    path: Optional[str] = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    cache_dir: Optional[str] = None  # where the tiny model is generated; default ~/.cache/vlora
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
                 f"model.device must be auto, cpu or cuda[:N], got {self.device!r}")
        _require(self.max_model_len is None or self.max_model_len >= 16, "model.max_model_len must be >= 16")


@dataclass(frozen=True)
class LoraConfig:
    """Adapters: where they may be loaded from, and how many stay resident."""

    adapter_root: Optional[str] = None  # default: the demo adapters of the tiny model
    max_gpu_adapters: int = 8  # adapter slots in device memory (per target module buffers)
    max_cpu_adapters: int = 64  # host-memory LRU tier
    max_rank: int = 64
    target_modules: tuple[str, ...] = LORA_TARGETS
    # LoRA on the vision tower and projector (or merger) too: slot buffers for every vision-side projection
    # the model family lists (vlora.models.base.ModelFamily.vision_lora_modules); off: adapters that target them are refused at load.
    vision_lora: bool = True
    load_timeout_s: float = 30.0  # an adapter read (on the loader threads) that takes longer is refused
    # Page-locked host memory (MiB, on CUDA, allocated at start) where adapters read from disk land before their
    # first slot copy, which is then asynchronous (vlora.lora.transfers.PinnedLanding); 0: none.
    pinned_landing_mb: int = 1024
    # An unload waits this long for the adapter's running and waiting requests to finish, then answers
    # with state "unloading" (the unload still completes when the last one finishes; 0: answer at once).
    unload_timeout_s: float = 30.0
    # Adapter load/unload requests must carry the token this file holds (``admin_token``); None: they are
    # refused (``list`` stays open). A file, not the token: config.pbtxt parameters are readable by clients.
    admin_token_file: Optional[str] = None

    def __post_init__(self) -> None:
        _require(self.max_gpu_adapters >= 1, "lora.max_gpu_adapters must be >= 1")
        _require(isinstance(self.vision_lora, bool), "lora.vision_lora must be on or off")
        _require(self.admin_token_file is None or (isinstance(self.admin_token_file, str) and self.admin_token_file),
                 "lora.admin_token_file must be a file path or null")
        _require(self.load_timeout_s > 0, "lora.load_timeout_s must be > 0")
        _require(isinstance(self.pinned_landing_mb, int) and 0 <= self.pinned_landing_mb <= (1 << 20),
                 "lora.pinned_landing_mb must be an integer number of MiB >= 0")
        _require(self.unload_timeout_s >= 0, "lora.unload_timeout_s must be >= 0")
        _require(self.max_cpu_adapters >= self.max_gpu_adapters, "lora.max_cpu_adapters must be >= lora.max_gpu_adapters")
        _require(1 <= self.max_rank <= 256, "lora.max_rank must be in [1, 256]")
        bad = [t for t in self.target_modules if t not in LORA_TARGETS]
        _require(not bad, f"lora.target_modules: unsupported {bad}; supported: {list(LORA_TARGETS)}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and batching limits of the iteration loop."""

    max_batch_size: int = 32  # MaxBS: running requests per step
    max_num_batched_tokens: int = 2048  # prefill + decode tokens per step
    # Sarathi-style chunked prefill: each step carries the running decodes first (one token each), and the
    # prompts take chunks of the budget left, a long prompt over several steps (its decoders keep running)
    # and many short ones in one. Off: a prompt runs whole in one step (alone when it exceeds the budget).
    chunked_prefill: bool = True
    max_waiting: int = 256  # queued beyond the batch's free places; beyond this a request is refused (the Triton model) or waits
    admission_timeout_s: float = 30.0  # how long AsyncEngine.submit waits for room before refusing (the Triton model: 0)
    # The engine watchdog: a loop iteration (one step or one adapter action) running longer than this
    # while requests wait or run means the engine is stuck; they are failed and the model goes down.
    # 0 disables stall detection (a dead engine thread is still detected).
    stall_timeout_s: float = 60.0
    fault_injection: bool = False  # tests only: accept the vlora_test_fault request parameter (kill, wedge)

    def __post_init__(self) -> None:
        _require(self.max_batch_size >= 1, "scheduler.max_batch_size must be >= 1")
        _require(self.stall_timeout_s >= 0, "scheduler.stall_timeout_s must be >= 0 (0: no stall detection)")
        _require(self.max_num_batched_tokens >= 16, "scheduler.max_num_batched_tokens must be >= 16")
        _require(isinstance(self.chunked_prefill, bool), "scheduler.chunked_prefill must be on or off")
        _require(self.max_waiting >= 1, "scheduler.max_waiting must be >= 1")
        _require(self.admission_timeout_s > 0, "scheduler.admission_timeout_s must be > 0")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache."""

    block_size: int = 16
    num_blocks: Optional[int] = None  # default: sized from gpu_memory_fraction on CUDA, 4096 on CPU
    gpu_memory_fraction: float = 0.85
    # Reuse the KV blocks of a prompt prefix computed before, by the same adapter and version, with the same
    # tokens and images (vlora.engine.kv_cache.BlockAllocator); YAML's on/off read as true/false.
    prefix_caching: bool = True
    # Projected image features kept on the device, keyed by the image's content hash and the vision-side
    # weights, LRU within this many MiB (0: off).
    encoder_cache_mb: float = 256.0

    def __post_init__(self) -> None:
        _require(self.block_size in (8, 16, 32, 64, 128), "cache.block_size must be one of 8, 16, 32, 64, 128")
        _require(self.num_blocks is None or self.num_blocks >= 1, "cache.num_blocks must be >= 1")
        _require(0.05 <= self.gpu_memory_fraction <= 0.98, "cache.gpu_memory_fraction must be in [0.05, 0.98]")
        _require(isinstance(self.prefix_caching, bool), "cache.prefix_caching must be on or off")
        _require(self.encoder_cache_mb >= 0, "cache.encoder_cache_mb must be >= 0 (0: off)")


@dataclass(frozen=True)
class InputLimits:
    """Bounds on what one request may carry. Refused before anything is queued."""

    max_images: int = 8  # several images are video frames
    max_image_bytes: int = 16 * 1024 * 1024  # encoded size of one image
    max_image_pixels: int = 4096 * 4096  # decoded width * height; guards against decompression bombs
    max_prompt_chars: int = 64 * 1024
    # Decoding costs CPU per pixel, not per byte (a 60 KB solid-colour 4096x4096 PNG takes ~0.5-1 s to
    # decode and preprocess), so a request's images are bounded in pixels, read from their headers before
    # anything is decoded: 32 M allows 8 video frames of 2048x2048, or two 4096x4096 images.
    max_total_pixels: int = 32 * 1024 * 1024
    image_decode_timeout_s: float = 10.0  # a request whose images take longer to decode is refused
    # Image requests over inline_image_pixels in all are decoded on image_workers threads (0: half the
    # CPU cores, 1 to 4), not on Triton's request thread; image_queue_size more may wait for them, and
    # beyond that a request is refused as overloaded (UNAVAILABLE). Triton queues nothing for the model, so this
    # queue takes a burst (64 one-image requests at once); their memory is bounded by max_inflight_image_bytes.
    image_workers: int = 0
    image_queue_size: int = 256
    inline_image_pixels: int = 512 * 512
    # The image memory of the requests in flight, from admission until their final answer: each image's
    # encoded bytes (base64 as sent, and once decoded from it) plus 4 bytes per pixel of its header's size
    # (the decoded image). A request that would take the total past this waits for no one: it is refused
    # as overloaded (UNAVAILABLE), unless nothing else is in flight. 0: auto, 1/8 of the host's memory
    # (MemTotal) capped at 4 GiB (vlora.engine.preprocess.ImageBudget).
    max_inflight_image_bytes: int = 0

    def __post_init__(self) -> None:
        _require(self.max_images >= 1, "limits.max_images must be >= 1")
        _require(self.max_image_bytes >= 1024, "limits.max_image_bytes must be >= 1024")
        _require(self.max_image_pixels >= 64 * 64, "limits.max_image_pixels must be >= 4096")
        _require(self.max_prompt_chars >= 1, "limits.max_prompt_chars must be >= 1")
        _require(self.max_total_pixels >= 64 * 64, "limits.max_total_pixels must be >= 4096")
        _require(self.image_decode_timeout_s > 0, "limits.image_decode_timeout_s must be > 0")
        _require(0 <= self.image_workers <= 64, "limits.image_workers must be in [0, 64] (0: auto)")
        _require(self.image_queue_size >= 1, "limits.image_queue_size must be >= 1")
        _require(self.inline_image_pixels >= 0, "limits.inline_image_pixels must be >= 0")
        _require(self.max_inflight_image_bytes == 0 or self.max_inflight_image_bytes >= 1 << 20,
                 "limits.max_inflight_image_bytes must be 0 (auto) or at least 1 MiB (1048576)")

    @property
    def resolved_image_workers(self) -> int:
        return self.image_workers or max(1, min(4, (os.cpu_count() or 2) // 2))

    @property
    def resolved_inflight_image_bytes(self) -> int:
        """limits.max_inflight_image_bytes, or for 0 an eighth of MemTotal capped at 4 GiB (1 GiB when
        /proc/meminfo cannot be read)."""
        if self.max_inflight_image_bytes:
            return self.max_inflight_image_bytes
        total = 8 << 30
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        total = int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            pass
        return max(64 << 20, min(4 << 30, total // 8))


POLICIES = ("vlora", "merge-only", "unmerge-only", "dlora")


@dataclass(frozen=True)
class OrchestratorConfig:
    """Inference modes and the scheduling policy (the V-LoRA paper's Algorithm 1 and its baselines).

    ``vlora``: Algorithm 1's credits and starvation bound, with the merge decision taken from a cost
    model measured on this GPU (:mod:`vlora.orchestrator.costs`): merge (or mix) the most requested
    adapter when the unmerged cost it saves outweighs the switches and the deLoRA tax of the others,
    unmerge when more than half of MaxBS starves. ``cost_model``: ``auto`` (the model cached for this
    GPU, model and settings under ``cost_model_dir``, else measured at load on CUDA, else the default),
    ``measure`` (measure at load, a few seconds, and cache), ``default`` (the H100 figures of
    benchmarks/RESULTS.md) or the path of a cost-model JSON. Only ``vlora`` decides with it; other
    policies measure it only when ``cost_model`` is ``measure``.
    ``merge-only``, ``unmerge-only`` and ``dlora`` (merge when the top adapter has more than
    ``merge_share`` of the queue, per-layer addmm switch, padded-einsum unmerged compute) are the
    baselines it is compared against. ``theta_s`` bounds starvation: a request whose credit (waiting
    time + estimated step + needed switch) passes it, or its own latency target (per request, or per
    adapter in ``latency_targets``), runs in the next step.
    """

    policy: str = "unmerge-only"
    theta_s: float = 2.0  # a request starves when its credit (seconds) exceeds this, or its own latency target
    merge_share: float = 0.5  # dlora: share of the queue the most requested adapter needs for merge mode
    latency_targets: Mapping[str, float] = field(default_factory=dict)  # adapter name -> seconds (an application's SLO)
    switcher: str = "auto"  # swift (one call for all layers), per-layer (addmm per matrix); auto: per policy
    lora_compute: str = "auto"  # atmm, padded-einsum; auto: per policy
    ema: float = 0.2  # weight of the newest measurement in the step-time and switch-time estimates
    cost_model: str = "auto"  # auto, measure, default, or a JSON file (vlora.orchestrator.costs)
    cost_model_dir: Optional[str] = None  # the per-GPU cache of measured cost models; default ~/.cache/vlora/cost-model

    def __post_init__(self) -> None:
        _require(self.policy in POLICIES, f"orchestrator.policy must be one of {POLICIES}, got {self.policy!r}")
        _require(self.theta_s > 0, "orchestrator.theta_s must be > 0")
        _require(0.0 < self.merge_share < 1.0, "orchestrator.merge_share must be in (0, 1)")
        _require(self.switcher in ("auto", "swift", "per-layer"), "orchestrator.switcher must be auto, swift or per-layer")
        _require(self.lora_compute in ("auto", "atmm", "padded-einsum"), "orchestrator.lora_compute must be auto, atmm or padded-einsum")
        _require(0.0 < self.ema <= 1.0, "orchestrator.ema must be in (0, 1]")
        _require(isinstance(self.cost_model, str) and self.cost_model.strip() != "",
                 "orchestrator.cost_model must be auto, measure, default or the path of a cost-model JSON file")
        _require(self.cost_model_dir is None or (isinstance(self.cost_model_dir, str) and self.cost_model_dir),
                 "orchestrator.cost_model_dir must be a folder path or null")
        _require(isinstance(self.latency_targets, Mapping) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for k, v in self.latency_targets.items()),
            "orchestrator.latency_targets maps adapter names to positive, finite seconds")

    @property
    def resolved_switcher(self) -> str:
        return self.switcher if self.switcher != "auto" else ("per-layer" if self.policy == "dlora" else "swift")

    @property
    def resolved_lora_compute(self) -> str:
        return self.lora_compute if self.lora_compute != "auto" else ("padded-einsum" if self.policy == "dlora" else "atmm")


TUNE_AT_LOAD = ("auto", "always", "never")


@dataclass(frozen=True)
class AtmmConfig:
    """The ATMM tiling tuner, run at model load as a sidecar process on CUDA machines.

    ``tune_at_load``: ``auto`` tunes when ``configs/tiling/<gpu>.json`` is missing, is for another
    dtype, or lacks one of this model's LoRA widths (other ranks take the nearest key); ``always`` tunes anyway (the tuner's cache makes
    a repeated load instant); ``never`` serves with the committed table (or a same-capability GPU's) or the
    default rule. Serving starts at once; the tuned entries replace the table's when the sidecar finishes. The
    sidecar profiles the model's own projections at the calls the engine makes
    (:func:`vlora.engine.builder.tuner_shapes`: decode graphs, one-sequence prefills up to the step budget, and
    eager steps of ``tune_segments`` sequences where more than one), the largest of ``tune_ranks`` first. It shares
    the GPU, so it is stopped while requests are in flight and goes on after a second of idleness
    (``tune_budget_s`` of its running time at most: the time it is stopped does not count).
    ``prefill_graph_expand``: the expand kernel of the prefill graphs' LoRA calls; ``auto``: the table's, except a
    column-stationary one (``tr_c_*``) in graphs of several sequences, which takes the row-tile one
    (:func:`vlora.atmm.dispatch.mixed_step_expand`); a compiled expand config's name: that one for every prefill
    graph (to compare them through the server; refused at load where the extension lacks it).
    """

    tune_at_load: str = "auto"
    tune_budget_s: float = 600.0
    tune_ranks: tuple[int, ...] = (8, 16, 32, 64, 128)  # those up to lora.max_rank are tuned
    tune_segments: tuple[int, ...] = (1, 4, 16, 64)
    tune_cache_dir: Optional[str] = None  # default ~/.cache/vlora/tiling
    prefill_graph_expand: str = "auto"

    def __post_init__(self) -> None:
        _require(self.tune_at_load in TUNE_AT_LOAD, f"atmm.tune_at_load must be one of {TUNE_AT_LOAD}")
        _require(isinstance(self.prefill_graph_expand, str) and bool(self.prefill_graph_expand),
                 "atmm.prefill_graph_expand must be auto or an expand config's name")
        _require(self.tune_budget_s > 0, "atmm.tune_budget_s must be > 0")
        _require(all(isinstance(r, int) and r >= 1 for r in self.tune_ranks), "atmm.tune_ranks are positive ints")
        _require(all(isinstance(x, int) and x >= 1 for x in self.tune_segments), "atmm.tune_segments are positive ints")


ATTENTION_BACKENDS = ("auto", "flash", "triton", "torch")


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runner executes a step (``engine`` section).

    ``cuda_graphs``: ``auto`` captures every decode step shape in ``graph_batch_sizes`` (up to
    ``scheduler.max_batch_size``) as a CUDA graph at model load and replays it, padding a decode batch to
    the next captured size; steps that hold a prefill run eagerly unless ``prefill_graph_tokens`` covers them.
    ``off`` runs every step eagerly. Only
    CUDA devices capture. ``attention``: the paged attention backend (``triton``: kernels that read the
    KV cache in place; ``flash``: the same, but a prefill of long fresh prompts in fp16/bf16 runs cuDNN's
    fused attention (up to 8 prompts, the longest of 1,024 tokens or more, no GQA) or PyTorch's FlashAttention-2 varlen
    kernel (4,096 or more); ``torch``: the SDPA reference, what CPUs
    run: it reads the lengths on the host, so on CUDA it runs with the graphs off, and says so at load); a
    backend the device cannot run is refused at load, naming this setting. ``auto`` picks flash on CUDA sm80+, else triton where it imports, else torch. ``overlap``: launch
    each step before the last one's sampled tokens are read back, so the host's work for a step (reading
    the tokens, detokenizing, stop checks, reporting, scheduling and planning the next) runs while the
    GPU computes; a request that stops on a token (EOS, a stop string) costs one discarded decode row.
    ``auto``: on for CUDA devices, off elsewhere (on a CPU nothing overlaps). ``prefill_graph_tokens``: with
    ``cuda_graphs: auto``, steps that hold a prefill of up to this many tokens (buckets 8 short of each
    multiple of 32 up to 1,024, then every 64 up to 2,048, then every 128: ``graphs.prefill_buckets``; a
    step pads to the next) replay a graph of the decoder too, the embedding and images put in eagerly first,
    with the step's unmerged adapters inside (one graph per bucket and LoRA variant, as the decode graphs);
    0 runs every such step eagerly. An eager prefill issues about 350 launches from Python and is bound by its host on most
    machines seen: a 600-token prompt of the 7B model took 14.3-22 ms eagerly on H100 hosts against 12.3 ms
    of kernels. The default 1,024 covers a one-image LLaVA prompt; its 33 graphs take a few seconds to
    capture at load (7B on an H100: 3.4 s, 388 MiB) and share the decode graphs' memory pool. 2,048 (the
    default step budget, which caps this: every chunk of a chunked prefill would replay a graph) takes single
    prompts of 1,500-2,000 tokens to 1.36x their FLOP floor against 1.42x eagerly (H200, 49 graphs of the base
    variant: 6.1 s and 1,868 MiB at load against 4.8 s and 1,558 MiB), but through the server it did not win
    on both models' video applications (benchmarks/NOTES.md), so it is not the default.
    ``vision_graph_images``: with ``cuda_graphs: auto``, a vision tower of one fixed image size (LLaVA's CLIP)
    and its projector are captured per bucket of this many images, with vision-side LoRA inside
    (:mod:`vlora.engine.vision_graphs`); an eager CLIP forward is bound by its host (22 ms for one image on an
    H200 against 0.5 ms of FLOPs); empty: eager. ``vision_graph_grids``: with ``cuda_graphs: auto`` and a vision
    tower of many grids (Qwen2-VL), the item sizes captured at load, per bucket of ``vision_graph_images``:
    images as ``HxW``, videos as ``FxHxW`` (F frames of H x W, one video per graph); other grids are captured the
    second time a step meets them, at one item, and a run of several items of a grid without a graph of that
    bucket replays the grid's graphs once per item (:class:`vlora.engine.vision_graphs.GridGraphs`; one 448x448
    image's eager tower took 20-26 ms on an H200 against a 1.9 ms floor). ``gemv_max_rows``: steps of at most this many
    rows (tokens; 0..16) run their projections (q/k/v, o, gate/up with SiLU * up fused where the layer has
    no LoRA work, down, and the LM head) as memory-bound Triton kernels (:mod:`vlora.engine.gemv`) instead
    of cuBLAS, on CUDA in bf16/fp16 (fp32 keeps cuBLAS); a row gives the same bits in any step of up to that
    many rows, so a graph's padded bucket and the eager step agree. Keep it a captured batch size (16) so
    that a decode step and its bucket fall on the same side; 0: cuBLAS. On an H200 the default 16 takes the
    7B decode step from 4.54 to 4.25 ms at batch 1 and 5.21 to 4.87 ms at batch 8 (benchmarks/RESULTS.md).
    ``gemv_table``: a launch table file for those kernels (what ``benchmarks/gemv_probe.py --table-out``
    writes), its entries over the committed ones; null: the package's ``engine/gemv_tables/<gpu>.json`` for
    this GPU where one is shipped (``$VLORA_GEMV_TABLE``, for the benchmarks, before it), else the committed
    table alone (:class:`vlora.engine.gemv.GemvTable`). Read once at load. ``warmup``: before the engine is
    ready, run one request of every path (text greedy and sampled, an image, a video, the first adapter's
    LoRA and task heads: :mod:`vlora.engine.warmup`) so that the first client request pays for no compilation
    or plan; ``auto``: on CUDA devices. ``profile_dir``: a folder where the engine thread writes a torch.profiler
    trace of ``profile_steps`` = [skip, count] steps of the serving loop (the steps after the first ``skip``
    that ran something), CPU ops of the engine thread and the device's kernels
    (:mod:`vlora.engine.step_profiler`): what the server's steps spend, to set beside a benchmark's in-process
    profile; null: none. ``host_threads``: PyTorch's intra-op CPU threads for the process (``torch.set_num_threads``,
    set once the model's weights are loaded); ``auto``: 1 on a CUDA device, PyTorch's default (the cores) on a CPU, where the
    model computes on them. On a GPU the host's torch work is small copies and checks on several threads at once
    (adapter loaders, the slot-copy thread, image workers), and each thread that runs a parallel op gets its own team
    of OpenMP threads: with the host's cores busy (clients, Triton, the engine thread) a team waits at its barrier
    for a descheduled member, and a 0.5 MB copy took 8-12 ms against 0.014 ms on one thread (the 2-core CPU, its
    other core busy). ``switch_interval_ms``: Python's GIL switch interval for the process
    (``sys.setswitchinterval``): how long a thread that wants the GIL waits before it asks the holder to let go.
    Every thread but the engine's (adapter loaders, the slot-copy thread, image workers, the stub's response
    threads) takes the GIL back after each call that released it, and beside an engine thread running Python waits
    for it up to this long each time; ``auto``: 1 ms on a CUDA device (adapter reads beside a busy thread 4x faster,
    decode 1-3% faster through the server: vlora.engine.builder), Python's own (5 ms) on a CPU.
    """

    cuda_graphs: str = "auto"
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    prefill_graph_tokens: int = 1024
    vision_graph_images: tuple[int, ...] = (1, 2, 4, 8)
    vision_graph_grids: tuple[str, ...] = ("448x448",)
    gemv_max_rows: int = 16
    gemv_table: Optional[str] = None
    attention: str = "auto"
    overlap: str = "auto"
    warmup: str = "auto"
    profile_dir: Optional[str] = None
    profile_steps: tuple[int, ...] = (20, 40)
    host_threads: Any = "auto"
    switch_interval_ms: Any = "auto"

    def __post_init__(self) -> None:
        _require(self.switch_interval_ms == "auto" or (isinstance(self.switch_interval_ms, (int, float))
                                                       and not isinstance(self.switch_interval_ms, bool)
                                                       and 0.05 <= self.switch_interval_ms <= 100),
                 "engine.switch_interval_ms must be auto or a number of milliseconds in [0.05, 100]")
        _require(self.host_threads == "auto" or (isinstance(self.host_threads, int) and not isinstance(self.host_threads, bool)
                                                 and 1 <= self.host_threads <= 1024),
                 "engine.host_threads must be auto or an integer in [1, 1024]")
        if isinstance(self.cuda_graphs, bool):  # YAML reads a bare off/on as a boolean
            object.__setattr__(self, "cuda_graphs", "auto" if self.cuda_graphs else "off")
        _require(self.cuda_graphs in ("auto", "off"), "engine.cuda_graphs must be auto or off")
        _require(len(self.graph_batch_sizes) >= 1 and all(isinstance(b, int) and 1 <= b <= 1024 for b in self.graph_batch_sizes),
                 "engine.graph_batch_sizes must be integers in [1, 1024]")
        _require(self.attention in ATTENTION_BACKENDS, f"engine.attention must be one of {ATTENTION_BACKENDS}")
        _require(isinstance(self.prefill_graph_tokens, int) and 0 <= self.prefill_graph_tokens <= 16384,
                 "engine.prefill_graph_tokens must be an integer in [0, 16384]")
        _require(all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 64 for b in self.vision_graph_images),
                 "engine.vision_graph_images must be integers in [1, 64] (empty: the vision tower runs eagerly)")
        _require(all(isinstance(g, str) and re.fullmatch(r"([1-9][0-9]{0,2}x)?[1-9][0-9]{0,4}x[1-9][0-9]{0,4}", g)
                     for g in self.vision_graph_grids),
                 "engine.vision_graph_grids must be sizes HxW (images) or FxHxW (videos of F frames), e.g. 448x448")
        _require(isinstance(self.gemv_max_rows, int) and not isinstance(self.gemv_max_rows, bool)
                 and 0 <= self.gemv_max_rows <= 16, "engine.gemv_max_rows must be an integer in [0, 16]")
        _require(self.gemv_table is None or (isinstance(self.gemv_table, str) and self.gemv_table),
                 "engine.gemv_table must be a file path or null")
        if isinstance(self.overlap, bool):
            object.__setattr__(self, "overlap", "on" if self.overlap else "off")
        _require(self.overlap in ("auto", "on", "off"), "engine.overlap must be auto, on or off")
        if isinstance(self.warmup, bool):
            object.__setattr__(self, "warmup", "on" if self.warmup else "off")
        _require(self.warmup in ("auto", "on", "off"), "engine.warmup must be auto, on or off")
        _require(self.profile_dir is None or (isinstance(self.profile_dir, str) and self.profile_dir),
                 "engine.profile_dir must be a folder path or null")
        _require(len(self.profile_steps) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                       for n in self.profile_steps) and self.profile_steps[1] >= 1,
                 "engine.profile_steps must be [skip, count]: integers, count >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    limits: InputLimits = field(default_factory=InputLimits)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    atmm: AtmmConfig = field(default_factory=AtmmConfig)
    engine: RunnerConfig = field(default_factory=RunnerConfig)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EngineConfig":
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(sections))
        _require(not unknown, f"unknown config section(s) {unknown}; known: {sorted(sections)}")
        built = {}
        for f in dataclasses.fields(cls):
            sub = d.get(f.name) or {}
            _require(isinstance(sub, Mapping), f"config section {f.name!r} must be a mapping")
            built[f.name] = _build(type(getattr(cls(), f.name)), f.name, sub)
        return cls(**built)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "EngineConfig":
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(yaml.safe_load(fh) or {})

    def with_overrides(self, flat: Mapping[str, Any]) -> "EngineConfig":
        """Apply ``{"section.field": value}`` overrides; string values are parsed as YAML scalars."""
        d = self.to_dict()
        for key, value in flat.items():
            section, _, name = key.partition(".")
            _require(section in d and name in d[section], f"unknown config key {key!r}")
            if isinstance(value, str):
                value = None if value == "" else yaml.safe_load(value)
            d[section][name] = value
        return EngineConfig.from_dict(d)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _build(kind: type, section: str, values: Mapping[str, Any]):
    names = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - set(names))
    _require(not unknown, f"{section}: unknown key(s) {unknown}; known: {sorted(names)}")
    kw = dict(values)
    for k, v in kw.items():
        _check_number(f"{section}.{k}", names[k].type, v)
        if isinstance(v, list):
            kw[k] = tuple(v)
        elif isinstance(v, Mapping):
            kw[k] = dict(v)
    try:
        return kind(**kw)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a value of the wrong kind met a check: one line naming the section
        raise ConfigError(f"{section}: a setting has a value of the wrong type ({e})") from None


def _check_number(key: str, annotation: Any, value: Any) -> None:
    """A number setting (annotated int or float, optionally Optional) must get a number: ConfigError naming
    ``key`` otherwise (``--set scheduler.max_waiting=abc`` is one line, not a traceback)."""
    kind = str(annotation).replace(" ", "")
    optional = kind.startswith("Optional[") and kind.endswith("]")
    kind = kind[len("Optional["):-1] if optional else kind
    if value is None and optional:
        return
    if kind == "int":
        _require(isinstance(value, int) and not isinstance(value, bool), f"{key} must be an integer, got {value!r}")
    elif kind == "float":
        _require(isinstance(value, (int, float)) and not isinstance(value, bool), f"{key} must be a number, got {value!r}")


MIN_ADMIN_TOKEN_CHARS = 16


def read_admin_token(path: str | os.PathLike) -> str:
    """The adapter admin token in ``path``: its text without surrounding whitespace. Raises ConfigError
    (naming the file, never the token) when it cannot be read or is shorter than MIN_ADMIN_TOKEN_CHARS."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"admin token file {path}: cannot be read ({type(e).__name__}: {e})") from None
    _require(len(token) >= MIN_ADMIN_TOKEN_CHARS,
             f"admin token file {path}: the token must have at least {MIN_ADMIN_TOKEN_CHARS} characters "
             f"(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}`)")
    return token


def default_cache_dir() -> Path:
    """Where generated artefacts (the tiny model, demo adapters) live: ~/.cache/vlora."""
    return Path.home() / ".cache" / "vlora"
