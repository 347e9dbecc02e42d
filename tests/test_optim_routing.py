"""Parameter routing of a stand-in tiny hybrid, parameter hints, errors, and the routing table."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megacpp.model.hints import ParamHint, collect_param_hints
from megacpp.optim import OptimConfig, build_optimizers, route_parameters
from megacpp.optim.muon import Muon
from tests.test_optim_standins import TinyHybrid


def _groups(model: nn.Module, cfg: OptimConfig | None = None) -> dict[str, str]:
    return {r.name: r.group for r in route_parameters(model, cfg or OptimConfig())}


def test_tier1_every_parameter_routed_exactly_once() -> None:
    model = TinyHybrid()
    stack = build_optimizers(model, OptimConfig(), log=None)
    in_groups = [id(p) for opt in stack.optimizers for g in opt.param_groups for p in g["params"]]
    assert sorted(in_groups) == sorted(id(p) for p in model.parameters())
    assert len(set(in_groups)) == len(in_groups)


def test_tier1_tiny_hybrid_routes() -> None:
    groups = _groups(TinyHybrid())
    expected = {
        "tok_embed.weight": "adamw:embed",
        "ngram_embed.weight": "adamw:embed",
        "lm_head.weight": "adamw:head",
        "mtp.0.weight": "adamw:head",
        "norm_f.weight": "adamw:other",
        "blocks.0.norm.weight": "adamw:other",
        "blocks.0.mixer.qkv.weight": "muon:original",
        "blocks.0.mixer.out.weight": "muon:original",
        "blocks.1.mixer.in_proj.weight": "muon:original",
        "blocks.1.mixer.decay": "adamw:other",  # 1-D
        "blocks.1.mixer.bc_bias": "adamw:other",  # 2-D, hinted optimizer="adamw"
        "blocks.1.engram.0.weight": "muon:original",
        "blocks.2.mixer.gate.weight": "adamw:other",  # router gate, hinted
        "blocks.2.mixer.w_up": "muon:match_rms_adamw",  # stacked experts
        "blocks.2.mixer.w_down": "muon:match_rms_adamw",
        "blocks.3.mixer.fc_in.weight": "muon:original",
        "blocks.3.mixer.fc_out.bias": "adamw:other",
    }
    for name, group in expected.items():
        assert groups[name] == group, name


def test_tier1_expert_optimizer_adamw_moves_exactly_the_routed_experts_to_adamw() -> None:
    """`optim.expert_optimizer adamw` on the real model: the E blocks' w_up and w_down (hinted routed_expert
    by MoE itself) leave Muon for AdamW's hidden group; every other parameter keeps its group, R's stacked W
    included. The stand-in (TinyHybrid) moves the same way."""
    from megacpp.model.hybrid import HybridLM
    from megacpp.presets import small

    cfg = small()
    cfg.model.depth = 12
    with torch.device("meta"):
        model = HybridLM(cfg.model)
    for case, base in ((model, cfg.optim), (TinyHybrid(), OptimConfig())):
        muon = _groups(case, base)
        adamw = _groups(case, OptimConfig(**{**vars(base), "expert_optimizer": "adamw"}))
        moved = {name for name in muon if muon[name] != adamw[name]}
        experts = {name for name in muon if name.endswith(("mixer.w_up", "mixer.w_down"))}
        assert experts and moved == experts
        assert all(muon[name].startswith("muon:") and adamw[name].startswith("adamw:hidden") for name in moved)
    on_adamw = _groups(model, OptimConfig(**{**vars(cfg.optim), "expert_optimizer": "adamw"}))
    r_weights = [name for name, p in model.named_parameters() if name.endswith("mixer.W") and p.ndim == 3]
    assert r_weights and all(on_adamw[name].startswith("muon:") for name in r_weights), "R's stacked W stays"


def _muon_step_once(cfg: OptimConfig) -> dict[str, torch.Tensor]:
    """TinyHybrid's parameters after one step of its optimizers on fixed gradients (seeded)."""
    torch.manual_seed(0)
    model = TinyHybrid()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    build_optimizers(model, cfg, log=None).step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_tier1_expert_ns_steps_changes_only_the_routed_experts_iterations() -> None:
    """`optim.expert_ns_steps`: the routed experts' Muon group runs that many Newton-Schulz iterations and every
    other Muon group keeps `ns_steps`. Stepped once on the same gradients, 5 given explicitly matches the default
    bit for bit, and 2 moves exactly the experts' weights (to a different point: fewer iterations leave the update
    further from orthogonal)."""
    stack = build_optimizers(TinyHybrid(), OptimConfig(expert_ns_steps=2), log=None)
    assert "expert_ns_steps: 2 Newton-Schulz iterations for the routed experts, 5 for" in stack.routing_table
    assert "expert_ns_steps" not in build_optimizers(TinyHybrid(), OptimConfig(), log=None).routing_table
    (muon,) = [opt for opt in stack.optimizers if isinstance(opt, Muon)]
    experts = [g for g in muon.param_groups if g["ns_steps"] == 2]
    assert experts and all(p.ndim == 3 for g in experts for p in g["params"])
    assert all(g["ns_steps"] == 5 for g in muon.param_groups if g not in experts)

    default, five, two = (_muon_step_once(OptimConfig(expert_ns_steps=n)) for n in (None, 5, 2))
    assert all(torch.equal(default[name], five[name]) for name in default)
    moved = {name for name in default if not torch.equal(default[name], two[name])}
    assert moved == {"blocks.2.mixer.w_up", "blocks.2.mixer.w_down"}


def test_tier1_stacked_default_scaling_and_hint_override() -> None:
    model = TinyHybrid()
    del model.blocks[2].mixer.param_hints["w_up"]  # unhinted stacked weight: expert_lr_scaling default
    model.blocks[3].mixer.param_hints = {"fc_in.weight": ParamHint(lr_scaling="match_rms_adamw")}
    cfg = OptimConfig(expert_lr_scaling="original", muon_lr_scaling="original")
    groups = _groups(model, cfg)
    assert groups["blocks.2.mixer.w_up"] == "muon:original"
    assert groups["blocks.2.mixer.w_down"] == "muon:match_rms_adamw"
    assert groups["blocks.3.mixer.fc_in.weight"] == "muon:match_rms_adamw"


def test_tier1_muon_hint_forces_muon_and_rejects_vectors() -> None:
    model = TinyHybrid()
    model.lm_head.param_hints = {"weight": ParamHint(optimizer="muon")}
    assert _groups(model)["lm_head.weight"] == "muon:original"
    model.norm_f.param_hints = {"weight": ParamHint(optimizer="muon")}
    with pytest.raises(ValueError, match="norm_f.weight"):
        _groups(model)


def test_tier1_unroutable_parameter_errors_naming_it() -> None:
    model = TinyHybrid()
    model.blocks[0].register_parameter("stray", nn.Parameter(torch.zeros(4, 4)))
    with pytest.raises(ValueError, match=r"blocks\.0\.stray"):
        build_optimizers(model, OptimConfig(), log=None)
    model.blocks[0].param_hints = {"stray": ParamHint(optimizer="adamw")}
    assert _groups(model)["blocks.0.stray"] == "adamw:other"


def test_tier1_hint_naming_no_parameter_is_an_error() -> None:
    """A misspelt hint would silently route by the defaults; it names the module and the key."""
    model = TinyHybrid()
    model.blocks[2].mixer.param_hints = {"w_upp": ParamHint(lr_scaling="original")}
    with pytest.raises(ValueError, match=r"TinyMoE declares a hint for 'w_upp'"):
        collect_param_hints(model)


def test_tier1_hints_are_read_by_name_not_from_parameter_objects() -> None:
    """Replacing every Parameter object (as FSDP2's fully_shard does) keeps every route, because the
    hints were collected by name before the replacement."""
    model = TinyHybrid()
    hints = collect_param_hints(model)
    before = {r.name: (r.group, r.hint) for r in route_parameters(model, OptimConfig(), hints)}
    for module in model.modules():
        for local, p in list(module.named_parameters(recurse=False)):
            setattr(module, local, nn.Parameter(p.detach().clone()))
    after = {r.name: (r.group, r.hint) for r in route_parameters(model, OptimConfig(), hints)}
    assert after == before
    assert before["blocks.0.mixer.qkv.weight"][1].qkv_split == (32, 16, 16)


def test_tier1_norms_biases_and_hinted_tables_are_never_decayed() -> None:
    cfg = OptimConfig(weight_decay=0.1, adamw_weight_decay=0.01)
    stack = build_optimizers(TinyHybrid(), cfg, log=None)
    # Each optimizer holds its hyperparameters as 0-D tensors of its own dtype (AdamW fp32, Muon fp64).
    decay = {g["name"]: g["weight_decay"] for opt in stack.optimizers for g in opt.param_groups}
    expected = {"adamw:other:no_decay": 0.0, "adamw:other": 0.01, "adamw:embed": 0.01, "muon:original": 0.1}
    for name, value in expected.items():
        assert torch.equal(decay[name], torch.tensor(value, dtype=decay[name].dtype)), name
    no_decay = next(g for g in stack.by_name["adamw"].param_groups if g["name"] == "adamw:other:no_decay")
    assert all(p.ndim == 1 for p in no_decay["params"])


def test_tier1_wrapper_prefixes_are_ignored() -> None:
    wrapped = torch.compile(TinyHybrid(), backend="eager")  # names gain "_orig_mod."
    groups = _groups(wrapped)
    assert groups["tok_embed.weight"] == "adamw:embed"
    assert groups["blocks.0.mixer.qkv.weight"] == "muon:original"


def test_tier1_adamw_only_mode() -> None:
    stack = build_optimizers(TinyHybrid(), OptimConfig(use_muon=False), log=None)
    assert list(stack.by_name) == ["adamw"]
    names = {g["name"] for g in stack.by_name["adamw"].param_groups}
    assert "adamw:hidden" in names and not any(n.startswith("muon") for n in names)


def test_tier1_group_learning_rates() -> None:
    cfg = OptimConfig(muon_lr=0.03, adamw_lr=2e-3, embed_lr=0.1, head_lr=4e-3)
    stack = build_optimizers(TinyHybrid(), cfg, log=None)
    base = {g["name"]: g["base_lr"] for opt in stack.optimizers for g in opt.param_groups}
    assert base == {"muon:original": 0.03, "muon:match_rms_adamw": 2e-3, "adamw:embed": 0.1,
                    "adamw:head": 4e-3, "adamw:other": 2e-3, "adamw:other:no_decay": 2e-3}


def test_tier1_routing_table_printed_with_counts_and_state_bytes() -> None:
    model = TinyHybrid()
    lines: list[str] = []
    stack = build_optimizers(model, OptimConfig(), log=lines.append)
    assert lines == [stack.routing_table]
    rows = {line.split()[0]: line.split()[1:] for line in stack.routing_table.splitlines()[1:]}
    n_params = sum(p.numel() for p in model.parameters())
    assert rows["total"][:2] == [str(len(list(model.parameters()))), f"{n_params:,}"]
    up, down = model.blocks[2].mixer.w_up, model.blocks[2].mixer.w_down
    expert_state = 2 * (up.numel() + down.numel()) + 4 * (3 * 64 + 3 * 64)  # bf16 momentum + factored VR
    assert rows["muon:match_rms_adamw"] == ["2", f"{up.numel() + down.numel():,}", f"{expert_state:,}"]
