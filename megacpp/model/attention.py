"""A block mixer: grouped-query attention (stub: config only, implementation pending)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AttentionConfig:
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    qk_norm: bool = True
    softcap: float = 0.0  # 0 = off; else logits -> softcap * tanh(logits / softcap)
    qk_clip: str = "off"  # off | weight | activation
    qk_clip_tau: float = 100.0
    backend: str = "auto"  # auto | sdpa | flex
