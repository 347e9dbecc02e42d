"""Block pattern language: one symbol per residual sublayer, tiled to the model depth.

``"AEMEAEMEAEMR"`` tiled to depth 52 repeats the pattern four times and then takes its first four
symbols, giving 13 A, 13 M, 22 E and 4 R sublayers.
"""
from __future__ import annotations

from megacpp.errors import ConfigError, MegacppError
from megacpp.model.registry import BLOCK_KINDS


class PatternError(MegacppError, ValueError):
    """A pattern string or depth that cannot describe a model."""


class PatternConfigError(ConfigError, PatternError):
    """A model.pattern or model.depth problem found by the model's rules (`ModelConfig.check`): a
    configuration error (the CLI's exit status 2, like every other) that code expecting a PatternError
    still catches as one."""


def _allowed() -> str:
    return ", ".join(f"{k} ({v.description})" for k, v in BLOCK_KINDS.items())


def validate_pattern(pattern: str) -> str:
    """Return the pattern if every symbol is a known block kind, else raise naming the position."""
    if not pattern:
        raise PatternError(f"empty block pattern; use symbols from: {_allowed()}")
    for position, symbol in enumerate(pattern):
        if symbol not in BLOCK_KINDS:
            raise PatternError(
                f"unknown block symbol {symbol!r} at position {position} of pattern {pattern!r}; "
                f"allowed symbols: {_allowed()}"
            )
    return pattern


def expand_pattern(pattern: str, depth: int) -> str:
    """Tile ``pattern`` to exactly ``depth`` sublayers.

    A depth shorter than the pattern would silently drop block kinds, so it is an error.
    """
    validate_pattern(pattern)
    if depth < len(pattern):
        raise PatternError(
            f"depth {depth} cannot fill pattern {pattern!r} ({len(pattern)} symbols): the symbols from "
            f"position {max(depth, 0)} on would be dropped; use depth >= {len(pattern)} or a shorter pattern"
        )
    repeats, rest = divmod(depth, len(pattern))
    return pattern * repeats + pattern[:rest]

