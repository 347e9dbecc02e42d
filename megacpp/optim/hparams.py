"""Base class for optimizers whose hyperparameters are 0-D tensors and whose step may be compiled.

Dynamo bakes Python floats into a graph as constants, so a compiled step that reads lr as a float
recompiles whenever the schedule moves it. Holding lr (and the other scheduled values) as 0-D
tensors on the parameters' device, and writing new values into them in place, keeps the compiled
graph's inputs unchanged: no recompile, no host sync.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from megacpp.optim.local import local_tensor

GradientOf = Callable[[Tensor], Tensor | None]


class StepCall(NamedTuple):
    """A compiled call of an optimizer's step: what `_run` would compile, with its arguments. A helper
    process compiles it from a description while the model compiles (megacpp.train.step_prewarm)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    backend: str


def gradient(p: Tensor) -> Tensor | None:
    """The gradient a step reads: the backward's."""
    return p.grad


def gradient_stand_in(p: Tensor) -> Tensor | None:
    """What p's local gradient will look like after the backward (shape, strides, dtype), as a meta
    tensor: describes a step before any backward ran. None for a parameter that gets no gradient."""
    if not p.requires_grad:
        return None
    local = local_tensor(p)
    return torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="meta")


class TensorHParamOptimizer(Optimizer):
    """Optimizer whose group keys in TENSOR_HPARAMS are 0-D tensors of HPARAM_DTYPE on the group's
    device; `base_lr` keeps the float lr.

    Subclasses implement `step` by gathering tensors and handing them to a pure update function
    through `_run`, which calls it eagerly or through one `torch.compile(fullgraph=True)` graph.
    """

    TENSOR_HPARAMS: ClassVar[tuple[str, ...]] = ("lr", "weight_decay")
    HPARAM_DTYPE: ClassVar[torch.dtype] = torch.float32

    def __init__(
        self, params: Any, defaults: dict[str, Any], *, compile_step: bool, compile_backend: str
    ) -> None:
        self.compile_step = compile_step
        self.compile_backend = compile_backend
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
        # The gradient clip's 0-D coefficient for the next step (set by OptimizerStack), multiplied into
        # each gradient as the step reads it; None: gradients are used as they are.
        self.grad_scale: Tensor | None = None
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        group.setdefault("base_lr", float(group["lr"]))
        for key in self.TENSOR_HPARAMS:
            # A fresh tensor per group: the defaults dict must never hand one tensor to two groups.
            group[key] = torch.tensor(float(group[key]), dtype=self.HPARAM_DTYPE, device=device)

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The state of `p` in `group`, every tensor of it created (zeros) on first use, in p's layout.
        `OptimizerStack.moments()` checkpoints and restores these tensors in place, by their keys."""
        raise NotImplementedError(f"{type(self).__name__} must define init_state to join an OptimizerStack")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch's loader replaces each group dict; copy the loaded values into the existing tensors
        # so that their identity and device survive (the schedule and a compiled step hold them).
        kept = [{key: group[key] for key in self.TENSOR_HPARAMS} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, tensors in zip(self.param_groups, kept, strict=True):
            for key, tensor in tensors.items():
                tensor.copy_(torch.as_tensor(group[key]))
                group[key] = tensor
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    self._restore_state(p, group, self.state[p])

    def _restore_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Undo torch's load-time casts (every floating state tensor to the param's dtype)."""

    def first_step_calls(self) -> list[StepCall]:
        """The compiled calls the next step makes, in order, when every parameter that requires a gradient
        has one, with `gradient_stand_in`s for the gradients (and for `grad_scale`, which the caller sets)
        and meta tensors for what the step computes between calls. Creates the state that step would
        create. Empty when the step runs eagerly."""
        return []

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, eagerly or through its one ``torch.compile(fullgraph=True)`` graph."""
        if not self.compile_step:
            return fn(*args)
        if fn not in self._compiled:
            self._compiled[fn] = torch.compile(fn, fullgraph=True, backend=self.compile_backend)
        return self._compiled[fn](*args)
