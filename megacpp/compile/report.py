"""`compile_report`: a per-callsite table of graphs, breaks, recompiles, guards and compile time.

Two measured passes over a freshly built model: cold (Dynamo reset, empty Inductor cache) and warm
(Dynamo reset again, Inductor/AOTAutograd on-disk caches kept). With ``backend="eager"`` both passes
are pure Dynamo tracing, so comparing backends tells tracing trouble from backend trouble. Each pass
runs a warmup step and then a smaller batch, which must not recompile (batch axis dynamic).

This is the one place megacpp calls ``torch._dynamo.reset()`` (tests/test_compile_source_rules.py):
resetting drops every compiled graph and clears the compile hooks, so it is done only where the model
is rebuilt anyway, before each pass.
"""
from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch._dynamo
from torch import Tensor, nn

from megacpp.compile.config import CompileConfig
from megacpp.compile.health import CallsiteStats, CompileHealth, bounds_for
from megacpp.compile.policy import apply_policy
from megacpp.compile.regions import compile_model
from megacpp.versions import torch_version

InputsFn = Callable[[nn.Module, int], dict[str, Tensor]]


@dataclass
class _Pass:
    stats: dict[str, CallsiteStats]
    first_step_s: float
    violations: list[str]
    alerts: list[str]
    sites: dict[str, str]


def random_token_batch(
    vocab: int, batch: int, seq_len: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """Random tokens, next-token targets and doc_ids with a document boundary inside every row, so the
    compiled graphs include the document-masking paths."""
    idx = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator).to(device)
    doc_ids = (torch.arange(seq_len) >= seq_len // 3).long().expand(batch, seq_len).contiguous().to(device)
    return {"idx": idx[:, :-1], "targets": idx[:, 1:], "doc_ids": doc_ids}


def token_inputs(seq_len: int = 32) -> InputsFn:
    """Inputs for a HybridLM-like model: a `random_token_batch` (vocab from ``tok_embed``)."""

    def make(model: nn.Module, batch: int) -> dict[str, Tensor]:
        device = next(model.parameters()).device
        return random_token_batch(model.tok_embed.num_embeddings, batch, seq_len, device)

    return make


@contextmanager
def _fresh_inductor_cache() -> Iterator[None]:
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="megacpp-report-") as path:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def _step(model: nn.Module, inputs: dict[str, Tensor]) -> None:
    device = next(model.parameters()).device
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()
    with autocast:  # the training forward on GPU
        out = model(**inputs)
    loss = out if out.dim() == 0 else out.float().square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def _reset_and_rebuild(build: Callable[[], nn.Module], health: CompileHealth) -> nn.Module:
    """Reset Dynamo, re-arm `health` (its hooks were cleared) and return ``build()``. On-disk caches
    (Inductor FX graph, AOTAutograd) survive, so the warm pass's model compiles warm."""
    health.refresh()  # reset clears Dynamo's break reasons: take them in first
    torch._dynamo.reset()
    health.after_reset()
    return build()


def _measure(factory: Callable[[], nn.Module], cfg: CompileConfig, make_inputs: InputsFn, batch: int,
             device: str) -> _Pass:
    with CompileHealth(bounds_for(cfg)) as health:
        model = _reset_and_rebuild(factory, health).to(device)
        health.attach(compile_model(model, cfg))
        start = time.perf_counter()
        _step(model, make_inputs(model, batch))
        first_step = time.perf_counter() - start
        health.end_warmup()
        _step(model, make_inputs(model, batch - 1))  # a smaller last batch: must reuse the graphs
        return _Pass(health.snapshot(), first_step, health.violations(), list(health.alerts),
                     health.break_sites(upstream=None))


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compile_report(
    model_factory: Callable[[], nn.Module],
    backend: str = "eager",
    mode: str = "blocks",
    *,
    batch: int = 4,
    make_inputs: InputsFn | None = None,
    device: str = "cpu",
) -> str:
    """Compile a fresh model from `model_factory` cold and warm; return the per-callsite table.

    `make_inputs(model, batch)` gives the forward's keyword arguments (default: `token_inputs`);
    `batch` (>= 3) is the warmup batch, ``batch - 1`` the smaller follow-up batch.
    """
    if batch < 3:
        raise ValueError("batch must be >= 3: the follow-up batch (batch - 1) must stay >= 2")
    # No CUDA graphs: the report measures compilation, and its passes call the regions without the
    # trainer's per-step mark (Inductor's own guess of a step frees one region's outputs before the next reads them).
    cfg = CompileConfig(mode=mode, backend=backend, cudagraphs="off")
    make_inputs = make_inputs or token_inputs()
    policy = apply_policy(cfg)
    with _fresh_inductor_cache():
        cold = _measure(model_factory, cfg, make_inputs, batch, device)
        warm = _measure(model_factory, cfg, make_inputs, batch, device)

    rows = [["callsite", "modules", "graphs", "breaks", "recompiles", "after warmup", "guards", "cold s", "warm s"]]
    for name, s in cold.stats.items():
        warm_s = warm.stats[name].compile_time_s if name in warm.stats else 0.0
        rows.append([name + (" [torch]" if s.upstream else ""), str(s.modules), str(s.graphs), str(s.breaks),
                     str(s.recompiles), str(s.recompiles_after_warmup), str(s.guards),
                     f"{s.compile_time_s:.2f}", f"{warm_s:.2f}"])
    rows.append(["first step (wall)", "", "", "", "", "", "", f"{cold.first_step_s:.2f}", f"{warm.first_step_s:.2f}"])

    out = [f"compile report: torch {torch_version()}, backend={backend}, mode={mode}, batch={batch} then {batch - 1}",
           _table(rows)]
    for title, attr in (("graph breaks", "break_reasons"), ("recompile guards", "recompile_guards"),
                        ("failed compiles", "failures")):
        items = [f"  {name}: {item}" for name, s in cold.stats.items() for item in getattr(s, attr)]
        if items:
            out += [f"{title}:"] + items
    if cold.sites:
        out += ["break sites:"] + [f"  {where}: {why}" for where, why in cold.sites.items()]
    if cold.alerts:
        out += ["alerts:"] + [f"  {a}" for a in cold.alerts]
    verdict = "within bounds" if not cold.violations else "BOUND EXCEEDED: " + "; ".join(cold.violations)
    out += [f"health: {verdict}", policy.format()]
    if torch.cuda.is_available() and device != "cpu":
        out.append(f"device: {torch.cuda.get_device_name()}")
    return "\n".join(out)
