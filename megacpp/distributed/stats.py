"""Per-forward statistics that feed back into weights or control flow, taken over a step's whole batch.

Modules declare such buffers in ``reduced_buffers`` (megacpp.model.hints), each with how it combines:
MoE expert counts and overflow are summed (the selection-bias update), attention logit bounds take the
maximum (MuonClip). Each forward overwrites them with its own micro-batch's values, so a step of several
micro-batches (``train.grad_accum``, ``train.micro_batch``, an auto-fit split) combines them here, one
forward at a time, and then over ranks, before anything reads them: the statistics of batch B run as k
micro-batches equal those of batch B run whole. Buffers of one reduction and dtype travel in one
collective.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor, nn

from megacpp.distributed.context import DistContext
from megacpp.model.hints import reduced_buffers

_COMBINE = {"sum": torch.add, "max": torch.maximum}


class StatisticsReducer:
    def __init__(self, model: nn.Module, ctx: DistContext) -> None:
        self.ctx = ctx
        self.groups: dict[tuple[str, torch.dtype], list[Tensor]] = defaultdict(list)
        for _, buffer, how in reduced_buffers(model):
            if how not in _COMBINE:
                raise ValueError(f"reduced_buffers: {how!r} is not a reduction; expected one of {sorted(_COMBINE)}")
            self.groups[(how, buffer.dtype)].append(buffer)
        self._forwards = 1
        self._seen = 0
        self._totals: dict[tuple[str, torch.dtype], list[Tensor]] = {}

    def begin_step(self, forwards: int) -> None:
        """A step of ``forwards`` forward passes (micro-batches) begins."""
        self._forwards, self._seen, self._totals = forwards, 0, {}

    def after_forward(self) -> None:
        """Fold this forward's statistics into the step's (nothing to do when the step has one forward)."""
        self._seen += 1
        if self._forwards == 1:
            return
        for key, buffers in self.groups.items():
            if key not in self._totals:
                self._totals[key] = [b.clone() for b in buffers]
            else:
                combine = _COMBINE[key[0]]
                for total, buffer in zip(self._totals[key], buffers, strict=True):
                    combine(total, buffer, out=total)

    def __call__(self) -> None:
        """Leave every declared statistic holding the step's value over all its forwards and ranks."""
        if self._seen != self._forwards:
            raise RuntimeError(f"statistics of {self._seen} forward(s) folded in a step of {self._forwards}")
        for key, totals in self._totals.items():
            for buffer, total in zip(self.groups[key], totals, strict=True):
                buffer.copy_(total)
        self._totals = {}
        if not self.ctx.distributed:
            return
        for (how, _), buffers in self.groups.items():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            self.ctx.all_reduce_(flat, how)
            for buffer, piece in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
                buffer.copy_(piece.view_as(buffer))
