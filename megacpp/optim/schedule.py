"""Warmup -> stable -> decay learning-rate schedule, applied as a multiplier of each group's base lr.

The multiplier is written into the groups' 0-D lr tensors in place (fill_): no host sync, and a
compiled optimizer step sees the same tensor every step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megacpp.optim.config import DECAY_SHAPES, OptimConfig

if TYPE_CHECKING:
    from megacpp.optim.hparams import TensorHParamOptimizer


@dataclass(frozen=True)
class WarmupStableDecay:
    """Multiplier m(step) for step = 0, 1, ...; `total_steps=None` means no decay phase."""

    total_steps: int | None
    warmup_steps: int = 0
    decay_steps: int = 0
    final_frac: float = 0.0
    shape: str = "linear"

    def __post_init__(self) -> None:
        if self.shape not in DECAY_SHAPES:
            raise ValueError(f"decay shape {self.shape!r}; expected one of {DECAY_SHAPES}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup_steps and decay_steps must be >= 0")
        if self.total_steps is None and self.decay_steps:
            raise ValueError("a decay phase needs total_steps")
        if self.total_steps is not None and self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(
                f"warmup ({self.warmup_steps}) + decay ({self.decay_steps}) steps exceed "
                f"total_steps ({self.total_steps})"
            )

    @classmethod
    def from_config(cls, cfg: OptimConfig, total_steps: int | None) -> WarmupStableDecay:
        return cls(
            total_steps=total_steps,
            warmup_steps=_steps(cfg.warmup_steps, cfg.warmup_frac, total_steps),
            decay_steps=_steps(cfg.decay_steps, cfg.decay_frac, total_steps),
            final_frac=cfg.final_lr_frac,
            shape=cfg.decay_shape,
        )

    def multiplier(self, step: int) -> float:
        """Warmup (step + 1) / warmup; stable 1; decay from 1 at its first step toward final_frac."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        # No decay phase (e.g. decay_frac of a very short run rounds to 0 steps): stable to the end.
        if self.total_steps is None or self.decay_steps == 0 or step < self.total_steps - self.decay_steps:
            return 1.0
        left = max(0.0, (self.total_steps - step) / self.decay_steps)  # 1 at the decay start, 0 at the end
        if self.shape == "cosine":
            left = 0.5 * (1.0 - math.cos(math.pi * left))
        return self.final_frac + (1.0 - self.final_frac) * left


class LRScheduler:
    """Writes base_lr * multiplier(position) into every group's lr tensor; `step()` advances."""

    def __init__(self, optimizers: list[TensorHParamOptimizer], schedule: WarmupStableDecay) -> None:
        self.optimizers = optimizers
        self.schedule = schedule
        self.position = 0
        self.apply()

    @property
    def multiplier(self) -> float:
        return self.schedule.multiplier(self.position)

    def apply(self) -> None:
        m = self.multiplier
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"].fill_(group["base_lr"] * m)

    def step(self) -> None:
        self.position += 1
        self.apply()

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.apply()


@dataclass(frozen=True)
class HeldEnd:
    """``inner``'s multipliers up to the end it was made for (``until`` steps), then its last one, held."""

    inner: WarmupStableDecay
    until: int

    def multiplier(self, step: int) -> float:
        return self.inner.multiplier(min(step, self.until - 1))


def extend(saved: WarmupStableDecay, new: WarmupStableDecay, position: int, how: str
           ) -> tuple[WarmupStableDecay | HeldEnd, str | None]:
    """The schedule of a run resumed at ``position`` with more steps than ``saved`` was made for, and a
    line saying what that does to the learning rate (None when it changes nothing): ``how`` "rewarm"
    keeps ``new`` (the schedule of the new length), "hold" keeps ``saved``'s last multiplier."""
    if saved.total_steps is None or new.total_steps is None or new.total_steps <= saved.total_steps:
        return new, None
    was = saved.multiplier(min(position, saved.total_steps) - 1) if position else saved.multiplier(0)
    if how == "hold":
        return HeldEnd(saved, saved.total_steps), (
            f"schedule: train.steps {saved.total_steps} -> {new.total_steps}; optim.extend_schedule = hold: the "
            f"added steps train at {saved.multiplier(saved.total_steps - 1):.3g}x the base learning rate, where the "
            "checkpoint's schedule ended")
    now = new.multiplier(position)
    if math.isclose(was, now):
        return new, None
    return new, (f"schedule: train.steps {saved.total_steps} -> {new.total_steps}: the schedule of the new length puts "
                 f"step {position + 1} at {now:.3g}x the base learning rate, where the checkpoint's was at {was:.3g}x "
                 "(optim.extend_schedule = rewarm; --optim.extend_schedule hold keeps the rate it ended with)")


def _steps(steps: int | None, frac: float, total: int | None) -> int:
    """Explicit steps win; a fraction needs the run length and means nothing without it."""
    if steps is not None:
        return steps
    return 0 if total is None else round(frac * total)
