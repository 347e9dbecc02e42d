"""Optimizer stack: Muon (Polar Express, split-QKV, variance reduction, cautious decay), AdamW,
LR schedule, MuonClip, parameter routing, the optimizer registry. See docs/optim.md.

`from megacpp.optim import Muon` works as documented, but the names load on first use (PEP 562):
`megacpp.config` reads `OptimConfig` from this package and the gate the optimizers' specs, and reading
the configuration should not load torch with the optimizers. Code inside megacpp imports from the
submodules. The function `orthogonalize` is imported from its module (megacpp.optim.orthogonalize): once
loaded, the submodule of that name is what the package attribute holds.
"""
from __future__ import annotations

import importlib
from typing import Any

_SUBMODULE = {
    **dict.fromkeys(("AdamW",), "adamw"),
    **dict.fromkeys(("MuonClip", "find_attention_modules", "qk_clip_scales"), "clip"),
    **dict.fromkeys(("OptimConfig",), "config"),
    **dict.fromkeys(("format_routing_table", "route_parameters"), "groups"),
    **dict.fromkeys(("Muon", "lr_ratio", "torch_muon_compatible"), "muon"),
    **dict.fromkeys(("second_moment_shape",), "muon_spec"),
    **dict.fromkeys(("POLAR_EXPRESS", "QUINTIC"), "orthogonalize"),
    **dict.fromkeys(("OPTIMIZERS",), "registry"),
    **dict.fromkeys(("Route",), "route"),
    **dict.fromkeys(("LRScheduler", "WarmupStableDecay"), "schedule"),
    **dict.fromkeys(("OptimizerSpec",), "spec"),
    **dict.fromkeys(("OptimizerStack", "build_optimizers"), "stack"),
}
__all__ = sorted(_SUBMODULE)


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULE:
        raise AttributeError(f"module 'megacpp.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megacpp.optim.{_SUBMODULE[name]}"), name)
