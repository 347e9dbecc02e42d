"""`OptimizerSpec`: what the optimizer stack needs to know to build one optimizer of it.

Each optimizer module defines its spec beside its class; `megacpp.optim.registry` lists them by name.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megacpp.optim.config import OptimConfig
from megacpp.optim.hparams import TensorHParamOptimizer
from megacpp.optim.route import Route
from megacpp.rules import Interval


@dataclass(frozen=True)
class OptimizerSpec:
    """How `build_optimizers` builds one optimizer from the routed parameters and the OptimConfig.

    The stack calls ``optimizer(param_groups, **settings(cfg), compile_step=..., compile_backend=...)``.
    Every parameter routed to it joins the param group of its ``group_settings(route, cfg)`` (the
    group's lr, weight decay, ...; it must give ``"lr"``, which a block kind's lr factor multiplies):
    routes with equal settings share a group, named after the route (``"<name>:<subgroup>"``, plus
    ``"@<kind>"`` for a block kind with an lr factor and ``":no_decay"`` for parameters never decayed).
    ``state_bytes`` is the optimizer state it keeps for one parameter, for the routing table.
    ``ranges`` are those of the OptimConfig fields that are this optimizer's own settings: the gate
    (megacpp.validate) holds every config to them, as it does a block's section to its ranges.
    """

    optimizer: type[TensorHParamOptimizer]
    settings: Callable[[OptimConfig], dict[str, Any]]
    group_settings: Callable[[Route, OptimConfig], dict[str, Any]]
    state_bytes: Callable[[Route, OptimConfig], int]
    ranges: Mapping[str, Interval] = field(default_factory=dict)
