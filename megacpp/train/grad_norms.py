"""Gradient norm of each part of the model, logged beside the global one.

A spike of the global gradient norm says that something exploded, not what: on one H200 `small`'s norm
reached 1.8e7 at 8192 tokens while the dense model's stayed under 4 (BENCHMARKS.md, issue 13). The
parts are megacpp.model.params.parameter_parts (each block kind, Engram, embedding, head, MTP), so a
spike names its block kind. The cost is one more read of the gradients per step, not measured yet;
by bandwidth, `small`'s 1.4 GB of fp32 gradients at ~3 TB/s is ~0.5 ms of its 187 ms step. Nothing
is written: the losses are bitwise those of a run without it (tested).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from megacpp.distributed.context import DistContext
from megacpp.model.params import parameter_parts
from megacpp.optim.local import is_sharded, local_tensor


class PartGradNorms:
    """Measures, after backward and before the optimizer clips anything, each part's gradient norm.

    Built after parallelisation (FSDP2 replaces the parameters): sharded gradients contribute their
    rows' squared norms, summed over ranks, so every rank logs the global figure."""

    def __init__(self, model: nn.Module, ctx: DistContext) -> None:
        parts = parameter_parts(model)
        self.names = [name for name, _ in parts]
        self.groups = [params for _, params in parts]
        self.ctx = ctx
        self.sharded = any(is_sharded(p) for params in self.groups for p in params)

    def measure(self) -> dict[str, Tensor]:
        """``{"grad_norm_<part>": 0-d tensor}`` for every part; a part without gradients reads 0."""
        squares = []
        for params in self.groups:
            grads = [local_tensor(p.grad) for p in params if p.grad is not None]
            if grads:
                norms = torch._foreach_norm(grads)
                squares.append(torch.stack([n.float() for n in norms]).square().sum())
            else:
                squares.append(torch.zeros((), device=local_tensor(params[0]).device))
        total = torch.stack(squares)
        if self.sharded:
            self.ctx.all_reduce_(total, "sum")
        return dict(zip((f"grad_norm_{name}" for name in self.names), total.sqrt().unbind(0), strict=True))
