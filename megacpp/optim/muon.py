"""Muon: momentum, orthogonalized update, optional variance reduction, cautious weight decay.

Per step and per parameter (fp32 math, momentum stored in bf16 by default):
    M <- lerp(M, G, 1 - mu)                        momentum (EMA form, as torch.optim.Muon)
    U <- lerp(G, M, mu) if nesterov else M
    O <- orthogonalize(U)                          per Q/K/V slice when tagged _qkv_split_sizes
    O <- variance_reduce(O)                        optional, factored second moment
    P <- P - lr * wd * mask * P - lr * ratio * O   mask = [sign(O) == sign(P)] if cautious else 1
ratio is the per-shape lr scaling ("original" or "match_rms_adamw", torch.optim.Muon's adjust_lr_fn).
Weight decay uses the unscaled lr, as torch.optim.Muon does.

Parameters of one group with equal shape and tags form a bucket that is stacked and orthogonalized
as one batch (one bmm chain instead of one per matrix). `muon_update` is pure tensor code on lists of
local tensors, so a sharded variant can feed it its own shards without changing the math.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megacpp.optim.config import LR_SCALINGS
from megacpp.optim.hparams import TensorHParamOptimizer
from megacpp.optim.orthogonalize import (
    NORMALIZATIONS,
    QUINTIC,
    Coefficients,
    coefficient_schedule,
    orthogonalize,
)


def lr_ratio(shape: Sequence[int], mode: str) -> float:
    """LR multiplier of a matrix (..., A, B), as torch.optim.Muon's adjust_lr_fn:
    "original" sqrt(max(1, A / B)), "match_rms_adamw" 0.2 sqrt(max(A, B))."""
    rows, cols = shape[-2], shape[-1]
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown lr scaling {mode!r}; expected one of {LR_SCALINGS}")


def second_moment_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Factored second moment of a matrix (..., A, B): per row (..., A, 1) when tall, else per column."""
    *batch, rows, cols = shape
    return (*batch, rows, 1) if rows > cols else (*batch, 1, cols)


class BucketPlan(NamedTuple):
    """Static description of one bucket; Dynamo treats it as a constant of the compiled graph."""

    split_sizes: tuple[int, ...] | None
    lr_ratio: float
    nesterov: bool
    cautious: bool
    variance_reduction: bool
    coefficients: Coefficients
    normalization: str
    eps: float


def variance_reduce(update: Tensor, second_moments: list[Tensor], beta2: Tensor) -> Tensor:
    """Damp rows (tall) or columns (otherwise) with a large running mean square, like AdamW does
    per element, then restore each matrix's Frobenius norm so the lr scaling keeps its meaning.

    update: (n, ..., A, B) fp32; second_moments: n fp32 buffers of second_moment_shape, updated in place.
    """
    rows, cols = update.shape[-2:]
    mean_sq = update.square().mean(dim=-1 if rows > cols else -2, keepdim=True)
    v = torch.stack(second_moments).lerp_(mean_sq, (1 - beta2).float())
    torch._foreach_copy_(second_moments, list(v.unbind(0)))
    scale = v.clamp_min(1e-10).rsqrt()
    # ||O||^2 = n * sum(mean_sq) and ||O * scale||^2 = n * sum(mean_sq * scale^2): n cancels.
    before = mean_sq.sum(dim=(-2, -1), keepdim=True)
    after = (mean_sq * scale.square()).sum(dim=(-2, -1), keepdim=True)
    kept = (before / after.clamp_min(1e-30)).sqrt()
    return update * (scale * kept)


def muon_update(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    second_moments: list[Tensor],
    lr: Tensor,
    weight_decay: Tensor,
    momentum: Tensor,
    beta2: Tensor,
    plan: BucketPlan,
) -> None:
    """One Muon step for a bucket of same-shape parameters; updates params and buffers in place."""
    grad = torch.stack(grads).float()
    buf = torch.stack(momentum_buffers).float().lerp_(grad, (1 - momentum).float())
    torch._foreach_copy_(momentum_buffers, list(buf.unbind(0)))  # rounds to the buffer dtype
    update = grad.lerp_(buf, momentum.float()) if plan.nesterov else buf
    ortho = orthogonalize(
        update, len(plan.coefficients), plan.split_sizes, plan.coefficients,
        normalization=plan.normalization, eps=plan.eps,
    ).float()
    if plan.variance_reduction:
        ortho = variance_reduce(ortho, second_moments, beta2)
    param = torch.stack(params)
    keep = (1 - lr * weight_decay).float()
    if plan.cautious:
        # Gate on the orthogonalized update, not the raw gradient: decay only where the step already
        # moves the weight toward zero (the raw-gradient gate diverged in the seed's deep runs).
        # keep - 1 is exact (Sterbenz), so entries get exactly `keep` or exactly 1.0; cheaper than where.
        keep = 1 + (keep - 1) * (ortho * param > 0)
    # addcmul rounds once (p + s * o), as torch's add_(o, alpha=-s) does.
    new = torch.addcmul(param * keep, ortho, -(lr * plan.lr_ratio).float())
    torch._foreach_copy_(params, list(new.unbind(0)))


def muon_step(work: list[tuple[Any, ...]], plans: tuple[BucketPlan, ...]) -> None:
    """All buckets of one optimizer step (the unit that `compile_step` turns into one graph)."""
    for args, plan in zip(work, plans, strict=True):
        muon_update(*args, plan)


class Muon(TensorHParamOptimizer):
    """Muon for matrices (..., A, B) with ndim >= 2; leading dims are a stack of independent matrices.

    Hyperparameters lr, weight_decay, momentum and beta2 are 0-D tensors (see TensorHParamOptimizer).
    Parameter tags (read when use_param_tags): `_qkv_split_sizes` splits the orthogonalization along
    the output dim; `_muon_lr_scaling` overrides the group's lr_scaling.
    """

    TENSOR_HPARAMS = ("lr", "weight_decay", "momentum", "beta2")
    # fp64 scalars: 1 - momentum, 1 - lr * wd and lr * ratio then round to fp32 exactly as the same
    # expressions on Python floats do (what torch.optim.Muon computes), before touching fp32 tensors.
    HPARAM_DTYPE = torch.float64

    def __init__(
        self,
        params: Any,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        *,
        beta2: float = 0.95,
        variance_reduction: bool = True,
        cautious_weight_decay: bool = True,
        coefficients: str | Sequence[float] | Sequence[Sequence[float]] = "polar_express",
        ns_steps: int = 5,
        normalization: str = "polar_express",
        eps: float = 1e-6,
        lr_scaling: str = "original",
        momentum_dtype: torch.dtype | str = torch.bfloat16,
        use_param_tags: bool = True,
        compile_step: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, beta2=beta2, nesterov=nesterov,
            variance_reduction=variance_reduction, cautious_weight_decay=cautious_weight_decay,
            coefficients=coefficients, ns_steps=ns_steps, normalization=normalization, eps=eps,
            lr_scaling=lr_scaling, momentum_dtype=_dtype_name(momentum_dtype), use_param_tags=use_param_tags,
        )
        super().__init__(params, defaults, compile_step=compile_step, compile_backend=compile_backend)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        coefficient_schedule(group["coefficients"], group["ns_steps"])  # validates
        if group["normalization"] not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {group['normalization']!r}")
        group["momentum_dtype"] = _dtype_name(group["momentum_dtype"])
        for p in group["params"]:
            if p.ndim < 2 or p.is_complex():
                raise ValueError(f"Muon takes real matrices (ndim >= 2); got shape {tuple(p.shape)}")
            lr_ratio(p.shape, self._lr_scaling(p, group))  # validates the mode
            self._split_sizes(p, group)  # validates the tag

    @staticmethod
    def _lr_scaling(p: Tensor, group: dict[str, Any]) -> str:
        tag = getattr(p, "_muon_lr_scaling", None) if group["use_param_tags"] else None
        return tag or group["lr_scaling"]

    @staticmethod
    def _split_sizes(p: Tensor, group: dict[str, Any]) -> tuple[int, ...] | None:
        sizes = getattr(p, "_qkv_split_sizes", None) if group["use_param_tags"] else None
        if sizes is None:
            return None
        if sum(sizes) != p.shape[-2]:
            raise ValueError(f"_qkv_split_sizes {tuple(sizes)} do not sum to {p.shape[-2]} rows")
        return tuple(int(s) for s in sizes)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if "momentum_buffer" not in state:
            dtype = getattr(torch, group["momentum_dtype"])
            state["momentum_buffer"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        if group["variance_reduction"] and "second_moment" not in state:
            shape = second_moment_shape(p.shape)
            state["second_moment"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return state

    def _restore_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state["momentum_buffer"] = state["momentum_buffer"].to(getattr(torch, group["momentum_dtype"]))
        if "second_moment" in state:
            state["second_moment"] = state["second_moment"].float()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work: list[tuple[Any, ...]] = []
        plans: list[BucketPlan] = []
        for group in self.param_groups:
            coefficients = coefficient_schedule(group["coefficients"], group["ns_steps"])
            buckets: dict[tuple[Any, ...], list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                split, scaling = self._split_sizes(p, group), self._lr_scaling(p, group)
                key = (tuple(p.shape), p.dtype, p.device, split, scaling)
                buckets.setdefault(key, []).append(p)
            for (shape, _, _, split_sizes, scaling), ps in buckets.items():
                states = [self._init_state(p, group) for p in ps]
                work.append((
                    ps, [p.grad for p in ps], [s["momentum_buffer"] for s in states],
                    [s["second_moment"] for s in states] if group["variance_reduction"] else [],
                    group["lr"], group["weight_decay"], group["momentum"], group["beta2"],
                ))
                plans.append(BucketPlan(
                    split_sizes, lr_ratio(shape, scaling), group["nesterov"], group["cautious_weight_decay"],
                    group["variance_reduction"], coefficients, group["normalization"], group["eps"],
                ))
        if work:
            self._run(muon_step, work, tuple(plans))
        return loss


def torch_muon_compatible(
    params: Any,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = QUINTIC,
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    *,
    compile_step: bool = False,
    compile_backend: str = "inductor",
) -> Muon:
    """A Muon that reproduces torch.optim.Muon's update; same arguments and defaults as torch.optim.Muon.

    torch.optim.Muon's terms: one quintic (a, b, c) for every iteration, normalisation by
    max(||X||_F, eps), no variance reduction, plain (not cautious) decoupled weight decay with the
    unscaled lr, fp32 momentum, and no parameter tags (it knows neither split-QKV nor per-parameter
    lr scaling).
    """
    return Muon(
        params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
        variance_reduction=False, cautious_weight_decay=False, coefficients=tuple(ns_coefficients),
        ns_steps=ns_steps, normalization="torch", eps=eps, lr_scaling=adjust_lr_fn or "original",
        momentum_dtype=torch.float32, use_param_tags=False,
        compile_step=compile_step, compile_backend=compile_backend,
    )


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ("bfloat16", "float32"):
        raise ValueError(f"momentum_dtype must be bfloat16 or float32, got {dtype}")
    return name
