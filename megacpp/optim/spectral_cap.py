"""Spectral cap: after every optimizer step, each matrix of a parameter declared with a bound
(``ParamHint.max_spectral_norm``) is rescaled so that its largest singular value is at most that bound.

Why it exists: M2RNN's recurrence h_t = tanh(f_t h_{t-1} W + k_t v_t^T) is bounded in its forward by
the tanh, but its backward through time multiplies the state's gradient by f_t (1 - h_t^2) W^T at each
step, whose norm is at most f_t * sigma_max(W). W starts as the identity; Muon's orthogonalized updates
raise sigma_max above 1 (1.0 -> 1.21 by step 150 on `tiny`), and `small`'s gradient-norm spikes (up to
5.7e15 at 8192 tokens, with an ordinary loss and head gradient) most often start in its topmost R block
(BENCHMARKS.md, issue 13). With sigma_max(W) <= 1 no step of that backward can amplify.

A projection after the step, not a reparametrization in the forward: the model's function, its kernels
and decode stay what they are; a matrix already within the bound is multiplied by exactly 1 (unchanged,
bit for bit). Under FSDP2 a stacked (H, A, B) parameter is sharded on dim 0 into whole matrices, so each
rank caps its own; a row-sharded matrix would need a distributed SVD and is refused. On CUDA the SVD
synchronizes with the host (torch.linalg's rule), once per step after the optimizer: the training step
already waits for its loss before the optimizer runs, so this adds the wait for the optimizer's kernels.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megacpp.optim.local import is_sharded, local_tensor
from megacpp.optim.route import Route


@dataclass(frozen=True)
class CappedParam:
    name: str
    param: Tensor
    bound: float


class SpectralCap:
    """Caps the spectral norm of each matrix of the given parameters; metrics of the last `apply()`:
    the largest spectral norm found before capping and how many matrices were rescaled."""

    def __init__(self, capped: Sequence[CappedParam]) -> None:
        for c in capped:
            if c.param.ndim < 2:
                raise ValueError(f"{c.name}: a spectral cap needs a matrix or a stack of matrices, got shape "
                                 f"{tuple(c.param.shape)}")
            if not c.bound > 0:
                raise ValueError(f"{c.name}: spectral cap {c.bound} must be > 0")
            if is_sharded(c.param) and any(pl.is_shard() and pl.dim >= c.param.ndim - 2 for pl in c.param.placements):
                raise ValueError(f"{c.name}: sharded inside its matrices ({c.param.placements}); a spectral cap "
                                 "needs whole matrices on every rank")
        self.capped = list(capped)
        self.metrics: dict[str, Tensor] = {}

    @classmethod
    def for_routes(cls, routes: Sequence[Route]) -> SpectralCap | None:
        """The cap the routed parameters' hints ask for; None when no hint sets a bound."""
        capped = [CappedParam(r.name, r.param, r.hint.max_spectral_norm) for r in routes
                  if r.hint.max_spectral_norm is not None]
        return cls(capped) if capped else None

    @torch.no_grad()
    def apply(self) -> dict[str, Tensor]:
        largest, rescaled = [], []
        for c in self.capped:
            matrices = local_tensor(c.param)
            if matrices.numel() == 0:  # a rank holding no matrix of an unevenly sharded stack
                continue
            sigma = torch.linalg.matrix_norm(matrices.float(), ord=2)  # (...,): one per matrix
            scale = (c.bound / sigma).clamp(max=1.0)
            matrices.mul_(scale.to(matrices.dtype)[..., None, None])
            largest.append(sigma.max())
            rescaled.append((scale < 1).sum())
        if largest:
            self.metrics = {"spectral_cap/max_sigma": torch.stack(largest).max(),
                            "spectral_cap/n_capped": torch.stack(rescaled).sum()}
        return self.metrics
