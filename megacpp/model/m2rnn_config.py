"""M2RNN's config section (pattern symbol R).

Torch-free, so the configuration (`megacpp config`, `megacpp.run_config.load_config`) loads without torch;
the mixer (megacpp/model/m2rnn.py) imports it from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from megacpp.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigSection, Interval, Keys, check_ordered


@dataclass
class M2RNNConfig(ConfigSection):
    n_heads: int = 4
    key_dim: int = 32
    value_dim: int = 32
    dt_min: float = 0.001  # softplus(a + dt_bias) at init is log-uniform in [dt_min, dt_max]
    dt_max: float = 0.1
    A_init_min: float = 1.0  # A at init is uniform in [A_init_min, A_init_max]
    A_init_max: float = 16.0
    # > 0: after every optimizer step, each head's W is rescaled to a spectral norm of at most this
    # (megacpp.optim.spectral_cap). At <= 1 the backward through time cannot grow from step to step:
    # each step's Jacobian has norm <= f * sigma_max(W) with f <= 1 and tanh' <= 1. 0 = off.
    w_spectral_cap: float = 0.0

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {
            "n_heads": AT_LEAST_1, "key_dim": AT_LEAST_1, "value_dim": AT_LEAST_1,
            "dt_min": POSITIVE, "dt_max": POSITIVE,  # log-uniform init
            "A_init_min": POSITIVE, "A_init_max": POSITIVE,  # stored as log(A)
            "w_spectral_cap": NON_NEGATIVE,  # 0 = off
        }

    def check(self, k: Keys) -> None:
        """As for Mamba-3, dt starts log-uniform in [dt_min, dt_max]; the decay rate A starts uniform in
        [A_init_min, A_init_max]. torch refuses either range reversed."""
        check_ordered(k, "dt_min", "dt_max")
        check_ordered(k, "A_init_min", "A_init_max")
