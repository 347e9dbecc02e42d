"""Activation recompute per block kind: the setting, bitwise equality with keeping the activations (eager
and compiled), the MoE router's choices in the recompute, and the memory it saves."""
from __future__ import annotations

import copy

import pytest
import torch

from megacpp.compile.config import CompileConfig
from megacpp.compile.health import CompileHealth, bounds_for
from megacpp.compile.regions import compile_model
from megacpp.model import moe
from megacpp.model.hybrid import HybridLM
from megacpp.model.registry import BLOCK_KINDS
from megacpp.train.config import recompute_kinds
from megacpp.train.recompute import apply_recompute
from tests.test_compile_hybrid import _batch
from tests.test_hybrid import shrunk


def test_the_setting_names_block_kinds():
    assert recompute_kinds("none") == frozenset()
    assert recompute_kinds("all") == frozenset(BLOCK_KINDS)
    assert recompute_kinds("M, E") == frozenset({"M", "E"})
    with pytest.raises(ValueError, match=r"unknown: 'X'"):
        recompute_kinds("E,X")


def _pair(kinds: str) -> tuple[HybridLM, HybridLM]:
    torch.manual_seed(0)
    kept = HybridLM(shrunk("tiny", depth=10))
    recomputed = copy.deepcopy(kept)
    wrapped = apply_recompute(recomputed, recompute_kinds(kinds))
    assert wrapped == [i for i, b in enumerate(recomputed.blocks) if b.kind in recompute_kinds(kinds)]
    return kept, recomputed


def _routing(model: HybridLM) -> list[torch.Tensor]:
    return [b.mixer.tokens_per_expert.clone() for b in model.blocks if b.kind == "E"]


def _assert_same_step(kept: HybridLM, recomputed: HybridLM, batch) -> None:
    losses = [model(*batch) for model in (kept, recomputed)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    for (name, a), (_, b) in zip(kept.named_parameters(), recomputed.named_parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name
    for a, b in zip(_routing(kept), _routing(recomputed), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kinds", ["all", "E", "M,R"])
def test_tier1_recompute_gives_the_same_loss_gradients_and_routes_eager(kinds):
    """Every block kind, Engram, n-gram hash and packed documents: with the mixers of `kinds` recomputed,
    the loss, every gradient and the MoE routing counts equal a run that keeps its activations."""
    kept, recomputed = _pair(kinds)
    for seed in (0, 1):
        _assert_same_step(kept, recomputed, _batch(3, seed=seed))


def test_tier1_the_router_picks_the_same_experts_in_the_recompute(monkeypatch):
    """The E mixer's forward runs twice under recompute (forward, then in the backward); the experts and
    weights each run's router picks are captured and must be equal."""
    _, recomputed = _pair("E")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    route = moe.token_choice_route

    def capturing_route(*args, **kwargs):
        picked = route(*args, **kwargs)
        seen.append(tuple(t.detach().clone() for t in picked))
        return picked

    monkeypatch.setattr(moe, "token_choice_route", capturing_route)
    recomputed(*_batch(3)).backward()
    experts = sum(b.kind == "E" for b in recomputed.blocks)
    assert len(seen) == 2 * experts, "each E mixer routed in the forward and again in the backward"
    forward, again = seen[:experts], seen[experts:]
    for (idx_a, w_a), (idx_b, w_b) in zip(forward, reversed(again), strict=True):  # last block recomputes first
        assert torch.equal(idx_a, idx_b) and torch.equal(w_a, w_b)


def test_recompute_keeps_fewer_activations():
    """Bytes saved for the backward during one forward: recomputing every mixer keeps far fewer."""
    def saved_bytes(model: HybridLM) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*_batch(3))
        return total

    kept, recomputed = _pair("all")
    assert saved_bytes(recomputed) < 0.6 * saved_bytes(kept)


@pytest.mark.slow
def test_tier1_recompute_under_compile_has_no_breaks_and_equals_keeping(isolated_dynamo):
    """Blocks mode (aot_eager: the partitioner's recompute, eager kernels): zero graph breaks, and the
    loss and gradients equal the compiled model that keeps its activations."""
    kept, recomputed = _pair("all")
    cfg = CompileConfig(mode="blocks", backend="aot_eager")
    with CompileHealth(bounds_for(cfg)) as health:
        for model in (kept, recomputed):
            health.attach(compile_model(model, cfg))
        _assert_same_step(kept, recomputed, _batch(3))
        assert health.break_sites() == {}


@pytest.mark.slow
def test_a_micro_batch_of_one_trains_compiled_with_recompute(tmp_path, small_corpus):
    """Auto-fit's last resort: micro-batch 1 (its batch axis cannot be dynamic; it compiles static) with
    every mixer recomputed, compiled by blocks, trains to the end with no graph break and no recompile."""
    from megacpp.train.loop import Trainer
    from megacpp.train.metrics import read_metrics
    from tests.helpers import tiny_train_config

    cfg = tiny_train_config(tmp_path, small_corpus, **{
        "train.batch_size": "2", "train.micro_batch": "1", "train.recompute": "all", "train.steps": "3",
        "compile.mode": "blocks", "compile.backend": "aot_eager", "compile.forbid_recompiles": "true"})
    result = Trainer(cfg, log=lambda _line: None, progress=False).run()
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    (record,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "compile"]
    assert record["graph_break_sites"] == 0 and record["recompiles_after_warmup"] == 0
