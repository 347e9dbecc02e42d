"""Attention's config section (pattern symbol A): heads, RoPE tables, QK-norm, soft-cap, QK-clip.

Torch-free, so the configuration (`megacpp config`, `megacpp.run_config.load_config`) loads without torch;
the mixer (megacpp/model/attention.py) imports it from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megacpp.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigSection, Interval, Keys

QkClipMode = Literal["off", "weight", "activation"]
AttentionBackend = Literal["auto", "sdpa", "flex"]


@dataclass
class AttentionConfig(ConfigSection):
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    # Rows of the RoPE tables: the longest training or evaluation row (the gate holds data.seq_len to it).
    # Decoding is not bound by it: a longer decode cache carries its own longer tables.
    max_seq_len: int = 8192
    qk_norm: bool = True
    softcap: float = 0.0  # 0 = off; else logits -> softcap * tanh(logits / softcap)
    qk_clip: QkClipMode = "off"
    qk_clip_tau: float = 100.0
    backend: AttentionBackend = "auto"  # flex applies on CUDA; CPU always uses SDPA

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {"n_heads": AT_LEAST_1, "n_kv_heads": AT_LEAST_1, "head_dim": AT_LEAST_1, "rope_theta": POSITIVE,
                "max_seq_len": AT_LEAST_1, "softcap": NON_NEGATIVE, "qk_clip_tau": POSITIVE}  # softcap 0 = off

    def check(self, k: Keys) -> None:
        """Grouped-query attention: query head h reads kv head h // (n_heads / n_kv_heads). RoPE rotates
        pairs of dimensions."""
        if self.n_heads % self.n_kv_heads:
            raise k.error_among(("n_heads", "n_kv_heads"),
                                "n_heads must be a multiple of n_kv_heads (query heads share kv heads in groups)")
        if self.head_dim % 2:
            raise k.error("head_dim", "must be even: RoPE rotates pairs of dimensions")
