"""The toy optimizer's spec (tests/toy_optimizer.py), written as a new optimizer's spec module is:
torch-free, naming the class by import path, so that the configuration gate reads its ranges without
loading torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megacpp.optim.config import OptimConfig
from megacpp.optim.spec import OptimizerSpec
from megacpp.rules import UNIT

if TYPE_CHECKING:
    from megacpp.optim.route import Route


def _settings(cfg: OptimConfig) -> dict[str, Any]:
    return {"lr": cfg.sign_lr}


def _group_settings(route: Route, cfg: OptimConfig) -> dict[str, Any]:
    return {"lr": cfg.sign_lr}


def _state_bytes(route: Route, cfg: OptimConfig) -> int:
    return 0


# A step moves every entry by lr: beyond 1 it would outrun any weight's scale.
SIGN_SPEC = OptimizerSpec("tests.toy_optimizer:SignDescent", _settings, _group_settings, _state_bytes,
                          ranges={"sign_lr": UNIT})
