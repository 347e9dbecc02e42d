"""What stops a run that has gone wrong: a non-finite loss (naming the sublayer), non-finite weights at
checkpoint time, and divergence without a NaN. Every rank reaches the same verdict: each guard reads
values that are already global (the reduced loss, the global gradient norm) or gathers its evidence."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from megacpp.distributed.context import DistContext
from megacpp.errors import MegacppError
from megacpp.optim.local import local_tensor


class TrainingFault(MegacppError, RuntimeError):
    """Training went wrong in a way that implicates the weights as of step ``suspect_step``: the loss or
    gradient that showed it was computed from them. A checkpoint of that step or later holds weights the
    run must not resume from (megacpp.train.lifecycle sets them aside)."""

    def __init__(self, message: str, suspect_step: int) -> None:
        super().__init__(message)
        self.suspect_step = suspect_step

    def with_note(self, note: str) -> TrainingFault:
        """The same error, its message followed by ``note`` (what was set aside, where to resume)."""
        return type(self)(f"{self}; {note}", self.suspect_step)


class NonFiniteLossError(TrainingFault):
    """Training produced a NaN or infinite loss."""


class NonFiniteWeightsError(MegacppError, RuntimeError):
    """A weight holds NaN or infinity at checkpoint time: the checkpoint is not written."""


class DivergenceError(TrainingFault):
    """Training diverged without a NaN (a loss far above chance, or no gradient at all)."""


# Divergence rule: at initialization the model predicts close to uniformly, a loss of ln(vocab_size)
# (plus the weighted MTP loss). A loss DIVERGED_FACTOR times that level for DIVERGED_STEPS consecutive
# steps means the model is much worse than knowing nothing: a learning rate or data problem that
# would otherwise burn the rest of the run. One spike does not stop it.
DIVERGED_FACTOR = 1.5
DIVERGED_STEPS = 3


def uniform_loss(model_cfg: Any) -> float:
    """The loss of predicting every token uniformly, as the model's loss counts it."""
    mtp_weight = model_cfg.mtp_loss_weight if model_cfg.mtp_depth > 0 else 0.0
    return math.log(model_cfg.vocab_size) * (1.0 + mtp_weight)


class DivergenceGuard:
    """Stops a run that diverged without a NaN (the rule is at DIVERGED_FACTOR). Both values it reads
    are global (the loss averaged over ranks, the norm of the sharded gradients): every rank agrees."""

    def __init__(self, model_cfg: Any) -> None:
        self.model_cfg = model_cfg
        self.high_loss_steps = 0  # consecutive steps above the divergence level

    def implicated_from(self, losses: list[float], step: int) -> int:
        """The first step whose weights are in doubt when those after `step` are: earlier steps whose loss
        (``losses[i]`` is step i + 1's, computed from the weights after step i) was already above the
        divergence level implicate theirs too."""
        level = DIVERGED_FACTOR * uniform_loss(self.model_cfg)
        while step >= 1 and losses[step - 1] > level:
            step -= 1
        return step

    def check(self, step: int, loss: float, grad_norm: float | None) -> None:
        if grad_norm == 0.0:
            raise DivergenceError(f"step {step}: the gradient norm is exactly 0: nothing is learning (a "
                                  "detached loss, or every target ignored); the run was stopped", step - 1)
        level = DIVERGED_FACTOR * uniform_loss(self.model_cfg)
        self.high_loss_steps = self.high_loss_steps + 1 if loss > level else 0
        if self.high_loss_steps >= DIVERGED_STEPS:
            raise DivergenceError(
                f"step {step}: loss {loss:.3f} above {level:.3f} ({DIVERGED_FACTOR} x the uniform-prediction "
                f"loss ln({self.model_cfg.vocab_size})) for {DIVERGED_STEPS} consecutive steps: training diverged; "
                "lower the learning rates", step - DIVERGED_STEPS)


def first_nonfinite_parameter(model: nn.Module) -> str | None:
    """The name of the first parameter whose local values (this rank's shard) are not all finite.
    One host sync for all parameters."""
    named = [(name, local_tensor(p)) for name, p in model.named_parameters()]
    if not named:
        return None
    with torch.no_grad():
        finite = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu()
    bad = (~finite).nonzero()
    return named[int(bad[0])][0] if len(bad) else None


def check_finite_weights(ctx: DistContext, model: nn.Module, step: int, out_dir: Path) -> None:
    """Never write a checkpoint of non-finite weights: it would replace good ones when pruning."""
    reports = ctx.all_gather_objects(first_nonfinite_parameter(model))
    bad = [(rank, name) for rank, name in enumerate(reports) if name is not None]
    if bad:
        rank, name = bad[0]
        where = f" (rank {rank})" if ctx.distributed else ""
        raise NonFiniteWeightsError(
            f"step {step}: parameter {name}{where} holds NaN or infinite values; the checkpoint was "
            f"not written and the previous ones under {out_dir / 'checkpoints'} are untouched")


def find_nonfinite_sublayer(model: nn.Module, x: Tensor, doc_ids: Tensor) -> str:
    """Re-run one batch eagerly through ``forward`` and name the first sublayer whose output is not
    finite. Forward hooks, not a hand-written walk: under FSDP2 every rank must run the same whole
    forward (each block gathers its weights collectively)."""
    outputs: list[tuple[str, bool]] = []

    def watch(label: str):
        def hook(_module: nn.Module, _args: Any, output: Tensor) -> None:
            outputs.append((label, bool(torch.isfinite(output).all())))
        return hook

    watched = [(m, "the embeddings") for m in (model.tok_embed, model.ngram_embed) if m is not None]
    watched += [(b, f"sublayer {i} ({b.kind}: {type(b.mixer).__name__})") for i, b in enumerate(model.blocks)]
    handles = [module.register_forward_hook(watch(label)) for module, label in watched]
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(x, doc_ids=doc_ids)
    finally:
        for handle in handles:
            handle.remove()
    return next((label for label, finite in outputs if not finite),
                "no sublayer in a re-run (the loss or backward overflowed)")


def stop_nonfinite_loss(ctx: DistContext, model: nn.Module, step: int, value: float, local: float,
                        last_batch: tuple[Tensor, Tensor]) -> None:
    """Raise NonFiniteLossError on every rank together (each saw the same reduced loss ``value``; ``local``
    is this rank's own), naming the first non-finite sublayer of each rank whose own loss was bad."""
    where = find_nonfinite_sublayer(model, *last_batch)  # every rank: collectives in lockstep
    reports = ctx.all_gather_objects((math.isfinite(local), where))
    if ctx.distributed:
        bad = [f"rank {r}: first non-finite output at {w}" for r, (ok, w) in enumerate(reports) if not ok]
        where = "; ".join(bad) or f"no rank's own loss (the reduction overflowed); {where}"
        detail = f"loss is {value} on rank(s) {', '.join(str(r) for r, (ok, _) in enumerate(reports) if not ok)}"
    else:
        detail, where = f"loss is {value}", f"first non-finite output at {where}"
    raise NonFiniteLossError(f"step {step}: {detail}; {where}", step - 1)
