"""Engram branch and n-gram hash embedding (stub: config only)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngramConfig:
    layers: list[int] = field(default_factory=list)  # block indices that get an Engram branch
    dim: int = 64
    gate: bool = False
    ngram_hash: bool = False
    ngram_orders: list[int] = field(default_factory=lambda: [2, 3])
    ngram_heads: int = 2
    ngram_table_size: int = 0  # 0 = pick a prime from the vocabulary size
