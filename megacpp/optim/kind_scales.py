"""`optim.lr_scale_by_kind`: learning-rate factors per block kind, written as "<kind>=<factor>" entries.

The configuration has no mapping fields, and a list of strings is what TOML (``["M=0.5", "R=0.25"]``)
and the command line (``--optim.lr_scale_by_kind M=0.5,R=0.25``) already parse. A kind is a pattern
letter of `megacpp.model.registry.BLOCK_KINDS`; a factor is a finite number >= 0 (0 freezes the kind's
blocks: lr 0 means no step and, since decoupled weight decay is lr * wd, no decay either).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from megacpp.model.registry import BLOCK_KINDS


def parse_lr_scales(entries: Sequence[str]) -> dict[str, float]:
    """``["M=0.5", "R=0.25"]`` -> ``{"M": 0.5, "R": 0.25}``; ValueError naming the first bad entry
    (no "=", an unknown kind, a factor that is not a finite number >= 0, a kind given twice)."""
    scales: dict[str, float] = {}
    for entry in entries:
        kind, sep, text = entry.partition("=")
        kind = kind.strip()
        if not sep or kind not in BLOCK_KINDS:
            raise ValueError(f"entry {entry!r} is not <kind>=<factor> with a kind among {', '.join(BLOCK_KINDS)}")
        try:
            factor = float(text)
        except ValueError:
            raise ValueError(f"entry {entry!r}: factor {text.strip()!r} is not a number") from None
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"entry {entry!r}: the factor must be a finite number >= 0")
        if kind in scales:
            raise ValueError(f"entry {entry!r}: kind {kind} is given more than once")
        scales[kind] = factor
    return scales
