"""Build an :class:`LLMEngine` from configuration: device, dtype, model, LoRA slots, KV cache, inputs."""
from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Mapping, Optional

import torch

from vlora.config import ConfigError, EngineConfig, default_cache_dir
from vlora.engine.core import LLMEngine
from vlora.metrics import EngineMetrics
from vlora.engine.model_runner import ModelRunner
from vlora.orchestrator.orchestrator import Orchestrator

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={name} but CUDA is not available here")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_model_and_adapters(config: EngineConfig) -> tuple[Path, Optional[Path]]:
    """The model folder and adapter root; with no model given, the tiny model and its demo adapters."""
    cache_dir = Path(config.model.cache_dir) if config.model.cache_dir else default_cache_dir()
    if config.model.path:
        model_dir = Path(config.model.path)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model.path {model_dir} is not a folder")
        root = Path(config.lora.adapter_root) if config.lora.adapter_root else None
    else:
        from vlora.lora.demo import ensure_demo_adapters
        from vlora.models.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model(cache_dir)
        root = Path(config.lora.adapter_root) if config.lora.adapter_root else ensure_demo_adapters(model_dir, cache_dir / "demo-adapters")
    if root is not None and not root.is_dir():
        raise FileNotFoundError(f"lora.adapter_root {root} is not a folder")
    return model_dir, root


def eos_token_ids(loaded) -> set[int]:
    ids = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    gen = getattr(loaded.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return ids


def build_engine(config: EngineConfig, metrics: Optional[EngineMetrics] = None) -> LLMEngine:
    """Load the model and adapters' manager, allocate the KV cache, capture the graphs: the engine on
    ``model.device``. On a CUDA device other than the caller's current one (one model instance per GPU)
    everything is built with that device current: events, side streams, graph captures and kernels that
    launch on the current device (Triton's, the ATMM extension's) all land on it."""
    device = resolve_device(config.model.device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return _build_engine(config, metrics, device)
    return _build_engine(config, metrics, device)


# engine.switch_interval_ms's auto on CUDA. Beside a thread that keeps the GIL busy, 32 adapter reads on 8 loaders took
# 2,069 ms each (209 alone) at Python's 5 ms and 510 ms at 1 ms (host_transfers --read-burst, an H200's host). Through
# the server (serve_burst, 4 runs at 1 ms against 5 at 5 ms, on H200s): cold adapters' TTFT p50 1,065-1,544 ms against
# 1,275-1,661, decode 1-3% faster; the TTFT spread between runs is as large as the difference (benchmarks/RESULTS.md).
CUDA_SWITCH_INTERVAL_MS = 1.0


def _set_host_threads(threads, device) -> None:
    """``engine.host_threads`` (RunnerConfig says why): PyTorch's intra-op threads, before any thread of the
    engine (loaders, copy thread, image workers, the engine loop, the warm-up's) runs a parallel op; a thread
    takes the setting at its first one."""
    if threads == "auto":
        threads = 1 if device.type == "cuda" else None
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def _set_switch_interval(ms, device) -> None:
    """``engine.switch_interval_ms`` (RunnerConfig says why): the process's GIL switch interval; ``auto``: 1 ms on
    CUDA, Python's own on a CPU."""
    if ms == "auto":
        ms = CUDA_SWITCH_INTERVAL_MS if device.type == "cuda" else None
    if ms is not None:
        sys.setswitchinterval(float(ms) / 1e3)


def _build_engine(config: EngineConfig, metrics: Optional[EngineMetrics], device) -> LLMEngine:
    from vlora.engine.inputs import InputProcessor
    from vlora.lora.manager import LoraManager
    from vlora.models.family import load_model

    dtype = resolve_dtype(config.model.dtype, device)
    warm = config.engine.warmup == "on" or (config.engine.warmup == "auto" and device.type == "cuda")
    if warm and metrics is not None:
        from vlora.engine.warmup import GatedMetrics

        metrics = GatedMetrics(metrics)  # opened after the warm-up: its requests are not traffic
    model_dir, adapter_root = resolve_model_and_adapters(config)
    t0 = time.perf_counter()
    loaded = load_model(model_dir, dtype, device)
    _set_host_threads(config.engine.host_threads, device)  # loading the weights kept every core
    _set_switch_interval(config.engine.switch_interval_ms, device)
    max_model_len = min(config.model.max_model_len or loaded.max_model_len, loaded.max_model_len)
    runner = ModelRunner(loaded.model, image_token_id=loaded.image_token_id, num_slots=config.lora.max_gpu_adapters,
                         max_rank=config.lora.max_rank, target_modules=config.lora.target_modules, loaded=loaded,
                         vision_lora=config.lora.vision_lora)
    runner.allocate_kv(config.cache.num_blocks, config.cache.block_size, config.cache.gpu_memory_fraction)
    try:
        runner.set_attention(config.engine.attention)
    except RuntimeError as e:  # a backend that does not run on this device: refused at load, naming the setting
        raise ConfigError(f"engine.attention={config.engine.attention}: {e}; "
                          "use auto (or triton / torch) on this device") from None
    runner.set_gemv_max_rows(config.engine.gemv_max_rows, table=config.engine.gemv_table)
    runner.set_encoder_cache(config.cache.encoder_cache_mb)
    loras = LoraManager(adapter_root, runner.lora_wrappers, runner.num_layers, runner.module_dims(), config.lora, metrics,
                        vision=runner.vision_lora_sites())
    info = {"name": loaded.name, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "max_model_len": max_model_len, "model_dir": str(model_dir), "adapter_root": str(adapter_root) if adapter_root else None}
    # The orchestrator places the weights (its switcher's stacks, the LoRA backend); then the graphs are
    # captured, the cost model measured over them, and the tuner started: the engine is built complete.
    orchestrator = Orchestrator(config.orchestrator, config.scheduler.max_batch_size, runner, loras, metrics)
    capture_graphs(config, runner, max_model_len, info)
    resolve_cost_model(config, runner, loras, orchestrator, info)  # after the graphs: a measurement replays them
    tuner = start_tuner(config, runner, device, dtype)  # last: it profiles beside the finished model
    engine = LLMEngine(config, runner, loras, loaded.tokenizer, max_model_len, eos_token_ids(loaded), metrics,
                       inputs=InputProcessor(loaded, config.limits, loras, max_model_len), model_info=info,
                       tuner=tuner, orchestrator=orchestrator)
    if warm:
        from vlora.engine.warmup import warm_up

        if tuner is not None:  # the warm-up is timed and logged: the engine loop lets the tuner go on when idle
            tuner.pause()
        info["warmup"] = warm_up(engine)
        if metrics is not None:
            metrics.open = True
    log.info("engine ready: %s on %s/%s in %.1fs, adapters at %s", loaded.name, device, dtype, time.perf_counter() - t0, adapter_root)
    return engine


def capture_graphs(config: EngineConfig, runner: ModelRunner, max_model_len: int, info: dict) -> None:
    """Capture the decode graphs (``engine.cuda_graphs``), then the prefill graphs (``engine.prefill_graph_tokens``),
    once the orchestrator has placed the weights; what was captured goes to ``info["cuda_graphs"]`` (the
    engine's ``model_info``)."""
    if runner.device.type != "cuda" or config.engine.cuda_graphs == "off":
        return
    if not runner.attention.graph_safe:
        log.warning("engine.attention=%s reads the sequence lengths on the host: CUDA graphs are off with it "
                    "(every step runs eager; engine.attention auto, flash or triton capture them)", runner.attention.name)
        info["cuda_graphs"] = {"off": f"engine.attention={runner.attention.name} cannot be captured"}
        return
    from vlora.engine.graphs import VARIANTS, DecodeGraphs, PrefillGraphs, prefill_buckets

    sizes = tuple(b for b in config.engine.graph_batch_sizes if b < config.scheduler.max_batch_size)
    sizes += (config.scheduler.max_batch_size,)
    runner.graphs = DecodeGraphs(runner, sizes, max_model_len)
    # Only the vlora policy runs mixture steps; other policies would capture such a graph when first needed.
    variants = VARIANTS if config.orchestrator.policy == "vlora" else ("base", "lora")
    runner.graphs.capture_all(variants)
    info["cuda_graphs"] = {"batch_sizes": list(runner.graphs.sizes), "capture_s": round(runner.graphs.capture_s, 2),
                                        "memory_mib": round(runner.graphs.memory_bytes / 2**20, 1)}
    max_tokens = min(config.engine.prefill_graph_tokens, config.scheduler.max_num_batched_tokens)
    set_prefill_graph_expand(config, runner)
    if prefill_buckets(max_tokens):
        runner.prefill_graphs = PrefillGraphs(runner, max_tokens, config.scheduler.max_batch_size, max_model_len,
                                              pool=runner.graphs.pool)
        runner.prefill_graphs.capture_all(variants)
        info["cuda_graphs"]["prefill_tokens"] = list(runner.prefill_graphs.sizes)
        info["cuda_graphs"]["prefill_capture_s"] = round(runner.prefill_graphs.capture_s, 2)
        info["cuda_graphs"]["prefill_memory_mib"] = round(runner.prefill_graphs.memory_bytes / 2**20, 1)
    loaded = runner.loaded
    if config.engine.vision_graph_images and loaded is not None and loaded.family.fixed_pixels(loaded) is not None:
        from vlora.engine.vision_graphs import VisionGraphs

        runner.vision_graphs = VisionGraphs(runner, config.engine.vision_graph_images, pool=runner.graphs.pool)
        runner.vision_graphs.capture_all()
        info["cuda_graphs"]["vision_images"] = list(runner.vision_graphs.sizes)
        info["cuda_graphs"]["vision_capture_s"] = round(runner.vision_graphs.capture_s, 2)
    elif config.engine.vision_graph_images and loaded is not None and loaded.family.grid_vision(loaded) is not None:
        from vlora.engine.vision_graphs import GridGraphs

        runner.grid_graphs = GridGraphs(runner, config.engine.vision_graph_images, pool=runner.graphs.pool)
        for size in config.engine.vision_graph_grids:
            *frames, h, w = (int(x) for x in size.split("x"))
            grid = loaded.family.item_grid(loaded, h, w, frames[0] if frames else 0)
            if grid is None:
                log.warning("engine.vision_graph_grids: %s: this model's processor settings are not the ones the "
                            "fast preprocessing reproduces; its grid is captured when a step first meets it twice", size)
                continue
            runner.grid_graphs.capture_grids([grid], video=bool(frames))
        info["cuda_graphs"]["vision_grids"] = sorted({str(k[0]) for k in runner.grid_graphs.graphs})
        info["cuda_graphs"]["vision_capture_s"] = round(runner.grid_graphs.capture_s, 2)


def resolve_cost_model(config: EngineConfig, runner: ModelRunner, loras, orchestrator: Orchestrator, info: dict) -> None:
    """Give the orchestrator the cost model ``orchestrator.cost_model`` names (after the graphs are captured:
    a measurement replays them), summed up in ``info["cost_model"]``. Policies other than vlora only measure
    one when asked to (``measure``)."""
    from vlora.engine import cost_probe
    from vlora.orchestrator.switcher import SWITCHERS

    cfg = config.orchestrator
    if cfg.policy != "vlora" and cfg.cost_model == "auto":
        return
    key = cost_probe.model_key(runner, dtype=str(runner.dtype).removeprefix("torch."), max_rank=config.lora.max_rank,
                               targets=config.lora.target_modules, max_batch_size=config.scheduler.max_batch_size,
                               lora_backend=cfg.resolved_lora_compute, switcher=cfg.resolved_switcher)
    cache = Path(cfg.cost_model_dir) if cfg.cost_model_dir else default_cache_dir() / "cost-model"
    model = cost_probe.resolve(cfg.cost_model, runner, cache_dir=cache, key=key,
                               max_batch_size=config.scheduler.max_batch_size,
                               switcher_cls=SWITCHERS[cfg.resolved_switcher], loras=loras)
    orchestrator.set_costs(model)
    info["cost_model"] = model.summary()


# One-sequence prefill sizes the tuner sidecar profiles (up to the step's token budget): the prefill graphs'
# buckets run at these and between them (the table's nearest key serves the others).
TUNE_PREFILL_TOKENS = (256, 384, 512, 640, 768, 1024, 1536, 2048, 4096, 8192)


def tuner_shapes(config: EngineConfig) -> list[tuple[int, int]]:
    """The (tokens, segments) LoRA calls this engine makes, for the tuner sidecar: a decode graph's one segment a
    row at each captured batch size; prefill steps of one sequence (a prefill graph's key, however many segments
    its call has) at :data:`TUNE_PREFILL_TOKENS` and the step's token budget; and eager steps of more sequences,
    ``atmm.tune_segments`` of them, at 1,024 tokens and at the budget. About 20 shapes, where the token grid times
    the segments was about 250 per rank and projection, far past ``atmm.tune_budget_s``."""
    budget = config.scheduler.max_num_batched_tokens
    max_bs = config.scheduler.max_batch_size
    decode = sorted({b for b in config.engine.graph_batch_sizes if b < max_bs} | {max_bs})
    prefill = sorted({t for t in TUNE_PREFILL_TOKENS if t < budget} | {budget})
    eager = [(t, s) for t in sorted({min(1024, budget), budget}) for s in config.atmm.tune_segments if 1 < s <= t]
    return [(b, b) for b in decode] + [(t, 1) for t in prefill] + eager


def set_prefill_graph_expand(config: EngineConfig, runner: ModelRunner) -> None:
    """``atmm.prefill_graph_expand`` onto the runner's ATMM kernels, before the prefill graphs plan their calls.
    A name the extension does not compile as an expand is refused (ConfigError); without the extension the
    setting has nothing to act on."""
    name = config.atmm.prefill_graph_expand
    kernels = getattr(runner.lora_ctx.backend, "kernels", None)
    if kernels is None or not kernels.available:
        if name != "auto":
            log.warning("atmm.prefill_graph_expand=%s: the ATMM extension is not in use here; the setting is ignored",
                        name)
        return
    if name == "auto":
        kernels.prefill_graph_expand = None
        return
    if name not in kernels.expand_config_names:
        raise ConfigError(f"atmm.prefill_graph_expand: {name!r} is not an expand config of this build "
                          f"(expands: {', '.join(kernels.expand_config_names)})")
    kernels.prefill_graph_expand = name


def start_tuner(config: EngineConfig, runner: ModelRunner, device: torch.device, dtype: torch.dtype):
    """The ATMM tuner sidecar for this model's LoRA shapes (``atmm`` config section), or None."""
    from vlora.atmm import tuner
    from vlora.atmm.dispatch import default_kernels

    cfg = config.atmm
    dims = runner.module_dims()
    # The calls themselves, most frequent first (an expand tuned on a square call can be far off the engine's).
    projections = [pq for pq, _ in Counter(dims[m] for m in config.lora.target_modules).most_common()]
    widths = tuner.widths_of(projections)
    # The largest first: a run cut short by its budget then has every shape at the rank whose kernels serve all.
    ranks = sorted((r for r in cfg.tune_ranks if r <= config.lora.max_rank), reverse=True) or [config.lora.max_rank]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    cache = Path(cfg.tune_cache_dir) if cfg.tune_cache_dir else default_cache_dir() / "tiling"
    index = device.index if device.type == "cuda" and device.index is not None else 0
    # The sidecar profiles on its device 0: show it this engine's GPU only, and give each GPU its own
    # output (one Triton instance per GPU starts one sidecar each, at the same time).
    return tuner.start_at_load(
        default_kernels(), mode=cfg.tune_at_load, widths=widths, ranks=ranks,
        max_tokens=config.scheduler.max_num_batched_tokens, segments=list(cfg.tune_segments),
        dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype)), budget_s=cfg.tune_budget_s,
        cache_dir=cache, work_dir=cache / "runs" / f"cuda{index}", device_name=name,
        env=child_env(index if device.type == "cuda" else None), projections=projections,
        pad_segments=config.scheduler.max_batch_size if config.engine.prefill_graph_tokens else 0,
        shapes=tuner_shapes(config))


def visible_devices_for_child(index: int, visible: Optional[str]) -> Optional[str]:
    """``CUDA_VISIBLE_DEVICES`` for a child process that must see only this process's device ``index``,
    given this process's own ``CUDA_VISIBLE_DEVICES`` (None: unset); None when it cannot be told."""
    if visible is None:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return entries[index] if 0 <= index < len(entries) else None


def child_env(index: Optional[int], environ: Optional[Mapping[str, str]] = None) -> Optional[dict[str, str]]:
    """The environment for a child process (passed as ``env=``) that must see only this process's device
    ``index``: a copy of ``environ`` (default this process's) with ``CUDA_VISIBLE_DEVICES`` naming it.
    None (inherit unchanged) for a CPU engine (``index`` None) or when the device cannot be told.
    This process's own environment is never changed."""
    environ = os.environ if environ is None else environ
    value = None if index is None else visible_devices_for_child(index, environ.get("CUDA_VISIBLE_DEVICES"))
    if value is None:
        return None
    return {**environ, "CUDA_VISIBLE_DEVICES": value}
