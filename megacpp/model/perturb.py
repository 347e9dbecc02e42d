"""Seeded weight perturbation, for search methods over weights (RandOpt, evolution strategies).

    saved = perturb_(model, seed=7, sigma=0.01)   # every parameter += 0.01 * N(0, 1), in place
    score = evaluate(model)
    restore_(model, saved)                        # the original weights, bit for bit

    with perturbed(model, seed=7, sigma=0.01):    # the same, restored on leaving the block
        score = evaluate(model)

``perturb_`` draws its noise from a generator of its own, seeded with ``seed``, parameter by parameter
in ``named_parameters`` order, so the same (seed, sigma) gives the same weights whatever the global RNG
did, and the noise of one candidate is its seed alone. Restoring copies the saved originals back:
subtracting regenerated noise would not round-trip bitwise in floating point. Frozen parameters are
perturbed too unless ``include_frozen=False``. Tier 1 (bit-exact): tests/test_determinism.py.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


@torch.no_grad()
def perturb_(model: nn.Module, seed: int, sigma: float, include_frozen: bool = True) -> dict[str, Tensor]:
    """Add ``sigma`` * N(0, 1) to every parameter of ``model`` in place (the noise drawn on the CPU in
    fp32, then cast to each parameter's device and dtype); returns the originals for `restore_`."""
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
    """Copy the values `perturb_` saved back into ``model``'s parameters."""
    params = dict(model.named_parameters())
    for name, value in saved.items():
        params[name].copy_(value)


@contextmanager
def perturbed(model: nn.Module, seed: int, sigma: float, include_frozen: bool = True) -> Iterator[nn.Module]:
    """``with perturbed(model, seed, sigma): score(model)``: the original weights back afterwards, even
    when the block raises."""
    saved = perturb_(model, seed, sigma, include_frozen)
    try:
        yield model
    finally:
        restore_(model, saved)
