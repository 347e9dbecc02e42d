"""M block mixer: Mamba-3 SISO (stub: config only)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Mamba3Config:
    d_state: int = 16
    expand: int = 2
    head_dim: int = 32
    n_groups: int = 1
    rope_fraction: float = 0.5
    A_floor: float = 1e-4
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    chunk_size: int = 64
