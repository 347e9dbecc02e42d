"""Compile health across ranks: every rank must have compiled the same program.

After warmup each rank summarises its compile health (graphs, breaks and recompiles of each compiled
model region, the break sites, any bound violation) and one all-gather compares them. A violation on
any rank, or ranks that differ (one rank recompiled: 6 graphs against 12), stops every rank with the
same error. On one process this is the plain bound check.
"""
from __future__ import annotations

from typing import Any

from megacpp.compile.health import CompileHealth, CompileHealthError
from megacpp.distributed.context import DistContext
from megacpp.distributed.parity import check_parity


def health_summary(health: CompileHealth) -> dict[str, Any]:
    """What must match across ranks. Only model regions: the optimizer's compiled steps legitimately
    differ (each rank orthogonalizes the matrices it owns) and hold no collectives."""
    stats = health.snapshot()
    regions = {name: {"graphs": s.graphs, "breaks": s.breaks, "recompiles": s.recompiles}
               for name, s in sorted(stats.items()) if s.modules > 0}
    return {"regions": regions, "break_sites": sorted(health.break_sites())}


def check_compile_health(ctx: DistContext, health: CompileHealth, when: str) -> dict[str, Any]:
    """Bounds on every rank, then cross-rank equality; returns this rank's summary."""
    if not ctx.distributed:
        health.check_bounds()
        return health_summary(health)
    violations = ctx.all_gather_objects(health.violations())
    failed = [(rank, found) for rank, found in enumerate(violations) if found]
    if failed:
        shown = "; ".join(f"rank {rank}: {' / '.join(found)}" for rank, found in failed)
        raise CompileHealthError(f"compile health bound exceeded {when} ({shown})")
    summary = health_summary(health)
    check_parity(ctx, {"compile_health": summary}, when)
    return summary
