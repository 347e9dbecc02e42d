"""torch.compile on the real hybrid: no graph breaks in either region mode, no recompiles in training."""
import pytest
import torch

from megacpp.compile.config import CompileConfig
from megacpp.compile.health import CompileHealth, bounds_for, forbid_recompiles
from megacpp.compile.regions import compile_model
from megacpp.model.hints import run_after_optimizer_step
from megacpp.model.hybrid import HybridLM
from megacpp.model.moe import MoE
from megacpp.optim import OptimConfig, build_optimizers
from tests.test_hybrid import shrunk


def _batch(b: int, t: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 97, (b, t), generator=g)
    doc_ids = torch.cumsum(torch.rand(b, t, generator=g) < 0.1, dim=1)  # packed documents
    return idx, torch.roll(idx, -1, dims=1), doc_ids


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocks", "model"])
def test_tiny_hybrid_compiles_with_inductor_without_breaks(mode):
    """Every block kind, Engram, n-gram hash and doc_ids on, Inductor on CPU: zero break sites and the
    health bounds hold (forward and backward). Breaks if any mixer falls out of the graph."""
    torch.manual_seed(0)
    model = HybridLM(shrunk("tiny", depth=10))
    cfg = CompileConfig(mode=mode, backend="inductor")
    with CompileHealth(bounds_for(cfg)) as health:
        health.attach(compile_model(model, cfg))
        for b in (3, 2):
            model(*_batch(b)).backward()
            if b == 3:
                health.end_warmup()
        assert health.break_sites() == {}
        assert health.totals().graphs >= 1
        assert health.check_bounds(strict=True) == []


def test_thirty_training_steps_without_recompiles():
    """30 optimizer steps of the real hybrid in blocks mode while MoE routing shifts (bias updates),
    the learning rate moves (warmup then decay) and the last batch is smaller: no recompile after
    warmup. Breaks if any per-step value reached a compiled region as a Python number."""
    torch.manual_seed(0)
    model = HybridLM(shrunk("tiny", depth=10))
    cfg = CompileConfig(mode="blocks", backend="aot_eager")
    stack = build_optimizers(model, OptimConfig(warmup_steps=5, decay_steps=10), total_steps=30, log=None)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    biases, lrs = [], []
    with CompileHealth(bounds_for(cfg)) as health:
        health.attach(compile_model(model, cfg))
        for step in range(30):
            batch = _batch(3 if step == 29 else 4, seed=step)
            with forbid_recompiles() if step > 0 else torch.enable_grad():
                model(*batch).backward()
                stack.step()
            run_after_optimizer_step(model)
            stack.zero_grad()
            biases.append(moe.expert_bias.clone())
            lrs.append(stack.muon.param_groups[0]["lr"].item())
            if step == 0:
                health.end_warmup()
        assert health.totals().recompiles_after_warmup == 0
        assert health.check_bounds(strict=True) == []
    assert not torch.equal(biases[0], biases[-1]), "MoE routing bias never moved"
    assert len(set(lrs)) > 5, "the learning rate never changed"
