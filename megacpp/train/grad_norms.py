"""Gradient norm of each part and of each block of the model, logged beside the global one.

A spike of the global gradient norm says that something exploded, not what: on one H200 `small`'s norm
reached 1.8e7 at 8192 tokens while the dense model's stayed under 4 (BENCHMARKS.md, issue 13). The
parts are megacpp.model.params.parameter_parts (each block kind, Engram, embedding, head, MTP), so a
spike names its block kind. The per-block norms place it in depth: a backward that blows up at block k
inflates the gradients of k and of every block below it, so the topmost inflated block is where it
starts (in `small`'s spikes at 8192 tokens every block kind rose together while the head's norm stayed
under 1.5, which a per-kind split cannot place). One fused norm per gradient tensor serves both; the
cost is one more read of the gradients per step, by bandwidth ~0.5 ms of `small`'s 187 ms (`small`'s
1.4 GB of fp32 gradients at ~3 TB/s). Nothing is written: the losses are bitwise those of a run
without it (tested).
"""
from __future__ import annotations

import statistics
from collections import Counter

import torch
from torch import Tensor, nn

from megacpp.distributed.context import DistContext
from megacpp.model.params import parameter_parts
from megacpp.optim.local import is_sharded, local_tensor


class PartGradNorms:
    """Measures, after backward and before the optimizer clips anything, each part's and each block's
    gradient norm.

    Built after parallelisation (FSDP2 replaces the parameters): sharded gradients contribute their
    rows' squared norms, summed over ranks, so every rank logs the global figure."""

    def __init__(self, model: nn.Module, ctx: DistContext) -> None:
        parts = parameter_parts(model)
        self.names = [name for name, _ in parts]
        self.params = [p for _, params in parts for p in params]  # every parameter exactly once
        position = {id(p): i for i, p in enumerate(self.params)}
        device = local_tensor(self.params[0]).device
        self.part_index = [torch.tensor([position[id(p)] for p in params], device=device) for _, params in parts]
        # Labelled "<depth><kind>" (e.g. "11R"), so a record is read without the run's config.
        self.block_labels = [f"{depth}{block.kind}" for depth, block in enumerate(model.blocks)]
        self.block_index = [torch.tensor([position[id(p)] for p in block.parameters()], device=device)
                            for block in model.blocks]
        self.zero = torch.zeros((), device=device)
        self.ctx = ctx
        self.sharded = any(is_sharded(p) for p in self.params)

    def measure(self) -> tuple[dict[str, Tensor], Tensor]:
        """``({"grad_norm_<part>": 0-d tensor}, per-block norms as a 1-d tensor)``; a part or a block
        without gradients reads 0."""
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        norms = iter(torch._foreach_norm(grads)) if grads else iter(())
        squares = torch.stack([next(norms).float() if p.grad is not None else self.zero
                               for p in self.params]).square()
        totals = torch.stack([squares.index_select(0, index).sum() for index in self.part_index + self.block_index])
        if self.sharded:
            self.ctx.all_reduce_(totals, "sum")
        norms_out = totals.sqrt()
        parts, blocks = norms_out[:len(self.names)], norms_out[len(self.names):]
        return dict(zip((f"grad_norm_{name}" for name in self.names), parts.unbind(0), strict=True)), blocks

    def block_record(self, blocks: Tensor) -> dict[str, float]:
        """Per-block norms as a metrics field: ``{"0A": ..., "1E": ..., ...}`` (one host read)."""
        return dict(zip(self.block_labels, blocks.tolist(), strict=True))


def topmost_inflated_block(blocks: dict[str, float], typical: dict[str, float], factor: float = 10.0) -> str | None:
    """The deepest block (largest depth: nearest the head, where the backward starts) whose gradient
    norm exceeds ``factor`` times its typical value, e.g. the median over a window of steps; None when
    no block does. Labels are ``block_record``'s "<depth><kind>"."""
    inflated = [label for label, norm in blocks.items() if norm > factor * typical[label]]
    return max(inflated, key=lambda label: int(label[:-1]), default=None)


def spike_starts(window: list[dict[str, float]], spikes: list[dict[str, float]], factor: float = 10.0
                 ) -> Counter[str | None]:
    """How often each block was where a spike started: `topmost_inflated_block` of each spike's block
    norms against every block's median over ``window`` (None: no block was inflated)."""
    typical = {label: statistics.median(blocks[label] for blocks in window) for label in window[0]}
    return Counter(topmost_inflated_block(blocks, typical, factor) for blocks in spikes)


SPIKE_FACTOR = 10.0  # a spike: a gradient norm above this many times the run's median (and, per block, its own)
QUIET_START = 20  # the first steps' norms are large by nature (fresh weights, warmup): never spikes


def spike_summary(history: list[tuple[int, float, dict[str, float] | None]]) -> str | None:
    """One end-of-run line on the gradient-norm spikes of ``(step, norm before clipping, block norms)``
    records: how many steps after QUIET_START exceed SPIKE_FACTOR x the median, the largest, and the
    blocks where they start; None when there are none (or too few steps to say)."""
    window = [h for h in history if h[0] > QUIET_START]
    if len(window) < 3:
        return None
    median = statistics.median(norm for _, norm, _ in window)
    spikes = [h for h in window if h[1] > SPIKE_FACTOR * median]
    if not spikes:
        return None
    step, largest, _ = max(spikes, key=lambda h: h[1])
    line = (f"gradient norm: {len(spikes)} of {len(window)} steps after step {QUIET_START} above "
            f"{SPIKE_FACTOR:g}x the median {median:.3g} (largest {largest:.3g} at step {step}, before clipping)")
    if all(blocks for _, _, blocks in window):
        starts = spike_starts([blocks for _, _, blocks in window], [blocks for _, _, blocks in spikes])
        line += "; they start at " + ", ".join(f"{label or 'no single block'} ({n})"
                                               for label, n in starts.most_common())
    return line + " (every block's norm is in metrics.jsonl; benchmarks/loss_spread.py tabulates them)"
