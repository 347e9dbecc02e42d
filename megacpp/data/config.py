"""Data configuration (stub)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    corpus: list[str] | None = None  # None = the C++ headers shipped inside torch (torch/include)
    seq_len: int = 256
