"""Mamba-3 rotation angles (megacpp/ops/mamba3_angles.py): the Triton kernels and the custom op against
float64 computations. Tier in each name.

The kernels run under Triton's CPU interpreter, which only takes effect when TRITON_INTERPRET=1 is set
before triton is imported; torch or another test may already have imported it in this process, so the
kernel comparisons run once in a subprocess (`report`) and the tests assert on its JSON report. The
interpreter runs tl.associative_scan element by element (~0.1 ms each), so the sizes are small: the
whole subprocess takes a few seconds.

Tolerance (float32, EPS = 2^-23 = 2u, u the unit roundoff). Every compared value is a sum of products,
each product rounded once (u relative), added up along a binary tree of additions of disjoint partial
sums (the kernels' block scans and carries, the reference's cumsums, the sums over heads or angles),
in whatever order. A tree over n terms has depth at most n - 1, so to first order
|computed - exact| <= n u sum|terms| (Higham, Accuracy and Stability, 4.2), for any order and with or
without fused multiply-adds. sum|terms| is the same computation on |inputs| in float64 (`_abs_scale`),
so the bound is elementwise: |triton - float64| <= EPS * n * abs_scale, twice the first-order bound
(room for the O(u^2) terms). n: forward, the tokens summed (<= t) plus the product's rounding, at most
t; backward, the reverse sum (<= t - 1 additions) + the product + the sum over A angles (dL/ddt) or h
heads (dL/drate): at most t + A + h. The float64 values carry their own error of n 2^-53 sum|terms|,
2^-29 of that bound. Observed: at most 0.23 of the bound (t = 1, where it is one product's rounding),
under 0.014 from t = 70 on (on an H200, not part of these tests: at most 0.21, under 0.005 from t = 257
on), while a wrong kernel is off by O(sum|terms|): each of these mutations failed the interpreted
tier3 cases (the two restart mutations the one-token test too): the restart ignored in the forward or in
the scan's combine, the carry dropped (forward, backward, no-documents path), the carry added to a block whose
first token starts a document, the carry taken from the block's first row, the document ends one token
late in the backward, dL/drate with head 0's dt, dL/ddt without rate.
"""
from __future__ import annotations

import json

import pytest
import torch

from megacpp.ops import mamba3_angles
from megacpp.ops.mamba3_angles import (
    document_angles,
    document_angles_bwd_reference,
    document_angles_reference,
)
from tests.helpers import interpreted_report

EPS = 2.0**-23
EPS64 = 2.0**-52
# (b, t, h, A, documents, tokens per block of both kernels; None: the launchers' defaults, 128 forward and
# 256 backward for these A). Odd t: 1 (one partial block), 7, 70 (a full and a partial block of 64), 131
# (three blocks of 64), 300 (three forward and two backward blocks at the defaults); one and three heads;
# A = 1, 3, 5 (padded to a power of two with masked columns) and 32 (the mixer's). Documents
# (`_start_offsets`): "none" (one per row, start_offsets None), "mixed" (one-token documents, a start on
# a block boundary, documents inside one block and documents across two or three blocks), "every" (every
# token starts one). Block size 4 puts many block boundaries into 20 tokens.
CASES = [
    (1, 1, 1, 1, "none", 64),
    (1, 1, 1, 1, "mixed", 64),
    (2, 7, 3, 5, "none", 64),
    (2, 7, 3, 5, "mixed", 64),
    (2, 70, 1, 32, "mixed", 64),
    (1, 131, 1, 32, "mixed", 64),
    (2, 131, 3, 5, "mixed", 64),
    (2, 131, 3, 32, "none", 64),
    (2, 20, 2, 3, "mixed", 4),
    (2, 9, 2, 5, "every", 64),
    (2, 300, 1, 5, "mixed", None),
    (1, 300, 1, 32, "none", None),
]
OUTPUTS = ("theta", "d_rate", "d_dt")


def _case_id(case: tuple) -> str:
    return "b{}_t{}_h{}_A{}_{}_bt{}".format(*case)


def _start_offsets(b: int, t: int, documents: str, block_t: int) -> torch.Tensor | None:
    """start_offsets (b, t) int64, built as `Segments.start_offsets` is (running max of the starts).
    "mixed" with block size bt: row 0 starts documents at 3, 4, 5 (one-token documents at 3 and 4), bt (a
    block boundary) and bt + 6 (a document up to the row's end, across blocks when t > 2 bt); row 1 at
    bt + bt // 2 (the first document spans two blocks); further rows every 5 tokens from the row index."""
    if documents == "none":
        return None
    starts = torch.zeros(b, t, dtype=torch.bool)
    starts[:, 0] = True
    for row in range(b):
        if documents == "every":
            points = range(t)
        elif row == 0:
            points = (3, 4, 5, block_t, block_t + 6)
        elif row == 1:
            points = (block_t + block_t // 2,)
        else:
            points = range(row, t, 5)
        for s in points:
            if s < t:
                starts[row, s] = True
    time = torch.arange(t)
    return torch.where(starts, time, 0).cummax(dim=1).values


def _inputs(b: int, t: int, h: int, n_angles: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rate in (-pi, pi) (pi tanh of a normal), dt in (0, 0.1) as softplus gives it, a normal cotangent.
    rate is a slice of a wider tensor (as the mixer's projection split gives it) and the cotangent a
    transposed view: the kernels read both through their strides."""
    g = torch.Generator().manual_seed(seed)
    rate = (torch.pi * torch.tanh(torch.randn(b, t, n_angles + 2, generator=g)))[..., 1:-1]
    dt = 0.1 * torch.rand(b, t, h, generator=g)
    grad = torch.randn(b, h, t, n_angles, generator=g).transpose(1, 2)
    return rate, dt, grad


def _abs_scale(rate, dt, start_offsets, grad) -> tuple[torch.Tensor, ...]:
    """The outputs computed in float64 on |rate|, |dt|, |grad|: sum|terms| of every output element."""
    rate, dt, grad = (x.double().abs() for x in (rate, dt, grad))
    return (document_angles_reference(rate, dt, start_offsets),
            *document_angles_bwd_reference(rate, dt, start_offsets, grad))


def _worst(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> list[float]:
    """[max |got - want| / bound elementwise (an element with bound 0 must match exactly: inf if not),
    max |got - want|, max |want|]."""
    err = (got.double() - want).abs()
    ratio = torch.where(bound > 0, err / bound.clamp(min=torch.finfo(torch.float64).tiny), err * float("inf"))
    return [ratio.nan_to_num(0.0).max().item(), err.max().item(), want.abs().max().item()]


def _case_errors(case: tuple, seed: int) -> dict[str, list[float]]:
    b, t, h, n_angles, documents, block_t = case
    rate, dt, grad = _inputs(b, t, h, n_angles, seed)
    so = _start_offsets(b, t, documents, block_t or mamba3_angles.FWD_BLOCK_T)
    got = (mamba3_angles.document_angles_triton(rate, dt, so, block_t=block_t),
           *mamba3_angles.document_angles_bwd_triton(rate, dt, so, grad, block_t=block_t))
    want = (document_angles_reference(rate.double(), dt.double(), so),
            *document_angles_bwd_reference(rate.double(), dt.double(), so, grad.double()))
    terms = (t, t + n_angles + h, t + n_angles + h)
    errors = {}
    for name, a, w, scale, n in zip(OUTPUTS, got, want, _abs_scale(rate, dt, so, grad), terms, strict=True):
        assert a.shape == w.shape and a.dtype == torch.float32 and a.is_contiguous(), name
        errors[name] = _worst(a, w, EPS * n * scale)
    return errors


def _one_token_documents_exact() -> bool:
    """Every token its own document: theta is the step itself, rate * dt rounded once, with no addition."""
    rate, dt, _ = _inputs(2, 9, 2, 5, seed=11)
    so = _start_offsets(2, 9, "every", 1)
    return torch.equal(mamba3_angles.document_angles_triton(rate, dt, so), rate[:, :, None, :] * dt[..., None])


def _rerun_equal() -> bool:
    """Two runs of both kernels give bitwise the same outputs (the outputs are torch.empty buffers: an
    element a kernel left unwritten would show as a difference)."""
    rate, dt, grad = _inputs(2, 20, 2, 3, seed=12)
    so = _start_offsets(2, 20, "mixed", 4)
    runs = [(mamba3_angles.document_angles_triton(rate, dt, so, block_t=4),
             *mamba3_angles.document_angles_bwd_triton(rate, dt, so, grad, block_t=4)) for _ in range(2)]
    return all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def _report() -> None:
    """Subprocess entry point: prints every result as one JSON line."""
    report = {"cases": {_case_id(c): _case_errors(c, seed) for seed, c in enumerate(CASES)},
              "one_token_documents_exact": _one_token_documents_exact(), "rerun_equal": _rerun_equal()}
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report() -> dict:
    return interpreted_report("tests.test_mamba3_angles", timeout=300)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_tier3_triton_matches_float64_reference_interpreted(report, case):
    """Forward theta and both gradients of the Triton launchers against the float64 reference, within
    EPS * n * sum|terms| elementwise (module docstring)."""
    errors = report["cases"][_case_id(case)]
    assert set(errors) == set(OUTPUTS)
    for name, (ratio, err, scale) in errors.items():
        assert ratio <= 1.0, f"{name}: max abs diff {err:.3g} is {ratio:.3g} x its bound (max |ref| {scale:.3g})"


def test_tier1_triton_one_token_documents_give_the_step_exactly_interpreted(report):
    assert report["one_token_documents_exact"]


def test_tier1_triton_rerun_bitwise_equal_interpreted(report):
    assert report["rerun_equal"]


def test_tier1_default_blocks():
    """The default-block cases above assume 128 forward and 256 backward tokens per block for A <= 32; wide
    A gets fewer tokens per block, keeping each program's tile."""
    fwd, bwd = ((mamba3_angles.FWD_BLOCK_T, mamba3_angles.FWD_MAX_TILE),
                (mamba3_angles.BWD_BLOCK_T, mamba3_angles.BWD_MAX_TILE))
    assert all(mamba3_angles._block_t(n, *fwd) == 128 and mamba3_angles._block_t(n, *bwd) == 256 for n in (5, 32))
    assert (mamba3_angles._block_t(1000, *fwd), mamba3_angles._block_t(1000, *bwd)) == (4, 8)


def _explicit_angles(rate: torch.Tensor, dt: torch.Tensor, start_offsets: torch.Tensor | None) -> torch.Tensor:
    """theta from its definition with plain torch ops, independent of the op's cumsum-and-gather: the step
    (b, t, h, A), summed over s with a (b, t, s) mask of start(t) <= s <= t."""
    b, t = rate.shape[:2]
    step = rate[:, :, None, :] * dt[..., None]
    time = torch.arange(t)
    start = torch.zeros(b, t, dtype=torch.long) if start_offsets is None else start_offsets
    mask = (time[None, None, :] <= time[None, :, None]) & (time[None, None, :] >= start[:, :, None])
    return torch.einsum("bts,bsha->btha", mask.to(step.dtype), step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("documents", ["none", "mixed", "every"])
def test_tier3_custom_op_autograd_matches_explicit_formula(dtype, documents):
    """The op (CPU: the PyTorch reference and its hand-written backward) against autograd through
    `_explicit_angles` in float64: theta and the gradients of rate and dt. The reference subtracts
    cumulative sums over the whole row (theta = total - total before the document's start; the backward
    likewise from the row's end), so its error is bounded by the row's sums, not the document's: EPS * n
    * the same computation on |inputs| without documents, n = t + 1 forward (two cumulative sums of at most
    t terms, each term's product, the subtraction) and t + A + h + 1 backward."""
    b, t, h, n_angles = 2, 37, 3, 5
    eps = EPS if dtype == torch.float32 else EPS64
    rate, dt, grad = _inputs(b, t, h, n_angles, seed=21)
    so = _start_offsets(b, t, documents, 8)
    leaves = [x.to(dtype).requires_grad_() for x in (rate, dt)]
    theta = document_angles(*leaves, so)
    got = (theta, *torch.autograd.grad(theta, leaves, grad.to(dtype)))
    exact = [x.double().requires_grad_() for x in (rate, dt)]
    want_theta = _explicit_angles(*exact, so)
    want = (want_theta, *torch.autograd.grad(want_theta, exact, grad.double()))
    scales = _abs_scale(rate, dt, None, grad)
    for name, a, w, scale, n in zip(OUTPUTS, got, want, scales, (t + 1, t + n_angles + h + 1, t + n_angles + h + 1),
                                    strict=True):
        assert a.dtype == dtype, name
        ratio, err, ref = _worst(a.detach(), w.detach(), eps * n * scale)
        assert ratio <= 1.0, f"{name}: max abs diff {err:.3g} is {ratio:.3g} x its bound (max |ref| {ref:.3g})"


def test_tier1_op_on_cpu_is_the_mixer_formula_of_before():
    """On CPU the op computes bitwise what the mixer computed before it existed: the (b, t, h, A) step,
    its cumsum along t, minus the exclusive sum at each token's document start (the mixer itself now
    calls the reference directly on CPU; tests/test_mamba3_fused.py pins its whole forward and
    gradients to that formula)."""
    rate, dt, _ = _inputs(2, 37, 3, 5, seed=22)
    for documents in ("none", "mixed"):
        so = _start_offsets(2, 37, documents, 8)
        step = rate[:, :, None, :] * dt[..., None]
        total = step.cumsum(dim=1)
        want = total if so is None else total - (total - step).gather(1, so[:, :, None, None].expand_as(step))
        assert torch.equal(document_angles(rate, dt, so), want), documents


@pytest.mark.parametrize("documents", ["none", "mixed"])
def test_tier1_compiled_fullgraph_equals_eager(isolated_dynamo, documents):
    """fullgraph=True fails on any graph break; the op is opaque, so the compiled forward and backward
    run the same implementation and must match eager bitwise."""
    rate, dt, grad = _inputs(2, 19, 3, 5, seed=23)
    so = _start_offsets(2, 19, documents, 8)
    results = []
    for fn in (document_angles, torch.compile(document_angles, fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (rate, dt)]
        theta = fn(*leaves, so)
        results.append((theta.detach(), *torch.autograd.grad(theta, leaves, grad)))
    for name, eager, compiled in zip(OUTPUTS, *results, strict=True):
        assert torch.equal(eager, compiled), name


@pytest.mark.parametrize("documents", ["none", "mixed"])
def test_tier1_custom_ops_opcheck(documents):
    """Schema, fake tensors, autograd registration and AOT dispatch of both ops (CPU, float64)."""
    rate, dt, grad = (x.double() for x in _inputs(2, 9, 3, 5, seed=24))
    so = _start_offsets(2, 9, documents, 4)
    checks = [(torch.ops.megacpp.mamba3_document_angles.default, (rate.requires_grad_(), dt.requires_grad_(), so)),
              (torch.ops.megacpp.mamba3_document_angles_bwd.default, (rate.detach(), dt.detach(), so, grad))]
    for op, args in checks:
        results = torch.library.opcheck(op, args)
        assert all(r == "SUCCESS" for r in results.values()), (op, results)


def test_tier1_triton_registered_as_cuda_kernel_only():
    for op in ("megacpp::mamba3_document_angles", "megacpp::mamba3_document_angles_bwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"), op


def test_tier1_unsupported_inputs_named():
    rate, dt, grad = _inputs(1, 3, 2, 5, seed=25)
    so = torch.zeros(1, 3, dtype=torch.long)
    assert mamba3_angles.unsupported_reason(rate, dt, so, grad) is None
    assert mamba3_angles.unsupported_reason(rate, dt, None) is None
    assert mamba3_angles.unsupported_reason(rate, dt, so.int()) is None
    assert "float32" in mamba3_angles.unsupported_reason(rate.double(), dt, so)
    assert "float32" in mamba3_angles.unsupported_reason(rate, dt, so, grad.bfloat16())
    assert "integer" in mamba3_angles.unsupported_reason(rate, dt, so.float())
    assert "empty" in mamba3_angles.unsupported_reason(rate[:, :0], dt[:, :0], None)
    with pytest.raises(ValueError, match="float32"):
        mamba3_angles.document_angles_triton(rate.double(), dt.double(), so)


def test_tier1_cuda_implementation_falls_back_to_the_reference():
    """Unsupported inputs (float64 here) go to the references, without a kernel launch (so this runs on
    CPU tensors in-process)."""
    rate, dt, grad = (x.double() for x in _inputs(2, 9, 3, 5, seed=26))
    so = _start_offsets(2, 9, "mixed", 4)
    assert torch.equal(mamba3_angles._fwd_cuda(rate, dt, so), document_angles_reference(rate, dt, so))
    got, want = mamba3_angles._bwd_cuda(rate, dt, so, grad), document_angles_bwd_reference(rate, dt, so, grad)
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True))


def test_tier1_dtypes_and_layout():
    """bfloat16 inputs compute in float32: theta float32 and contiguous, gradients in the inputs' dtype;
    start_offsets gets no gradient."""
    rate, dt, grad = _inputs(2, 9, 3, 5, seed=27)
    leaves = [x.bfloat16().requires_grad_() for x in (rate, dt)]
    theta = document_angles(*leaves, _start_offsets(2, 9, "mixed", 4))
    assert theta.dtype == torch.float32 and theta.is_contiguous() and theta.shape == (2, 9, 3, 5)
    theta.backward(grad)
    assert all(x.grad.dtype == torch.bfloat16 for x in leaves)
    assert torch.equal(theta, document_angles(*(x.detach().float() for x in leaves), _start_offsets(2, 9, "mixed", 4)))


def test_tier1_shape_mismatch_raises():
    rate, dt, _ = _inputs(2, 9, 3, 5, seed=28)
    with pytest.raises(ValueError, match="dt"):
        document_angles(rate, dt[:, :8])
    with pytest.raises(ValueError, match="start_offsets"):
        document_angles(rate, dt, torch.zeros(2, 8, dtype=torch.long))
