"""Learning-rate factors per block kind (`optim.lr_scale_by_kind`): the param groups they make, the lr
those groups get, what the optimizers then do with it, and that without a factor nothing changes."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from megacpp.model.hints import run_after_optimizer_step
from megacpp.model.hybrid import HybridLM
from megacpp.model.params import parameter_parts
from megacpp.model.registry import BLOCK_KINDS
from megacpp.optim import OptimConfig, OptimizerStack, build_optimizers
from megacpp.optim.kind_scales import parse_lr_scales
from megacpp.presets import tiny
from tests.test_optim_standins import TinyHybrid

# TinyHybrid's param groups before lr_scale_by_kind existed, from docs/optim.md's routing rules: per
# optimizer in registry order, groups in order of their first parameter, split-QKV in a group of its
# own, < 2-D parameters in ":no_decay", Engram matrices with the hidden ones; muon_lr 0.02, adamw_lr 3e-3
# (the match_rms_adamw scaling reuses it).
TODAYS_GROUPS = [
    ("muon:original", 0.02, ["blocks.0.mixer.qkv.weight"]),
    ("muon:original", 0.02, ["blocks.0.mixer.out.weight", "blocks.1.mixer.in_proj.weight",
                             "blocks.1.mixer.out_proj.weight", "blocks.1.engram.0.weight", "blocks.1.engram.1.weight",
                             "blocks.3.mixer.fc_in.weight", "blocks.3.mixer.fc_out.weight"]),
    ("muon:match_rms_adamw", 3e-3, ["blocks.2.mixer.w_up", "blocks.2.mixer.w_down"]),
    ("adamw:embed", 3e-3, ["tok_embed.weight", "ngram_embed.weight"]),
    ("adamw:other:no_decay", 3e-3, ["blocks.0.norm.weight", "blocks.1.norm.weight", "blocks.1.mixer.decay",
                                    "blocks.2.norm.weight", "blocks.3.norm.weight", "blocks.3.mixer.fc_out.bias",
                                    "norm_f.weight"]),
    ("adamw:other", 3e-3, ["blocks.1.mixer.bc_bias", "blocks.2.mixer.gate.weight"]),
    ("adamw:head", 3e-3, ["lm_head.weight", "mtp.0.weight"]),
]


def _groups(stack: OptimizerStack, model: torch.nn.Module) -> list[tuple[str, float, list[str]]]:
    names = {p: n for n, p in model.named_parameters()}
    return [(g["name"], g["base_lr"], [names[p] for p in g["params"]]) for opt in stack.optimizers
            for g in opt.param_groups]


def test_tier1_without_factors_the_param_groups_are_todays() -> None:
    model = TinyHybrid()
    stack = build_optimizers(model, OptimConfig(lr_scale_by_kind=[]), log=None)
    assert _groups(stack, model) == TODAYS_GROUPS
    for opt in stack.optimizers:
        for g in opt.param_groups:
            assert torch.equal(g["lr"], torch.tensor(g["base_lr"], dtype=g["lr"].dtype))
    assert "@" not in stack.routing_table and "lr_scale_by_kind" not in stack.routing_table


def test_tier1_a_half_factor_halves_exactly_that_kinds_groups_and_the_schedule_multiplies_on_top() -> None:
    """M=0.5 on TinyHybrid (block 1 is M, with an Engram branch): the M mixer's and norm's parameters
    move to "@M" groups at half the base lr; the Engram matrices and every other group keep theirs. With
    4 warmup steps the first step's lr is a quarter of that (powers of two: every product is exact)."""
    model = TinyHybrid()
    stack = build_optimizers(model, OptimConfig(lr_scale_by_kind=["M=0.5"], warmup_steps=4), log=None)
    expected = [
        ("muon:original", 0.02, ["blocks.0.mixer.qkv.weight"]),
        ("muon:original", 0.02, ["blocks.0.mixer.out.weight", "blocks.1.engram.0.weight", "blocks.1.engram.1.weight",
                                 "blocks.3.mixer.fc_in.weight", "blocks.3.mixer.fc_out.weight"]),
        ("muon:original@M", 0.02 / 2, ["blocks.1.mixer.in_proj.weight", "blocks.1.mixer.out_proj.weight"]),
        ("muon:match_rms_adamw", 3e-3, ["blocks.2.mixer.w_up", "blocks.2.mixer.w_down"]),
        ("adamw:embed", 3e-3, ["tok_embed.weight", "ngram_embed.weight"]),
        ("adamw:other:no_decay", 3e-3, ["blocks.0.norm.weight", "blocks.2.norm.weight", "blocks.3.norm.weight",
                                        "blocks.3.mixer.fc_out.bias", "norm_f.weight"]),
        ("adamw:other@M:no_decay", 3e-3 / 2, ["blocks.1.norm.weight", "blocks.1.mixer.decay"]),
        ("adamw:other@M", 3e-3 / 2, ["blocks.1.mixer.bc_bias"]),
        ("adamw:other", 3e-3, ["blocks.2.mixer.gate.weight"]),
        ("adamw:head", 3e-3, ["lm_head.weight", "mtp.0.weight"]),
    ]
    assert _groups(stack, model) == expected
    for opt in stack.optimizers:
        for g in opt.param_groups:
            assert torch.equal(g["lr"], torch.tensor(g["base_lr"] / 4, dtype=g["lr"].dtype)), g["name"]
    rows = {line.split()[0] for line in stack.routing_table.splitlines()}
    assert {"muon:original@M", "adamw:other@M"} <= rows
    assert "lr_scale_by_kind: @M x 0.5" in stack.routing_table


def test_a_factor_for_a_kind_the_model_lacks_is_an_error_naming_its_blocks() -> None:
    with pytest.raises(ValueError, match=r"block kind\(s\) R, but the model's blocks are AMEF"):
        build_optimizers(TinyHybrid(), OptimConfig(lr_scale_by_kind=["M=0.5", "R=0.5"]), log=None)


def test_tier1_parse_lr_scales() -> None:
    assert parse_lr_scales([]) == {}
    assert parse_lr_scales(["M=0.5", " R = 0 ", "E=2"]) == {"M": 0.5, "R": 0.0, "E": 2.0}
    for bad, why in [("M", "is not <kind>=<factor>"), ("X=1", "with a kind among A, M, R, E, F"),
                     ("m=1", "with a kind among"), ("M=", "factor '' is not a number"),
                     ("M=half", "factor 'half' is not a number"), ("M=-0.5", "finite number >= 0"),
                     ("M=inf", "finite number >= 0"), ("M=nan", "finite number >= 0")]:
        with pytest.raises(ValueError, match=why):
            parse_lr_scales([bad])
    with pytest.raises(ValueError, match="kind M is given more than once"):
        parse_lr_scales(["M=0.5", "M=0.25"])


# ---------------------------------------------------------------- the tiny preset's model, stepped


def _tiny_model() -> HybridLM:
    cfg = tiny().model
    cfg.vocab_size = 300
    torch.manual_seed(0)
    return HybridLM(cfg)


def _train(scales: list[str], steps: int = 3, **optim: float) -> tuple[HybridLM, OptimizerStack]:
    """`steps` optimizer steps of the tiny preset's model on fixed random tokens (as the trainer does
    them: stack step, then the post-step hooks)."""
    model = _tiny_model()
    cfg = dataclasses.replace(tiny().optim, lr_scale_by_kind=scales, **optim)
    stack = build_optimizers(model, cfg, total_steps=10, log=None)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, 300, (2, 33), generator=gen)
        stack.zero_grad()
        model(idx[:, :-1], idx[:, 1:]).backward()
        stack.step()
        run_after_optimizer_step(model)
    return model, stack


def _weights(model: HybridLM) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tier1_the_scaled_groups_hold_exactly_each_kinds_blocks_parameters() -> None:
    """The "@<kind>" groups partition the parameters as megacpp.model.params.parameter_parts does."""
    model = _tiny_model()
    stack = build_optimizers(model, dataclasses.replace(tiny().optim, lr_scale_by_kind=["M=0.5", "R=0.25"]),
                             log=None)
    for kind in ("M", "R"):
        grouped = {id(p) for opt in stack.optimizers for g in opt.param_groups if f"@{kind}" in g["name"]
                   for p in g["params"]}
        assert grouped == {id(p) for p in dict(parameter_parts(model))[kind]}, kind


def test_tier1_factors_of_one_change_the_groups_but_not_a_bit_of_the_training() -> None:
    """Every kind at factor 1.0: every block parameter is in an "@<kind>" group (smaller Muon buckets,
    separate AdamW groups), yet after 3 steps the weights and optimizer moments equal an unscaled run's.
    On a CPU a Muon bucket's batched update equals the per-matrix one bit for bit (docs/optim.md)."""
    plain_model, plain = _train([])
    scaled_model, scaled = _train([f"{kind}=1" for kind in BLOCK_KINDS])
    names = [g["name"] for opt in scaled.optimizers for g in opt.param_groups]
    assert all(any(f"@{kind}" in name for name in names) for kind in BLOCK_KINDS)
    assert len(names) > sum(len(opt.param_groups) for opt in plain.optimizers)
    a, b = _weights(plain_model), _weights(scaled_model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = plain.moments(), scaled.moments()
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def test_tier1_a_zero_factor_freezes_exactly_that_kind() -> None:
    """R=0 with weight decay on for Muon and AdamW: the R blocks' parameters (mixers and norms) stay
    bit for bit as initialized, since decoupled decay is lr * wd and lr is 0 (no step and no decay),
    while every other part of the model moves."""
    initial = {n: p.detach().clone() for n, p in _tiny_model().named_parameters()}
    model, _ = _train(["R=0"], weight_decay=0.1, adamw_weight_decay=0.1)
    names = {p: n for n, p in model.named_parameters()}
    for part, params in parameter_parts(model):
        changed = [not torch.equal(p.detach(), initial[names[p]]) for p in params]
        if part == "R":
            assert not any(changed), [names[p] for p, c in zip(params, changed, strict=True) if c]
        else:
            assert any(changed), part
