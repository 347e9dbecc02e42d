"""Optimizer stack: Muon (Polar Express, split-QKV, variance reduction, cautious decay), AdamW,
LR schedule, MuonClip, parameter routing, the optimizer registry. See docs/optim.md."""
from megacpp.optim.adamw import AdamW
from megacpp.optim.clip import MuonClip, find_attention_modules, qk_clip_scales
from megacpp.optim.config import OptimConfig
from megacpp.optim.groups import format_routing_table, route_parameters
from megacpp.optim.muon import Muon, lr_ratio, second_moment_shape, torch_muon_compatible
from megacpp.optim.orthogonalize import POLAR_EXPRESS, QUINTIC, orthogonalize
from megacpp.optim.registry import OPTIMIZERS
from megacpp.optim.route import Route
from megacpp.optim.schedule import LRScheduler, WarmupStableDecay
from megacpp.optim.spec import OptimizerSpec
from megacpp.optim.stack import OptimizerStack, build_optimizers

__all__ = [
    "OPTIMIZERS",
    "POLAR_EXPRESS",
    "QUINTIC",
    "AdamW",
    "LRScheduler",
    "Muon",
    "MuonClip",
    "OptimConfig",
    "OptimizerSpec",
    "OptimizerStack",
    "Route",
    "WarmupStableDecay",
    "build_optimizers",
    "find_attention_modules",
    "format_routing_table",
    "lr_ratio",
    "orthogonalize",
    "qk_clip_scales",
    "route_parameters",
    "second_moment_shape",
    "torch_muon_compatible",
]
