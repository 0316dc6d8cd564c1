"""The decoder's projections in weight groups: every layer's projections that share d_in in one contiguous
stack, one GEMM per group and layer (or the memory-bound gemv kernels for a few rows), each module's LoRA
added into its columns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from vlora.engine import gemv
from vlora.engine.fused_ops import silu_mul
from vlora.lora.layers import GroupSlots, LoraLinear


@dataclass
class WeightGroup:
    """Projections of every layer that share d_in, in one contiguous stack: the layer's fused GEMM
    reads ``stack[layer]``, each module's ``nn.Linear.weight`` is a view of its rows, and the swift
    switcher merges an adapter into the whole stack in one call.

    Shape: stack [L, sum of d_out, d_in]; bias [L, sum of d_out] or None; modules: (name, row offset,
    d_out) in order; lora[layer]: (row offset, d_out, wrapper) of the modules with a LoRA wrapper.
    ``gemv_rows``: calls of at most this many rows run :mod:`vlora.engine.gemv`'s kernels where they serve
    (``engine.gemv_max_rows``; 0: always cuBLAS).
    """

    name: str
    stack: torch.Tensor
    bias: Optional[torch.Tensor]
    modules: tuple[tuple[str, int, int], ...]
    lora: list[tuple[tuple[int, int, LoraLinear], ...]]
    slots: Optional[GroupSlots] = None  # the LoRA slot buffers of its wrapped modules, all layers
    gemv_rows: int = 0
    gemv_table: Optional[gemv.GemvTable] = None  # the runner's launches (ModelRunner.set_gemv_max_rows)

    def __post_init__(self) -> None:
        # Each layer's weight and bias as views made once (the step's hot loop reads them; merges write the
        # stack in place, which the views see).
        self.weights = tuple(self.stack.unbind(0))
        self.biases = tuple(self.bias.unbind(0)) if self.bias is not None else (None,) * self.stack.shape[0]

    def forward(self, li: int, x: torch.Tensor, lora: bool = True) -> torch.Tensor:
        """x [T, d_in] -> [T, sum of d_out]: one GEMM, then each module's LoRA into its columns
        (``lora=False``: the step has no LoRA work, so the wrappers are not visited)."""
        if x.shape[0] <= self.gemv_rows and gemv.available(x):
            y = gemv.linear_rows(x, self.weights[li], self.biases[li], impl="triton", table=self.gemv_table)
        else:
            y = F.linear(x, self.weights[li], self.biases[li])
        if lora:
            for off, d, wrapper in self.lora[li]:
                wrapper.add_lora(x, y[:, off:off + d])
        return y

    def fusable(self, li: int, x: torch.Tensor, lora: bool = True) -> bool:
        """Whether layer ``li``'s call on x's rows runs the gemv kernels with nothing else reading x or the
        projection's output: at most ``gemv_rows`` rows, the kernels serve x, and no LoRA work of this group
        in the layer (a wrapper reads x and adds into the output's columns). Then the gate/up group fuses its
        activation (:meth:`forward_silu`)."""
        return x.shape[0] <= self.gemv_rows and not (lora and self.lora[li]) and gemv.available(x)

    def forward_silu(self, li: int, x: torch.Tensor, lora: bool = True) -> torch.Tensor:
        """The gate/up group: x [T, d_in] -> ``silu(gate) * up`` [T, d_out / 2]. One kernel with the activation
        in its epilogue where :meth:`fusable` (LoRA adds into the projection's columns before the activation),
        else :meth:`forward` and ``silu_mul``."""
        if self.fusable(li, x, lora):
            return gemv.gate_up_silu(x, self.weights[li], self.biases[li], impl="triton", table=self.gemv_table)
        return silu_mul(self.forward(li, x, lora))
