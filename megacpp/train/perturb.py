"""Seeded weight perturbation for search methods over weights (e.g. RandOpt, evolution strategies).

``perturb_`` adds sigma * N(0, 1) noise drawn from its own generator, parameter by parameter in
``named_parameters`` order, so the same (seed, sigma) gives the same weights whatever the global RNG
did. Restoring copies the saved originals back: subtracting regenerated noise would not round-trip
bitwise in floating point.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


@torch.no_grad()
def perturb_(model: nn.Module, seed: int, sigma: float, include_frozen: bool = True) -> dict[str, Tensor]:
    """Perturb ``model`` in place; returns the original values for ``restore_``."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    saved: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if not (p.requires_grad or include_frozen):
            continue
        saved[name] = p.detach().clone()
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
        p.add_(noise.to(device=p.device, dtype=p.dtype), alpha=sigma)
    return saved


@torch.no_grad()
def restore_(model: nn.Module, saved: dict[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, value in saved.items():
        params[name].copy_(value)


@contextmanager
def perturbed(model: nn.Module, seed: int, sigma: float, include_frozen: bool = True) -> Iterator[nn.Module]:
    """``with perturbed(model, seed, sigma): score(model)`` — original weights back afterwards."""
    saved = perturb_(model, seed, sigma, include_frozen)
    try:
        yield model
    finally:
        restore_(model, saved)
