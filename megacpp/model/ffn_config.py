"""The dense FFN's config section (pattern symbol F).

Torch-free, so the configuration (`megacpp config`, `megacpp.run_config.load_config`) loads without torch;
the mixer (megacpp/model/ffn.py) imports it from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megacpp.rules import AT_LEAST_1, ConfigSection, Interval

Activation = Literal["relu2", "swiglu"]


@dataclass
class FFNConfig(ConfigSection):
    hidden: int = 512
    activation: Activation = "relu2"

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {"hidden": AT_LEAST_1}
