"""Mamba-3 SISO kernel: chunked scan vs the sequential reference, state passing, doc resets, step, grads.

Tolerances: float64 comparisons use 1e-10 of the reference's max magnitude (tens of fp64 roundings);
float32 chunked results are checked against the float64 reference at 1e-4 of its max magnitude.
bf16 matmul operands (matmul_dtype): 4 bf16 unit roundoffs (4 * 2**-8) of the max magnitude. Each of
the chained products rounds its operands once; measured errors stay below 1.8 roundoffs.
"""
from __future__ import annotations

import pytest
import torch

from megacpp.ops.mamba3_scan import mamba3_scan, mamba3_scan_sequential, mamba3_step
from tests.helpers import assert_close_scaled, documents, spans

F64_TOL = 1e-10
F32_TOL = 1e-4
BF16_TOL = 4 * 2**-8


def make_inputs(b: int, t: int, h: int, g: int, dtype: torch.dtype, seed: int, p: int = 3, n: int = 4):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=dtype)

    dt = 0.02 + 0.5 * rand(b, t, h)
    return {
        "x": randn(b, t, h, p),
        "B": randn(b, t, g, n),
        "C": randn(b, t, g, n),
        "adt": -(0.05 + 2.0 * rand(b, t, h)) * dt,
        "dt": dt,
        "lam": rand(b, t, h),
        "D": randn(h),
        "z": randn(b, t, h, p),
    }


def random_state(b: int, h: int, g: int, dtype: torch.dtype, seed: int, p: int = 3, n: int = 4):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, p, n, generator=gen, dtype=dtype),
        torch.randn(b, g, n, generator=gen, dtype=dtype),
        torch.randn(b, h, p, generator=gen, dtype=dtype),
    )


def to64(inputs: dict) -> dict:
    return {k: v.double() for k, v in inputs.items()}


CASES = [  # (t, chunk_size, h, g, use D and z)
    (1, 64, 2, 2, True),
    (13, 1, 4, 2, False),
    (13, 7, 4, 1, True),
    (33, 16, 2, 2, True),
    (33, 7, 6, 3, False),
    (50, 16, 4, 4, True),
    (70, 64, 4, 2, True),
]


@pytest.mark.parametrize("t,chunk,h,g,dz", CASES)
def test_tier3_chunked_matches_sequential_float64(t, chunk, h, g, dz):
    inp = make_inputs(2, t, h, g, torch.float64, seed=t * 100 + chunk)
    if not dz:
        inp["D"] = inp["z"] = None
    y = mamba3_scan(**inp, chunk_size=chunk)
    ref = mamba3_scan_sequential(**inp)
    assert y.dtype == torch.float64
    assert_close_scaled(y, ref, F64_TOL)


@pytest.mark.parametrize("t,chunk,h,g,dz", CASES)
def test_tier3_chunked_float32_matches_float64_reference(t, chunk, h, g, dz):
    inp = make_inputs(2, t, h, g, torch.float32, seed=t * 100 + chunk + 1)
    if not dz:
        inp["D"] = inp["z"] = None
    y = mamba3_scan(**inp, chunk_size=chunk)
    ref = mamba3_scan_sequential(**{k: None if v is None else v.double() for k, v in inp.items()})
    assert y.dtype == torch.float32
    assert_close_scaled(y, ref, F32_TOL)


@pytest.mark.parametrize("chunk", [5, 16])
def test_tier3_split_and_continue_equals_one_pass(chunk):
    inp = make_inputs(2, 29, 4, 2, torch.float64, seed=7)
    doc_ids = torch.tensor([[0] * 10 + [1] * 19, [2] * 17 + [3] * 12])
    full, full_state = mamba3_scan(**inp, doc_ids=doc_ids, chunk_size=chunk, return_final_state=True)
    cut = 13
    first = {k: v[:, :cut] if v.dim() > 1 else v for k, v in inp.items()}
    second = {k: v[:, cut:] if v.dim() > 1 else v for k, v in inp.items()}
    y1, state = mamba3_scan(**first, doc_ids=doc_ids[:, :cut], chunk_size=chunk, return_final_state=True)
    y2, state = mamba3_scan(
        **second, doc_ids=doc_ids[:, cut:], initial_state=state, chunk_size=chunk, return_final_state=True
    )
    assert_close_scaled(torch.cat([y1, y2], dim=1), full, F64_TOL)
    assert_close_scaled(state[0], full_state[0], F64_TOL)
    assert torch.equal(state[1], full_state[1]) and torch.equal(state[2], full_state[2])


def test_tier3_final_state_matches_sequential():
    inp = make_inputs(2, 23, 4, 2, torch.float64, seed=8)
    init = random_state(2, 4, 2, torch.float64, seed=9)
    _, state = mamba3_scan(**inp, initial_state=init, chunk_size=8, return_final_state=True)
    _, ref = mamba3_scan_sequential(**inp, initial_state=init, return_final_state=True)
    assert_close_scaled(state[0], ref[0], F64_TOL)


def _slice(inp: dict, start: int, stop: int) -> dict:
    return {k: v[:, start:stop] if v.dim() > 1 else v for k, v in inp.items()}


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_tier3_doc_resets_equal_separate_runs(with_initial_state):
    """Breaks when doc_boundaries finds no starts (no -inf log-decay, beta kept): the state crosses documents."""
    inp = make_inputs(1, 37, 4, 2, torch.float64, seed=11)
    bounds = [0, 5, 6, 21, 37]  # includes a one-token document and a boundary inside a chunk
    doc_ids = documents(bounds)
    init = random_state(1, 4, 2, torch.float64, seed=12) if with_initial_state else None
    packed = mamba3_scan(**inp, doc_ids=doc_ids, initial_state=init, chunk_size=8)
    for i, (lo, hi) in enumerate(spans(bounds)):
        alone = mamba3_scan_sequential(**_slice(inp, lo, hi), initial_state=init if i == 0 else None)
        assert_close_scaled(packed[:, lo:hi], alone, F64_TOL)


def test_tier3_sequential_doc_resets_equal_separate_runs():
    inp = make_inputs(1, 12, 2, 1, torch.float64, seed=13)
    doc_ids = torch.tensor([[4] * 5 + [9] * 7])
    packed = mamba3_scan_sequential(**inp, doc_ids=doc_ids)
    for lo, hi in ((0, 5), (5, 12)):
        assert_close_scaled(packed[:, lo:hi], mamba3_scan_sequential(**_slice(inp, lo, hi)), F64_TOL)


def test_tier1_constant_doc_ids_equal_no_doc_ids():
    inp = make_inputs(2, 19, 4, 2, torch.float32, seed=14)
    y = mamba3_scan(**inp, chunk_size=8)
    y_doc = mamba3_scan(**inp, doc_ids=torch.zeros(2, 19, dtype=torch.long), chunk_size=8)
    assert torch.equal(y, y_doc)


def test_tier1_scan_ignores_autocast():
    inp = make_inputs(2, 19, 4, 2, torch.float32, seed=25)
    y = mamba3_scan(**inp, chunk_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_autocast = mamba3_scan(**inp, chunk_size=8)
    assert torch.equal(y_autocast, y)


def test_tier2_rerun_identical():
    inp = make_inputs(2, 21, 4, 2, torch.float32, seed=15)
    doc_ids = torch.tensor([[0] * 9 + [1] * 12] * 2)
    assert torch.equal(mamba3_scan(**inp, doc_ids=doc_ids, chunk_size=8),
                       mamba3_scan(**inp, doc_ids=doc_ids, chunk_size=8))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64_TOL), (torch.float32, F32_TOL)])
def test_tier3_step_loop_matches_scan(dtype, tol):
    inp = make_inputs(2, 17, 4, 2, dtype, seed=16)
    state = random_state(2, 4, 2, dtype, seed=17)
    y_scan, final = mamba3_scan(**inp, initial_state=state, chunk_size=8, return_final_state=True)
    ys = []
    for i in range(17):
        step = {k: v[:, i] if v.dim() > 1 else v for k, v in inp.items()}
        y, state = mamba3_step(step["x"], step["B"], step["C"], step["adt"], step["dt"], step["lam"], state,
                               D=step["D"], z=step["z"])
        ys.append(y)
    assert_close_scaled(torch.stack(ys, 1), y_scan, tol)
    assert_close_scaled(state[0], final[0], tol)


def test_tier3_step_from_zero_state_drops_beta_term():
    inp = make_inputs(1, 1, 2, 1, torch.float64, seed=18)
    zeros = (torch.zeros(1, 2, 3, 4, dtype=torch.float64), torch.zeros(1, 1, 4, dtype=torch.float64),
             torch.zeros(1, 2, 3, dtype=torch.float64))
    step = {k: v[:, 0] if v.dim() > 1 else v for k, v in inp.items()}
    y, _ = mamba3_step(step["x"], step["B"], step["C"], step["adt"], step["dt"], step["lam"], zeros)
    # One fresh token: H = lam * dt * x B^T, so y = lam * dt * (B.C) x.
    bc = (step["B"] * step["C"]).sum(-1)
    expected = (step["lam"] * step["dt"] * bc)[..., None] * step["x"]
    assert_close_scaled(y, expected, F64_TOL)


def _grads(fn, inp: dict, init, doc_ids):
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
    init_leaves = tuple(s.clone().requires_grad_() for s in init)
    y, state = fn(**leaves, initial_state=init_leaves, doc_ids=doc_ids, chunk_size=4, return_final_state=True)
    loss = (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum() + state[0].square().sum()
    return torch.autograd.grad(loss, [*leaves.values(), *init_leaves])


def test_tier3_gradients_finite_and_match_sequential_float64():
    inp = make_inputs(2, 14, 4, 2, torch.float64, seed=19)
    init = random_state(2, 4, 2, torch.float64, seed=20)
    # boundaries on and off chunk edges
    doc_ids = torch.tensor([[0] * 4 + [1] * 3 + [2] * 7, [5] * 9 + [6] * 5])
    chunked = _grads(mamba3_scan, inp, init, doc_ids)
    reference = _grads(mamba3_scan_sequential, inp, init, doc_ids)
    for got, want in zip(chunked, reference, strict=True):
        assert torch.isfinite(got).all()
        assert_close_scaled(got, want, F64_TOL)


def test_tier3_gradients_finite_float32_strong_decay():
    inp = make_inputs(2, 40, 2, 1, torch.float32, seed=21)
    inp["adt"] = inp["adt"] * 200.0  # exp underflows to 0 inside chunks
    doc_ids = torch.randint(0, 4, (2, 40), generator=torch.Generator().manual_seed(22))
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
    y = mamba3_scan(**leaves, doc_ids=doc_ids, chunk_size=16)
    grads = torch.autograd.grad(y.square().sum(), list(leaves.values()))
    assert torch.isfinite(y).all()
    assert all(torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("matmul_dtype", [None, torch.bfloat16])
def test_tier1_compile_fullgraph_eager_backend_no_graph_breaks(matmul_dtype):
    from torch._dynamo.utils import counters

    inp = make_inputs(2, 11, 4, 2, torch.float32, seed=23)
    init = random_state(2, 4, 2, torch.float32, seed=24)
    doc_ids = torch.tensor([[0] * 4 + [1] * 7] * 2)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mamba3_scan, fullgraph=True, backend="eager")
    y, state = compiled(**inp, initial_state=init, doc_ids=doc_ids, chunk_size=4, return_final_state=True,
                        matmul_dtype=matmul_dtype)
    assert not counters["graph_break"]
    y_ref, state_ref = mamba3_scan(**inp, initial_state=init, doc_ids=doc_ids, chunk_size=4,
                                   return_final_state=True, matmul_dtype=matmul_dtype)
    assert torch.equal(y, y_ref) and torch.equal(state[0], state_ref[0])


@pytest.mark.parametrize("t,chunk,h,g,dz", CASES)
def test_tier3_bf16_matmuls_match_sequential_float64(t, chunk, h, g, dz):
    p, n = (16, 32) if t > 30 else (3, 4)
    inp = make_inputs(2, t, h, g, torch.float32, seed=t * 100 + chunk + 1, p=p, n=n)
    if not dz:
        inp.pop("D"), inp.pop("z")
    init = random_state(2, h, g, torch.float32, seed=t + 7, p=p, n=n)
    doc_ids = (torch.arange(t) // max(1, t // 3)).expand(2, t)
    y, (H, _, _) = mamba3_scan(**inp, initial_state=init, doc_ids=doc_ids, chunk_size=chunk,
                               return_final_state=True, matmul_dtype=torch.bfloat16)
    y_ref, (H_ref, _, _) = mamba3_scan_sequential(**to64(inp), initial_state=tuple(s.double() for s in init),
                                                  doc_ids=doc_ids, return_final_state=True)
    assert y.dtype == torch.float32
    assert_close_scaled(y, y_ref, BF16_TOL)
    assert_close_scaled(H, H_ref, BF16_TOL)
    # The option takes effect: fp32 operands give a different (more exact) result.
    assert not torch.equal(y, mamba3_scan(**inp, initial_state=init, doc_ids=doc_ids, chunk_size=chunk))


def test_tier3_bf16_matmul_gradients_match_sequential_float64():
    inp = make_inputs(2, 50, 6, 3, torch.float32, seed=26, p=16, n=32)
    init = random_state(2, 6, 3, torch.float32, seed=27, p=16, n=32)
    doc_ids = torch.tensor([[0] * 4 + [1] * 30 + [2] * 16, [5] * 41 + [6] * 9])

    def bf16_scan(**kwargs):
        return mamba3_scan(**kwargs, matmul_dtype=torch.bfloat16)

    got = _grads(bf16_scan, inp, init, doc_ids)
    want = _grads(mamba3_scan_sequential, to64(inp), tuple(s.double() for s in init), doc_ids)
    for g_bf16, g_ref in zip(got, want, strict=True):
        assert torch.isfinite(g_bf16).all()
        assert_close_scaled(g_bf16, g_ref, BF16_TOL)


def test_tier1_matmul_dtype_default_is_the_fp32_path():
    inp = make_inputs(2, 19, 4, 2, torch.float32, seed=28)
    assert torch.equal(mamba3_scan(**inp, chunk_size=8), mamba3_scan(**inp, chunk_size=8, matmul_dtype=torch.float32))
