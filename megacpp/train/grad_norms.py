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

import math
import statistics
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from megacpp.distributed.context import DistContext
from megacpp.distributed.expert_parallel import ExpertParallel
from megacpp.model.params import parameter_parts
from megacpp.optim.local import is_sharded, local_tensor


class PartGradNorms:
    """Measures, after backward and before the optimizer clips anything, each part's and each block's
    gradient norm.

    Built after parallelisation (FSDP2 replaces the parameters): sharded gradients contribute their
    rows' squared norms, summed over ranks, so every rank logs the global figure."""

    def __init__(self, model: nn.Module, ctx: DistContext, experts: ExpertParallel | None = None) -> None:
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
        # Expert parallelism: each rank holds other experts' rows, whose squares add over the expert group.
        self.experts = experts
        self.is_expert = torch.tensor([experts is not None and experts.holds(p) for p in self.params], device=device)
        # Sharded gradients' squares are summed over every rank: a row held by several ranks (an expert's
        # replicas beside fsdp, a shard's replicas under hsdp) is counted once by dividing by its copies.
        self.copies = torch.tensor([self._copies(p) for p in self.params], dtype=torch.float32, device=device)

    def _copies(self, p: Tensor) -> int:
        """Ranks holding the same rows of ``p`` (those of a sharded DTensor's replicated mesh dimensions)."""
        if self.experts is not None and self.experts.holds(p):
            return self.experts.replicas
        if not is_sharded(p):
            return 1
        return math.prod(p.device_mesh.size(d) for d, pl in enumerate(p.placements) if pl.is_replicate())

    def measure(self) -> tuple[dict[str, Tensor], Tensor]:
        """``({"grad_norm_<part>": 0-d tensor}, per-block norms as a 1-d tensor)``; a part or a block
        without gradients reads 0."""
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        norms = iter(torch._foreach_norm(grads)) if grads else iter(())
        squares = torch.stack([next(norms).float() if p.grad is not None else self.zero
                               for p in self.params]).square()
        if self.sharded:
            squares = squares / self.copies  # summed over every rank below
        elif self.experts is not None:
            squares = self.experts.square_sums(squares, self.is_expert)
        totals = torch.stack([squares.index_select(0, index).sum() for index in self.part_index + self.block_index])
        if self.sharded:
            self.ctx.all_reduce_(totals, "sum")
        norms_out = totals.sqrt()
        parts, blocks = norms_out[:len(self.names)], norms_out[len(self.names):]
        return dict(zip((f"grad_norm_{name}" for name in self.names), parts.unbind(0), strict=True)), blocks

    def block_record(self, blocks: Tensor | Sequence[float]) -> dict[str, float]:
        """Per-block norms (`measure`'s tensor, or its values already read) as a metrics field:
        ``{"0A": ..., "1E": ..., ...}``."""
        values = blocks.tolist() if isinstance(blocks, Tensor) else list(blocks)
        return dict(zip(self.block_labels, values, strict=True))


def topmost_inflated_block(blocks: dict[str, float], typical: dict[str, float], factor: float = 10.0) -> str | None:
    """The deepest block (largest depth: nearest the head, where the backward starts) whose gradient
    norm exceeds ``factor`` times its typical value, e.g. the median over a window of steps; None when
    no block does. Labels are ``block_record``'s "<depth><kind>"."""
    inflated = [label for label, norm in blocks.items() if norm > factor * typical[label]]
    return max(inflated, key=lambda label: int(label[:-1]), default=None)


def median_block_norms(window: Iterable[dict[str, float]]) -> dict[str, float]:
    """Each block's median norm over a window of steps' ``block_record``s: the typical value a spike is
    measured against."""
    rows = list(window)
    return {label: statistics.median(blocks[label] for blocks in rows) for label in rows[0]}


def spike_starts(spikes: Iterable[dict[str, float]], typical: dict[str, float], factor: float = 10.0
                 ) -> Counter[str | None]:
    """How often each block was where a spike started: `topmost_inflated_block` of each spike's block
    norms against ``typical`` (each block's median; None: no block was inflated)."""
    return Counter(topmost_inflated_block(blocks, typical, factor) for blocks in spikes)


SPIKE_FACTOR = 10.0  # a spike: a gradient norm above this many times the run's median (and, per block, its own)
QUIET_START = 20  # the first steps' norms are large by nature (fresh weights, warmup): never spikes


class NormHistory:
    """The gradient norms of a run's steps, kept for `spike_summary` in flat arrays: about 8 bytes per
    block and step, where a list of per-step dicts of Python floats cost ~2 KB per step (180 MB over
    100k steps of `small`)."""

    def __init__(self) -> None:
        self.steps = array("q")
        self.norms = array("d")
        self.labels: tuple[str, ...] | None = None  # the block labels, while every step has all of them
        self._blocks = array("d")  # row-major: one row of len(labels) per step
        self._every_step_has_blocks = True

    def append(self, step: int, norm: float, blocks: dict[str, float] | None) -> None:
        """One step's global norm and its blocks' norms (``block_record``), or None without them."""
        self.steps.append(step)
        self.norms.append(norm)
        if blocks is None or (self.labels is not None and tuple(blocks) != self.labels):
            self._every_step_has_blocks = False
        if self._every_step_has_blocks:
            self.labels = self.labels or tuple(blocks)
            self._blocks.extend(blocks.values())

    def blocks(self, i: int) -> dict[str, float] | None:
        """Step i's block norms (i counts appended steps), None unless every step has them."""
        if not self._every_step_has_blocks or self.labels is None:
            return None
        width = len(self.labels)
        return dict(zip(self.labels, self._blocks[i * width:(i + 1) * width], strict=True))

    def block_medians(self, indices: list[int]) -> dict[str, float]:
        """`median_block_norms` over the steps at `indices`, read column by column from the arrays."""
        width = len(self.labels or ())
        return {label: statistics.median(self._blocks[i * width + j] for i in indices)
                for j, label in enumerate(self.labels or ())}


def spike_summary(history: NormHistory) -> str | None:
    """One end-of-run line on the gradient-norm spikes of a run's steps (norms before clipping): how
    many steps after QUIET_START exceed SPIKE_FACTOR x the median, the largest, and the blocks where
    they start; None when there are none (or too few steps to say)."""
    window = [i for i, step in enumerate(history.steps) if step > QUIET_START]
    if len(window) < 3:
        return None
    median = statistics.median(history.norms[i] for i in window)
    spikes = [i for i in window if history.norms[i] > SPIKE_FACTOR * median]
    if not spikes:
        return None
    top = max(spikes, key=lambda i: history.norms[i])
    line = (f"gradient norm: {len(spikes)} of {len(window)} steps after step {QUIET_START} above "
            f"{SPIKE_FACTOR:g}x the median {median:.3g} (largest {history.norms[top]:.3g} at step "
            f"{history.steps[top]}, before clipping)")
    if history.blocks(0) is not None:
        starts = spike_starts((history.blocks(i) for i in spikes), history.block_medians(window))
        line += "; they start at " + ", ".join(f"{label or 'no single block'} ({n})"
                                               for label, n in starts.most_common())
    return line + " (every block's norm is in metrics.jsonl; benchmarks/loss_spread.py tabulates them)"
