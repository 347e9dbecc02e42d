"""On a CUDA machine: the Gram / polynomial kernel in bf16, at `small`'s Muon stacks and at odd sizes, against
float64, and the folded iterations with it as close to the polar factor as with the reference's products.
Run with `python -m pytest -m gpu tests/test_gpu_gram.py`.

Bound (bf16 operands, fp32 accumulation, one rounding to bf16): the fp32 sum's error as in tests/test_gram.py
(2 (γ_k + 3 u) of |c| Σ|M_ik M_jk| + |b M_ij| + |a|, u = 2^-24), plus the output's rounding, 2^-8 of the
value's magnitude (twice: the bound holds the difference of two roundings of nearby values)."""
from __future__ import annotations

import pytest
import torch

from megacpp.ops.gram import gram_polynomial, gram_polynomial_reference
from megacpp.optim.orthogonalize import POLAR_EXPRESS

pytestmark = pytest.mark.gpu
U32, U_BF16 = 2.0**-24, 2.0**-8


def _bound(M: torch.Tensor, exact: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    m64 = M.double().abs()
    k = M.shape[-1]
    products = abs(c) * (m64 @ m64.mT)
    own = abs(b) * m64 if b else 0.0
    fp32 = 2 * (k * U32 / (1 - k * U32) * products + 3 * U32 * (products + own + abs(a)))
    return fp32 + 2 * U_BF16 * exact.abs()


@pytest.mark.parametrize("n,m,k,tall", [(160, 768, 1024, False), (160, 768, 1024, True), (6, 768, 3432, True),
                                        (3, 97, 211, False), (2, 130, 129, True), (1, 1, 5, False)])
def test_tier3_gram_and_polynomial_within_bound(n, m, k, tall):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (n, k, m) if tall else (n, m, k)
    G = torch.randn(shape, device="cuda", generator=g)
    G = G.mT if tall else G
    X = (G / (G.norm(dim=(-2, -1), keepdim=True) * 1.02)).to(torch.bfloat16)
    A = gram_polynomial(X, 0, 0, 1)
    exact_A = X.double() @ X.double().mT
    assert A.dtype == torch.bfloat16 and torch.equal(A, A.mT)
    assert ((A.double() - exact_A).abs() <= _bound(X, exact_A, 0, 0, 1)).all()
    a, b, c = POLAR_EXPRESS[1]
    P = gram_polynomial(A, a, b, c)
    A64 = A.double()
    exact_P = a * torch.eye(m, device="cuda", dtype=torch.float64) + b * A64 + c * A64 @ A64
    assert ((P.double() - exact_P).abs() <= _bound(A, exact_P, a, b, c)).all()
    # The reference (cuBLAS in bf16, the terms summed in fp32) meets the same bound.
    assert ((gram_polynomial_reference(A, a, b, c).double() - exact_P).abs() <= _bound(A, exact_P, a, b, c)).all()
