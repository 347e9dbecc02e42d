"""AdamW companion: agreement with torch.optim.AdamW, tensor hyperparameters, state_dict resume."""
from __future__ import annotations

import copy

import torch
from torch import nn

from megacpp.optim import AdamW


def _problem(seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(16, 8), (8,), (3, 4, 5)]]
    targets = [torch.randn(p.shape, generator=gen) for p in params]

    def loss(ps: list[nn.Parameter]) -> torch.Tensor:
        return sum(((p - t) ** 2 * (1 + t.abs())).sum() for p, t in zip(ps, targets, strict=True))

    return params, loss


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], loss, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        loss(params).backward()
        opt.step()


def test_tier3_matches_torch_adamw() -> None:
    # Tolerance: per step, 4 fp32 roundings of the value and of an lr-sized update,
    # |diff| <= steps * 4 * eps32 * (|p| + lr). The kernels differ (torch's default foreach path vs our
    # fused call, and our decay factor is the fp32 tensor 1 - lr * wd), so single roundings differ.
    steps, lr = 10, 0.01
    ref, loss = _problem(0)
    ours = [nn.Parameter(p.detach().clone()) for p in ref]
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    _run(torch.optim.AdamW(ref, **kw), ref, loss, steps)
    _run(AdamW(ours, **kw), ours, loss, steps)
    for a, b in zip(ref, ours, strict=True):
        tol = steps * 4 * torch.finfo(torch.float32).eps * (a.detach().abs() + lr)
        assert ((a - b).abs() <= tol).all(), (a - b).abs().max()


def test_tier1_lr_change_through_tensor_takes_effect() -> None:
    p = nn.Parameter(torch.zeros(4))
    opt = AdamW([p], lr=0.1)
    opt.param_groups[0]["lr"].fill_(0.0)  # as the scheduler writes it
    p.grad = torch.ones(4)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(4))
    opt.param_groups[0]["lr"].fill_(0.1)
    opt.step()
    assert (p.detach() < 0).all()


def test_tier1_state_dict_resume_is_bitwise() -> None:
    params, loss = _problem(1)
    opt = AdamW(params, lr=0.01, weight_decay=0.1)
    _run(opt, params, loss, steps=3)
    saved_params, saved_state = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    _run(opt, params, loss, steps=3)
    resumed = [nn.Parameter(p.clone()) for p in saved_params]
    opt2 = AdamW(resumed, lr=0.01, weight_decay=0.1)
    opt2.load_state_dict(saved_state)
    assert all(opt2.state[p]["step"].dtype == torch.float32 for p in resumed)
    _run(opt2, resumed, loss, steps=3)
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)
