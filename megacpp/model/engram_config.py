"""The Engram branches' config section: which blocks get one, and the n-gram hash embedding.

Torch-free, so the configuration (`megacpp config`, `megacpp.run_config.load_config`) loads without torch;
the mixer (megacpp/model/engram.py) imports it from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megacpp.rules import AT_LEAST_1, NON_NEGATIVE, ConfigSection, Interval, Keys


@dataclass
class EngramConfig(ConfigSection):
    layers: list[int] = field(default_factory=list)  # block indices that get an Engram branch
    dim: int = 64
    gate: bool = False
    ngram_hash: bool = False
    ngram_orders: list[int] = field(default_factory=lambda: [2, 3])
    ngram_heads: int = 2
    ngram_table_size: int = 0  # 0 = next prime >= 2 * vocab; else rounded up to a prime
    ngram_dim: int = 64  # width of the hash-table embeddings before the projection to d_model

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {"dim": AT_LEAST_1, "ngram_heads": AT_LEAST_1,
                "ngram_table_size": NON_NEGATIVE,  # 0 = next prime >= 2 * vocab
                "ngram_dim": AT_LEAST_1}

    def check(self, k: Keys) -> None:
        """The n-gram hash embeds n-grams of order >= 2 (order 1 is the token embedding itself). Which
        blocks get a branch is a rule of the model's (ModelConfig.check): it needs the depth."""
        if self.ngram_hash and (not self.ngram_orders or min(self.ngram_orders) < 2):
            raise k.error("ngram_orders", "needs one or more orders, each >= 2 (1 is the token embedding)")
