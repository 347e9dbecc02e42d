"""F block mixer: dense feed-forward (stub: config only)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FFNConfig:
    hidden: int = 512
    activation: str = "relu2"  # relu2 | swiglu
