"""Per-rank statistics that feed back into weights or control flow, reduced across ranks.

Each rank routes, clips and measures its own batch. Modules declare such buffers in
``reduced_buffers`` (megacpp.model.hints): MoE expert counts and overflow are summed before the
selection-bias update, attention logit bounds take the maximum before MuonClip. Buffers of one
reduction and dtype travel in one collective.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor, nn

from megacpp.distributed.context import DistContext
from megacpp.model.hints import reduced_buffers


class StatisticsReducer:
    def __init__(self, model: nn.Module, ctx: DistContext) -> None:
        self.ctx = ctx
        self.groups: dict[tuple[str, torch.dtype], list[Tensor]] = defaultdict(list)
        for _, buffer, how in reduced_buffers(model):
            self.groups[(how, buffer.dtype)].append(buffer)

    def __call__(self) -> None:
        """Replace every declared statistic by its reduction over ranks (nothing on one process)."""
        if not self.ctx.distributed:
            return
        for (how, _), buffers in self.groups.items():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            self.ctx.all_reduce_(flat, how)
            for buffer, piece in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
                buffer.copy_(piece.view_as(buffer))
