"""`OptimizerSpec`: what the optimizer stack needs to know to build one optimizer of it.

Each optimizer's spec is its own torch-free module beside the optimizer's (``muon_spec.py`` beside
``muon.py``), naming the class by import path: the configuration gate reads the specs' ranges through
`megacpp.optim.registry`, and reading a configuration (`megacpp config`) loads no torch.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megacpp.optim.config import OptimConfig
from megacpp.rules import Interval

if TYPE_CHECKING:
    from megacpp.optim.hparams import TensorHParamOptimizer
    from megacpp.optim.route import Route


@dataclass(frozen=True)
class OptimizerSpec:
    """How `build_optimizers` builds one optimizer from the routed parameters and the OptimConfig.

    The stack calls ``optimizer(param_groups, **settings(cfg), compile_step=..., compile_backend=...)``,
    the class ``optimizer_path`` names (``"module:Class"``, imported on first use).
    Every parameter routed to it joins the param group of its ``group_settings(route, cfg)`` (the
    group's lr, weight decay, ...; it must give ``"lr"``, which a block kind's lr factor multiplies):
    routes with equal settings share a group, named after the route (``"<name>:<subgroup>"``, plus
    ``"@<kind>"`` for a block kind with an lr factor and ``":no_decay"`` for parameters never decayed).
    ``state_bytes`` is the optimizer state it keeps for one parameter, for the routing table.
    ``ranges`` are those of the OptimConfig fields that are this optimizer's own settings: the gate
    (megacpp.validate) holds every config to them, as it does a block's section to its ranges.
    ``compiled_by_auto``: whether ``optim.compile_step = "auto"`` compiles its step on CUDA (an optimizer
    whose eager step is already one fused kernel has nothing to win there but the compile's time).
    """

    optimizer_path: str
    settings: Callable[[OptimConfig], dict[str, Any]]
    group_settings: Callable[[Route, OptimConfig], dict[str, Any]]
    state_bytes: Callable[[Route, OptimConfig], int]
    ranges: Mapping[str, Interval] = field(default_factory=dict)
    compiled_by_auto: bool = True

    @property
    def optimizer(self) -> type[TensorHParamOptimizer]:
        module, _, name = self.optimizer_path.partition(":")
        return getattr(importlib.import_module(module), name)
