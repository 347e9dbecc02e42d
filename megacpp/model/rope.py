"""Rotary position embedding (RoPE); positions inside each document come from `Segments`.

RoPE reads cos/sin from fixed tables indexed by position: computing them inside the forward lets
Inductor fuse sin/cos into every q/k element (16x redundant transcendental math per head and batch
row; measured 4 extra 0.4 ms kernels per attention layer at B16xT2048 on H200).

The base period ``theta`` sets the slowest rotation (about once every 2 pi theta positions): positions
far apart in a context much longer than that rotation look alike to attention. `rope_theta_for_length` is the
documented rule for long contexts (README "Long context"); the default 10,000 stays the setting of every
preset, which train at 256 to 4,096 tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor

SHORT_CONTEXT_THETA = 10_000.0  # the original RoPE base, AttentionConfig's default
# (longest context, theta), from public long-context recipes: Llama 3 raised theta to 500,000 and cites
# Xiong et al. 2023 ("Effective Long-Context Scaling", arXiv 2309.16039) for its effectiveness up to
# 32,768 tokens; Code Llama (arXiv 2308.12950) trained at 16,384 tokens with theta 1,000,000 and stayed
# stable up to 100,000.
LONG_CONTEXT_THETAS = ((8192, SHORT_CONTEXT_THETA), (32768, 500_000.0), (65536, 1_000_000.0))


def rope_theta_for_length(seq_len: int) -> float:
    """The base period for rows of `seq_len` tokens: the first entry of LONG_CONTEXT_THETAS whose length
    covers it (10,000 up to 8,192, 500,000 up to 32,768, 1,000,000 up to 65,536)."""
    for longest, theta in LONG_CONTEXT_THETAS:
        if seq_len <= longest:
            return theta
    raise ValueError(f"no documented rope_theta for {seq_len} tokens (the rule covers up to "
                     f"{LONG_CONTEXT_THETAS[-1][0]:,})")


def rope_table(max_len: int, head_dim: int, theta: float, start: int = 0) -> tuple[Tensor, Tensor]:
    """cos, sin tables (max_len - start, head_dim // 2) in fp32 for positions start..max_len-1, computed in
    fp64 so large angles stay exact."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(start, max_len, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (i, i + head_dim/2) of x (b, h, t, head_dim) in fp32; returns x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.to(x.dtype)
