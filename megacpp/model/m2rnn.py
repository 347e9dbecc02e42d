"""R block mixer: M2RNN matrix-state recurrence (stub: config only)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class M2RNNConfig:
    n_heads: int = 4
    key_dim: int = 32
    value_dim: int = 32
