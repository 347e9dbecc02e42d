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
rank caps its own; a row-sharded matrix would need a distributed computation and is refused.

The spectral norm comes from repeated squaring of the Gram matrix, not an SVD: torch.linalg's SVD
synchronizes a CUDA device with the host, and on an H200 the exact cap made `small`'s whole step
12.5 ms slower (180.8 against 168.3 ms). `spectral_norm_bound` is matmuls only: no sync, deterministic,
and an upper bound within a factor (1 + 1e-6) of the true norm.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megacpp.optim.local import is_sharded, local_tensor
from megacpp.optim.route import Route

SQUARINGS = 20  # the bound's overestimate is at most n ** (1 / 2 ** 22) - 1: 1e-6 for n = 64
# Squarings between two rescalings. After a rescaling to Frobenius norm 1 the entries stay <= 1 and the top
# eigenvalue >= n ** -0.5, so four squarings leave it >= n ** -8, far above float64's smallest (~1e-308) for
# any n below 1e38. The cap runs eagerly after every step: rescaling at every squaring took about 150 launches,
# and 7-12 ms of the host's time per `small` step on an H200 against 4-5 ms now (BENCHMARKS A7).
SQUARINGS_PER_RESCALE = 4


def spectral_norm_bound(matrices: Tensor) -> tuple[Tensor, float]:
    """An upper bound of each matrix's largest singular value (..., A, B) -> (...,) in float64, and the
    relative slack it may exceed it by.

    With G = the smaller Gram matrix (eigenvalues s_i^2), ||G^k||_F = sqrt(sum s_i^(4k)) lies between
    s_max^(2k) and sqrt(n) s_max^(2k), so ||G^k||_F^(1/(2k)) bounds s_max from above within a factor
    n^(1/(4k)); k = 2^SQUARINGS is reached by squaring G, rescaled to norm 1 every SQUARINGS_PER_RESCALE
    squarings (the scales are kept as logarithms) so that nothing overflows or underflows."""
    x = matrices.double()
    rows, cols = x.shape[-2:]
    gram = x.mT @ x if cols <= rows else x @ x.mT
    log_scale = torch.zeros(gram.shape[:-2], dtype=gram.dtype, device=gram.device)
    for _ in range(SQUARINGS // SQUARINGS_PER_RESCALE):
        norm = torch.linalg.matrix_norm(gram).clamp_min(torch.finfo(gram.dtype).tiny)
        log_scale = (log_scale + norm.log()) * 2 ** SQUARINGS_PER_RESCALE
        gram = gram / norm[..., None, None]
        for _ in range(SQUARINGS_PER_RESCALE):
            gram = gram @ gram
    log_power_norm = log_scale + torch.linalg.matrix_norm(gram).log()  # log ||G^(2^SQUARINGS)||_F
    bound = (log_power_norm / 2 ** (SQUARINGS + 1)).exp()
    return bound, min(rows, cols) ** (1 / 2 ** (SQUARINGS + 2)) - 1


@dataclass(frozen=True)
class CappedParam:
    name: str
    param: Tensor
    bound: float


class SpectralCap:
    """Caps the spectral norm of each matrix of the given parameters at its bound, to within the relative
    slack of `spectral_norm_bound` (1e-6): a matrix within the bound is left as it is, one above ends
    between bound and bound * (1 + slack). Metrics of the last `apply()`: the largest spectral norm found
    before capping (to that slack) and how many matrices were rescaled."""

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
        for group in self._same_shape_groups():
            # One bound computation for the group's matrices stacked: `small`'s two R layers' W share
            # one chain of 20 squarings (about 7 launches each) instead of two.
            sigmas, slack = spectral_norm_bound(torch.cat([m.reshape(-1, *m.shape[-2:]) for _, m in group]))
            for (c, matrices), sigma in zip(group, sigmas.split([m[..., 0, 0].numel() for _, m in group]),
                                            strict=True):
                scale = (c.bound * (1 + slack) / sigma).clamp(max=1.0)
                matrices.mul_(scale.to(matrices.dtype).view(*matrices.shape[:-2], 1, 1))
                largest.append(sigma.max())
                rescaled.append((scale < 1).sum())
        if largest:
            self.metrics = {"spectral_cap/max_sigma": torch.stack(largest).max(),
                            "spectral_cap/n_capped": torch.stack(rescaled).sum()}
        return self.metrics

    def _same_shape_groups(self) -> list[list[tuple[CappedParam, Tensor]]]:
        """Each capped parameter's local matrices, grouped by matrix shape, dtype and device, in order;
        a rank holding no matrix of an unevenly sharded stack skips that parameter."""
        groups: dict[tuple, list[tuple[CappedParam, Tensor]]] = {}
        for c in self.capped:
            matrices = local_tensor(c.param)
            if matrices.numel():
                key = (tuple(matrices.shape[-2:]), matrices.dtype, matrices.device)
                groups.setdefault(key, []).append((c, matrices))
        return list(groups.values())
