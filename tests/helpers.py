"""Helpers shared by the unit, GPU and end-to-end tests (tests/ is on sys.path: see tests/conftest.py): the tiny
model's engine configuration, a callback that collects a request's outputs, shuffled KV block tables,
transformers + PEFT references (adapters loaded, one switched on per call, Qwen2-VL processor inputs), and the
switchers' synthetic runner (q/k/v and o stacks with their slot stacks)."""
from __future__ import annotations

import importlib
import io
import threading
from typing import Callable, Optional, Sequence


def tiny_config(model_dir, adapter_root, **over):
    """The EngineConfig of the tiny model and its adapters on the CPU (fp32, LoRA ranks up to 32); ``over``:
    more dotted settings (``**{"scheduler.max_batch_size": 2}``), each value given as its string."""
    from vlora.config import EngineConfig

    base = {"model.path": str(model_dir), "lora.adapter_root": str(adapter_root), "model.device": "cpu",
            "model.dtype": "float32", "lora.max_rank": "32"}
    base.update({k: str(v) for k, v in over.items()})
    return EngineConfig().with_overrides(base)


class Collector:
    """An engine output callback that keeps every request's outputs (``events``) and its last one (``done``);
    a request that finishes twice fails the test. Safe to call from the engine thread."""

    def __init__(self) -> None:
        self.events: dict[str, list] = {}
        self.done: dict[str, object] = {}
        self.cv = threading.Condition()

    def __call__(self, out) -> None:
        with self.cv:
            self.events.setdefault(out.request_id, []).append(out)
            if out.finished:
                assert out.request_id not in self.done, f"{out.request_id} finished twice"
                self.done[out.request_id] = out
            self.cv.notify_all()

    def wait(self, n: int, timeout: float = 60) -> None:
        """Until ``n`` requests have finished."""
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.done) >= n, timeout), f"only {len(self.done)} of {n} finished"

    def wait_running(self, rid: str, timeout: float = 60) -> None:
        """Until ``rid`` (a streaming request) has produced a token: it is in the running batch."""
        with self.cv:
            assert self.cv.wait_for(lambda: any(o.text_delta or o.num_output_tokens for o in self.events.get(rid, ())),
                                    timeout), f"{rid} never produced a token"


def shuffled_block_tables(seq_lens: Sequence[int], block_size: int, generator, spare: int,
                          first_id: int = 0) -> tuple[list[list[int]], int]:
    """Block tables for sequences of the given lengths, their blocks a shuffle of ids ``first_id`` on (so not
    contiguous), with ``spare`` blocks nobody owns; returns (tables, number of blocks the pool needs)."""
    import torch

    need = [-(-L // block_size) for L in seq_lens]
    ids = (first_id + torch.randperm(sum(need) + spare, generator=generator)).tolist()
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    return tables, first_id + sum(need) + spare


# -- transformers + PEFT references ------------------------------------------------------------------------

def peft_with_adapters(base, adapter_root, names: Sequence[str]):
    """``base`` (a transformers model) with the PEFT adapters ``adapter_root/<name>`` loaded under their names."""
    import peft

    model = peft.PeftModel.from_pretrained(base, adapter_root / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_root / name, adapter_name=name)
    return model


def with_adapter(model, adapter: Optional[str], fn: Callable):
    """``fn()`` with the PEFT ``model``'s adapter ``adapter`` switched on (None: the base model), without grad."""
    import torch

    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                return fn()
        model.set_adapter(adapter)
        return fn()


def peft_greedy(model, adapter: Optional[str], inputs, max_new_tokens: int) -> list[int]:
    """The new token ids of transformers + PEFT's greedy continuation of ``inputs`` (one request)."""
    out = with_adapter(model, adapter, lambda: model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False))
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def qwen_processor_inputs(processor, text: str, images: Sequence[bytes]):
    """The model inputs of a Qwen2-VL request as its processor builds them: the images as one video where the
    text has the video placeholder, else as images (placed first where the text has no image placeholder)."""
    from PIL import Image

    from vlora.models.qwen2_vl import VIDEO_PLACEHOLDER, VISION_PLACEHOLDER

    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
    if VIDEO_PLACEHOLDER in text:
        return processor(text=[text], videos=[pil], return_tensors="pt")
    if images and VISION_PLACEHOLDER not in text:
        text = VISION_PLACEHOLDER * len(images) + text
    return processor(text=[text], images=pil, return_tensors="pt")


# -- the ATMM extension, faked -----------------------------------------------------------------------------

class FakeAtmmExt:
    """The ATMM extension's Python surface (``AtmmKernels(ext=...)``) for CPU tests: two configs,
    ``shrink<suffix>`` and ``expand<suffix>`` (with ``kind`` when given), a tiling table that answers each
    direction with its own config (split-K ``shrink_split`` for the shrink) and counts its ``lookups``, and a
    forward that records its arguments in ``calls`` and, given ``refuse`` (a message), raises it as a refused
    launch would."""

    MAX_SLOTS = 64

    def __init__(self, suffix: str = "", shrink_split: int = 1, kind: Optional[str] = None,
                 refuse: Optional[str] = None) -> None:
        self.calls: list[tuple] = []
        self.lookups = 0
        self.refuse = refuse
        self.names = ("shrink" + suffix, "expand" + suffix)
        self.kind = kind
        ext = self

        class Table:
            def add(self, *args) -> None:
                pass

            def lookup(self, direction, dtype, tokens, width, rank, segments) -> dict:
                ext.lookups += 1
                config = direction + suffix
                return {"config": config, "split_k": shrink_split if direction == "shrink" else 1, "exact": True,
                        "default": False, "matched": config}

        self.TilingTable = Table

    def configs(self) -> list[dict]:
        return [{"name": n} if self.kind is None else {"name": n, "kind": self.kind} for n in self.names]

    @staticmethod
    def workspace_size(segments, split_k, tokens, r_max, dtype) -> int:
        return 4096

    def forward(self, *args) -> None:
        self.calls.append(args)
        if self.refuse is not None:
            raise RuntimeError(self.refuse)


def require_cuda(triton: bool = False) -> None:
    """Skip the calling test module (call it at import, before importing what needs CUDA) unless CUDA is here
    and, with ``triton``, triton imports (the Triton kernels' modules serve nothing without it)."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    if triton:
        try:
            importlib.import_module("triton")
        except ImportError:
            pytest.skip("triton is not installed", allow_module_level=True)


def synthetic_runner(L: int, d: int, r: int, slots: int, dtype, device: str):
    """What the switchers read of a ModelRunner (``groups``, ``lora_layers``, ``num_layers``), for q/k/v/o
    of a LLaMA layer of width ``d`` with no GQA, built as ModelRunner builds it (q/k/v and o stacks in one
    buffer; the slot buffers of each group in one stack). It was benchmarks/switch_probe.py's (benchmarks/NOTES.md)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from vlora.engine.weight_groups import WeightGroup
    from vlora.lora.layers import GroupSlots, LoraContext, LoraLinear

    ctx = LoraContext()
    layers, groups = {}, {}
    buf = torch.randn(4 * L, d, d, dtype=dtype, device=device) * 0.02  # as ModelRunner._attention_buffer
    stacks = {"qkv": buf[:3 * L].view(L, 3 * d, d), "o": buf[3 * L:]}
    for name, mods in (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",))):
        M = len(mods)
        stack = stacks[name]
        a = torch.zeros(L, M, slots, r, d, dtype=dtype, device=device)
        b = torch.zeros(L, M, slots, d, r, dtype=dtype, device=device)
        lora = []
        for li in range(L):
            wrappers = []
            for k, m in enumerate(mods):
                lin = nn.Linear(d, d, bias=False, device="meta", dtype=dtype)
                lin.weight = nn.Parameter(stack[li, k * d:(k + 1) * d], requires_grad=False)
                w = LoraLinear(lin, ctx, slots, r, lora_a=a[li, k], lora_b=b[li, k])
                layers[(li, m)] = w
                wrappers.append((k * d, d, w))
            lora.append(tuple(wrappers))
        groups[name] = WeightGroup(name, stack, None, tuple((m, k * d, d) for k, m in enumerate(mods)), lora,
                                   GroupSlots(mods, a, b, tuple(b[:, k] for k in range(M))))
    return SimpleNamespace(groups=groups, lora_layers=layers, num_layers=L)


def count_encodes(runner) -> list[int]:
    """Turn off ``runner``'s encoder cache and count its vision encodes: the returned list gets the number of
    items (images, videos) of each ``runner.encode`` call, so a test sees which items a step encoded."""
    runner.set_encoder_cache(0)
    counts: list[int] = []
    encode = runner.encode

    def counting(pixel_values, *args, **kwargs):
        out = encode(pixel_values, *args, **kwargs)
        counts.append(len(out))
        return out

    runner.encode = counting
    return counts
