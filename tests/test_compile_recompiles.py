"""Zero recompiles after warmup while batch size, hyperparameters and routing change; planted triggers caught."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.exc import FailOnRecompileLimitHit, RecompileError

from megacpp.compile.config import CompileConfig
from megacpp.compile.health import CompileHealth, CompileHealthError, bounds_for, forbid_recompiles
from megacpp.compile.regions import compile_model
from megacpp.compile.report import random_token_batch
from tests.compile_fixtures.standin import FFNMixer, MoEMixer, build_standin

pytestmark = pytest.mark.usefixtures("isolated_dynamo")


class ScaledFFN(FFNMixer):
    """A 0-D tensor hyperparameter (non-persistent buffer) that changes every step."""

    def __init__(self, d_model: int) -> None:
        super().__init__(d_model)
        self.register_buffer("temperature", torch.ones(()), persistent=False)

    def forward(self, x, doc_ids=None):
        return super().forward(x) * self.temperature


class FloatScaledFFN(FFNMixer):
    """Planted: the same hyperparameter as a Python float."""

    def __init__(self, d_model: int) -> None:
        super().__init__(d_model)
        self.temperature = 1.0

    def forward(self, x, doc_ids=None):
        return super().forward(x) * self.temperature


class CountingFFN(FFNMixer):
    """Planted: a Python-int call counter mutated in forward."""

    def __init__(self, d_model: int) -> None:
        super().__init__(d_model)
        self.calls_seen = 0

    def forward(self, x, doc_ids=None):
        self.calls_seen += 1
        return super().forward(x)


@pytest.mark.parametrize("mode", ["model", "blocks"])
def test_no_recompiles_over_30_steps(mode):
    torch.manual_seed(0)
    cfg = CompileConfig(mode=mode, backend="eager")
    model = build_standin("AEMF")
    model.blocks[3].mixer = ScaledFFN(32)
    moe = model.blocks[1].mixer
    assert isinstance(moe, MoEMixer)
    lr = torch.tensor(1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    sizes = [6, 4, 6, 5] * 7 + [6, 3]  # 30 steps; the last batch of the "epoch" is smaller
    routing = []
    with CompileHealth(bounds_for(cfg)) as health:
        health.attach(compile_model(model, cfg))
        step = torch.compile(opt.step, backend=cfg.backend)  # as optim.compile_step does
        for i, batch in enumerate(sizes):
            with forbid_recompiles() if i > 0 else torch.enable_grad():
                model(**random_token_batch(64, batch, 8)).backward()
                step()
            opt.zero_grad(set_to_none=True)
            moe.update_bias(0.5)  # routing shifts, outside the graph
            routing.append(moe.tokens_per_expert.clone())
            lr.fill_(1e-2 * (1 - i / len(sizes)))  # the schedule moves the 0-D learning rate
            model.blocks[3].mixer.temperature.fill_(1.0 + 0.1 * i)
            if i == 0:
                health.end_warmup()
        totals = health.totals()
        assert totals.recompiles_after_warmup == 0, totals.late_recompile_guards
        assert health.break_sites() == {}  # torch.optim's own breaks are upstream, not ours
        assert health.check_bounds(strict=True) == []
    assert any(not torch.equal(routing[0], r) for r in routing[1:]), "routing never shifted"


@pytest.mark.parametrize("mode", ["model", "blocks"])
def test_planted_float_attribute_is_caught_by_forbid_recompiles(mode):
    model = build_standin("AF")
    model.blocks[1].mixer = FloatScaledFFN(32)
    with CompileHealth() as health:
        health.attach(compile_model(model, CompileConfig(mode=mode, backend="eager")))
        model(**random_token_batch(64, 4, 8)).backward()
        health.end_warmup()
        model.blocks[1].mixer.temperature = 0.5  # e.g. a schedule writing a Python float
        with pytest.raises(RecompileError, match=r"temperature == 1\.0"), forbid_recompiles():
            model(**random_token_batch(64, 4, 8)).backward()
        assert health.totals().recompiles_after_warmup == 1
        with pytest.raises(CompileHealthError, match="temperature"):
            health.check_bounds(strict=True)


def test_a_recompile_after_warmup_and_an_inductor_alert_are_reported_when_they_happen():
    """Told to the run's log at once, not only in the summary at the end of the run."""
    import logging

    model = build_standin("AF")
    model.blocks[1].mixer = FloatScaledFFN(32)
    told: list[str] = []
    with CompileHealth(report=told.append) as health:
        health.attach(compile_model(model, CompileConfig(mode="blocks", backend="eager")))
        model(**random_token_batch(64, 4, 8)).backward()
        health.end_warmup()
        assert told == []
        model.blocks[1].mixer.temperature = 0.5
        model(**random_token_batch(64, 4, 8)).backward()
        health.refresh()
        assert len(told) == 1 and told[0].startswith("recompile after warmup: Block.forward (0/")
        logging.getLogger("torch._inductor.select_algorithm").warning(
            "Runtime error during autotuning: \n%s. \nIgnoring this choice.", "CUDA out of memory")
        assert told[1].startswith("compile alert (autotune_choice_failed): Runtime error during autotuning")


def test_planted_int_counter_fails_the_guard_with_its_name():
    model = build_standin("F")
    model.blocks[0].mixer = CountingFFN(32)
    compile_model(model, CompileConfig(mode="blocks", backend="eager"))
    model(**random_token_batch(64, 4, 8)).backward()
    with pytest.raises(RecompileError, match="calls_seen"), forbid_recompiles():
        model(**random_token_batch(64, 4, 8)).backward()


def test_recompile_cap_hit_is_counted_and_fails_loudly():
    model = build_standin("F")
    model.blocks[0].mixer = FloatScaledFFN(32)
    cfg = CompileConfig(mode="blocks", backend="eager")
    with CompileHealth(bounds_for(cfg)) as health:
        health.attach(compile_model(model, cfg))
        with torch._dynamo.config.patch(recompile_limit=2), pytest.raises(FailOnRecompileLimitHit):
            for i in range(4):
                model.blocks[0].mixer.temperature = 1.0 + i
                model(**random_token_batch(64, 4, 8))
        stats = health.snapshot()["Block.forward"]
        assert stats.cache_limit_hits == 1 and stats.recompiles >= 1
        assert any("recompile_limit" in a for a in health.alerts)
        with pytest.raises(CompileHealthError, match="recompile-cap hit"):
            health.check_bounds(strict=True)
