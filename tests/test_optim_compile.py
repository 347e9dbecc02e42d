"""Compiled optimizer steps: one graph, 0 recompiles while lr / weight decay / momentum change."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

from megacpp.optim import AdamW, Muon

SHAPES = [(24, 16), (3, 8, 12), (24, 16)]  # two buckets: a pair of matrices, a stack of experts


def _recompiles() -> int:
    return sum(1 for m in torch._dynamo.utils.get_compilation_metrics() if m.recompile_reason)


def _params(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _drive(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: int, hparams: tuple[str, ...]) -> None:
    """Steps with fresh gradients; every step moves every hyperparameter in `hparams`."""
    gen = torch.Generator().manual_seed(100)
    for i in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        for key in hparams:  # written in place, as the scheduler writes lr
            for group in opt.param_groups:
                group[key].fill_({"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}[key] * (1 + i) / steps)
        opt.step()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the global counters
    # ... and the metrics log, a bounded deque: after the earlier tests' compiles, new entries push old
    # recompile records out, so a count taken across this test could even fall.
    torch._dynamo.utils.clear_compilation_metrics()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def _build(kind: str, params: list[nn.Parameter], compiled: bool, backend: str) -> torch.optim.Optimizer:
    if kind == "muon":
        return Muon(params, weight_decay=0.1, compile_step=compiled, compile_backend=backend)
    momentum_dtype = "bfloat16" if kind == "adamw_bf16" else "float32"  # bf16 first moments: per-tensor fp32 copies
    return AdamW(params, weight_decay=0.1, momentum_dtype=momentum_dtype, compile_step=compiled,
                 compile_backend=backend)


@pytest.mark.parametrize("kind,hparams", [
    ("muon", ("lr", "weight_decay", "momentum")),
    ("adamw", ("lr", "weight_decay")),
    ("adamw_bf16", ("lr", "weight_decay")),
])
def test_tier3_compiled_step_no_recompiles_over_50_steps(fresh_dynamo, kind: str, hparams: tuple[str, ...]) -> None:
    # error_on_recompile=True raises on the first recompile; the metrics count is the second witness.
    params = _params(0)
    opt = _build(kind, params, compiled=True, backend="aot_eager")
    before = _recompiles()
    _drive(opt, params, steps=50, hparams=hparams)
    assert _recompiles() - before == 0
    # The whole step is one graph; Muon's one per run of buckets (muon.STEP_PARTS): SHAPES' two buckets, two.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == (2 if kind == "muon" else 1)


@pytest.mark.parametrize("kind", ["muon", "adamw", "adamw_bf16"])
def test_tier3_compiled_step_matches_eager(fresh_dynamo, kind: str) -> None:
    # Tolerance: 1e-6 absolute after 5 steps (lr 0.02 on O(1) weights). aot_eager runs decomposed aten
    # ops, and the AdamW paths differ (fused eager kernel vs foreach + capturable compiled), so
    # roundings may differ; Muon's bf16 iteration amplifies an fp32 ulp to at most a bf16 ulp of lr.
    eager_params, compiled_params = _params(1), _params(1)
    _drive(_build(kind, eager_params, False, "aot_eager"), eager_params, steps=5, hparams=("lr",))
    _drive(_build(kind, compiled_params, True, "aot_eager"), compiled_params, steps=5, hparams=("lr",))
    for a, b in zip(eager_params, compiled_params, strict=True):
        assert (a - b).abs().max() <= 1e-6


@pytest.mark.slow
def test_tier3_inductor_muon_step_no_recompiles(fresh_dynamo) -> None:
    params = _params(2)
    opt = _build("muon", params, compiled=True, backend="inductor")
    before = _recompiles()
    _drive(opt, params, steps=50, hparams=("lr", "weight_decay", "momentum"))
    assert _recompiles() - before == 0
