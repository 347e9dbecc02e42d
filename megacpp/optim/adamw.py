"""AdamW companion with Muon's idiom: lr and weight decay as 0-D tensors, optionally one compiled graph.

The moment updates, bias correction and parameter update are torch's own functional Adam
(`torch.optim.adam.adam`); only the decoupled weight decay is done here, because torch takes
weight_decay as a Python float (a compiled step would recompile whenever it changed) and tests
`weight_decay != 0` on the host. Eager steps use torch's fused kernel (CPU and CUDA, tensor lr
supported); compiled steps use its foreach + capturable path, which traces into one graph.

The first moment may be stored in bf16 (``momentum_dtype``): torch's Adam takes moments of the parameter's
dtype only, so it then runs on an fp32 copy of each parameter's first moment, one parameter at a time (the
fp32 copy in flight is one tensor's, not the group's), and the result is rounded back into the bf16 store.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam

from megacpp.optim.hparams import GradientOf, StepCall, TensorHParamOptimizer, gradient, gradient_stand_in
from megacpp.optim.local import local_tensor
from megacpp.optim.state_dtype import state_dtype, state_dtype_name


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    lr: Tensor,
    weight_decay: Tensor,
    betas: tuple[float, float],
    eps: float,
    grad_scale: Tensor | None,
    fused: bool,
) -> None:
    """One AdamW step for one group: p <- p (1 - lr wd), then torch's Adam update with tensor lr, on the
    gradients times grad_scale (the gradient clip's coefficient) when given. First moments of another
    dtype than the parameters' (bf16) are updated in fp32 and rounded back, parameter by parameter."""
    if grad_scale is not None:
        grads = torch._foreach_mul(grads, grad_scale)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    if exp_avgs[0].dtype == params[0].dtype:
        _adam(params, grads, exp_avgs, exp_avg_sqs, steps, lr, betas, eps, fused)
        return
    for param, grad, exp_avg, exp_avg_sq, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        wide = exp_avg.to(param.dtype)
        _adam([param], [grad], [wide], [exp_avg_sq], [step], lr, betas, eps, fused)
        exp_avg.copy_(wide)  # rounds to the storage dtype


def _adam(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
          steps: list[Tensor], lr: Tensor, betas: tuple[float, float], eps: float, fused: bool) -> None:
    """torch's Adam update without weight decay (the caller decays), fused or foreach + capturable."""
    adam(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        foreach=not fused, capturable=not fused, fused=fused,
        amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr, weight_decay=0.0, eps=eps, maximize=False,
    )


def adamw_step(work: list[tuple[Any, ...]], fused: bool) -> None:
    """All groups of one optimizer step (the unit that `compile_step` turns into one graph)."""
    for args in work:
        adamw_update(*args, fused)


class AdamW(TensorHParamOptimizer):
    """AdamW (decoupled weight decay) with 0-D tensor lr and weight_decay; betas and eps are static.
    ``momentum_dtype`` ("float32" | "bfloat16", per group) stores the first moment; the second moment is
    always fp32."""

    TENSOR_HPARAMS = ("lr", "weight_decay")

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        momentum_dtype: torch.dtype | str = torch.float32,
        compile_step: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        momentum_dtype=state_dtype_name(momentum_dtype))
        super().__init__(params, defaults, compile_step=compile_step, compile_backend=compile_backend)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["momentum_dtype"] = state_dtype_name(group["momentum_dtype"])

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The state of `p`, created on first use; moments in p's layout (a DTensor gets DTensors)."""
        state = self.state[p]
        if not state:
            # step lives on the parameter's device as fp32: both torch paths read it as a tensor there.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(group["momentum_dtype"]),
                                                memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _restore_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
        # A state dict from before momentum_dtype existed kept the first moment in the parameter's dtype.
        group.setdefault("momentum_dtype", "float32")
        state["exp_avg"] = state["exp_avg"].to(state_dtype(group["momentum_dtype"]))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._work(gradient)
        if work:
            self._run(adamw_step, work, not self.compile_step)
        return loss

    def first_step_calls(self) -> list[StepCall]:
        work = self._work(gradient_stand_in) if self.compile_step else []
        return [StepCall(adamw_step, (work, False), self.compile_backend)] if work else []

    def _work(self, grad_of: GradientOf) -> list[tuple[Any, ...]]:
        """`adamw_update`'s arguments per group with gradients: each rank's local tensors."""
        work: list[tuple[Any, ...]] = []
        for group in self.param_groups:
            ps = [p for p in group["params"] if grad_of(p) is not None]
            if not ps:
                continue
            states = [self.init_state(p, group) for p in ps]
            work.append((
                [local_tensor(p) for p in ps], [local_tensor(grad_of(p)) for p in ps],
                [local_tensor(s["exp_avg"]) for s in states], [local_tensor(s["exp_avg_sq"]) for s in states],
                [s["step"] for s in states],
                group["lr"], group["weight_decay"], tuple(group["betas"]), group["eps"], self.grad_scale,
            ))
        return work
