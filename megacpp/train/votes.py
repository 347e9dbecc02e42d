"""The ranks' vote on when to stop: Ctrl-C (or SIGTERM) and the time budget, decided the same way on every rank.

Ranks get SIGINT at different moments and their clocks differ, yet all of them must stop after the
same step and save one checkpoint together. Each step's vote (any rank's Ctrl-C flag, the largest
elapsed time) is all-reduced with the step's loss, behind its last forward: reading it waits for no
backward or optimizer step, and the step's end needs no collective of its own. One process reads its
own flag and clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from megacpp.distributed.context import DistContext
from megacpp.train.interrupt import StopRequest


@dataclass
class StepVote:
    """What the ranks agreed on with a step's loss: whether any of them had Ctrl-C by its last forward,
    and the longest elapsed training time then (every rank reads the same values)."""
    interrupted: bool
    elapsed: float


class StopVotes:
    """Ctrl-C and ``time_budget_s`` (0 = none) as every rank agrees on them; the run's training clock."""

    def __init__(self, ctx: DistContext, device: torch.device, time_budget_s: float) -> None:
        self.ctx = ctx
        self.device = device
        self.time_budget_s = time_budget_s
        self.sigint: StopRequest | None = None  # Ctrl-C's and SIGTERM's flag while the loop runs
        self.elapsed_before = 0.0  # training wall time of the run before this process (a resume)
        self.last: StepVote | None = None  # the last step's, on several ranks
        self._t_start: float | None = None  # when this process's training loop started

    def start(self, sigint: StopRequest) -> None:
        """The loop starts: its Ctrl-C flag, and the clock."""
        self.sigint = sigint
        self._t_start = time.perf_counter()

    def elapsed(self) -> float:
        """Training wall time of the run so far: this process's loop plus what a resumed checkpoint
        had recorded (compilation, evaluations and checkpoints included)."""
        running = time.perf_counter() - self._t_start if self._t_start is not None else 0.0
        return self.elapsed_before + running

    def queue(self, reductions: dict[str, Tensor]) -> dict[str, Tensor]:
        """Add this rank's vote to a step's reductions (all-reduced max, queued now; nothing on one process)."""
        if self.ctx.distributed:
            flags = torch.tensor([float(self.sigint is not None and self.sigint.requested), self.elapsed()],
                                 dtype=torch.float64)
            if self.device.type == "cuda":  # from pageable memory the copy would wait for the queue
                flags = flags.pin_memory().to(self.device, non_blocking=True)
            self.ctx.all_reduce_(flags, "max")
            reductions["interrupted"], reductions["elapsed"] = flags[0], flags[1]
        return reductions

    def record(self, read: dict[str, float]) -> None:
        """The step's vote, from the values `queue` added, read back on the host."""
        self.last = StepVote(read["interrupted"] > 0, read["elapsed"]) if self.ctx.distributed else None

    def out_of_time(self) -> bool:
        """Whether the time budget is spent. Ranks' clocks differ: they agree on the largest (as it was
        at the step's last forward), so every rank stops at the same step."""
        if not self.time_budget_s:
            return False
        if not self.ctx.distributed:
            return self.elapsed() >= self.time_budget_s
        return self._last_vote().elapsed >= self.time_budget_s

    def interrupted_at_step_end(self) -> bool:
        """Ctrl-C at a step's end. Several ranks use what they voted with the step's loss, so a Ctrl-C
        during a step's backward or optimizer step stops the run after the next step: asking the ranks
        here would wait for the optimizer step to finish and leave the GPU idle while the next forward
        is queued. One process reads its flag."""
        if self.ctx.distributed:
            return self._last_vote().interrupted
        return self._flag()

    def interrupt_requested(self) -> bool:
        """Whether any rank got SIGINT (one scalar all-reduce: every rank stops at the same point; one
        process reads its flag alone, with no device work: this is asked before every evaluation batch
        and sampled token too)."""
        if not self.ctx.distributed:
            return self._flag()
        flag = torch.tensor(float(self._flag()), device=self.device)
        return bool(self.ctx.all_reduce_(flag, "max").item())

    def _flag(self) -> bool:
        return self.sigint is not None and self.sigint.requested

    def _last_vote(self) -> StepVote:
        if self.last is None:
            raise RuntimeError("no step has been voted on yet: a training step comes first")
        return self.last
