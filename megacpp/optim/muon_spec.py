"""Muon's `OptimizerSpec`: its settings from the OptimConfig, its param groups, its state size and the
ranges of its own knobs. The optimizer itself is megacpp/optim/muon.py; this module is torch-free so
that the configuration gate reads the ranges without loading torch (`megacpp config`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megacpp.optim.config import OptimConfig
from megacpp.optim.spec import OptimizerSpec
from megacpp.rules import AT_LEAST_1, BELOW_1, NON_NEGATIVE

if TYPE_CHECKING:
    from megacpp.optim.route import Route


def second_moment_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Factored second moment of a matrix (..., A, B): per row (..., A, 1) when tall, else per column.
    Shape arithmetic only: the state size here and the optimizer's buffers (megacpp.optim.muon) read it."""
    *batch, rows, cols = shape
    return (*batch, rows, 1) if rows > cols else (*batch, 1, cols)


def _muon_settings(cfg: OptimConfig) -> dict[str, Any]:
    return dict(
        lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=cfg.nesterov,
        beta2=cfg.variance_beta2, variance_reduction=cfg.variance_reduction,
        cautious_weight_decay=cfg.cautious_weight_decay, coefficients=cfg.ns_coefficients, ns_steps=cfg.ns_steps,
        lr_scaling=cfg.muon_lr_scaling, momentum_dtype=cfg.momentum_dtype, gram_kernel=cfg.muon_gram_kernel,
    )


def _muon_group_settings(route: Route, cfg: OptimConfig) -> dict[str, Any]:
    """A Muon route's subgroup is its lr scaling mode, and each mode has its own base lr; fused QKV
    matrices of one split form groups of their own, and so do the routed experts under their own
    Newton-Schulz iterations (`expert_ns_steps`)."""
    scaling = route.subgroup
    lr = cfg.muon_lr if scaling == "original" else (cfg.adamw_lr if cfg.muon_rms_lr is None else cfg.muon_rms_lr)
    settings = {"lr": lr, "lr_scaling": scaling, "split_sizes": route.hint.qkv_split,
                "weight_decay": cfg.weight_decay if route.decayed else 0.0}
    if route.hint.routed_expert and cfg.expert_ns_steps is not None:
        settings["ns_steps"] = cfg.expert_ns_steps
    return settings


def _muon_state_bytes(route: Route, cfg: OptimConfig) -> int:
    p = route.param
    momentum = p.numel() * (2 if cfg.momentum_dtype == "bfloat16" else 4)
    factored = 4 * math.prod(second_moment_shape(p.shape)) if cfg.variance_reduction else 0
    return momentum + factored


MUON_SPEC = OptimizerSpec(
    "megacpp.optim.muon:Muon", _muon_settings, _muon_group_settings, _muon_state_bytes,
    ranges={"muon_lr": NON_NEGATIVE, "muon_rms_lr": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
            "muon_momentum": BELOW_1, "variance_beta2": BELOW_1, "ns_steps": AT_LEAST_1,
            "expert_ns_steps": AT_LEAST_1},
)
