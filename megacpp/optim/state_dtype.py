"""Storage dtypes of optimizer moments: a moment may be kept in bf16 (2 bytes per parameter instead of
4) while every update of it is computed in fp32 and rounded to the storage dtype once, when written back.

Which moments may be bf16 and why is docs/optim.md's "State dtypes"; the optimizers name the dtype per
param group (``momentum_dtype``) by its torch name, the form a param group and a checkpoint keep.
"""
from __future__ import annotations

import torch

STATE_DTYPES = ("bfloat16", "float32")


def state_dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16``, ``"bfloat16"`` -> ``"bfloat16"`` (likewise float32); anything else is refused."""
    name = str(dtype).removeprefix("torch.")
    if name not in STATE_DTYPES:
        raise ValueError(f"momentum_dtype must be one of {STATE_DTYPES}, got {dtype}")
    return name


def state_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name `state_dtype_name` accepted."""
    return getattr(torch, state_dtype_name(name))
