"""OptimizerStack: Muon + AdamW + LR schedule + MuonClip, stepped in the one fixed order.

step(): grad-norm clip -> optimizer steps -> MuonClip -> LR scheduler. MuonClip must see the weights
the optimizer just wrote and the bounds of the forward that produced this step's gradients; the
scheduler moves last so the step that just ran used the lr of its own position.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from megacpp.optim.adamw import AdamW
from megacpp.optim.clip import MuonClip
from megacpp.optim.config import OptimConfig
from megacpp.optim.groups import Route, format_routing_table, route_parameters
from megacpp.optim.hparams import TensorHParamOptimizer
from megacpp.optim.muon import Muon
from megacpp.optim.schedule import LRScheduler, WarmupStableDecay


class OptimizerStack:
    def __init__(
        self,
        muon: Muon | None,
        adamw: AdamW | None,
        scheduler: LRScheduler,
        clip: MuonClip | None = None,
        grad_clip_norm: float = 0.0,
        routing_table: str = "",
    ) -> None:
        self.muon = muon
        self.adamw = adamw
        self.scheduler = scheduler
        self.clip = clip
        self.grad_clip_norm = grad_clip_norm
        self.routing_table = routing_table
        self.metrics: dict[str, Tensor | float] = {}

    @property
    def optimizers(self) -> list[TensorHParamOptimizer]:
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    def parameters(self) -> list[Tensor]:
        return [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]

    def step(self) -> None:
        """The one place that fixes the order: optimizer steps, then MuonClip, then the scheduler."""
        metrics: dict[str, Tensor | float] = {"lr_multiplier": self.scheduler.multiplier}
        if self.grad_clip_norm > 0:
            # foreach norm + clamp on the device; no host sync (error_if_nonfinite stays off).
            with_grad = [p for p in self.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(with_grad, self.grad_clip_norm, foreach=True)
            metrics["grad_norm"] = norm
        for opt in self.optimizers:
            opt.step()
        if self.clip is not None:
            metrics.update(self.clip.apply())
        self.scheduler.step()
        self.metrics = metrics

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {
            "muon": self.muon.state_dict() if self.muon is not None else None,
            "adamw": self.adamw.state_dict() if self.adamw is not None else None,
            "scheduler": self.scheduler.state_dict(),
            "clip": self.clip.state_dict() if self.clip is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("muon", "adamw", "clip"):
            part = getattr(self, name)
            if (part is None) != (state[name] is None):
                raise ValueError(f"checkpoint and stack disagree on whether there is a {name!r} part")
            if part is not None:
                part.load_state_dict(state[name])
        # Last: it rewrites the lr tensors that the optimizers' load just restored.
        self.scheduler.load_state_dict(state["scheduler"])


def build_optimizers(
    model: nn.Module,
    cfg: OptimConfig,
    total_steps: int | None = None,
    log: Callable[[str], None] | None = print,
) -> OptimizerStack:
    """Route `model`'s parameters (megacpp.optim.groups) and build the stack; logs the routing table.

    total_steps sizes the *_frac schedule phases; without it only warmup_steps/decay_steps apply
    (a decay phase then needs total_steps and raises).
    """
    routes = route_parameters(model, cfg)
    by_group: dict[str, list[Route]] = {}
    for r in routes:
        by_group.setdefault(r.group, []).append(r)

    muon_groups, adamw_groups = [], []
    for name, rs in by_group.items():
        params = [r.param for r in rs]
        kind, sub = name.split(":", 1)
        if kind == "muon":
            lr = cfg.muon_lr if sub == "original" else _or(cfg.muon_rms_lr, cfg.adamw_lr)
            muon_groups.append({"params": params, "lr": lr, "lr_scaling": sub, "name": name})
        else:
            lr = {"embed": cfg.embed_lr, "head": cfg.head_lr}.get(sub)
            lr = _or(lr, cfg.adamw_lr)
            adamw_groups.append({"params": params, "lr": lr, "name": name})

    muon = Muon(
        muon_groups, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
        nesterov=cfg.nesterov, beta2=cfg.variance_beta2, variance_reduction=cfg.variance_reduction,
        cautious_weight_decay=cfg.cautious_weight_decay, coefficients=cfg.ns_coefficients,
        ns_steps=cfg.ns_steps, lr_scaling=cfg.muon_lr_scaling, momentum_dtype=cfg.momentum_dtype,
        compile_step=cfg.compile_step, compile_backend=cfg.compile_backend,
    ) if muon_groups else None
    adamw = AdamW(
        adamw_groups, lr=cfg.adamw_lr, betas=(cfg.adamw_beta1, cfg.adamw_beta2), eps=cfg.adamw_eps,
        weight_decay=cfg.adamw_weight_decay,
        compile_step=cfg.compile_step, compile_backend=cfg.compile_backend,
    ) if adamw_groups else None
    optimizers = [opt for opt in (muon, adamw) if opt is not None]
    scheduler = LRScheduler(optimizers, WarmupStableDecay.from_config(cfg, total_steps))

    clip = MuonClip.for_model(model)
    table = format_routing_table(routes, cfg)
    if log is not None:
        log(table)
    return OptimizerStack(muon, adamw, scheduler, clip, cfg.grad_clip_norm, table)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
