"""The LM head's loss: linear projection, soft-cap and cross-entropy as one op with two implementations.

    linear_softcap_cross_entropy(x, weight, targets, cap, ignore_index, kernel="auto") -> loss

x (n, d) the normed hidden states, weight (V, d) (both cast to the autocast dtype where autocast is on,
as F.linear would), targets (n,) integer; the loss is the mean, over the rows whose target is not
``ignore_index``, of ``cross_entropy(cap * tanh((x @ weight.T).float() / cap), targets)``, as
`F.cross_entropy` computes it (nan when every target is ignored).

- `linear_softcap_cross_entropy_reference` is exactly what `HybridLM.loss` computed before this op
  existed: the CPU path, bitwise unchanged.
- The fused path (`megacpp::linear_softcap_xent_rows`) computes the logits with one GEMM, then runs one
  Triton kernel (megacpp/ops/softcap_xent_triton.py) that returns each row's loss and overwrites the
  logits with the gradient of the summed loss with respect to them, already in the forward. The
  backward is two GEMMs on that gradient, with the upstream gradient and 1 / n_valid applied to their
  small (n, d) and (V, d) results, not to the (n, V) gradient. Compiled, the loss takes Inductor's
  forward reduction and its backward's pass over the logits (2.0-2.1 ms each at `small`'s head on an
  H200, docs/benchmarks_archive.md) down to one kernel of ~2.4 ms, and holds one (n, V) buffer as before.

`kernel` picks the implementation: "auto" (fused for CUDA tensors it supports, else the reference),
"reference", or "triton" (an error where the kernel cannot serve the call). On CPU, "triton" runs only
under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported): that is how the tests run the
kernel without a GPU.
"""
from __future__ import annotations

from types import ModuleType
from typing import get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from megacpp.errors import MegacppError
from megacpp.ops.softcap_xent_limits import MAX_CAP, LossKernel
from megacpp.ops.triton_choice import TRITON_FLOATS, asks_for_triton, triton_runs_on

try:
    from megacpp.ops import softcap_xent_triton
except ImportError:  # no triton (CPU-only installs): the reference serves every call
    softcap_xent_triton = None



class LossKernelError(MegacppError):
    """The requested loss implementation cannot run these inputs."""


def softcap(logits: Tensor, cap: float) -> Tensor:
    """cap * tanh(logits / cap) in fp32 (cap 0: the fp32 logits unchanged)."""
    logits = logits.float()
    return cap * torch.tanh(logits / cap) if cap > 0 else logits


def linear_softcap_cross_entropy_reference(x: Tensor, weight: Tensor, targets: Tensor, cap: float,
                                           ignore_index: int) -> Tensor:
    """Mean cross-entropy of the soft-capped logits over the rows not ignored."""
    return F.cross_entropy(softcap(F.linear(x, weight), cap), targets, ignore_index=ignore_index)


def softcap_xent_rows_reference(logits: Tensor, targets: Tensor, cap: float, ignore_index: int
                                ) -> tuple[Tensor, Tensor]:
    """Per row of logits (n, V): the soft-capped cross-entropy (n,) and the gradient of the summed rows
    with respect to the logits, (n, V) in the logits' dtype: (softmax(z) - onehot(target)) * (1 - (z /
    cap)^2), z the capped logits, computed in at least fp32 (the loss in that dtype). A row whose target
    is ignore_index has loss and gradient 0."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    z = cap * torch.tanh(logits.to(acc) / cap)
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(-1)
    row_loss = torch.where(valid, lse - z.gather(-1, safe).squeeze(-1), torch.zeros_like(lse))
    grad = torch.exp(z - lse.unsqueeze(-1))
    grad = grad.scatter_add(-1, safe, torch.full_like(z[:, :1], -1.0))
    grad = grad * (1.0 - (z / cap).square()) * valid.unsqueeze(-1)
    return row_loss, grad.to(logits.dtype)


def fused_unsupported_reason(x: Tensor, weight: Tensor, cap: float) -> str | None:
    """None when the fused path can serve this call, else why not (static facts only: device, dtypes,
    sizes, the cap; no data is read, so it traces under torch.compile)."""
    if not 0 < cap <= MAX_CAP:
        return f"the kernel needs a logit soft-cap in (0, {MAX_CAP:g}], got {cap:g}"
    if x.dtype not in TRITON_FLOATS or weight.dtype != x.dtype:
        return f"x and weight of one float dtype (float32, bfloat16, float16), got {x.dtype} and {weight.dtype}"
    if weight.shape[0] < 1:
        return "an empty vocabulary"
    if softcap_xent_triton is None:
        return "triton is not importable"
    if not triton_runs_on(x.device):
        return f"the Triton kernel needs CUDA tensors, got {x.device.type}"
    return None


def linear_softcap_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, cap: float, ignore_index: int,
                                 kernel: LossKernel = "auto") -> Tensor:
    """Same semantics as `linear_softcap_cross_entropy_reference`; `kernel` picks the implementation
    (module doc)."""
    if kernel not in get_args(LossKernel):
        raise LossKernelError(f"linear_softcap_cross_entropy: kernel must be one of {get_args(LossKernel)}, "
                              f"got {kernel!r}")
    if asks_for_triton(kernel, x.device):
        # The operands F.linear would see: both in the autocast dtype when autocast is on for x's device.
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
        reason = fused_unsupported_reason(x, weight, cap)
        if reason is None:
            return _FusedLoss.apply(x, weight, targets, cap, ignore_index)
        if kernel == "triton":
            raise LossKernelError(f"loss_kernel 'triton' cannot run this call: {reason}; expected CUDA tensors "
                                  "and a soft-cap the kernel supports, or loss_kernel 'auto'")
    return linear_softcap_cross_entropy_reference(x, weight, targets, cap, ignore_index)


def _kernels() -> ModuleType:
    if softcap_xent_triton is None:
        raise LossKernelError("megacpp::linear_softcap_xent_rows: triton is not importable; expected triton installed "
                              "(torch's CUDA wheels bring it)")
    return softcap_xent_triton


def linear_softcap_xent_rows_reference(x: Tensor, weight: Tensor, targets: Tensor, cap: float, ignore_index: int
                                      ) -> tuple[Tensor, Tensor]:
    """`softcap_xent_rows_reference` of the logits F.linear(x, weight): each row's loss and the gradient of
    the summed rows with respect to the logits."""
    return softcap_xent_rows_reference(F.linear(x, weight), targets, cap, ignore_index)


@torch.library.custom_op("megacpp::linear_softcap_xent_rows", mutates_args=())
def linear_softcap_xent_rows(x: Tensor, weight: Tensor, targets: Tensor, cap: float, ignore_index: int
                             ) -> tuple[Tensor, Tensor]:
    """The fused path's forward, contract of `linear_softcap_xent_rows_reference`: the logits GEMM, then
    the Triton kernel, which overwrites the logits with their gradient (one (n, V) buffer, not two; the
    logits never leave the op)."""
    logits = F.linear(x, weight)
    return _kernels().softcap_xent_rows_(logits, targets, cap, ignore_index), logits


@linear_softcap_xent_rows.register_fake
def _linear_softcap_xent_rows_fake(x, weight, targets, cap, ignore_index):
    return x.new_empty(x.shape[0], dtype=torch.float32), x.new_empty(x.shape[0], weight.shape[0])


class _FusedLoss(torch.autograd.Function):
    """Logits GEMM, the per-row kernel, and a backward of two GEMMs on the gradient the kernel wrote."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, cap: float, ignore_index: int) -> Tensor:
        row_loss, grad_logits = linear_softcap_xent_rows(x, weight, targets, cap, ignore_index)
        n_valid = (targets != ignore_index).sum()
        ctx.save_for_backward(x, weight, grad_logits, n_valid)
        return row_loss.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        x, weight, grad_logits, n_valid = ctx.saved_tensors
        # The scale applies to the GEMMs' (n, d) and (V, d) results: no pass over the (n, V) gradient.
        scale = grad_loss / n_valid
        grad_x = (grad_logits @ weight) * scale
        grad_weight = (grad_logits.t() @ x) * scale
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None, None, None
