"""Parameter routing (docs/architecture.md, "Parameter hints read by the optimizer") and the routing table.

The default routes are a table, `DEFAULT_ROUTES`, first match wins (hints are the modules'
``param_hints``, collected by name before any wrapping):
  0. hint optimizer naming another registered optimizer (megacpp.optim.registry) -> "<name>:hinted"
  1. hint optimizer "muon" (must be ndim >= 2), or unhinted ndim >= 2 under `blocks.<i>.mixer` or
     `blocks.<i>.engram` -> Muon, "muon:<lr scaling>" ("adamw:hidden" with use_muon off, and for the
     routed experts' weights, hinted routed_expert, with expert_optimizer "adamw")
  2. under `tok_embed` / `ngram_embed` -> AdamW "embed"
  3. under `lm_head` / `mtp` -> AdamW "head"
  4. hint optimizer "adamw", or ndim < 2 -> AdamW "other"
  5. anything else -> error naming the parameter
Muon groups are split by lr scaling mode (hint lr_scaling, else expert_lr_scaling for stacked
(E, A, B) weights, else muon_lr_scaling) because each mode has its own base lr.

`optim.lr_scale_by_kind` (megacpp.optim.kind_scales) then marks each parameter of a named kind's
blocks (``blocks.<i>.mixer.*`` and ``blocks.<i>.norm.*``, the block's ``kind`` attribute deciding) with
that kind and its factor: its param group becomes ``"<group>@<kind>"``, whose base lr is the factor
times the group's. Parameters of kinds not named, and every parameter when the setting is empty, keep
today's groups, so the default groups, numerics and checkpoints do not change.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from megacpp.model.hints import ParamHint, canonical_name, collect_param_hints
from megacpp.optim.config import LR_SCALINGS, OptimConfig
from megacpp.optim.kind_scales import parse_lr_scales
from megacpp.optim.registry import OPTIMIZERS
from megacpp.optim.route import NO_HINT, Route

_HIDDEN = re.compile(r"blocks\.\d+\.(mixer|engram)\.")
_BLOCK = re.compile(r"blocks\.\d+")
_BLOCK_OWN = re.compile(r"(blocks\.\d+)\.(mixer|norm)\.")  # a block's own parameters (not its Engram branch)
_EMBED = ("tok_embed", "ngram_embed")
_HEAD = ("lm_head", "mtp")


@dataclass(frozen=True)
class DefaultRoute:
    """A row of the default routing: the parameters ``matches(name, param, hint)`` takes go to ``group``,
    a group name, or a function of (name, param, hint, cfg) giving one."""

    matches: Callable[[str, nn.Parameter, ParamHint], bool]
    group: str | Callable[[str, nn.Parameter, ParamHint, OptimConfig], str]


def _is_hidden_matrix(name: str, param: nn.Parameter, hint: ParamHint) -> bool:
    """Hinted "muon", or unhinted, >= 2-D and under a block's mixer or Engram branch."""
    hidden = hint.optimizer is None and param.ndim >= 2 and _HIDDEN.match(name) is not None
    return hint.optimizer == "muon" or hidden


def _muon_group(name: str, param: nn.Parameter, hint: ParamHint, cfg: OptimConfig) -> str:
    """Muon's group is its lr scaling mode (hint, else expert_lr_scaling for stacked (E, A, B) weights, else
    muon_lr_scaling): each mode has its own base lr. use_muon=False sends hidden matrices to AdamW, and
    expert_optimizer="adamw" the routed experts' weights."""
    if not cfg.use_muon or (hint.routed_expert and not cfg.experts_on_muon):
        return "adamw:hidden"
    mode = hint.lr_scaling or (cfg.expert_lr_scaling if param.ndim >= 3 else cfg.muon_lr_scaling)
    if mode not in LR_SCALINGS:
        raise ValueError(f"parameter {name!r}: lr_scaling={mode!r}, expected one of {LR_SCALINGS}")
    return f"muon:{mode}"


def _top(name: str) -> str:
    return name.split(".", 1)[0]


# First match wins (the module docstring numbers the rows).
DEFAULT_ROUTES: tuple[DefaultRoute, ...] = (
    DefaultRoute(lambda name, param, hint: hint.optimizer not in (None, "muon", "adamw"),
                 lambda name, param, hint, cfg: f"{hint.optimizer}:hinted"),
    DefaultRoute(_is_hidden_matrix, _muon_group),
    DefaultRoute(lambda name, param, hint: _top(name) in _EMBED, "adamw:embed"),
    DefaultRoute(lambda name, param, hint: _top(name) in _HEAD, "adamw:head"),
    DefaultRoute(lambda name, param, hint: hint.optimizer == "adamw" or param.ndim < 2, "adamw:other"),
)


def route_parameter(name: str, param: nn.Parameter, cfg: OptimConfig, hint: ParamHint = NO_HINT) -> str:
    """The group of one parameter: the first of `DEFAULT_ROUTES` that matches it. ValueError naming the
    parameter for a hint no optimizer can follow, or when no route matches."""
    if hint.optimizer is not None and hint.optimizer not in OPTIMIZERS:
        raise ValueError(f"parameter {name!r}: hint optimizer={hint.optimizer!r}, expected one of the registered "
                         f"optimizers {tuple(OPTIMIZERS)}")
    if hint.optimizer == "muon" and param.ndim < 2:
        raise ValueError(f"parameter {name!r} is hinted optimizer='muon' but is {param.ndim}-D")
    for route in DEFAULT_ROUTES:
        if route.matches(name, param, hint):
            return route.group if isinstance(route.group, str) else route.group(name, param, hint, cfg)
    raise ValueError(
        f"parameter {name!r} (shape {tuple(param.shape)}) fits no routing rule: a >= 2-D parameter outside "
        "blocks.<i>.mixer / blocks.<i>.engram / tok_embed / ngram_embed / lm_head / mtp needs a "
        "ParamHint(optimizer=...) in its module's param_hints"
    )


def route_parameters(model: nn.Module, cfg: OptimConfig, hints: Mapping[str, ParamHint] | None = None
                     ) -> list[Route]:
    """Route every trainable parameter of `model` (each exactly once; shared parameters count once).

    ``hints`` (fully qualified name -> hint) should be collected before the model is wrapped or sharded;
    by default they are collected from `model` now.
    """
    hints = collect_param_hints(model) if hints is None else hints
    scales = parse_lr_scales(cfg.lr_scale_by_kind)
    kinds = _scaled_block_kinds(model, scales)
    routes = []
    for raw_name, param in model.named_parameters():
        if param.requires_grad:
            name = canonical_name(raw_name)
            hint = hints.get(name, NO_HINT)
            own = _BLOCK_OWN.match(name)
            kind = kinds.get(own.group(1)) if own else None
            routes.append(Route(name, param, route_parameter(name, param, cfg, hint), hint, kind,
                                scales[kind] if kind is not None else 1.0))
    return routes


def _scaled_block_kinds(model: nn.Module, scales: Mapping[str, float]) -> dict[str, str]:
    """``{"blocks.<i>": kind}`` for the blocks whose kind has an lr factor, read from each block's ``kind``
    attribute (module attributes survive FSDP2 and compile wrappers; the names are canonical). A factor
    for a kind the model has no block of would change nothing: an error."""
    if not scales:
        return {}
    kinds = {}
    for raw_name, module in model.named_modules():
        name, kind = canonical_name(raw_name), getattr(module, "kind", None)
        if _BLOCK.fullmatch(name) and isinstance(kind, str):
            kinds[name] = kind
    absent = [kind for kind in scales if kind not in kinds.values()]
    if absent:
        raise ValueError(f"lr_scale_by_kind names block kind(s) {', '.join(absent)}, but the model's blocks are "
                         f"{''.join(dict.fromkeys(kinds.values())) or 'none'}: a factor there would change nothing")
    return {name: kind for name, kind in kinds.items() if kind in scales}


def format_routing_table(routes: list[Route], cfg: OptimConfig) -> str:
    rows: dict[str, list[int]] = {}
    for r in routes:
        row = rows.setdefault(r.scaled_group, [0, 0, 0])
        row[0] += 1
        row[1] += r.param.numel()
        row[2] += OPTIMIZERS[r.optimizer].state_bytes(r, cfg)
    total = [sum(col) for col in zip(*rows.values(), strict=True)] if rows else [0, 0, 0]
    lines = [f"{'group':<24}{'tensors':>8}{'params':>14}{'state bytes':>14}"]
    for group in sorted(rows):
        count, numel, nbytes = rows[group]
        lines.append(f"{group:<24}{count:>8}{numel:>14,}{nbytes:>14,}")
    lines.append(f"{'total':<24}{total[0]:>8}{total[1]:>14,}{total[2]:>14,}")
    factors = {r.kind: r.lr_factor for r in routes if r.kind is not None}
    if factors:
        shown = ", ".join(f"@{kind} x {factor:g}" for kind, factor in sorted(factors.items()))
        lines.append(f"lr_scale_by_kind: {shown} (the base lr of each @<kind> group)")
    if cfg.expert_ns_steps is not None and any(r.hint.routed_expert and r.optimizer == "muon" for r in routes):
        lines.append(f"expert_ns_steps: {cfg.expert_ns_steps} Newton-Schulz iterations for the routed experts, "
                     f"{cfg.ns_steps} for the other Muon matrices")
    return "\n".join(lines)


def optimizer_state_bytes(model: nn.Module, cfg: OptimConfig, hints: Mapping[str, ParamHint] | None = None) -> int:
    """The optimizer state of the whole model as routed, in bytes (what its optimizers keep per parameter)."""
    return sum(OPTIMIZERS[r.optimizer].state_bytes(r, cfg) for r in route_parameters(model, cfg, hints))
