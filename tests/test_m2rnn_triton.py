"""Triton M2RNN scan (megacpp.ops.m2rnn_triton) vs the PyTorch reference ops. Tier in each name.

The kernels run under Triton's CPU interpreter, which only takes effect when TRITON_INTERPRET=1 is set
before triton is imported; torch or another test may already have imported it in this process, so
the comparisons run once in a subprocess (`_errors_by_case`) and the tests assert on its report.

Tolerance (float32, eps = 2^-23): every step rounds each output at O(eps) relative (dot products of at
most 128 terms, tanh), and the inputs keep the step contractive (f <= 1, |tanh'| <= 1, W scaled to
spectral norm ~0.5), so the difference grows at most linearly in t; the backward's sums over (t, b, dk)
are reordered (grad_W: each program of the gradients kernel adds up its steps' terms, then the
per-program partials are summed over step blocks and b), also O(t eps). Bound: |triton - reference| <= 8 eps t
max(1, max|reference|), 5x (t = 1) to 80x (t = 33) above the observed differences, while a dropped or
wrong term was off by O(max|reference|) (checked by mutating the kernel).
"""
from __future__ import annotations

import json

import pytest
import torch

from megacpp.ops import m2rnn_triton
from megacpp.ops.m2rnn_scan import _scan_bwd, _scan_fwd
from tests.helpers import interpreted_report

EPS = 2.0**-23
# (b, t, H, dk, dv): odd b and t, one and several heads, one, two and four row blocks (dk 16, 32, 64);
# the backward's per-block partials are summed over blocks and batch rows (b > 1 with dk > 16); t = 70
# spans two of the gradients kernel's step blocks (GRADS_STEPS = 64), the second one partial; dk = 128
# two of its row blocks (GRADS_ROWS = 64).
CASES = [(1, 1, 1, 16, 16), (3, 7, 3, 32, 16), (2, 33, 1, 16, 32), (1, 7, 3, 32, 32), (2, 5, 1, 64, 16),
         (2, 70, 2, 16, 16), (2, 3, 1, 128, 16)]
NAMES = ["y", "states", "grad_q", "grad_k", "grad_v", "grad_f", "grad_W", "grad_h0"]


def _inputs(b: int, t: int, n_heads: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, f, W, h0 and the two cotangents, float32; f in (0, 1], h0 in [-0.5, 0.5)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, n_heads, dk, generator=g) for _ in range(2))
    v = torch.randn(b, t, n_heads, dv, generator=g)
    f = 1.0 - torch.rand(b, t, n_heads, generator=g)  # rand is in [0, 1): f in (0, 1]
    W = torch.randn(n_heads, dv, dv, generator=g) * (0.25 / dv**0.5)
    h0 = torch.rand(n_heads, b, dk, dv, generator=g) - 0.5
    grad_y = torch.randn(t, n_heads, b, dv, generator=g)
    grad_states = torch.randn(t, n_heads, b, dk, dv, generator=g)
    return q, k, v, f, W, h0, grad_y, grad_states


def _case_errors(case: tuple[int, ...], seed: int, states_grad: bool) -> dict[str, tuple[float, float]]:
    """{output: (max |triton - reference|, max |reference|)}; the backward gets the reference states.
    Without states_grad the states gradient is absent (an empty tensor), as in training."""
    q, k, v, f, W, h0, grad_y, grad_states = _inputs(*case, seed)
    if not states_grad:
        grad_states = grad_states.new_empty(0)
    ref = _scan_fwd(q, k, v, f, W, h0)  # CPU tensors: the op runs its PyTorch reference
    ref = (*ref, *_scan_bwd(q, k, v, f, W, h0, ref[1], grad_y, grad_states))
    out = (*m2rnn_triton.scan_fwd_triton(q, k, v, f, W, h0),
           *m2rnn_triton.scan_bwd_triton(q, k, v, f, W, h0, ref[1], grad_y, grad_states))
    errors = {}
    for name, a, r in zip(NAMES, out, ref, strict=True):
        assert a.shape == r.shape and a.dtype == r.dtype and a.is_contiguous(), name
        errors[name] = ((a - r).abs().max().item(), r.abs().max().item())
    return errors


def _report() -> None:
    """Subprocess entry point: prints every case's errors as one JSON line."""
    print(json.dumps({f"{c}/{states_grad}": _case_errors(c, seed, states_grad)
                      for seed, c in enumerate(CASES) for states_grad in (True, False)}))


@pytest.fixture(scope="module")
def errors_by_case() -> dict[str, dict[str, list[float]]]:
    return interpreted_report("tests.test_m2rnn_triton", timeout=300)


@pytest.mark.parametrize("states_grad", [True, False], ids=["states_grad", "no_states_grad"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_t{}_H{}_dk{}_dv{}".format(*c))
def test_tier3_triton_scan_matches_reference_interpreted(errors_by_case, case, states_grad):
    """Also with the states gradient absent (the kernel then skips its reads): a dropped y term would
    show in every gradient."""
    t = case[1]
    for name, (err, scale) in errors_by_case[f"{case}/{states_grad}"].items():
        bound = 8 * EPS * t * max(1.0, scale)
        assert err <= bound, f"{name}: max abs diff {err:.3g} > {bound:.3g} (max |ref| {scale:.3g})"


def test_tier1_unsupported_inputs_named():
    x32, x64 = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    assert m2rnn_triton.unsupported_reason((x32,), 16, 128, 1, 1) is None
    assert "float32" in m2rnn_triton.unsupported_reason((x32, x64), 16, 16, 1, 1)
    for dk, dv in ((8, 16), (16, 256), (48, 16)):
        assert f"key_dim={dk}" in m2rnn_triton.unsupported_reason((x32,), dk, dv, 1, 1)
    assert "empty" in m2rnn_triton.unsupported_reason((x32,), 16, 16, 1, 0)


def test_tier1_launcher_raises_on_unsupported_sizes():
    q, k, v, f, W, h0, _, _ = _inputs(1, 2, 1, 8, 16, seed=0)
    with pytest.raises(ValueError, match="key_dim=8"):
        m2rnn_triton.scan_fwd_triton(q, k, v, f, W, h0)


def test_tier1_fallback_serves_unsupported_inputs_with_the_reference():
    """float64 and dk = 8 go to the reference (no Triton launch, so this runs in-process)."""
    calls = []

    def fast(*args):
        raise AssertionError("fast path taken for unsupported inputs")

    def reference(*args):
        calls.append(args[0].dtype)
        return args[0]

    impl = m2rnn_triton.with_fallback(fast, reference)
    for case, dtype in (((1, 2, 1, 16, 16), torch.float64), ((1, 2, 1, 8, 16), torch.float32)):
        impl(*(x.to(dtype) for x in _inputs(*case, seed=0)[:6]))
    assert calls == [torch.float64, torch.float32]


def test_tier1_triton_registered_as_cuda_kernel_only():
    for op in ("megacpp::m2rnn_scan_fwd", "megacpp::m2rnn_scan_bwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"), op


def test_tier1_absent_states_gradient_equals_a_zero_one():
    """Training reads y only: the op's backward then gets no states gradient (not materialised) and
    must give exactly the gradients a zero states gradient gives."""
    q, k, v, f, W, h0, grad_y, _ = _inputs(2, 9, 2, 16, 16, seed=7)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, f, W, h0)]
    y, _states = _scan_fwd(*leaves)
    y.backward(grad_y)
    absent = [x.grad for x in leaves]
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    y, states = _scan_fwd(*leaves)
    torch.autograd.backward([y, states], [grad_y, torch.zeros_like(states)])
    for name, a, z in zip(["q", "k", "v", "f", "W", "h0"], absent, [x.grad for x in leaves], strict=True):
        assert torch.equal(a, z), name
