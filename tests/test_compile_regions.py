"""compile_model in none / model / blocks modes; graph breaks are counted and bounded; the gated fallback."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from megacpp.compile.config import CompileConfig
from megacpp.compile.health import (
    CompileHealth,
    CompileHealthError,
    CompileHealthWarning,
    HealthBounds,
    bounds_for,
)
from megacpp.compile.regions import compile_model, mark_batch_dynamic
from megacpp.compile.report import random_token_batch
from tests.compile_fixtures.standin import FFNMixer, build_standin

pytestmark = pytest.mark.usefixtures("isolated_dynamo")


class BreakingFFN(FFNMixer):
    def forward(self, x, doc_ids=None):
        y = super().forward(x)
        torch._dynamo.graph_break()
        return y


def _train(model, batch, seq_len=8):
    model(**random_token_batch(64, batch, seq_len)).backward()


# blocks mode: the five blocks share Block.forward, and the loss head (final norm, LM head,
# cross-entropy) is a region of its own, so blocks mode has two callsites; model mode inlines the head.
@pytest.mark.parametrize("mode, modules", [
    ("none", {}),
    ("model", {"StandInLM.forward": 1}),
    ("blocks", {"Block.forward": 5, "StandInLM.loss": 1}),
])
def test_modes_compile_with_zero_breaks(mode, modules):
    cfg = CompileConfig(mode=mode, backend="eager")
    torch.manual_seed(0)
    model = build_standin("AMERF")
    with CompileHealth(bounds_for(cfg)) as health:
        compiled = compile_model(model, cfg)
        health.attach(compiled)
        _train(model, 4)
        health.end_warmup()
        _train(model, 3)
        stats = health.snapshot()
        assert health.check_bounds(strict=True) == []
    totals = health.totals()
    assert totals.breaks == 0 and totals.recompiles_after_warmup == 0
    if not modules:
        assert stats == {} and compiled.regions == []
    assert {name: s.modules for name, s in stats.items()} == modules
    for callsite in modules:
        assert stats[callsite].graphs >= 1 and stats[callsite].compile_time_s > 0


@pytest.mark.parametrize("mode", ["model", "blocks"])
def test_planted_graph_break_fails_the_bound_with_its_reason(mode):
    cfg = CompileConfig(mode=mode, backend="eager")
    model = build_standin("AF")
    model.blocks[1].mixer = BreakingFFN(32)
    with CompileHealth(bounds_for(cfg)) as health:
        health.attach(compile_model(model, cfg))
        _train(model, 4)
        with pytest.raises(CompileHealthError, match=r"graph break.*graph_break\(\)"):
            health.check_bounds(strict=True)
        with pytest.warns(CompileHealthWarning, match="graph break"):
            health.check_bounds(strict=False)
    assert health.totals().breaks >= 1


def test_bound_allows_the_configured_number_of_breaks():
    cfg = CompileConfig(mode="blocks", backend="eager", max_graph_breaks=1)
    model = build_standin("AF")
    model.blocks[1].mixer = BreakingFFN(32)
    with CompileHealth(bounds_for(cfg)) as health:
        health.attach(compile_model(model, cfg))
        _train(model, 4)
        assert health.check_bounds(strict=True) == []


def test_blocks_mode_needs_model_blocks():
    with pytest.raises(ValueError, match="model.blocks"):
        compile_model(torch.nn.Linear(2, 2), CompileConfig(mode="blocks", backend="eager"))


def test_compiling_twice_is_refused():
    model = build_standin("F")
    compile_model(model, CompileConfig(mode="blocks", backend="eager"))
    with pytest.raises(RuntimeError, match="already replaced"):
        compile_model(model, CompileConfig(mode="blocks", backend="eager"))


def test_state_dict_keys_unchanged_by_compile():
    model = build_standin("AF")
    keys = list(model.state_dict())
    compile_model(model, CompileConfig(mode="blocks", backend="eager"))
    assert list(model.state_dict()) == keys


def test_a_batch_of_one_compiles_static_and_runs_again_without_a_recompile():
    """Micro-batch 1 (auto-fit's last resort) is not marked dynamic (Dynamo specializes size 1): it compiles
    one static graph, which later batches of one reuse. Marking it by hand is still refused."""
    cfg = CompileConfig(mode="model", backend="eager")
    model = build_standin("F")
    with CompileHealth(bounds_for(cfg)) as health:
        health.attach(compile_model(model, cfg))
        _train(model, 1)
        health.end_warmup()
        _train(model, 1)
        assert health.totals().recompiles_after_warmup == 0 and health.totals().graphs == 1
    with pytest.raises(ValueError, match="warm up with >= 2"):
        mark_batch_dynamic(torch.zeros(1, 4))


def test_disabled_mixer_break_is_attributed_to_the_calling_block():
    # The seed's alternative: the break is raised inside nn.Module.__call__ (torch code), but the
    # site is the block line that calls the mixer, so it counts against the bound.
    model = build_standin("AM")
    model.blocks[1].mixer.forward = torch.compiler.disable(model.blocks[1].mixer.forward)
    with CompileHealth() as health:
        health.attach(compile_model(model, CompileConfig(mode="blocks", backend="eager")))
        _train(model, 4)
        sites = health.break_sites()
        assert len(sites) == 1 and "standin.py" in next(iter(sites))
        assert "torch.compiler.disable" in next(iter(sites.values()))


def test_optional_graph_cap():
    # Two block variants (two graphs for Block.forward) and the loss head's own graph.
    model = build_standin("AF")
    with CompileHealth(HealthBounds(graphs=1)) as health:
        health.attach(compile_model(model, CompileConfig(mode="blocks", backend="eager")))
        _train(model, 4)
        assert health.violations() == ["3 graphs > bound 1"]
