"""What a run derives from its frozen configuration, computed once and read everywhere: how a step's
rows are laid out over ranks, loader batches and micro-batches (`BatchPlan`), and the model's
configuration with the tokenizer's vocabulary (`trained_config`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megacpp.config import Config
from megacpp.section import freeze


@dataclass(frozen=True)
class BatchPlan:
    """A step's rows: ``grad_accum`` loader batches of ``batch_size`` rows per rank on ``ranks`` ranks,
    each run as ``batch_size / micro_batch`` micro-batches (forward and backward) of ``micro_batch``
    rows; every row is ``seq_len`` tokens. The token stream depends on the global batch alone."""
    ranks: int
    batch_size: int
    micro_batch: int
    grad_accum: int
    seq_len: int

    @classmethod
    def of(cls, cfg: Config, ranks: int) -> BatchPlan:
        """The plan ``cfg`` asks for (``train.micro_batch`` 0: the whole batch in one forward)."""
        tc = cfg.train
        return cls(ranks, tc.batch_size, tc.micro_batch or tc.batch_size, tc.grad_accum, cfg.data.seq_len)

    def with_micro_batch(self, micro_batch: int) -> BatchPlan:
        return dataclasses.replace(self, micro_batch=micro_batch)

    @property
    def splits(self) -> int:
        """Micro-batches per loader batch."""
        return self.batch_size // self.micro_batch

    @property
    def micro_steps(self) -> int:
        """Forwards and backwards per optimizer step on each rank: every micro-batch's mean loss is
        weighted by the inverse of this."""
        return self.grad_accum * self.splits

    @property
    def global_batch(self) -> int:
        """Rows per loader batch over all ranks."""
        return self.ranks * self.batch_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step over all ranks."""
        return self.global_batch * self.grad_accum * self.seq_len

    def split(self, batch: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
        """A loader batch's tensors as micro-batches of rows, in order; the batch itself, untouched,
        when it is one micro-batch (the default path)."""
        if self.micro_batch >= batch[0].shape[0]:
            return [batch]
        return list(zip(*(t.split(self.micro_batch) for t in batch), strict=True))

    def describe(self) -> str:
        """``batch 16 (as 2 micro-batches of 8) x 2 rank(s) x 1 accum x 2048 tokens``."""
        split = f" (as {self.splits} micro-batches of {self.micro_batch})" if self.splits > 1 else ""
        return (f"batch {self.batch_size}{split} x {self.ranks} rank(s) x {self.grad_accum} accum x "
                f"{self.seq_len} tokens")


def resumed_plan(plan: BatchPlan, configured: int, recorded: int | None, where: Path,
                 log: Callable[[str], None]) -> BatchPlan:
    """A resumed run keeps the micro-batch its checkpoint at ``where`` recorded (auto-fit's choice, or the
    user's) unless train.micro_batch (``configured``) is set, by the user or by the supervisor for a retry."""
    if configured or recorded is None or recorded == plan.micro_batch:
        return plan
    if plan.batch_size % recorded:
        log(f"resume: the micro-batch {recorded} recorded in {where / 'meta.json'} does not divide "
            f"train.batch_size {plan.batch_size}; using micro-batch {plan.micro_batch}")
        return plan
    log(f"resume: micro-batch {recorded} x {plan.batch_size // recorded} per batch of {plan.batch_size}, as "
        f"recorded in {where / 'meta.json'} (set --train.micro_batch to choose another)")
    return plan.with_micro_batch(recorded)


def trained_config(cfg: Config, vocab_size: int) -> Config:
    """The configuration as the model is trained: ``cfg`` with the tokenizer's vocabulary, frozen."""
    return freeze(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size)))
