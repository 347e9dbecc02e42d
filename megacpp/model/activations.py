"""Activations shared by the feed-forward mixers (F and E blocks)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def relu_squared(h: Tensor) -> Tensor:
    """relu(h)^2 in h's dtype, as h * h rather than square(): CUDA autocast runs square() (a pow) in fp32, which
    writes an fp32 copy of the hidden rows and reads it back for the next projection (and grouped_mm takes no
    fp32 operand beside bf16 weights). Both round the exact square once, and both gradients are 2 g h rounded
    once, so values and gradients are the same bit for bit (tested)."""
    h = F.relu(h)
    return h * h
