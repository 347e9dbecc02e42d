"""Validation bits per byte: the one evaluation of training, ``megacpp eval`` and every torchrun rank.

By default it covers the whole validation split, the bytes the baselines beside it were measured on
(`megacpp.data.baselines`): a figure printed next to a baseline covers the same text. A number of
batches evaluates the split's first rows instead, and the figure says how many tokens it covers.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.hybrid import IGNORE_INDEX
from megacpp.ops import kernel_prewarm
from megacpp.runtime.data import DataBundle
from megacpp.runtime.device import autocast_context


class Ranks(Protocol):
    """What evaluation needs of the ranks of a job (megacpp.distributed.context.DistContext, a package
    above this one): a sum over ranks, in place."""

    def all_reduce_(self, tensor: Tensor) -> Tensor: ...


class Evaluation(NamedTuple):
    """Validation bits per byte and what it covers: ``tokens`` targets standing for ``bytes`` UTF-8
    bytes, of a split of ``split_tokens`` tokens (``whole``: every row of the split)."""
    bpb: float
    tokens: int
    bytes: int
    split_tokens: int
    whole: bool

    def coverage(self) -> str:
        """``over 59,000 tokens (the whole validation split)`` or ``... (4 batches, 38% of it)``."""
        share = "the whole validation split" if self.whole else \
            f"{self.tokens / max(self.split_tokens, 1):.0%} of the validation split"
        return f"over {self.tokens:,} tokens ({share})"

    def record(self) -> dict[str, float | int | bool]:
        return {"val_bpb": self.bpb, "val_tokens": self.tokens, "val_bytes": self.bytes,
                "val_split_tokens": self.split_tokens, "val_whole_split": self.whole}


@torch.no_grad()
@kernel_prewarm.no_backward_follows()
def evaluate_bpb(model: nn.Module, data: DataBundle, device: torch.device, max_batches: int = 0,
                 ctx: Ranks | None = None, micro_batch: int | None = None,
                 stop: Callable[[], bool] | None = None) -> Evaluation | None:
    """Bits per byte on the validation split: summed NLL (nats) / ln 2 / UTF-8 bytes of the targets
    (special-token targets excluded from both), over the whole split, or with ``max_batches`` > 0 over
    its first rows. Under torchrun each rank evaluates its rows of the same global batches and the sums
    are added over ranks. ``micro_batch`` runs each
    batch in slices of that many rows (the training micro-batch: what fits in memory).

    ``stop`` is asked before every batch (Ctrl-C during training's evaluation); when it says so the
    evaluation ends there and returns None. Under torchrun it must give every rank the same answer.

    Runs eagerly (``force_eager``) so no-grad evaluation never compiles or recompiles a frame.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nats, bytes, tokens
    stopped = False
    with torch.compiler.set_stance("force_eager"), autocast_context(device):
        for batch in data.val_batches(max_batches):
            if stop is not None and stop():
                stopped = True
                break
            # Special-token targets (document ends) stand for no bytes: excluded from both sums.
            targets = batch.targets.masked_fill(batch.target_bytes == 0, IGNORE_INDEX)
            rows = micro_batch or len(batch.inputs)
            for start in range(0, len(batch.inputs), rows):
                part = slice(start, start + rows)
                logits = model(batch.inputs[part], doc_ids=batch.doc_ids[part])
                sums[0] += F.cross_entropy(logits.flatten(0, 1).float(), targets[part].flatten(),
                                           ignore_index=IGNORE_INDEX, reduction="sum")
            sums[1] += batch.target_bytes.sum()
            sums[2] += (batch.target_bytes > 0).sum()
    model.train(was_training)
    if stopped:
        return None
    if ctx is not None:
        ctx.all_reduce_(sums)
    nats, n_bytes, tokens = sums.tolist()
    split_tokens = data.shards.splits["val"].num_tokens
    return Evaluation(nats / math.log(2) / max(n_bytes, 1), int(tokens), int(n_bytes), split_tokens,
                      data.covers_whole_val_split(max_batches))
