"""Lint: Python int/float/bool attributes that a forward mutates (the counter-as-int time bomb).

Dynamo guards on every Python scalar attribute compiled code reads, so a counter incremented in
forward recompiles every step until the cap, then that frame silently runs eagerly. Per-step state
must be a non-persistent buffer (a tensor) instead. The lint runs the forward eagerly a few times and
names every scalar attribute of any submodule that changed or appeared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

_SCALARS = (bool, int, float)


class MutatedScalarError(AssertionError):
    """A forward mutated Python scalar attributes; the message names them."""


@dataclass(frozen=True)
class ScalarMutation:
    path: str  # "blocks.2.mixer.calls"
    before: Any  # None when the attribute appeared during forward
    after: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.before!r} -> {self.after!r}"


def _scalars(model: nn.Module) -> dict[str, Any]:
    found = {}
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if type(value) in _SCALARS:
                found[f"{prefix}.{attr}" if prefix else attr] = value
    return found


def find_mutated_scalars(model: nn.Module, *args: Any, steps: int = 2, **kwargs: Any) -> list[ScalarMutation]:
    """Run ``model(*args, **kwargs)`` `steps` times; return the scalar attributes that changed.

    Run it on the uncompiled model (before `compile_model`) so that the check does not compile.
    """
    start = _scalars(model)
    changed: dict[str, ScalarMutation] = {}
    for _ in range(steps):
        model(*args, **kwargs)
        for path, value in _scalars(model).items():
            if path not in start or start[path] != value or type(start[path]) is not type(value):
                changed[path] = ScalarMutation(path, start.get(path), value)
    return sorted(changed.values(), key=lambda m: m.path)


def assert_no_mutated_scalars(model: nn.Module, *args: Any, steps: int = 2, **kwargs: Any) -> None:
    """Raise `MutatedScalarError` naming every scalar attribute the forward mutates."""
    mutations = find_mutated_scalars(model, *args, steps=steps, **kwargs)
    if mutations:
        names = "\n  ".join(str(m) for m in mutations)
        raise MutatedScalarError(
            f"forward mutates Python scalar attribute(s); make them non-persistent buffers:\n  {names}"
        )
