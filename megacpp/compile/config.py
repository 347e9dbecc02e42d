"""Compile configuration (stub)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompileConfig:
    mode: str = "blocks"  # none | model | blocks
