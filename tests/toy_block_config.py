"""A toy block kind's config section, written as a new kind's is: torch-free, so that reading a
configuration that composes it (`megacpp config`) loads no torch. Its mixer is tests/toy_block.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from megacpp.rules import AT_LEAST_1, ConfigSection, Interval, Keys


@dataclass
class ToyConfig(ConfigSection):
    hidden: int = 16

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {"hidden": AT_LEAST_1}

    def check(self, k: Keys) -> None:
        """The up-projection's rows split into two equal halves, the values and their gates."""
        if self.hidden % 2:
            raise k.error("hidden", "must be even: half the rows gate the other half")
