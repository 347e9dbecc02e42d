"""Muon: momentum, orthogonalized update, optional variance reduction, cautious weight decay.

Per step and per parameter (fp32 math, momentum stored in bf16 by default):
    M <- lerp(M, G, 1 - mu)                        momentum (EMA form, as torch.optim.Muon)
    U <- lerp(G, M, mu) if nesterov else M
    O <- orthogonalize(U)                          per Q/K/V slice when the group has split_sizes
    O <- variance_reduce(O)                        optional, factored second moment
    P <- P - lr * wd * mask * P - lr * ratio * O   mask = [sign(O) == sign(P)] if cautious else 1
ratio is the per-shape lr scaling ("original" or "match_rms_adamw", torch.optim.Muon's adjust_lr_fn).
Weight decay uses the unscaled lr, as torch.optim.Muon does.

Parameters of one group with equal shape form a bucket that is stacked and orthogonalized as one
batch (one bmm chain instead of one per matrix); the elementwise stages run matrix by matrix, so only
the bf16 input of the orthogonalization is stacked. The update is three pure stages on lists of plain
tensors: `momentum_update` (elementwise), `orthogonal_update` (whole matrices) and `apply_update`
(elementwise). A sharded optimizer (megacpp.distributed.muon) runs the elementwise stages on each rank's
rows and only moves the orthogonalization to where whole matrices are.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megacpp.optim.config import LR_SCALINGS
from megacpp.optim.hparams import GradientOf, StepCall, TensorHParamOptimizer, gradient, gradient_stand_in
from megacpp.optim.local import is_sharded, local_tensor
from megacpp.optim.muon_spec import second_moment_shape
from megacpp.optim.orthogonalize import (
    GRAM_KERNELS,
    NORMALIZATIONS,
    QUINTIC,
    Coefficients,
    coefficient_schedule,
    orthogonalize,
)
from megacpp.optim.state_dtype import state_dtype, state_dtype_name


def lr_ratio(shape: Sequence[int], mode: str) -> float:
    """LR multiplier of a matrix (..., A, B), as torch.optim.Muon's adjust_lr_fn:
    "original" sqrt(max(1, A / B)), "match_rms_adamw" 0.2 sqrt(max(A, B))."""
    rows, cols = shape[-2], shape[-1]
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown lr scaling {mode!r}; expected one of {LR_SCALINGS}")


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
    gram_kernel: str


def variance_scale(update: Tensor, second_moments: list[Tensor], beta2: Tensor) -> Tensor:
    """Variance reduction's multiplier of `update`: damp rows (tall) or columns (otherwise) with a large
    running mean square, like AdamW does per element, then restore each matrix's Frobenius norm so the
    lr scaling keeps its meaning.

    update: (n, ..., A, B) fp32; second_moments: n fp32 buffers of second_moment_shape, updated in place.
    Returns (n, ..., A, 1) for tall matrices, else (n, ..., 1, B).
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
    return scale * kept


def variance_reduce(update: Tensor, second_moments: list[Tensor], beta2: Tensor) -> Tensor:
    """`update` (n, ..., A, B) fp32 times its `variance_scale`."""
    return update * variance_scale(update, second_moments, beta2)


def momentum_updates(grads: list[Tensor], momentum_buffers: list[Tensor], momentum: Tensor, nesterov: bool,
                     grad_scale: Tensor | None = None) -> list[Tensor]:
    """Advance the momentum buffers in place; return each matrix's fp32 update to orthogonalize.
    grad_scale (0-D fp32, the gradient clip's coefficient) multiplies each gradient as it is read.

    Matrix by matrix: the math is elementwise, so this is the stacked arithmetic bit for bit, without
    stacked copies of the gradients and buffers (a compiled step fuses each matrix's ops into one pass)."""
    weight = (1 - momentum).float()
    updates = []
    for grad, buf in zip(grads, momentum_buffers, strict=True):
        grad = grad.float() if grad_scale is None else grad.float() * grad_scale
        new = torch.lerp(buf.float(), grad, weight)
        buf.copy_(new)  # rounds to the buffer dtype
        updates.append(torch.lerp(grad, new, momentum.float()) if nesterov else new)
    return updates


def momentum_update(grads: list[Tensor], momentum_buffers: list[Tensor], momentum: Tensor, nesterov: bool,
                    grad_scale: Tensor | None = None) -> Tensor:
    """`momentum_updates`, stacked: the (n, ..., A, B) fp32 update of the bucket."""
    return torch.stack(momentum_updates(grads, momentum_buffers, momentum, nesterov, grad_scale))


def orthogonalize_bucket(update: Tensor, plan: BucketPlan) -> Tensor:
    """Stacked whole matrices (n, ..., A, B) -> their bf16 orthogonalization under the bucket's plan."""
    return orthogonalize(
        update, len(plan.coefficients), plan.split_sizes, plan.coefficients,
        normalization=plan.normalization, eps=plan.eps, gram_kernel=plan.gram_kernel,
    )


def orthogonal_update(update: Tensor, second_moments: list[Tensor], beta2: Tensor, plan: BucketPlan) -> Tensor:
    """Stacked whole matrices (n, ..., A, B) -> their fp32 orthogonalized (and variance-reduced) update."""
    ortho = orthogonalize_bucket(update, plan).float()
    if plan.variance_reduction:
        ortho = variance_reduce(ortho, second_moments, beta2)
    return ortho


def apply_update(params: list[Tensor], ortho: Tensor, lr: Tensor, weight_decay: Tensor, plan: BucketPlan,
                 scale: Tensor | None = None) -> None:
    """Cautious decoupled weight decay and the scaled step, in place, matrix by matrix (elementwise:
    no stacked copy of the parameters). ortho: (n, ..., A, B), one update per parameter, taken in fp32
    and multiplied by `scale` (a `variance_scale`) when given."""
    keep = (1 - lr * weight_decay).float()
    step = -(lr * plan.lr_ratio).float()
    for i, (param, update) in enumerate(zip(params, ortho.unbind(0), strict=True)):
        update = update.float() if scale is None else update.float() * scale[i]
        factor = keep
        if plan.cautious:
            # Gate on the orthogonalized update, not the raw gradient: decay only where the step already
            # moves the weight toward zero (the raw-gradient gate diverged in the seed's deep runs).
            # keep - 1 is exact (Sterbenz), so entries get exactly `keep` or exactly 1.0; cheaper than where.
            factor = 1 + (keep - 1) * (update * param > 0)
        # addcmul rounds once (p + s * o), as torch's add_(o, alpha=-s) does.
        param.copy_(torch.addcmul(param * factor, update, step))


def muon_update(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    second_moments: list[Tensor],
    lr: Tensor,
    weight_decay: Tensor,
    momentum: Tensor,
    beta2: Tensor,
    grad_scale: Tensor | None,
    plan: BucketPlan,
) -> None:
    """One Muon step for a bucket of same-shape whole matrices; updates params and buffers in place.
    grad_scale: see `momentum_updates`."""
    updates = momentum_updates(grads, momentum_buffers, momentum, plan.nesterov, grad_scale)
    # Stacked in bf16, the dtype orthogonalize starts with: the values of stacking in fp32 and casting
    # after, at half the bytes.
    ortho = orthogonalize_bucket(torch.stack([u.to(torch.bfloat16) for u in updates]), plan)
    # orthogonal_update's arithmetic, with the variance-reduction product left to each matrix's
    # elementwise pass: no stacked fp32 copy of the update.
    scale = variance_scale(ortho.float(), second_moments, beta2) if plan.variance_reduction else None
    apply_update(params, ortho, lr, weight_decay, plan, scale)


def muon_step(work: list[tuple[Any, ...]], plans: tuple[BucketPlan, ...]) -> None:
    """Buckets of one optimizer step, in order; compiled as the graphs of `STEP_PARTS`."""
    for args, plan in zip(work, plans, strict=True):
        muon_update(*args, plan)


# The compiled step is four graphs, each over a run of buckets, so that four helper processes compile them
# side by side (`train.step_prewarm`): `small`'s step as one graph took its helper 60.5 s on an H100, as two
# 49-60 s each, the longest path of the cold first step; as four 20-41 s, and that first step fell from
# 87.8 to 62.0 s (BENCHMARKS.md, K9). Each part is a function of its own: Dynamo keys its cache on the code
# object, and one function for every part would be a recompile.
def muon_step_part1(work: list[tuple[Any, ...]], plans: tuple[BucketPlan, ...]) -> None:
    muon_step(work, plans)


def muon_step_part2(work: list[tuple[Any, ...]], plans: tuple[BucketPlan, ...]) -> None:
    muon_step(work, plans)


def muon_step_part3(work: list[tuple[Any, ...]], plans: tuple[BucketPlan, ...]) -> None:
    muon_step(work, plans)


def muon_step_part4(work: list[tuple[Any, ...]], plans: tuple[BucketPlan, ...]) -> None:
    muon_step(work, plans)


STEP_PARTS = (muon_step_part1, muon_step_part2, muon_step_part3, muon_step_part4)


def step_parts(buckets: list[Bucket], parts: int) -> list[list[Bucket]]:
    """`buckets` as at most `parts` runs of consecutive buckets with about equal numbers of matrices (the
    graph's size follows them: each matrix has its own momentum and update ops)."""
    total = sum(len(b.params) for b in buckets)
    runs: list[list[Bucket]] = [[]]
    done = 0
    for bucket in buckets:
        # Close the run when taking this bucket would overshoot the run's share by more than leaving it.
        end = total * len(runs) / parts
        if runs[-1] and len(runs) < parts and done + len(bucket.params) - end > end - done:
            runs.append([])
        runs[-1].append(bucket)
        done += len(bucket.params)
    return [run for run in runs if run]


def _parts(buckets: list[Bucket]) -> list[tuple[Callable[..., None], list[Bucket]]]:
    """Each run of `step_parts` with the step function that takes it; with fewer runs than parts (a single
    bucket), the first functions take them."""
    return list(zip(STEP_PARTS, step_parts(buckets, len(STEP_PARTS)), strict=False))


class Bucket(NamedTuple):
    """Same-shape parameters of one group, stepped as one stack."""

    params: list[Tensor]
    group: dict[str, Any]
    plan: BucketPlan


class Muon(TensorHParamOptimizer):
    """Muon for matrices (..., A, B) with ndim >= 2; leading dims are a stack of independent matrices.

    Hyperparameters lr, weight_decay, momentum and beta2 are 0-D tensors (see TensorHParamOptimizer).
    Per-group settings beyond torch's: ``lr_scaling`` ("original" | "match_rms_adamw") and
    ``split_sizes`` (row sizes of a fused QKV matrix, orthogonalized slice by slice; None = whole).
    ``gram_kernel`` ("auto" | "reference", the optimizer's, not a group's: it changes how the products run,
    not what they are) is `orthogonalize`'s: "reference" keeps every stack off the Triton Gram kernel.

    Parameters may be FSDP2 DTensors sharded on dim 0 when every shard holds whole matrices, i.e. for
    stacked (E, A, B) parameters; row-sharded 2-D matrices need megacpp.distributed.muon.ShardedMuon, which
    orthogonalizes each matrix whole.
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
        split_sizes: Sequence[int] | None = None,
        momentum_dtype: torch.dtype | str = torch.bfloat16,
        compile_step: bool = False,
        compile_backend: str = "inductor",
        gram_kernel: str = "auto",
    ) -> None:
        if gram_kernel not in GRAM_KERNELS:
            raise ValueError(f"unknown gram_kernel {gram_kernel!r}; expected one of {GRAM_KERNELS}")
        self.gram_kernel = gram_kernel
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, beta2=beta2, nesterov=nesterov,
            variance_reduction=variance_reduction, cautious_weight_decay=cautious_weight_decay,
            coefficients=coefficients, ns_steps=ns_steps, normalization=normalization, eps=eps,
            lr_scaling=lr_scaling, split_sizes=split_sizes, momentum_dtype=state_dtype_name(momentum_dtype),
        )
        super().__init__(params, defaults, compile_step=compile_step, compile_backend=compile_backend)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        coefficient_schedule(group["coefficients"], group["ns_steps"])  # validates
        if group["normalization"] not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {group['normalization']!r}")
        group["momentum_dtype"] = state_dtype_name(group["momentum_dtype"])
        if group["split_sizes"] is not None:
            group["split_sizes"] = tuple(int(s) for s in group["split_sizes"])
        for p in group["params"]:
            if p.ndim < 2 or p.is_complex():
                raise ValueError(f"Muon takes real matrices (ndim >= 2); got shape {tuple(p.shape)}")
            lr_ratio(p.shape, group["lr_scaling"])  # validates the mode
            if group["split_sizes"] is not None and sum(group["split_sizes"]) != p.shape[-2]:
                raise ValueError(f"split_sizes {group['split_sizes']} do not sum to {p.shape[-2]} rows "
                                 f"of a {tuple(p.shape)} parameter")
            self._check_layout(p)

    def _check_layout(self, p: Tensor) -> None:
        """Muon orthogonalizes whole matrices: a shard must never split one."""
        if is_sharded(p) and p.ndim == 2 and any(pl.is_shard() for pl in p.placements):
            raise ValueError(f"a row-sharded {tuple(p.shape)} matrix needs megacpp.distributed.muon.ShardedMuon "
                             "(Muon would orthogonalize each rank's rows on their own: another optimizer)")

    def _new_second_moment(self, p: Tensor) -> Tensor:
        return torch.zeros(second_moment_shape(p.shape), dtype=torch.float32, device=p.device)

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The state of `p`, created (zeros) on first use; in p's layout, so a DTensor gets DTensors."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(group["momentum_dtype"]))
        if group["variance_reduction"] and "second_moment" not in state:
            state["second_moment"] = self._new_second_moment(p)
        return state

    def _restore_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state["momentum_buffer"] = state["momentum_buffer"].to(state_dtype(group["momentum_dtype"]))
        if "second_moment" in state:
            state["second_moment"] = state["second_moment"].float()

    def buckets(self, grad_of: GradientOf = gradient) -> list[Bucket]:
        """Parameters with gradients, grouped by (group, shape, dtype, device), in a fixed order."""
        found: list[Bucket] = []
        for group in self.param_groups:
            coefficients = coefficient_schedule(group["coefficients"], group["ns_steps"])
            by_key: dict[tuple[Any, ...], list[Tensor]] = {}
            for p in group["params"]:
                if grad_of(p) is not None:
                    by_key.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
            for (shape, _, _), ps in by_key.items():
                plan = BucketPlan(
                    group["split_sizes"], lr_ratio(shape, group["lr_scaling"]), group["nesterov"],
                    group["cautious_weight_decay"], group["variance_reduction"], coefficients,
                    group["normalization"], group["eps"], self.gram_kernel,
                )
                found.append(Bucket(ps, group, plan))
        return found

    def bucket_work(self, bucket: Bucket, grad_of: GradientOf = gradient) -> tuple[Any, ...]:
        """`muon_update`'s tensor arguments for a bucket: each rank's local tensors."""
        ps, group = bucket.params, bucket.group
        states = [self.init_state(p, group) for p in ps]
        return (
            [local_tensor(p) for p in ps], [local_tensor(grad_of(p)) for p in ps],
            [local_tensor(s["momentum_buffer"]) for s in states],
            [local_tensor(s["second_moment"]) for s in states] if group["variance_reduction"] else [],
            group["lr"], group["weight_decay"], group["momentum"], group["beta2"], self.grad_scale,
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_buckets(self.buckets())
        return loss

    def step_buckets(self, buckets: list[Bucket]) -> None:
        """Step whole matrices: one (optionally compiled) call per run of buckets (`step_parts`)."""
        for fn, part in _parts(buckets):
            self._run(fn, *self._step_args(part))

    def first_step_calls(self) -> list[StepCall]:
        return self._whole_matrix_calls(self.buckets(gradient_stand_in) if self.compile_step else [])

    def _whole_matrix_calls(self, buckets: list[Bucket]) -> list[StepCall]:
        """`step_buckets`'s calls for these buckets, with gradient stand-ins."""
        return [StepCall(fn, self._step_args(part, gradient_stand_in), self.compile_backend)
                for fn, part in _parts(buckets)]

    def _step_args(self, buckets: list[Bucket], grad_of: GradientOf = gradient) -> tuple[Any, ...]:
        """`muon_step`'s arguments for these buckets."""
        return [self.bucket_work(b, grad_of) for b in buckets], tuple(b.plan for b in buckets)


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
    unscaled lr, fp32 momentum, and no split-QKV.
    """
    return Muon(
        params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
        variance_reduction=False, cautious_weight_decay=False, coefficients=tuple(ns_coefficients),
        ns_steps=ns_steps, normalization="torch", eps=eps, lr_scaling=adjust_lr_fn or "original",
        momentum_dtype=torch.float32,
        compile_step=compile_step, compile_backend=compile_backend,
    )

