"""The optimizer registry: the stack holds the registered optimizers by name, the checkpoint format
stays "<optimizer>/<parameter name>/<state key>", and a new optimizer joins with one registry entry."""
from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor

from megacpp.model.hints import ParamHint, collect_param_hints
from megacpp.model.hybrid import HybridLM
from megacpp.optim import OPTIMIZERS, OptimConfig, OptimizerSpec, build_optimizers
from megacpp.optim.hparams import TensorHParamOptimizer
from megacpp.presets import preset
from tests.test_optim_standins import TinyHybrid, batch

# docs/optim.md and megacpp.optim.stack: Muon keeps a momentum buffer and, with variance reduction, a
# factored second moment; AdamW keeps torch's step, exp_avg and exp_avg_sq.
MUON_KEYS = ("momentum_buffer", "second_moment")
ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")
HIDDEN = re.compile(r"blocks\.\d+\.(mixer|engram)\.")


def _documented_optimizer(name: str, param: Tensor, hint: ParamHint | None) -> str:
    """The routing rule of docs/optim.md, written out here: a hint decides, else >= 2-D matrices of a
    block's mixer or Engram branch go to Muon and everything else to AdamW."""
    if hint is not None and hint.optimizer is not None:
        return hint.optimizer
    return "muon" if param.ndim >= 2 and HIDDEN.match(name) else "adamw"


def test_tier1_the_tiny_presets_checkpoint_keys_keep_their_format() -> None:
    """The moments of every parameter of the tiny preset's model under exactly the names a checkpoint
    written before the registry holds, and the same small state_dict: old checkpoints still load."""
    cfg = preset("tiny")
    cfg.model.vocab_size = cfg.data.vocab_size
    assert cfg.optim.use_muon and cfg.optim.variance_reduction  # the keys below assume both
    torch.manual_seed(0)
    model = HybridLM(cfg.model)
    stack = build_optimizers(model, cfg.optim, total_steps=cfg.train.steps, log=None)
    hints = collect_param_hints(model)
    expected = set()
    for name, param in model.named_parameters():
        kind = _documented_optimizer(name, param, hints.get(name))
        expected |= {f"{kind}/{name}/{key}" for key in (MUON_KEYS if kind == "muon" else ADAMW_KEYS)}
    assert set(stack.moments()) == expected
    state = stack.state_dict()
    assert set(state) == {"parts", "scheduler", "clip"}
    assert state["parts"] == ["muon", "adamw"]
    assert set(state["scheduler"]) == {"position"}


def test_tier1_the_registry_order_is_the_step_order_and_an_empty_optimizer_is_not_built() -> None:
    stack = build_optimizers(TinyHybrid(), OptimConfig(), log=None)
    assert list(OPTIMIZERS) == ["muon", "adamw"]
    assert list(stack.by_name) == ["muon", "adamw"]
    assert stack.optimizers == [stack.by_name["muon"], stack.by_name["adamw"]]
    adamw_only = build_optimizers(TinyHybrid(), OptimConfig(use_muon=False), log=None)
    assert adamw_only.state_dict()["parts"] == ["adamw"]


class ToyMomentumSGD(TensorHParamOptimizer):
    """A stand-in for a new optimizer: heavy-ball SGD, v <- 0.5 v + g, p <- p - lr v."""

    def __init__(self, params: Any, lr: float = 0.1, *, compile_step: bool, compile_backend: str) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=0.0), compile_step=compile_step,
                         compile_backend=compile_backend)

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if "velocity" not in state:
            state["velocity"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    velocity = self.init_state(p, group)["velocity"]
                    velocity.mul_(0.5).add_(p.grad)
                    p.sub_(group["lr"] * velocity)


TOY_SPEC = OptimizerSpec(
    "tests.test_optim_registry:ToyMomentumSGD",
    settings=lambda cfg: {"lr": 0.25},
    group_settings=lambda route, cfg: {"lr": 0.25, "weight_decay": 0.0},
    state_bytes=lambda route, cfg: 4 * route.param.numel(),
)


def test_tier1_a_registered_toy_optimizer_gets_its_hinted_parameters_and_its_moments(monkeypatch) -> None:
    monkeypatch.setitem(OPTIMIZERS, "toy", TOY_SPEC)
    torch.manual_seed(0)
    model = TinyHybrid()
    toy_names = ["lm_head.weight", "blocks.0.mixer.out.weight"]  # a head and a hidden matrix
    hints = {**collect_param_hints(model), **{name: ParamHint(optimizer="toy") for name in toy_names}}
    stack = build_optimizers(model, OptimConfig(grad_clip_norm=0.0), log=None, hints=hints)

    assert list(stack.by_name) == ["muon", "adamw", "toy"]
    toy = stack.by_name["toy"]
    assert isinstance(toy, ToyMomentumSGD)
    params = dict(model.named_parameters())
    assert [p for g in toy.param_groups for p in g["params"]] == [p for n, p in params.items() if n in toy_names]
    assert {g["name"] for g in toy.param_groups} == {"toy:hinted"}
    others = {id(p) for kind in ("muon", "adamw") for g in stack.by_name[kind].param_groups for p in g["params"]}
    assert not others & {id(params[n]) for n in toy_names}
    assert "toy:hinted" in stack.routing_table

    keys = set(stack.moments())
    assert {k for k in keys if k.startswith("toy/")} == {f"toy/{n}/velocity" for n in toy_names}
    assert not any(k.startswith(("muon/", "adamw/")) and k.split("/")[1] in toy_names for k in keys)
    assert stack.state_dict()["parts"] == ["muon", "adamw", "toy"]

    before = params["lm_head.weight"].detach().clone()
    idx, tgt = batch(seed=0)
    model(idx, tgt).backward()
    grad = params["lm_head.weight"].grad.clone()
    stack.step()
    # First step from a zero velocity: v = g, p <- p - 0.25 g (the scheduler's multiplier is 1 here).
    assert torch.equal(stack.moments()["toy/lm_head.weight/velocity"], grad)
    assert torch.equal(params["lm_head.weight"].detach(), before - torch.tensor(0.25) * grad)


def test_a_hint_naming_no_registered_optimizer_is_an_error_listing_them() -> None:
    model = TinyHybrid()
    hints = {**collect_param_hints(model), "lm_head.weight": ParamHint(optimizer="lion")}
    with pytest.raises(ValueError, match=r"'lm_head.weight': hint optimizer='lion', expected one of the "
                                         r"registered optimizers \('muon', 'adamw'\)"):
        build_optimizers(model, OptimConfig(), log=None, hints=hints)


def test_classes_must_name_registered_optimizers() -> None:
    with pytest.raises(ValueError, match=r"classes given for \['muon2'\]"):
        build_optimizers(TinyHybrid(), OptimConfig(), log=None, classes={"muon2": ToyMomentumSGD})
