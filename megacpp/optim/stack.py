"""OptimizerStack: the registered optimizers + LR schedule + MuonClip, stepped in the one fixed order.

step(): grad-norm clip coefficient (applied by each optimizer as it reads the gradients, which stay
as the backward left them) -> optimizer steps (in registry order: Muon, then AdamW) -> MuonClip -> spectral
cap -> LR scheduler. MuonClip and the spectral cap (megacpp.optim.spectral_cap) must see the weights the
optimizers just wrote (MuonClip also the bounds of the forward that produced this step's gradients); the
scheduler moves last so the step that just ran used the lr of its own position.

The stack holds a named list of optimizers built from megacpp.optim.registry: each routed parameter
goes to the optimizer its route names, and an optimizer no parameter is routed to is not built.
Checkpoints hold the stack in two parts: `state_dict()` (which optimizers, schedule position, clip
metrics: small and the same on every rank) and `moments()` (every per-parameter tensor, keyed by
optimizer and parameter name, in the parameters' own layout), which a distributed checkpoint can
reshard to another number of ranks.

A stack may step only some of the routed parameters (``owns`` in `build_optimizers`: replicate data
parallelism, where each rank steps the parameters it owns): its optimizers then hold those alone, the
clip norm still covers every routed parameter's (already reduced) gradient, `zero_grad` clears every
routed parameter's gradient, and ``after_optimizers``
(the owners' all-gather) runs between the optimizer steps and MuonClip, so the clips see whole weights.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from megacpp.model.hints import ParamHint
from megacpp.optim.clip import MuonClip
from megacpp.optim.config import OptimConfig
from megacpp.optim.groups import format_routing_table, route_parameters
from megacpp.optim.hparams import StepCall, TensorHParamOptimizer
from megacpp.optim.local import full_value
from megacpp.optim.registry import OPTIMIZERS
from megacpp.optim.route import Route
from megacpp.optim.schedule import LRScheduler, WarmupStableDecay
from megacpp.optim.spectral_cap import SpectralCap


class OptimizerStack:
    def __init__(
        self,
        optimizers: Mapping[str, TensorHParamOptimizer],
        scheduler: LRScheduler,
        clip: MuonClip | None = None,
        grad_clip_norm: float = 0.0,
        routing_table: str = "",
        names: Mapping[Tensor, str] | None = None,
        spectral_cap: SpectralCap | None = None,
        *,
        parts: list[str] | None = None,
        routed: list[Tensor] | None = None,
        after_optimizers: Callable[[], None] | None = None,
        grad_norm: Callable[[list[Tensor]], Tensor] | None = None,
    ) -> None:
        self.by_name = dict(optimizers)  # registry name -> optimizer, in step order (those built here)
        self.parts = list(parts if parts is not None else self.by_name)  # every optimizer of the run
        # Every routed parameter, in the order a stack over all of them steps them: the clip norm covers
        # their gradients and zero_grad clears them. None: this stack's own parameters.
        self.routed = routed
        self.after_optimizers = after_optimizers
        # The global norm of the routed gradients, where each rank's plain norm is not it (expert
        # parallelism: each rank holds other experts' gradients).
        self.grad_norm = grad_norm
        self.scheduler = scheduler
        self.clip = clip
        self.spectral_cap = spectral_cap
        self.grad_clip_norm = grad_clip_norm
        self.routing_table = routing_table
        self.names = dict(names or {})  # parameter -> its model name, the key of its moments
        self.metrics: dict[str, Tensor | float] = {}

    @property
    def optimizers(self) -> list[TensorHParamOptimizer]:
        return list(self.by_name.values())

    def parameters(self) -> list[Tensor]:
        return [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]

    def describe_steps(self) -> str:
        """How each optimizer steps, for the run header: "optimizer steps: muon compiled, adamw eager"."""
        steps = [f"{name} {'compiled' if opt.compile_step else 'eager'}" for name, opt in self.by_name.items()]
        return f"optimizer steps: {', '.join(steps) or 'none on this rank'}"

    def step(self) -> None:
        """The one place that fixes the order: optimizer steps, MuonClip, the spectral cap, the scheduler."""
        metrics: dict[str, Tensor | float] = {"lr_multiplier": self.scheduler.multiplier}
        scale = None
        if self.grad_clip_norm > 0:
            # foreach norm + clamp on the device; no host sync (error_if_nonfinite stays off). Sharded
            # gradients give the global norm (a replicated DTensor): every rank clips alike.
            grads = [p.grad for p in self._routed() if p.grad is not None]
            norm = (self.grad_norm(grads) if self.grad_norm is not None
                    else full_value(torch.nn.utils.get_total_norm(grads, foreach=True)))
            metrics["grad_norm"] = norm
            # torch's clip_grad_norm_ coefficient, but the gradients are not rewritten: each optimizer
            # multiplies them by it as its step reads them, which a compiled step fuses into the pass it
            # makes anyway (the separate in-place multiply was 0.8 ms of `small`'s step on an H200).
            scale = torch.clamp(self.grad_clip_norm / (norm + 1e-6), max=1.0)
        for opt in self.optimizers:
            opt.grad_scale = scale
            opt.step()
            opt.grad_scale = None
        if self.after_optimizers is not None:
            self.after_optimizers()
        if self.clip is not None:
            metrics.update(self.clip.apply())
        if self.spectral_cap is not None:
            metrics.update(self.spectral_cap.apply())
        self.scheduler.step()
        self.metrics = metrics

    def first_step_calls(self) -> dict[str, list[StepCall]]:
        """The compiled calls of the next step by optimizer (`first_step_calls` of each that makes any),
        with the clip coefficient's stand-in where the step will pass one: what helper processes can
        compile while the model compiles (megacpp.train.step_prewarm)."""
        scale = torch.empty((), device="meta") if self.grad_clip_norm > 0 else None
        calls = {}
        for name, opt in self.by_name.items():
            opt.grad_scale = scale
            try:
                made = opt.first_step_calls()
            finally:
                opt.grad_scale = None
            if made:
                calls[name] = made
        return calls

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every routed parameter, those stepped by another rank's stack too."""
        if self.routed is None:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=set_to_none)
            return
        for p in self.routed:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _routed(self) -> list[Tensor]:
        return self.routed if self.routed is not None else self.parameters()

    def moments(self) -> dict[str, Tensor]:
        """Every per-parameter state tensor as ``"<optimizer>/<parameter name>/<key>"``, created (zeros)
        where no step has made it yet, so a freshly built stack is a complete load target. The values
        are the live state tensors: loading into them in place restores the optimizers."""
        out: dict[str, Tensor] = {}
        for kind, opt in self.by_name.items():
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in opt.init_state(p, group).items():
                        out[f"{kind}/{self.names[p]}/{key}"] = value
        return out

    def state_dict(self) -> dict[str, Any]:
        """Which optimizers, schedule position and clip metrics; the per-parameter state is `moments()`."""
        return {
            "parts": list(self.parts),
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


def read_after_step(model: nn.Module) -> set[nn.Parameter]:
    """The parameters `OptimizerStack.step` reads again after the optimizers stepped: the attention
    weights MuonClip may rescale (the modules following its contract, which only attention with QK-clip on
    does) and every parameter with a spectral cap. Under replicate they must be whole by then
    (megacpp.distributed.replicate.OwnedUpdates)."""
    from megacpp.model.hints import canonical_name, collect_param_hints
    from megacpp.optim.clip import find_attention_modules

    found = {p for module in find_attention_modules(model) for p in module.qkv.parameters()}
    capped = {name for name, hint in collect_param_hints(model).items() if hint.max_spectral_norm is not None}
    found.update(p for name, p in model.named_parameters() if canonical_name(name) in capped)
    return found


def build_optimizers(
    model: nn.Module,
    cfg: OptimConfig,
    total_steps: int | None = None,
    log: Callable[[str], None] | None = print,
    *,
    hints: Mapping[str, ParamHint] | None = None,
    classes: Mapping[str, type[TensorHParamOptimizer]] | None = None,
    model_compiled: bool = True,
    owns: Callable[[Tensor], bool] | None = None,
    after_optimizers: Callable[[], None] | None = None,
    grad_norm: Callable[[list[Tensor]], Tensor] | None = None,
) -> OptimizerStack:
    """Route `model`'s parameters (megacpp.optim.groups), build each registered optimizer that got
    parameters (megacpp.optim.registry) and the stack; logs the routing table.

    total_steps sizes the *_frac schedule phases; without it only warmup_steps/decay_steps apply
    (a decay phase then needs total_steps and raises). ``hints`` are the modules' parameter hints,
    collected before any wrapping (default: collected now). ``classes`` builds another class in place
    of a registered one, with the same arguments (under FSDP2: ``{"muon": ShardedMuon}``).
    ``model_compiled=False`` (compile mode none) keeps an "auto" ``compile_step`` eager: nothing of such
    a run is compiled. ``owns`` (replicate data parallelism) limits the optimizers to the parameters it
    accepts; ``after_optimizers`` runs after their steps (see the module docstring); ``grad_norm`` gives the
    global gradient norm where each rank's plain one is not it (expert parallelism).
    """
    classes = dict(classes or {})
    unknown = sorted(set(classes) - set(OPTIMIZERS))
    if unknown:
        raise ValueError(f"classes given for {unknown}, which are not registered optimizers {tuple(OPTIMIZERS)}")
    routes = route_parameters(model, cfg, hints)
    device = next(model.parameters()).device
    optimizers = {}
    all_groups = _param_groups(routes, cfg)
    for kind, groups in all_groups.items():
        if owns is not None:
            groups = [g for g in ({**g, "params": [p for p in g["params"] if owns(p)]} for g in groups) if g["params"]]
            if not groups:  # nothing of this optimizer is this rank's to step
                continue
        spec = OPTIMIZERS[kind]
        compile_step = resolve_compile_step(cfg.compile_step, device, model_compiled, spec.compiled_by_auto)
        optimizers[kind] = classes.get(kind, spec.optimizer)(groups, **spec.settings(cfg), compile_step=compile_step,
                                                             compile_backend=cfg.compile_backend)
    scheduler = LRScheduler(list(optimizers.values()), WarmupStableDecay.from_config(cfg, total_steps))

    clip = MuonClip.for_model(model)
    table = format_routing_table(routes, cfg)
    if log is not None:
        log(table)
    return OptimizerStack(optimizers, scheduler, clip, cfg.grad_clip_norm, table,
                          names={r.param: r.name for r in routes}, spectral_cap=SpectralCap.for_routes(routes),
                          parts=list(all_groups), routed=_every_param(all_groups) if owns else None,
                          after_optimizers=after_optimizers, grad_norm=grad_norm)


def _every_param(groups_by_kind: dict[str, list[dict[str, Any]]]) -> list[Tensor]:
    """Every routed parameter in the order a stack over all of them steps (and sums their norms) in."""
    return [p for groups in groups_by_kind.values() for group in groups for p in group["params"]]


def _param_groups(routes: list[Route], cfg: OptimConfig) -> dict[str, list[dict[str, Any]]]:
    """Param groups per optimizer, in registry order (optimizers without parameters left out). A group
    holds the routes of one name with equal settings, in model order. A route of a block kind with an
    lr factor (lr_scale_by_kind) gets its group's lr times that factor, in a group of its own."""
    by_kind: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {kind: {} for kind in OPTIMIZERS}
    for r in routes:
        settings = OPTIMIZERS[r.optimizer].group_settings(r, cfg)
        if r.kind is not None:
            settings["lr"] = settings["lr"] * r.lr_factor
        name = r.param_group
        group = by_kind[r.optimizer].setdefault((name, *settings.items()),
                                                {"params": [], **settings, "name": name})
        group["params"].append(r.param)
    return {kind: list(groups.values()) for kind, groups in by_kind.items() if groups}


def resolve_compile_step(setting: bool | str, device: torch.device, model_compiled: bool = True,
                         compiled_by_auto: bool = True) -> bool:
    """`OptimConfig.compile_step` for one optimizer's parameters on `device`: "auto" compiles on CUDA, where
    one fused graph replaces hundreds of launches and passes over memory (the eager step is memory-bound),
    unless the model itself runs uncompiled or the optimizer's spec says its eager step is already fused
    (``compiled_by_auto`` false: AdamW); it stays eager elsewhere (on a CPU the compile costs more than it
    saves, and the eager step is the reference). True and False are obeyed as given."""
    if setting == "auto":
        return device.type == "cuda" and model_compiled and compiled_by_auto
    return bool(setting)
