"""OptimizerStack: Muon + AdamW + LR schedule + MuonClip, stepped in the one fixed order.

step(): grad-norm clip -> optimizer steps -> MuonClip -> LR scheduler. MuonClip must see the weights
the optimizer just wrote and the bounds of the forward that produced this step's gradients; the
scheduler moves last so the step that just ran used the lr of its own position.

Checkpoints hold the stack in two parts: `state_dict()` (schedule position, clip metrics: small and
the same on every rank) and `moments()` (every per-parameter tensor, keyed by parameter name, in the
parameters' own layout), which a distributed checkpoint can reshard to another number of ranks.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from megacpp.model.hints import ParamHint
from megacpp.optim.adamw import AdamW
from megacpp.optim.clip import MuonClip
from megacpp.optim.config import OptimConfig
from megacpp.optim.groups import format_routing_table, route_parameters
from megacpp.optim.hparams import TensorHParamOptimizer
from megacpp.optim.local import full_value
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
        names: Mapping[Tensor, str] | None = None,
    ) -> None:
        self.muon = muon
        self.adamw = adamw
        self.scheduler = scheduler
        self.clip = clip
        self.grad_clip_norm = grad_clip_norm
        self.routing_table = routing_table
        self.names = dict(names or {})  # parameter -> its model name, the key of its moments
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
            # Sharded gradients give the global norm (a replicated DTensor): every rank clips alike.
            norm = torch.nn.utils.clip_grad_norm_(with_grad, self.grad_clip_norm, foreach=True)
            metrics["grad_norm"] = full_value(norm)
        for opt in self.optimizers:
            opt.step()
        if self.clip is not None:
            metrics.update(self.clip.apply())
        self.scheduler.step()
        self.metrics = metrics

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def moments(self) -> dict[str, Tensor]:
        """Every per-parameter state tensor as ``"<optimizer>/<parameter name>/<key>"``, created (zeros)
        where no step has made it yet, so a freshly built stack is a complete load target. The values
        are the live state tensors: loading into them in place restores the optimizers."""
        out: dict[str, Tensor] = {}
        for kind, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if opt is None:
                continue
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in opt.init_state(p, group).items():
                        out[f"{kind}/{self.names[p]}/{key}"] = value
        return out

    def state_dict(self) -> dict[str, Any]:
        """Schedule position and clip metrics; the per-parameter state is `moments()`."""
        return {
            "parts": [kind for kind in ("muon", "adamw") if getattr(self, kind) is not None],
            "scheduler": self.scheduler.state_dict(),
            "clip": self.clip.state_dict() if self.clip is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        if state["parts"] != mine["parts"] or (state["clip"] is None) != (self.clip is None):
            raise ValueError(f"checkpoint has optimizers {state['parts']} (clip: {state['clip'] is not None}), "
                             f"this run {mine['parts']} (clip: {self.clip is not None})")
        if self.clip is not None:
            self.clip.load_state_dict(state["clip"])
        self.scheduler.load_state_dict(state["scheduler"])


def build_optimizers(
    model: nn.Module,
    cfg: OptimConfig,
    total_steps: int | None = None,
    log: Callable[[str], None] | None = print,
    *,
    hints: Mapping[str, ParamHint] | None = None,
    make_muon: Callable[..., Muon] = Muon,
    model_compiled: bool = True,
) -> OptimizerStack:
    """Route `model`'s parameters (megacpp.optim.groups) and build the stack; logs the routing table.

    total_steps sizes the *_frac schedule phases; without it only warmup_steps/decay_steps apply
    (a decay phase then needs total_steps and raises). ``hints`` are the modules' parameter hints,
    collected before any wrapping (default: collected now). ``make_muon`` builds the Muon part (the
    sharded variant under FSDP2). ``model_compiled=False`` (compile mode none) keeps an "auto"
    ``compile_step`` eager: nothing of such a run is compiled.
    """
    routes = route_parameters(model, cfg, hints)
    compile_step = resolve_compile_step(cfg.compile_step, next(model.parameters()).device, model_compiled)
    muon_groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    adamw_groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in routes:
        kind, sub = r.group.split(":", 1)
        # Norms, biases and scalars are never decayed; hints may exempt others.
        decay = not (r.hint.no_decay or r.param.ndim < 2)
        if kind == "muon":
            key = (r.group, decay, r.hint.qkv_split)
            lr = cfg.muon_lr if sub == "original" else _or(cfg.muon_rms_lr, cfg.adamw_lr)
            group = muon_groups.setdefault(key, {
                "params": [], "lr": lr, "lr_scaling": sub, "split_sizes": r.hint.qkv_split,
                "weight_decay": cfg.weight_decay if decay else 0.0, "name": _group_name(r.group, decay)})
        else:
            key = (r.group, decay)
            lr = _or({"embed": cfg.embed_lr, "head": cfg.head_lr}.get(sub), cfg.adamw_lr)
            group = adamw_groups.setdefault(key, {
                "params": [], "lr": lr, "weight_decay": cfg.adamw_weight_decay if decay else 0.0,
                "name": _group_name(r.group, decay)})
        group["params"].append(r.param)

    muon = make_muon(
        list(muon_groups.values()), lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
        nesterov=cfg.nesterov, beta2=cfg.variance_beta2, variance_reduction=cfg.variance_reduction,
        cautious_weight_decay=cfg.cautious_weight_decay, coefficients=cfg.ns_coefficients,
        ns_steps=cfg.ns_steps, lr_scaling=cfg.muon_lr_scaling, momentum_dtype=cfg.momentum_dtype,
        compile_step=compile_step, compile_backend=cfg.compile_backend,
    ) if muon_groups else None
    adamw = AdamW(
        list(adamw_groups.values()), lr=cfg.adamw_lr, betas=(cfg.adamw_beta1, cfg.adamw_beta2), eps=cfg.adamw_eps,
        weight_decay=cfg.adamw_weight_decay,
        compile_step=compile_step, compile_backend=cfg.compile_backend,
    ) if adamw_groups else None
    optimizers = [opt for opt in (muon, adamw) if opt is not None]
    scheduler = LRScheduler(optimizers, WarmupStableDecay.from_config(cfg, total_steps))

    clip = MuonClip.for_model(model)
    table = format_routing_table(routes, cfg)
    if log is not None:
        log(table)
    return OptimizerStack(muon, adamw, scheduler, clip, cfg.grad_clip_norm, table,
                          names={r.param: r.name for r in routes})


def resolve_compile_step(setting: bool | str, device: torch.device, model_compiled: bool = True) -> bool:
    """`OptimConfig.compile_step` for parameters on `device`: "auto" compiles on CUDA, where one fused
    graph replaces hundreds of launches and passes over memory (the eager step is memory-bound), unless
    the model itself runs uncompiled; it stays eager elsewhere (on a CPU the compile costs more than it
    saves, and the eager step is the reference). True and False are obeyed as given."""
    if setting == "auto":
        return device.type == "cuda" and model_compiled
    return bool(setting)


def _group_name(route_group: str, decay: bool) -> str:
    return route_group if decay else f"{route_group}:no_decay"


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
