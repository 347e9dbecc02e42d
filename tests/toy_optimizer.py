"""A toy optimizer, written as a new optimizer's module is: its class, nothing else (its spec is
tests/toy_optimizer_spec.py).

Sign descent, ``p <- p - lr * sign(g)``: every entry moves by exactly lr or not at all, which makes its
steps easy to recognise. tests/test_extending.py registers it with one registry line and gives it one
OptimConfig field, `sign_lr`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megacpp.optim.hparams import TensorHParamOptimizer


class SignDescent(TensorHParamOptimizer):
    TENSOR_HPARAMS = ("lr",)

    def __init__(self, params: Any, lr: float = 0.01, *, compile_step: bool = False,
                 compile_backend: str = "inductor") -> None:
        super().__init__(params, {"lr": lr}, compile_step=compile_step, compile_backend=compile_backend)

    def init_state(self, p: Tensor, group: dict[str, Any] | None = None) -> dict[str, Any]:
        """Sign descent keeps no state."""
        return {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:  # the clip's coefficient is > 0: it never changes a sign
                    p.sub_(group["lr"] * torch.sign(p.grad))
