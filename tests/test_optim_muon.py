"""Muon: torch.optim.Muon compatibility, lr scaling, cautious decay, variance reduction, momentum dtype,
split-QKV and stacked experts, state_dict resume."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from megacpp.optim import Muon, lr_ratio, second_moment_shape, torch_muon_compatible
from megacpp.optim.muon import Bucket, step_parts
from megacpp.optim.orthogonalize import orthogonalize

SHAPES = [(32, 48), (64, 16), (24, 24), (32, 48)]  # wide, tall, square, and a second wide (one bucket of 2)


def _least_squares(shapes: list[tuple[int, int]], seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in shapes]
    xs = [torch.randn(64, s[1], generator=gen) for s in shapes]
    ys = [torch.randn(64, s[0], generator=gen) for s in shapes]

    def loss(ps: list[nn.Parameter]) -> torch.Tensor:
        return sum(((x @ p.T - y) ** 2).mean() for p, x, y in zip(ps, xs, ys, strict=True))

    return params, loss


def _clone(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], loss, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        loss(params).backward()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_tier1_torch_compatible_matches_torch_muon(nesterov: bool, adjust_lr_fn: str | None) -> None:
    # Tolerance: none. On CPU the compatible configuration reproduces torch.optim.Muon bit for bit
    # (fp64 scalar hyperparameters round like torch's Python floats; addcmul rounds like add_(alpha)).
    ref, loss = _least_squares(SHAPES, seed=0)
    ours = _clone(ref)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    _run(torch.optim.Muon(ref, **kw), ref, loss, steps=8)
    _run(torch_muon_compatible(ours, **kw), ours, loss, steps=8)
    for a, b in zip(ref, ours, strict=True):
        assert torch.equal(a, b)


def test_tier1_lr_ratio_values() -> None:
    assert lr_ratio((768, 768), "original") == 1.0
    assert lr_ratio((3072, 768), "original") == 2.0
    assert lr_ratio((768, 3072), "original") == 1.0
    assert lr_ratio((8, 3072, 768), "original") == 2.0  # stacked: the last two dims
    assert lr_ratio((768, 768), "match_rms_adamw") == 0.2 * math.sqrt(768)
    assert lr_ratio((3072, 768), "match_rms_adamw") == lr_ratio((768, 3072), "match_rms_adamw") == 0.2 * math.sqrt(3072)
    with pytest.raises(ValueError):
        lr_ratio((4, 4), "spectral")


def test_tier1_lr_ratio_agrees_with_torch_adjust_lr() -> None:
    muon_impl = pytest.importorskip("torch.optim._muon")
    for shape in [(768, 768), (3072, 768), (768, 3072), (5, 3)]:
        for mode in ("original", "match_rms_adamw"):
            assert lr_ratio(shape, mode) * 0.02 == muon_impl._adjust_lr(0.02, mode, torch.Size(shape))


def _plain(params, **kw) -> Muon:
    """Muon whose update is exactly -lr * ratio * orthogonalize(grad): no momentum, decay or VR."""
    return Muon(params, lr=0.05, momentum=0.0, nesterov=False, variance_reduction=False,
                cautious_weight_decay=False, **kw)


def _expected_plain(p0: torch.Tensor, grad: torch.Tensor, ratio: float, **orth_kw) -> torch.Tensor:
    step = (torch.tensor(0.05, dtype=torch.float64) * ratio).float()
    return torch.addcmul(p0 * 1.0, orthogonalize(grad, **orth_kw).float(), -step)


def test_tier1_per_group_lr_scaling() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = (nn.Parameter(torch.randn(48, 16, generator=gen)) for _ in range(2))
    a0, b0 = a.detach().clone(), b.detach().clone()
    a.grad, b.grad = torch.randn(48, 16, generator=gen), torch.randn(48, 16, generator=gen)
    _plain([{"params": [a]}, {"params": [b], "lr_scaling": "match_rms_adamw"}]).step()
    assert torch.equal(a, _expected_plain(a0, a.grad, lr_ratio(a.shape, "original")))
    assert torch.equal(b, _expected_plain(b0, b.grad, lr_ratio(b.shape, "match_rms_adamw")))


def test_tier1_split_qkv_group_is_honoured() -> None:
    gen = torch.Generator().manual_seed(2)
    w = nn.Parameter(torch.randn(64, 32, generator=gen))
    w0 = w.detach().clone()
    w.grad = torch.randn(64, 32, generator=gen)
    _plain([w], split_sizes=(32, 16, 16)).step()
    assert torch.equal(w, _expected_plain(w0, w.grad, lr_ratio(w.shape, "original"), split_sizes=(32, 16, 16)))
    assert not torch.equal(w, _expected_plain(w0, w.grad, lr_ratio(w.shape, "original")))


def test_tier1_stacked_experts_are_independent_matrices() -> None:
    gen = torch.Generator().manual_seed(3)
    w = nn.Parameter(torch.randn(4, 24, 40, generator=gen))
    w0 = w.detach().clone()
    w.grad = torch.randn(4, 24, 40, generator=gen)
    _plain([w]).step()
    per_expert = torch.stack([_expected_plain(w0[e], w.grad[e], lr_ratio((24, 40), "original")) for e in range(4)])
    assert torch.equal(w, per_expert)


def test_tier1_cautious_mask_decays_only_where_update_and_param_agree() -> None:
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(32, 48, generator=gen)
    grad = torch.randn(32, 48, generator=gen)
    results = {}
    for cautious in (True, False):
        p = nn.Parameter(p0.clone())
        p.grad = grad.clone()
        Muon([p], lr=0.05, weight_decay=0.5, momentum=0.0, nesterov=False, variance_reduction=False,
             cautious_weight_decay=cautious).step()
        results[cautious] = p.detach()
    ortho = orthogonalize(grad).float()
    agree = ortho * p0 > 0
    assert 0 < agree.sum() < agree.numel()
    assert torch.equal(results[True][agree], results[False][agree])  # decayed in both
    undecayed = torch.addcmul(p0, ortho, -(torch.tensor(0.05, dtype=torch.float64) * 1.0).float())
    assert torch.equal(results[True][~agree], undecayed[~agree])  # no decay where they disagree
    assert not torch.equal(results[False][~agree], undecayed[~agree])


@pytest.mark.parametrize("shape,expected", [
    ((64, 16), (64, 1)),  # tall: per row
    ((16, 64), (1, 64)),  # wide: per column
    ((32, 32), (1, 32)),  # square counts as "otherwise": per column
    ((3, 64, 16), (3, 64, 1)),  # stacked experts: one factored moment per matrix
])
def test_tier1_variance_reduction_state_shapes(shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    assert second_moment_shape(shape) == expected
    p = nn.Parameter(torch.randn(shape))
    p.grad = torch.randn(shape)
    opt = Muon([p], variance_reduction=True)
    opt.step()
    sm = opt.state[p]["second_moment"]
    assert sm.shape == expected and sm.dtype == torch.float32 and (sm > 0).all()


def test_tier3_variance_reduction_keeps_update_norm_and_reweights_rows() -> None:
    # Tolerance: 1e-5 relative on the Frobenius norm (fp32 rounding over a few thousand terms).
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(96, 32, generator=gen)
    grad = torch.randn(96, 32, generator=gen) * torch.linspace(0.1, 3.0, 96)[:, None]  # uneven rows
    deltas = {}
    for vr in (True, False):
        p = nn.Parameter(p0.clone())
        p.grad = grad.clone()
        Muon([p], lr=0.05, momentum=0.0, nesterov=False, variance_reduction=vr, cautious_weight_decay=False).step()
        deltas[vr] = p.detach() - p0
    n_vr, n_plain = deltas[True].norm(), deltas[False].norm()
    assert abs(n_vr / n_plain - 1) < 1e-5
    row_rms_vr, row_rms_plain = deltas[True].norm(dim=1), deltas[False].norm(dim=1)
    assert row_rms_vr.std() < row_rms_plain.std()  # rows evened out, like a per-row AdamW denominator


@pytest.mark.parametrize("dtype,nbytes", [("bfloat16", 2), ("float32", 4)])
def test_tier1_momentum_buffer_dtype(dtype: str, nbytes: int) -> None:
    p = nn.Parameter(torch.randn(16, 24))
    p.grad = torch.randn(16, 24)
    opt = Muon([p]) if dtype == "bfloat16" else Muon([p], momentum_dtype=torch.float32)
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    assert buf.dtype == getattr(torch, dtype) and buf.element_size() == nbytes and buf.abs().sum() > 0


def test_tier1_state_dict_resume_is_bitwise_and_keeps_bf16_momentum() -> None:
    params, loss = _least_squares(SHAPES, seed=6)
    opt = Muon(params, weight_decay=0.1)
    _run(opt, params, loss, steps=3)
    saved_params, saved_state = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    _run(opt, params, loss, steps=3)

    resumed = [nn.Parameter(p.clone()) for p in saved_params]
    opt2 = Muon(resumed, weight_decay=0.1)
    opt2.load_state_dict(saved_state)
    assert all(opt2.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in resumed)
    _run(opt2, resumed, loss, steps=3)
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)


def test_tier1_load_state_dict_keeps_hparam_tensor_identity() -> None:
    p = nn.Parameter(torch.randn(8, 8))
    opt = Muon([p], lr=0.01)
    lr_tensor = opt.param_groups[0]["lr"]
    state = copy.deepcopy(opt.state_dict())
    state["param_groups"][0]["lr"] = torch.tensor(0.5, dtype=torch.float64)
    opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == 0.5


def test_tier1_rejects_vectors_and_bad_group_settings() -> None:
    with pytest.raises(ValueError, match="ndim"):
        Muon([nn.Parameter(torch.randn(8))])
    with pytest.raises(ValueError, match="rows"):
        Muon([nn.Parameter(torch.randn(10, 4))], split_sizes=(4, 4))
    with pytest.raises(ValueError, match="lr scaling"):
        Muon([nn.Parameter(torch.randn(10, 4))], lr_scaling="spectral")


def test_tier1_matrix_by_matrix_stages_equal_the_stacked_arithmetic() -> None:
    """The elementwise stages run matrix by matrix (no stacked copies of gradients, buffers and weights)
    and reproduce, bit for bit, the same formulas on the stacked bucket: momentum (EMA, Nesterov) with
    bf16 buffers, then variance-reduction product, cautious decay and the step. Elementwise ops give
    each element the same operations on the same values either way."""
    from megacpp.optim.muon import BucketPlan, apply_update, momentum_updates, variance_scale
    from megacpp.optim.orthogonalize import POLAR_EXPRESS

    gen = torch.Generator().manual_seed(11)
    n, shape = 3, (2, 24, 40)
    grads = [torch.randn(shape, generator=gen) for _ in range(n)]
    buffers = [torch.randn(shape, generator=gen).bfloat16() for _ in range(n)]
    momentum = torch.tensor(0.95, dtype=torch.float64)
    stacked_grad, stacked_buf = torch.stack(grads), torch.stack(buffers).float()
    expected_buf = stacked_buf.lerp(stacked_grad, (1 - momentum).float())
    expected_update = stacked_grad.lerp(expected_buf, momentum.float())
    updates = momentum_updates(grads, buffers, momentum, nesterov=True)
    assert torch.equal(torch.stack(updates), expected_update)
    assert torch.equal(torch.stack(buffers), expected_buf.bfloat16())

    params = [torch.randn(shape, generator=gen) for _ in range(n)]
    ortho = torch.randn(n, *shape, generator=gen).bfloat16()
    second = [torch.rand(2, 1, 40, generator=gen) for _ in range(n)]
    beta2 = torch.tensor(0.95, dtype=torch.float64)
    lr, wd = torch.tensor(0.02, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)
    plan = BucketPlan(None, 1.3, True, True, True, POLAR_EXPRESS, "polar_express", 1e-6, "auto")
    stacked_param = torch.stack(params)
    scale = variance_scale(ortho.float(), [s.clone() for s in second], beta2)
    update = ortho.float() * scale
    keep = (1 - lr * wd).float()
    keep = 1 + (keep - 1) * (update * stacked_param > 0)
    expected = torch.addcmul(stacked_param * keep, update, -(lr * plan.lr_ratio).float())
    apply_update(params, ortho, lr, wd, plan, scale)
    assert torch.equal(torch.stack(params), expected)


def test_tier1_bucket_of_matrices_steps_like_each_matrix_alone() -> None:
    """A bucket stacks its same-shape matrices and orthogonalizes them with one bmm chain; each matrix
    gets bitwise the update it gets as a bucket of its own (one matrix per group). Bitwise on CPU, where
    every matrix of a batch goes through the same GEMM kernel as a batch of one; a GPU library may pick
    another kernel for another batch size (a bf16-rounding difference, not tested here)."""
    gen = torch.Generator().manual_seed(12)
    shapes = [(24, 40)] * 3 + [(2, 40, 24)] * 2
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    alone = _clone(params)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    together = Muon(params, weight_decay=0.1)
    separate = Muon([{"params": [p]} for p in alone], weight_decay=0.1)
    assert len(together.buckets()) == 0  # no gradients yet
    for step_grads in grads:
        for p, q, g in zip(params, alone, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        assert len(together.buckets()) == 2 and len(separate.buckets()) == len(shapes)
        together.step()
        separate.step()
    for p, q in zip(params, alone, strict=True):
        assert torch.equal(p, q)


def _buckets(*sizes: int) -> list[Bucket]:
    return [Bucket([torch.zeros(2, 2)] * n, {}, None) for n in sizes]


@pytest.mark.parametrize(("sizes", "parts", "runs"), [
    ((10, 1, 1), 2, [[10], [1, 1]]),
    ((1, 1, 10), 2, [[1, 1], [10]]),
    ((3, 3, 3, 3), 2, [[3, 3], [3, 3]]),
    ((1, 2, 3, 4, 5, 6), 2, [[1, 2, 3, 4], [5, 6]]),
    ((1, 2, 3, 4, 5, 6), 3, [[1, 2, 3], [4, 5], [6]]),
    ((5,), 2, [[5]]),
    ((), 2, []),
])
def test_tier1_step_parts_are_runs_of_consecutive_buckets_with_even_matrix_counts(sizes, parts, runs):
    buckets = _buckets(*sizes)
    split = step_parts(buckets, parts)
    assert [[len(b.params) for b in run] for run in split] == runs
    assert [b for run in split for b in run] == buckets  # every bucket once, in step order


def test_tier1_a_step_in_parts_equals_the_step_in_one_call(monkeypatch):
    """Buckets are independent: stepping them as two calls changes no bit of the parameters or state."""
    import megacpp.optim.muon as muon_module

    results = []
    for parts in ((muon_module.muon_step,), muon_module.STEP_PARTS):
        monkeypatch.setattr(muon_module, "STEP_PARTS", parts)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(8, 6)] * 3 + [(5, 7)] * 2 + [(3, 4, 4)]]
        opt = Muon(params, lr=0.05, weight_decay=0.1)
        for step in range(2):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
            opt.step()
        results.append([p.detach().clone() for p in params] +
                       [t.clone() for p in params for t in opt.state[p].values() if torch.is_tensor(t)])
    assert len(step_parts(opt.buckets(), 2)) == 2
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("choice", ["auto", "reference"])
def test_tier1_the_gram_kernel_setting_reaches_every_muon_bucket(choice):
    """`optim.muon_gram_kernel` goes from the config through the stack's Muon to every bucket's plan, which
    hands it to `orthogonalize`; Muon refuses a choice it does not know, naming the choices."""
    from megacpp.optim import OptimConfig, build_optimizers
    from megacpp.optim.hparams import gradient_stand_in
    from tests.test_optim_standins import TinyHybrid

    stack = build_optimizers(TinyHybrid(), OptimConfig(muon_gram_kernel=choice), log=None)
    (muon,) = [opt for opt in stack.optimizers if isinstance(opt, Muon)]
    plans = [bucket.plan for bucket in muon.buckets(gradient_stand_in)]
    assert len(plans) >= 3 and {plan.gram_kernel for plan in plans} == {choice}
    with pytest.raises(ValueError, match=r"unknown gram_kernel 'triton'; expected one of \('auto', 'reference'\)"):
        Muon([nn.Parameter(torch.zeros(4, 4))], gram_kernel="triton")
