"""The Gram / polynomial op of Muon's iterations (megacpp.ops.gram): its reference on hand-computed values,
its errors, and the Triton kernel against float64 under Triton's CPU interpreter (in a subprocess:
TRITON_INTERPRET=1 only takes effect before triton is imported). Tier in each name.

Tolerance of the kernel (fp32 operands, IEEE products): each element is c Σ_k M_ik M_jk accumulated in
fp32 over k terms, then b M_ij and a added and the sum rounded once. With unit roundoff u = 2^-24 a sum
of k products carries at most γ_k = k u / (1 - k u) of Σ_k |M_ik M_jk| (Higham 3.1), and the epilogue's
two additions and the rounding at most 3 u of |c| Σ|M_ik M_jk| + |b M_ij| + |a|. The bound is twice
their total. A wrong tile (a missed mirror, a dropped diagonal, an inner block skipped) is off by O(1).
"""
from __future__ import annotations

import json

import pytest
import torch

from megacpp.ops import gram
from megacpp.ops.gram import gram_polynomial, gram_polynomial_reference
from tests.helpers import interpreted_report

U32 = 2.0**-24
# (stack shape, m, k, transposed view, a, b, c, tile, inner tile): several tiles with partial edges, an inner
# dimension not a multiple of its tile, a transposed (tall) stack, two batch dims, a 1 x 1 matrix, the
# polynomial of a symmetric matrix, and the default tiles once.
CASES = [((3,), 37, 53, False, 0.0, 0.0, 1.0, 16, 16), ((2,), 45, 70, True, 0.0, 0.0, 1.0, 32, 16),
         ((2, 3), 40, 33, False, 0.0, 0.0, 1.0, 16, 32), ((1,), 1, 1, False, 0.0, 0.0, 1.0, 16, 16),
         ((2,), 41, 41, False, 3.89, -2.77, 0.506, 16, 16), ((2,), 50, 50, False, 8.16, -22.48, 15.88, 128, 64)]


def _matrices(shape: tuple[int, ...], m: int, k: int, transposed: bool, square_symmetric: bool,
              seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if square_symmetric:  # a Gram matrix of unit norm, as the polynomial sees it
        x = torch.randn(*shape, m, 2 * m, generator=g)
        x = x / x.norm(dim=(-2, -1), keepdim=True)
        return x @ x.mT
    if transposed:
        return torch.randn(*shape, k, m, generator=g).mT
    return torch.randn(*shape, m, k, generator=g)


def _bound(M: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    m64 = M.double().abs()
    k = M.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    products = abs(c) * (m64 @ m64.mT)
    own = abs(b) * m64 if b else 0.0
    return 2 * (gamma * products + 3 * U32 * (products + own + abs(a)))


def _exact(M: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    m64 = M.double()
    out = c * (m64 @ m64.mT) + a * torch.eye(M.shape[-2], dtype=torch.float64)
    return out + b * m64 if b else out


def _case_report(case: tuple, seed: int) -> dict:
    from megacpp.ops.gram_triton import gram_polynomial_triton

    shape, m, k, transposed, a, b, c, tile, inner_tile = case
    M = _matrices(shape, m, k, transposed, b != 0, seed)
    out = gram_polynomial_triton(M, a, b, c, block=tile, block_k=inner_tile, num_warps=4)
    excess = (out.double() - _exact(M, a, b, c)).abs() - _bound(M, a, b, c)
    through_op = gram_polynomial(M, a, b, c, kernel="triton")
    # Only the off-diagonal tiles are mirrored; a diagonal tile is one product, whose (i, j) and (j, i)
    # sums may run in different orders (the interpreter's numpy matmul does on some CPUs).
    tile_of = torch.arange(m) // tile
    mirrored = tile_of[:, None] != tile_of[None, :]
    return {"shape": list(out.shape), "dtype": str(out.dtype), "contiguous": out.is_contiguous(),
            "worst_excess": excess.max().item(),
            "mirrored_equal": torch.equal(out[..., mirrored], out.mT[..., mirrored]),
            "op_equal": torch.equal(through_op, gram_polynomial_triton(M, a, b, c))}


def _report() -> None:
    """Subprocess entry point: every case's report as one JSON line."""
    print(json.dumps({str(i): _case_report(case, seed=i) for i, case in enumerate(CASES)}))


@pytest.fixture(scope="module")
def report_by_case() -> dict:
    return interpreted_report("tests.test_gram", timeout=600)


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=lambda i: "{}_{}x{}_T{}_a{}_b{}_c{}_tile{}x{}".format(*CASES[i]))
def test_tier3_kernel_within_bound_of_float64_interpreted(report_by_case, index):
    shape, m, *_ = CASES[index]
    report = report_by_case[str(index)]
    assert report["shape"] == [*shape, m, m]
    assert report["dtype"] == "torch.float32" and report["contiguous"]
    assert report["worst_excess"] <= 0, report
    assert report["mirrored_equal"], report  # the mirrored tiles are the computed ones, bit for bit
    assert report["op_equal"], report  # the custom op runs the same kernel


def test_tier1_reference_on_hand_computed_values():
    M = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 1.0]])
    assert torch.equal(gram_polynomial_reference(M, 0, 0, 1), torch.tensor([[5.0, 11.0], [11.0, 26.0]]))
    S = torch.tensor([[2.0, 1.0], [1.0, 3.0]])  # S^2 = [[5, 5], [5, 10]]
    expected = torch.tensor([[1 + 4 + 15, 2 + 15], [2 + 15, 1 + 6 + 30]], dtype=torch.float32)
    assert torch.equal(gram_polynomial_reference(S, 1.0, 2.0, 3.0), expected)
    assert torch.equal(gram_polynomial_reference(S.to(torch.bfloat16), 0, 0, 2.0), torch.tensor(
        [[10.0, 10.0], [10.0, 20.0]], dtype=torch.bfloat16))


def test_tier1_auto_on_cpu_is_the_reference():
    M = torch.randn(3, 20, 30, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(gram_polynomial(M, 0, 0, 1), gram_polynomial_reference(M, 0, 0, 1))
    A = gram_polynomial(M, 0, 0, 1)
    assert torch.equal(gram_polynomial(A, 3.0, -2.0, 0.5, kernel="reference"),
                       gram_polynomial_reference(A, 3.0, -2.0, 0.5))


def test_tier1_errors_name_what_is_wrong(monkeypatch):
    with pytest.raises(ValueError, match="square matrices, got \\(3, 4\\)"):
        gram_polynomial(torch.randn(3, 4), 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="a matrix or a stack of matrices, got shape \\(5,\\)"):
        gram_polynomial(torch.randn(5), 0.0, 0.0, 1.0)
    monkeypatch.setattr(gram, "triton_runs_on", lambda device: False)
    with pytest.raises(ValueError, match="Triton kernel cannot serve torch.float32 on cpu"):
        gram_polynomial(torch.randn(3, 4), 0.0, 0.0, 1.0, kernel="triton")
