"""Host cost of one eager prefill step of ModelRunner.forward, on the CPU, through the GPU code path.

The fused Triton kernels (RMSNorm, rotary + cache, SiLU*mul) and the paged prefill attention kernel are
replaced by no-op launchers that count their launches, and ``fused_available`` reports True, so the
Python wrappers, checks, views and allocations that run per layer on the GPU run here too; a random
LLaVA (32 layers at a small width, so kernel time is small) makes the torch ops cheap. Prints the host
time per step (min over repeats, wall and process CPU), the dispatcher ops per step (torch dispatch
mode, views apart) and the Triton launches per layer. LoRA (``--lora``) runs the ATMM PyTorch reference
here (the extension needs CUDA), so its figures are not the device's. The device side of the same step:
``benchmarks/engine_floor.py --profile-prefill 600``; the host side on the device: ``profile_step.py``.

    python benchmarks/prefill_host_probe.py --tokens 600 [--lora]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
import types
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

VIEWS = {"view", "slice", "select", "unsqueeze", "expand", "t", "transpose", "reshape", "_unsafe_view", "alias",
         "as_strided", "detach", "squeeze", "permute", "split", "lift_fresh"}


class _Launcher:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` counts and does nothing."""

    def __init__(self, name: str, counts: collections.Counter) -> None:
        self.name, self.counts = name, counts

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts[self.name] += 1
        return launch


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def stub_kernels(launches: collections.Counter) -> None:
    from vlora.engine import attention, fused_ops, model_runner
    fake = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))
    fused_ops.fused_available = model_runner.fused_available = lambda t: True
    fused_ops.triton = attention.triton = fake
    for name in ("_rms_kernel", "_rotary_cache_kernel", "_silu_mul_kernel"):
        setattr(fused_ops, name, _Launcher(name, launches))
    attention._prefill_kernel = _Launcher("_prefill_kernel", launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lora", action="store_true", help="one rank-8 q/k/v/o adapter on every token")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from vlora.engine import attention
    from vlora.engine.kv_cache import SequenceBlocks
    from vlora.engine.model_runner import ModelRunner, SeqInput
    from vlora.models import tiny

    launches: collections.Counter = collections.Counter()
    stub_kernels(launches)
    text = LlamaConfig(**{**tiny.TEXT, "num_hidden_layers": args.layers, "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "num_key_value_heads": 2,
                          "max_position_embeddings": max(4096, args.tokens)}, vocab_size=256)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**tiny.VISION), text_config=text, image_token_index=255,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    runner = ModelRunner(model, image_token_id=255, num_slots=2, max_rank=8,
                         target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    runner.allocate_kv(-(-args.tokens // 16) + 4, 16, 0.9)
    runner.attention = attention.TritonAttentionBackend(torch.device("cpu"))
    if args.lora:
        g = torch.Generator().manual_seed(1)
        for w in runner.lora_layers.values():
            w.set_slot(0, torch.randn(8, w.in_features, generator=g) * .1, torch.randn(w.out_features, 8, generator=g) * .1, 2.0)
    blocks = SequenceBlocks(runner.kv.allocator.allocate(runner.kv.blocks_for(args.tokens)))
    seq = SeqInput(token_ids=[(i * 7) % 250 for i in range(args.tokens)], start_pos=0, blocks=blocks,
                   slot=0 if args.lora else -1)
    for _ in range(3):
        runner.forward([seq])
    walls, cpus = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            runner.forward([seq])
        walls.append((time.perf_counter() - t0) / args.steps * 1e3)
        cpus.append((time.process_time() - c0) / args.steps * 1e3)
    launches.clear()
    with _CountOps() as c:
        runner.forward([seq])
    real = {k: v for k, v in c.ops.items() if k not in VIEWS}
    views = sum(v for k, v in c.ops.items() if k in VIEWS)
    L = args.layers
    print(f"prefill of {args.tokens} tokens, {L} layers, {'one adapter' if args.lora else 'base'}: "
          f"host {min(walls):.2f} ms/step (min wall), {min(cpus):.2f} ms CPU")
    print(f"dispatcher ops per step: {sum(real.values())} + {views} views; Triton launches per step "
          f"{sum(launches.values())} ({sum(launches.values()) / L:.1f} per layer: {dict(launches)})")
    print("ops:", dict(sorted(real.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    sys.exit(main())
