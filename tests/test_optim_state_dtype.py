"""Moments stored in bf16 (Muon's momentum, AdamW's first moment) with fp32 arithmetic: the update is the
fp32 update of a buffer rounded to bf16 after every write, the state is half the bytes, the float32
setting is what it always was, and a resume keeps or converts the stored dtype."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megacpp.config import Config, to_dict
from megacpp.optim import AdamW, Muon, OptimConfig, build_optimizers
from megacpp.optim.groups import optimizer_state_bytes
from megacpp.optim.state_dtype import state_dtype_name
from megacpp.train.resume_rules import state_dtype_changes
from tests.test_optim_adamw import _problem
from tests.test_optim_muon import SHAPES, _least_squares
from tests.test_optim_standins import TinyHybrid


def _clone(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def _step(opt: torch.optim.Optimizer, params: list[nn.Parameter], loss) -> None:
    opt.zero_grad()
    loss(params).backward()
    opt.step()


def _round_to_bf16_(opt: torch.optim.Optimizer, key: str) -> None:
    """What bf16 storage does to an fp32 buffer after its write: one round to nearest even."""
    for state in opt.state.values():
        state[key].copy_(state[key].bfloat16())


@pytest.mark.parametrize("nesterov", [True, False])
def test_tier1_muon_bf16_momentum_is_the_fp32_update_of_a_rounded_buffer(nesterov: bool) -> None:
    """Every step equals an fp32-momentum Muon whose buffer the test rounds to bf16 after each step: the
    update reads the unrounded fp32 momentum, only the stored copy is rounded."""
    shapes = [*SHAPES, (37, 11)]  # an odd size beside the shared ones
    ref, loss = _least_squares(shapes, seed=4)
    ours = _clone(ref)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    reference = Muon(ref, momentum_dtype="float32", **kw)
    stored = Muon(ours, momentum_dtype="bfloat16", **kw)
    for step in range(6):
        _step(reference, ref, loss)
        _round_to_bf16_(reference, "momentum_buffer")
        _step(stored, ours, loss)
        for a, b in zip(ref, ours, strict=True):
            assert torch.equal(a, b), f"step {step}: parameter {tuple(a.shape)}"
            assert stored.state[b]["momentum_buffer"].dtype == torch.bfloat16
            assert torch.equal(reference.state[a]["momentum_buffer"], stored.state[b]["momentum_buffer"].float())


def test_tier1_adamw_bf16_first_moment_is_the_fp32_update_of_a_rounded_buffer() -> None:
    """Every step equals an fp32 AdamW whose first moment the test rounds to bf16 after each step; the
    second moment stays fp32 and equal."""
    ref, loss = _problem(3)
    ours = _clone(ref)
    kw = dict(lr=0.01, weight_decay=0.1)
    reference, stored = AdamW(ref, **kw), AdamW(ours, momentum_dtype=torch.bfloat16, **kw)
    for step in range(6):
        _step(reference, ref, loss)
        _round_to_bf16_(reference, "exp_avg")
        _step(stored, ours, loss)
        for a, b in zip(ref, ours, strict=True):
            assert torch.equal(a, b), f"step {step}: parameter {tuple(a.shape)}"
            mine = stored.state[b]
            assert mine["exp_avg"].dtype == torch.bfloat16 and mine["exp_avg_sq"].dtype == torch.float32
            assert torch.equal(reference.state[a]["exp_avg"], mine["exp_avg"].float())
            assert torch.equal(reference.state[a]["exp_avg_sq"], mine["exp_avg_sq"])


def test_tier3_muon_bf16_momentum_stays_near_fp32_momentum() -> None:
    """Bound: 5% of each matrix's displacement after 8 steps (Frobenius). The orthogonalization already
    runs in bf16 (input rounded, five bf16 iterations), so any input change larger than half a bf16 ulp
    flips roundings inside it and the two runs differ by its own rounding noise, a few bf16 roundings
    (2^-8 = 0.39% each) per entry: measured 1.1-1.7% on these problems."""
    ref, loss = _least_squares(SHAPES, seed=3)
    ours, start = _clone(ref), _clone(ref)
    kw = dict(lr=0.02, weight_decay=0.1)
    wide, narrow = Muon(ref, momentum_dtype="float32", **kw), Muon(ours, momentum_dtype="bfloat16", **kw)
    for _ in range(8):
        _step(wide, ref, loss)
        _step(narrow, ours, loss)
    for a, b, p0 in zip(ref, ours, start, strict=True):
        assert not torch.equal(a, b), "bf16 storage changed nothing: the setting is not applied"
        assert (a - b).norm() <= 0.05 * (a - p0).norm(), ((a - b).norm() / (a - p0).norm()).item()


def test_tier3_adamw_bf16_first_moment_stays_near_fp32() -> None:
    """Bound: 2^-8 / (1 - beta1) = 3.9% of each parameter's displacement after 10 steps (Frobenius). Each
    write of the first moment rounds it by at most 2^-8 of its value (bf16's unit roundoff); older roundings
    decay by beta1 per step, so its error stays below 2^-8 / (1 - beta1) of its size, and the step
    lr * m / (sqrt(v) + eps) is linear in m (v is fp32 and the same to first order). Measured 0.13%."""
    ref, loss = _problem(2)
    ours, start = _clone(ref), _clone(ref)
    wide = AdamW(ref, lr=0.01, weight_decay=0.1)
    narrow = AdamW(ours, lr=0.01, weight_decay=0.1, momentum_dtype="bfloat16")
    for _ in range(10):
        _step(wide, ref, loss)
        _step(narrow, ours, loss)
    bound = 2.0 ** -8 / (1 - 0.9)
    for a, b, p0 in zip(ref, ours, start, strict=True):
        assert not torch.equal(a, b), "bf16 storage changed nothing: the setting is not applied"
        assert (a - b).norm() <= bound * (a - p0).norm(), ((a - b).norm() / (a - p0).norm()).item()


def test_tier1_adamw_float32_is_the_default() -> None:
    """momentum_dtype float32 is AdamW's default and keeps fp32 first moments (that this path is the one
    from before the setting existed, bit for bit, is tests/test_determinism.py's pinned fixture)."""
    ref, loss = _problem(5)
    ours = _clone(ref)
    default, explicit = AdamW(ref, lr=0.01), AdamW(ours, lr=0.01, momentum_dtype="float32")
    for _ in range(3):
        _step(default, ref, loss)
        _step(explicit, ours, loss)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))
    assert all(s["exp_avg"].dtype == torch.float32 for s in explicit.state.values())


def test_tier1_adamw_state_dict_resume_keeps_bf16_first_moment_and_is_bitwise() -> None:
    params, loss = _problem(1)
    opt = AdamW(params, lr=0.01, weight_decay=0.1, momentum_dtype="bfloat16")
    for _ in range(3):
        _step(opt, params, loss)
    saved_params, saved_state = _clone(params), copy.deepcopy(opt.state_dict())
    for _ in range(3):
        _step(opt, params, loss)
    resumed = _clone(saved_params)
    opt2 = AdamW(resumed, lr=0.01, weight_decay=0.1, momentum_dtype="bfloat16")
    opt2.load_state_dict(saved_state)  # torch's loader casts every state tensor to the parameter's dtype
    assert all(opt2.state[p]["exp_avg"].dtype == torch.bfloat16 for p in resumed)
    for _ in range(3):
        _step(opt2, resumed, loss)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed, strict=True))


def test_state_dtype_names_are_checked() -> None:
    assert state_dtype_name(torch.bfloat16) == state_dtype_name("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="momentum_dtype must be one of"):
        AdamW([nn.Parameter(torch.zeros(2))], momentum_dtype=torch.float16)
    with pytest.raises(ValueError, match="momentum_dtype must be one of"):
        Muon([nn.Parameter(torch.zeros(2, 2))], momentum_dtype="float16")


def test_tier1_state_bytes_count_two_bytes_per_bf16_moment_entry() -> None:
    """The routing table's state bytes (the run header) and the auto strategy's estimate follow the
    setting: bf16 first moments save 2 bytes per AdamW parameter, bf16 Muon momentum 2 per Muon parameter,
    and the table's total is what the optimizers hold after a step."""
    model = TinyHybrid()
    stack = build_optimizers(model, OptimConfig(), log=None)
    adamw_numel = sum(p.numel() for g in stack.by_name["adamw"].param_groups for p in g["params"])
    muon_numel = sum(p.numel() for g in stack.by_name["muon"].param_groups for p in g["params"])
    sizes = {}
    for muon, adamw in [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]:
        cfg = OptimConfig(momentum_dtype=muon, adamw_momentum_dtype=adamw)
        sizes[muon, adamw] = optimizer_state_bytes(model, cfg)
        stack = build_optimizers(model, cfg, log=None)
        held = sum(t.numel() * t.element_size() for t in stack.moments().values())
        assert held == sizes[muon, adamw]
        assert stack.routing_table.splitlines()[-1].split()[-1] == f"{held:,}"
    assert sizes["float32", "float32"] - sizes["bfloat16", "float32"] == 2 * muon_numel
    assert sizes["bfloat16", "float32"] - sizes["bfloat16", "bfloat16"] == 2 * adamw_numel


def _config(**optim: str) -> dict:
    cfg = Config()
    for key, value in optim.items():
        setattr(cfg.optim, key, value)
    return to_dict(cfg)


def _without(optim: dict, key: str) -> dict:
    return {k: v for k, v in optim.items() if k != key}


@pytest.mark.parametrize(("saved_optim", "now", "line"), [
    (_config(momentum_dtype="bfloat16")["optim"], {"momentum_dtype": "float32"},
     "resuming with optim.momentum_dtype = 'float32' (the checkpoint stored 'bfloat16'): its moments are widened "
     "exactly as they load"),
    (_config()["optim"], {"adamw_momentum_dtype": "bfloat16"},
     "resuming with optim.adamw_momentum_dtype = 'bfloat16' (the checkpoint stored 'float32'): its moments are "
     "rounded once as they load"),
    # a checkpoint written before the setting existed stored AdamW's first moment in fp32
    (_without(_config()["optim"], "adamw_momentum_dtype"), {"adamw_momentum_dtype": "bfloat16"},
     "resuming with optim.adamw_momentum_dtype = 'bfloat16' (the checkpoint stored 'float32'): its moments are "
     "rounded once as they load"),
])
def test_tier1_resume_notes_each_moment_dtype_change_in_one_line(saved_optim: dict, now: dict, line: str) -> None:
    config = _config(**now)
    assert state_dtype_changes({"config": {"optim": saved_optim}}, config) == [line]
    assert state_dtype_changes({"config": {"optim": config["optim"]}}, config) == []
