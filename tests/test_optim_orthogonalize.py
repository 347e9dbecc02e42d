"""orthogonalize: singular-value bands, tall/wide/batched inputs, split-QKV, coefficient schedules."""
from __future__ import annotations

import pytest
import torch

from megacpp.optim import orthogonalize as orthogonalize_module
from megacpp.optim.orthogonalize import POLAR_EXPRESS, QUINTIC, coefficient_schedule, orthogonalize

# Bands of the output's singular values (5 steps, bf16), stated for inputs whose singular values
# span at most two decades (Gaussian matrices with aspect ratio >= 2, or an explicit spectrum from
# 1 down to 1e-2). Polar Express: [0.80, 1.20] (measured 0.857..1.143). Quintic: [0.60, 1.25]
# (measured 0.679..1.203; that iteration trades accuracy for slope at zero by design).
BANDS = {"polar_express": (0.80, 1.20), "quintic": (0.60, 1.25)}


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.float())


def _conditioned(rows: int, cols: int, smallest: float, gen: torch.Generator) -> torch.Tensor:
    """A random rows x cols matrix with singular values log-spaced from 1 down to `smallest`."""
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen))
    s = torch.logspace(0, torch.log10(torch.tensor(smallest)).item(), k)
    return (u * s) @ v.T


@pytest.mark.parametrize("fold_identity", [False, True])
@pytest.mark.parametrize("coefficients", ["polar_express", "quintic"])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 64, 128), (2, 2, 160, 48)])
def test_tier3_singular_values_in_band_gaussian(shape: tuple[int, ...], coefficients: str, fold_identity: bool
                                                ) -> None:
    gen = torch.Generator().manual_seed(0)
    out = orthogonalize(torch.randn(shape, generator=gen), coefficients=coefficients, fold_identity=fold_identity)
    assert out.shape == shape and out.dtype == torch.bfloat16
    lo, hi = BANDS[coefficients]
    s = _singular_values(out)
    assert s.min() >= lo and s.max() <= hi, (s.min().item(), s.max().item())


@pytest.mark.parametrize("fold_identity", [False, True])
@pytest.mark.parametrize("coefficients", ["polar_express", "quintic"])
@pytest.mark.parametrize("rows,cols", [(128, 128), (96, 160), (160, 96)])
def test_tier3_singular_values_in_band_conditioned(rows: int, cols: int, coefficients: str, fold_identity: bool
                                                   ) -> None:
    gen = torch.Generator().manual_seed(1)
    s = _singular_values(orthogonalize(_conditioned(rows, cols, 1e-2, gen), coefficients=coefficients,
                                       fold_identity=fold_identity))
    lo, hi = BANDS[coefficients]
    assert s.min() >= lo and s.max() <= hi, (s.min().item(), s.max().item())


def test_tier3_polar_express_tighter_than_quintic() -> None:
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(96, 256, generator=gen)
    spread = {c: _singular_values(orthogonalize(g, coefficients=c)) for c in ("polar_express", "quintic")}
    assert (spread["polar_express"] - 1).abs().max() < (spread["quintic"] - 1).abs().max()


@pytest.mark.parametrize("rows,cols", [(96, 160), (160, 96), (128, 128), (48, 200)])
def test_tier3_folded_form_as_close_to_polar_factor_as_epilogue_form(rows: int, cols: int) -> None:
    """The CUDA default X <- (a I + b A + c A^2) X against the CPU default's baddbmm epilogues: both
    bf16, so they differ bit for bit, but their distance to the exact polar factor U V^T (float64 SVD)
    may differ by at most 0.004 relative (measured over 12 seeds of these shapes: at most 2.3e-3, mean
    2e-4, against distances of 0.09-0.28 that Polar Express's 5 iterations leave by design)."""
    gen = torch.Generator().manual_seed(7)
    for g in (torch.randn(rows, cols, generator=gen), _conditioned(rows, cols, 1e-3, gen)):
        u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
        polar = u @ vh
        error = {fold: ((orthogonalize(g, fold_identity=fold).double() - polar).norm() / polar.norm()).item()
                 for fold in (False, True)}
        assert abs(error[True] - error[False]) <= 0.004, error


@pytest.mark.parametrize("rows,cols", [(160, 96), (96, 160)])
def test_tier3_folded_form_compiles_in_one_graph(rows: int, cols: int) -> None:
    """The folded form as CUDA runs it, under torch.compile(fullgraph=True) (forced here on CPU): one
    graph, and as close to the polar factor as eager within the same 0.004."""
    g = torch.randn(2, rows, cols, generator=torch.Generator().manual_seed(9))
    polar = torch.stack([u @ vh for u, _, vh in (torch.linalg.svd(m.double(), full_matrices=False) for m in g)])
    torch._dynamo.reset()
    compiled = torch.compile(orthogonalize, fullgraph=True)(g, fold_identity=True)
    eager = orthogonalize(g, fold_identity=True)
    assert compiled.shape == g.shape and compiled.dtype == torch.bfloat16
    errors = [((x.double() - polar).norm() / polar.norm()).item() for x in (compiled, eager)]
    assert abs(errors[0] - errors[1]) <= 0.004, errors


def test_tier1_cpu_default_is_the_epilogue_form() -> None:
    """The CPU path's numerics are pinned by the default-path fixtures: folding is the default only of
    compiled CUDA steps."""
    g = torch.randn(3, 40, 72, generator=torch.Generator().manual_seed(8))
    assert torch.equal(orthogonalize(g), orthogonalize(g, fold_identity=False))
    assert not torch.equal(orthogonalize(g), orthogonalize(g, fold_identity=True))


def _record_gram_kernels(monkeypatch) -> list[str]:
    """Replace `gram_polynomial` by a stub that records the kernel each call asks for (and returns an empty
    Gram-shaped tensor): the list it appends to."""
    seen: list[str] = []

    def record(M, a, b, c, kernel):
        seen.append(kernel)
        return M.new_empty(*M.shape[:-1], M.shape[-2])

    monkeypatch.setattr(orthogonalize_module, "gram_polynomial", record)
    return seen


@pytest.mark.parametrize(("shape", "expected"), [
    ((160, 768, 1024), "auto"), ((160, 1024, 768), "auto"),  # small's expert stacks, wide and tall: the kernel
    ((6, 768, 3432), "reference"), ((6, 768, 768), "reference"),  # M's in_proj and attention's: cuBLAS
    ((64, 1024, 2048), "auto")])  # nam52's expert stacks
def test_tier1_gram_kernel_takes_only_stacks_past_the_threshold(monkeypatch, shape, expected) -> None:
    """The folded iterations ask for the Gram kernel on the experts' stacks and for the reference (cuBLAS)
    on the smaller ones, whose calls cost the host more than the kernel saves (orthogonalize.py's threshold).
    Meta tensors: the shapes route the call, no arithmetic runs."""
    seen = _record_gram_kernels(monkeypatch)
    orthogonalize(torch.empty(shape, device="meta", dtype=torch.bfloat16), steps=3, fold_identity=True)
    assert seen == [expected] * 6  # two products per iteration


def test_tier1_gram_kernel_reference_keeps_every_stack_on_cublas(monkeypatch) -> None:
    """`gram_kernel="reference"` (`optim.muon_gram_kernel`) routes even the experts' stacks to the reference;
    an unknown choice is refused with the choices named."""
    seen = _record_gram_kernels(monkeypatch)
    experts = torch.empty(160, 768, 1024, device="meta", dtype=torch.bfloat16)
    orthogonalize(experts, steps=3, fold_identity=True, gram_kernel="reference")
    assert seen == ["reference"] * 6
    with pytest.raises(ValueError, match=r"unknown gram_kernel 'triton'; expected one of \('auto', 'reference'\)"):
        orthogonalize(experts, steps=3, fold_identity=True, gram_kernel="triton")


def test_tier1_tall_is_transpose_of_wide() -> None:
    g = torch.randn(40, 100, generator=torch.Generator().manual_seed(3))
    assert torch.equal(orthogonalize(g.T.contiguous()), orthogonalize(g).T)


def test_tier1_batched_equals_per_matrix() -> None:
    g = torch.randn(3, 2, 48, 96, generator=torch.Generator().manual_seed(4))
    per = torch.stack([orthogonalize(m) for m in g.reshape(-1, 48, 96)]).reshape(g.shape)
    assert torch.equal(orthogonalize(g), per)


@pytest.mark.parametrize("batch", [(), (4,)])
def test_tier1_split_qkv_equals_per_slice(batch: tuple[int, ...]) -> None:
    sizes = (64, 16, 16)  # 8 query heads, 2 kv heads, head_dim 8: q is square-ish, k and v are wide
    g = torch.randn(*batch, sum(sizes), 48, generator=torch.Generator().manual_seed(5))
    split = orthogonalize(g, split_sizes=sizes)
    per_slice = torch.cat([orthogonalize(part) for part in g.split(sizes, dim=-2)], dim=-2)
    assert torch.equal(split, per_slice)
    assert not torch.equal(split, orthogonalize(g))  # the fused matrix would mix Q, K and V


def test_tier1_torch_normalization_matches_torch_muon_iteration() -> None:
    muon_impl = pytest.importorskip("torch.optim._muon")
    g = torch.randn(48, 80, generator=torch.Generator().manual_seed(6))
    ours = orthogonalize(g, coefficients="quintic", normalization="torch", eps=1e-7)
    assert torch.equal(ours, muon_impl._zeropower_via_newtonschulz(g, QUINTIC, 5, 1e-7))


def test_tier1_coefficient_schedules() -> None:
    assert coefficient_schedule("polar_express", 5) == POLAR_EXPRESS
    assert coefficient_schedule("polar_express", 7)[5:] == (POLAR_EXPRESS[-1],) * 2
    assert coefficient_schedule("quintic", 3) == (QUINTIC,) * 3
    assert coefficient_schedule((1.0, 2.0, 3.0), 2) == ((1.0, 2.0, 3.0),) * 2
    with pytest.raises(ValueError):
        coefficient_schedule(POLAR_EXPRESS[:2], 3)
    with pytest.raises(ValueError):
        coefficient_schedule("cubic", 5)


def test_tier1_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="matrix"):
        orthogonalize(torch.randn(8))
    with pytest.raises(ValueError, match="sum"):
        orthogonalize(torch.randn(10, 4), split_sizes=(4, 4))
