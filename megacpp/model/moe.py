"""E block: mixture-of-experts FFN (stub: config only)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    shared_expert: bool = True
    capacity_factor: float = 1.25
    routing: str = "token_choice"  # token_choice | expert_choice
    bias_update_rate: float = 1e-3
