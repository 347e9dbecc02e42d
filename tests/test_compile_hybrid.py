"""torch.compile on the real hybrid: no graph breaks in either region mode, no recompiles in training."""
import copy

import pytest
import torch

from megacpp.compile.config import CompileConfig
from megacpp.compile.health import CompileHealth, bounds_for, forbid_recompiles
from megacpp.compile.regions import compile_model
from megacpp.model.hints import run_after_optimizer_step
from megacpp.model.hybrid import HybridLM
from megacpp.model.moe import MoE
from megacpp.model.registry import BLOCK_KINDS
from megacpp.optim import OptimConfig, build_optimizers
from tests.test_hybrid import shrunk


def _batch(b: int, t: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 97, (b, t), generator=g)
    doc_ids = torch.cumsum(torch.rand(b, t, generator=g) < 0.1, dim=1)  # packed documents
    return idx, torch.roll(idx, -1, dims=1), doc_ids


@pytest.mark.slow
@pytest.mark.parametrize("mode, backend", [("blocks", "inductor"), ("model", "aot_eager")])
def test_tiny_hybrid_compiles_without_breaks(mode, backend):
    """Every block kind, Engram, n-gram hash and doc_ids on: zero break sites and the health bounds hold
    (forward and backward). Breaks if any mixer falls out of the graph. Inductor lowers every op in blocks
    mode; model mode traces the same ops into one graph, so it checks Dynamo and AOTAutograd (where breaks
    arise) and spares the second lowering: 80 s of a 2-core CI machine for no op blocks mode misses."""
    torch.manual_seed(0)
    model = HybridLM(shrunk("tiny", depth=10))
    assert set(model.layout) == set(BLOCK_KINDS), "the test must cover every registered block kind"
    cfg = CompileConfig(mode=mode, backend=backend)
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
            lrs.append(stack.by_name["muon"].param_groups[0]["lr"].item())
            if step == 0:
                health.end_warmup()
        assert health.totals().recompiles_after_warmup == 0
        assert health.check_bounds(strict=True) == []
        assert health.snapshot()["HybridLM.loss"].graphs >= 1  # the loss head is a region of its own
    assert not torch.equal(biases[0], biases[-1]), "MoE routing bias never moved"
    assert len(set(lrs)) > 5, "the learning rate never changed"


def test_tier3_blocks_mode_loss_head_is_one_region_equal_to_eager():
    """blocks mode compiles the loss head (final norm, LM head, soft-cap, cross-entropy and two MTP
    heads with document masking) as one region, and the batch's segments as another: one graph each,
    zero breaks, the smaller batch after warmup reuses them, and loss and gradients match the
    uncompiled model. Tolerance 1e-6 absolute: the same
    fp32 ops run through AOTAutograd's traced backward, whose gradient accumulation order may differ
    from eager autograd's by an ulp of O(1) values (the loss is ~ln(97) = 4.6, gradients are < 1)."""
    torch.manual_seed(0)
    cfg = shrunk("tiny", depth=1)
    cfg.pattern, cfg.mtp_depth, cfg.engram.layers = "F", 2, []  # tiny's Engram layer is past depth 1
    eager = HybridLM(cfg)
    compiled = copy.deepcopy(eager)
    ccfg = CompileConfig(mode="blocks", backend="aot_eager", fullgraph=True)
    with CompileHealth(bounds_for(ccfg)) as health:
        handle = compile_model(compiled, ccfg)
        assert [r.name for r in handle.regions] == ["blocks.0", "segments", "loss"]
        health.attach(handle)
        for b in (3, 2):
            batch = _batch(b, seed=b)
            losses = [model(*batch) for model in (eager, compiled)]
            for model, loss in zip((eager, compiled), losses, strict=True):
                model.zero_grad()
                loss.backward()
            assert (losses[0] - losses[1]).abs() <= 1e-6
            for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
                assert (p.grad - q.grad).abs().max() <= 1e-6, name
            if b == 3:
                health.end_warmup()
        for region in ("HybridLM.loss", "HybridLM.segments"):
            stats = health.snapshot()[region]
            assert stats.graphs == 1 and stats.breaks == 0 and stats.recompiles_after_warmup == 0, region
