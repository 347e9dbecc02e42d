"""`Route`: where one parameter goes: its optimizer's routing group, its hint and its lr factor.

Its own module so the optimizers' specs can describe routes without importing the routing rules
(megacpp.optim.groups), which read the registry of those very optimizers.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from megacpp.model.hints import ParamHint

NO_HINT = ParamHint()


@dataclass(eq=False)
class Route:
    name: str  # the model's own name, wrapper components removed
    param: nn.Parameter
    # "muon:<lr scaling>" | "adamw:embed" | "adamw:head" | "adamw:hidden" | "adamw:other" | "<name>:hinted"
    group: str
    hint: ParamHint = NO_HINT
    kind: str | None = None  # the block kind whose lr factor applies; None: lr_scale_by_kind names none
    lr_factor: float = 1.0  # multiplies the group's base lr (only where kind is set)

    @property
    def optimizer(self) -> str:
        return self.group.split(":", 1)[0]

    @property
    def subgroup(self) -> str:
        return self.group.split(":", 1)[1]

    @property
    def decayed(self) -> bool:
        """Norms, biases and scalars (< 2-D) are never weight-decayed; a hint may exempt others."""
        return not (self.hint.no_decay or self.param.ndim < 2)

    @property
    def scaled_group(self) -> str:
        """The route's group, with "@<kind>" when a kind's lr factor applies: a row of the routing table."""
        return self.group if self.kind is None else f"{self.group}@{self.kind}"

    @property
    def param_group(self) -> str:
        """The name of the param group the parameter joins: `scaled_group`, ":no_decay" when never decayed."""
        return self.scaled_group if self.decayed else f"{self.scaled_group}:no_decay"
