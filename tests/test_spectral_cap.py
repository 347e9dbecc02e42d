"""Tests for the spectral cap (megacpp.optim.spectral_cap) and why R's W needs it. Tier in each name."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megacpp.model.m2rnn import M2RNN
from megacpp.model.m2rnn_config import M2RNNConfig
from megacpp.ops.m2rnn_scan import m2rnn_scan
from megacpp.optim import OptimConfig, build_optimizers
from megacpp.optim.spectral_cap import CappedParam, SpectralCap, spectral_norm_bound

# The cap lands a matrix between bound and bound * (1 + slack), slack = n ** (1 / 2 ** 22) - 1 <= 1e-6 for
# n <= 64, then rounds it to fp32 (eps 1.2e-7 relative): 2e-6 covers both with a margin of ~1.8.
SIGMA_RTOL = 2e-6


def sigma_max(w: torch.Tensor) -> torch.Tensor:
    """Largest singular value of each matrix, in float64 (independent of the cap's fp32 computation)."""
    return torch.linalg.svdvals(w.double())[..., 0]


def stack_with_sigmas(sigmas: list[float], n: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(len(sigmas), n, n, generator=g)
    return w * (torch.tensor(sigmas) / sigma_max(w).float())[:, None, None]


def test_tier1_matrices_within_the_bound_are_untouched_bit_for_bit() -> None:
    w = stack_with_sigmas([0.5, 0.999, 1.3, 2.0, 0.1])
    before = w.clone()
    SpectralCap([CappedParam("W", w, 1.0)]).apply()
    for i in (0, 1, 4):
        assert torch.equal(w[i], before[i]), i


def test_tier1_parameters_of_one_shape_capped_together_as_each_alone() -> None:
    """Same-shape parameters share one bound computation (stacked); each ends exactly as capped alone,
    with its own bound, and the metrics cover all of them. A parameter of another shape is its own group."""
    a, b = stack_with_sigmas([0.5, 1.3, 2.0], seed=2), stack_with_sigmas([3.0, 0.7], seed=3)
    c = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(4))
    c_sigmas = sigma_max(c)
    alone = [x.clone() for x in (a, b, c)]
    for x, bound in zip(alone, (1.0, 2.5, 0.5), strict=True):
        SpectralCap([CappedParam("W", x, bound)]).apply()
    metrics = SpectralCap([CappedParam("a", a, 1.0), CappedParam("b", b, 2.5), CappedParam("c", c, 0.5)]).apply()
    for together, single in zip((a, b, c), alone, strict=True):
        assert torch.equal(together, single)
    assert int(metrics["spectral_cap/n_capped"]) == 2 + 1 + int((c_sigmas > 0.5).sum())
    largest = max(3.0, c_sigmas.max().item())
    assert abs(metrics["spectral_cap/max_sigma"].item() - largest) <= largest * SIGMA_RTOL


def test_tier3_matrices_above_the_bound_end_at_it_and_keep_their_direction() -> None:
    w = stack_with_sigmas([0.5, 1.3, 2.0, 17.0], seed=1)
    before = w.clone()
    metrics = SpectralCap([CappedParam("W", w, 1.0)]).apply()
    after = sigma_max(w)
    for i in (1, 2, 3):
        assert abs(after[i].item() - 1.0) <= SIGMA_RTOL, (i, after[i].item())
        # a pure rescaling: the same matrix divided by its spectral norm
        ratio = before[i].double() / sigma_max(before[i]) - w[i].double()
        assert ratio.abs().max().item() <= SIGMA_RTOL * before[i].abs().max().item() / sigma_max(before[i]).item()
    assert int(metrics["spectral_cap/n_capped"]) == 3
    assert abs(metrics["spectral_cap/max_sigma"].item() - 17.0) <= 17.0 * SIGMA_RTOL


@pytest.mark.parametrize("shape", [(3, 7, 7), (2, 5, 9), (4, 9, 5), (1, 64, 64)])
def test_tier3_the_bound_is_above_the_spectral_norm_within_its_slack(shape: tuple[int, ...]) -> None:
    """Random matrices (a spectral gap) and scaled orthogonal ones (all singular values equal: the worst
    case, where the bound is the norm times (1 + slack) exactly). float64 throughout: rounding ~1e-15."""
    g = torch.Generator().manual_seed(4)
    random = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    orthogonal = torch.linalg.qr(torch.randn(shape[0], shape[1], shape[1], generator=g, dtype=torch.float64))[0] * 1.7
    for w in (random, orthogonal):
        bound, slack = spectral_norm_bound(w)
        exact = sigma_max(w)
        assert slack <= 1e-6
        assert (bound >= exact * (1 - 1e-12)).all() and (bound <= exact * (1 + slack) * (1 + 1e-12)).all()
    assert spectral_norm_bound(torch.zeros(2, 4, 4))[0].eq(0).all()


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_tier3_the_bound_holds_at_far_scales_and_for_a_large_flat_spectrum(scale: float) -> None:
    """Between rescalings the squarings run unscaled: a 512 x 512 orthogonal matrix (every eigenvalue of G
    equal: the smallest top eigenvalue a rescaled G can have, n ** -0.5) and a spectrum spanning 1e-12..1,
    at scales whose G^(2^20) unscaled would under- or overflow float64 many times over."""
    g = torch.Generator().manual_seed(5)
    orthogonal = torch.linalg.qr(torch.randn(1, 512, 512, generator=g, dtype=torch.float64))[0]
    u, v = (torch.linalg.qr(torch.randn(1, 40, 40, generator=g, dtype=torch.float64))[0] for _ in range(2))
    spread = u @ torch.diag_embed(torch.logspace(0, -12, 40, dtype=torch.float64)[None]) @ v
    for w in (orthogonal * scale, spread * scale):
        bound, slack = spectral_norm_bound(w)
        exact = sigma_max(w)
        assert torch.isfinite(bound).all() and slack <= 2e-6
        assert (bound >= exact * (1 - 1e-12)).all() and (bound <= exact * (1 + slack) * (1 + 1e-12)).all()


def test_tier1_cap_refuses_what_it_cannot_bound() -> None:
    with pytest.raises(ValueError, match="needs a matrix"):
        SpectralCap([CappedParam("b", torch.zeros(4), 1.0)])
    with pytest.raises(ValueError, match="must be > 0"):
        SpectralCap([CappedParam("W", torch.zeros(2, 3, 3), 0.0)])


class RBlock(nn.Module):
    def __init__(self, cap: float) -> None:
        super().__init__()
        self.mixer = M2RNN(16, M2RNNConfig(n_heads=3, key_dim=4, value_dim=5, w_spectral_cap=cap), layer_idx=0)


class OneRBlock(nn.Module):
    """The smallest model the optimizer routing accepts: blocks.0.mixer is an R mixer."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([RBlock(cap)])

    @property
    def rnn(self) -> M2RNN:
        return self.blocks[0].mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)


@pytest.mark.parametrize("compile_step", [False, True])
def test_tier1_optimizer_step_caps_m2rnn_W_when_configured(compile_step: bool) -> None:
    """W pushed to spectral norms 1.6 / 0.8 / 3.0, then one optimizer step with the cap at 1: the two
    heads above end within the bound; without the cap the stack has none and W keeps its norms."""
    torch.manual_seed(0)
    for cap in (1.0, 0.0):
        model = OneRBlock(cap)
        with torch.no_grad():
            model.rnn.W.copy_(stack_with_sigmas([1.6, 0.8, 3.0], n=5, seed=2))
            model.rnn.out_proj.weight.normal_()  # zero at init: W would get no gradient
        model(torch.randn(2, 9, 16)).square().mean().backward()
        stack = build_optimizers(model, OptimConfig(compile_step=compile_step), total_steps=10, log=None,
                                 model_compiled=compile_step)
        stack.step()
        sig = sigma_max(model.rnn.W.detach())
        if cap:
            assert (sig <= 1.0 + SIGMA_RTOL).all(), sig
            assert stack.metrics["spectral_cap/n_capped"] >= 2
        else:
            assert stack.spectral_cap is None and "spectral_cap/max_sigma" not in stack.metrics
            assert sig[2] > 2.5  # one Muon step moves W by ~lr: nothing pulled it to 1


def last_output_gradient_at_first_input(sigma: float, t: int = 256) -> tuple[float, float]:
    """||dL/dv_0|| / ||g|| for L = <g, y_{t-1}> through an M2RNN head with W = sigma * (an orthogonal
    matrix) and f = 1, and the largest |y| of the forward; float64, the reference scan."""
    g = torch.Generator().manual_seed(3)
    dk = dv = 16
    ortho, _ = torch.linalg.qr(torch.randn(dv, dv, generator=g, dtype=torch.float64))
    q = torch.nn.functional.normalize(torch.randn(1, t, 1, dk, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, t, 1, dk, generator=g, dtype=torch.float64), dim=-1)
    v = (0.1 * torch.randn(1, t, 1, dv, generator=g, dtype=torch.float64)).requires_grad_()
    f = torch.ones(1, t, 1, dtype=torch.float64)
    y = m2rnn_scan(q, k, v, f, (sigma * ortho)[None])
    weight = torch.randn(dv, generator=g, dtype=torch.float64)
    (y[0, -1, 0] * weight).sum().backward()
    return (v.grad[0, 0, 0].norm() / weight.norm()).item(), y.abs().max().item()


def test_tier3_backward_through_time_explodes_above_spectral_norm_1_and_not_at_it() -> None:
    """Why the cap: with sigma_max(W) = 2 the forward stays bounded (|y| <= sqrt(dk) = 4 by tanh and a
    unit q) while the gradient 255 steps back is > 1e10 times the output's (1.7e12-3.1e15 over seeds 3-5:
    the dynamics are chaotic). At sigma_max(W) = 1 each step's Jacobian has norm <= f * sigma_max(W) *
    max tanh' <= 1, so that gradient is at most the output's (||dL/dh_{t-1}|| = ||q|| ||g|| = ||g||).
    float64: rounding is ~1e-16 relative, far below both bounds."""
    grown, y_max = last_output_gradient_at_first_input(2.0)
    assert grown > 1e10 and y_max <= 16 ** 0.5
    bounded, _ = last_output_gradient_at_first_input(1.0)
    assert bounded <= 1.0
