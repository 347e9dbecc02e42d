"""The one place megacpp calls ``torch._dynamo.reset()``: a retry that rebuilds the model.

Resetting drops every compiled graph (on the deep hybrid, many minutes of recompile) and clears the
compile hooks, so it is done only when the model is rebuilt anyway: a retry after a failed attempt
(e.g. an out-of-memory at a smaller batch) or the warm-compile half of `compile_report`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch._dynamo

from megacpp.compile.health import CompileHealth

T = TypeVar("T")


def reset_and_rebuild(build: Callable[[], T], health: CompileHealth | None = None) -> T:
    """Reset Dynamo, re-arm `health` (its hooks were cleared) and return ``build()``.

    On-disk caches (Inductor FX graph, AOTAutograd) survive, so the rebuilt model compiles warm.
    """
    if health is not None:
        health.refresh()  # reset clears Dynamo's break reasons: take them in first
    torch._dynamo.reset()
    if health is not None:
        health.after_reset()
    return build()
