"""Rotary position embedding (RoPE); positions inside each document come from `Segments`.

RoPE reads cos/sin from fixed tables indexed by position: computing them inside the forward lets
Inductor fuse sin/cos into every q/k element (16x redundant transcendental math per head and batch
row; measured 4 extra 0.4 ms kernels per attention layer at B16xT2048 on H200).

The base period ``theta`` sets the slowest rotation; the documented rule for choosing it by context
length is `megacpp.model.rope_theta`.
"""
from __future__ import annotations

import torch
from torch import Tensor


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
