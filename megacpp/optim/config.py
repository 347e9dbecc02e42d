"""Optimizer configuration (stub)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimConfig:
    muon_lr: float = 0.02
    adamw_lr: float = 3e-3
    weight_decay: float = 0.0
