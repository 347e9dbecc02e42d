"""The Mamba-3 mixer's scan with everything between its projection and `out_proj`: per-head B/C biases,
the data-dependent rotation and the trapezoidal scan, as one op with two implementations.

    mamba3_fused_scan(x, z, B, C, B_bias, C_bias, theta, adt, dt, lam, D, doc_ids=None,
                      initial_state=None, chunk_size=64, return_final_state=False, matmul_dtype=None,
                      kernel="auto") -> y | (y, (H, B_prev, x_prev))

Shapes: x, z (b, t, h, p) in the activation dtype; B, C (b, t, g, n) per group, RMS-normed but without
the per-head bias; B_bias, C_bias (h, n); theta (b, t, h, n_angles), the cumulative rotation angles
(`megacpp.ops.mamba3_angles.document_angles`); adt, dt, lam (b, t, h); D (h,); doc_ids (b, t) integer. The
initial and final states are `mamba3_scan`'s, with B_prev per head, biased and rotated (b, h, n).

- `mamba3_fused_scan_reference` is exactly what the mixer computed before this op existed (bias,
  repeat to heads, `rotate_pairs`, `mamba3_scan`): the CPU path, bitwise unchanged.
- The Triton path (megacpp/ops/mamba3_triton.py) applies the biases and the rotation inside its
  kernels, so no per-head B/C tensor exists in memory. Its two kernel stages are the custom ops
  `megacpp::mamba3_fused_fwd` and `megacpp::mamba3_fused_bwd` with fake implementations and a
  registered autograd formula: one opaque node under torch.compile, no graph break. The per-token
  coefficients (log-decay with -inf at document starts, the key weight σ = γ + β̃_{t+1}, γ) and the
  initial state's β term are a few small elementwise ops around it, left to autograd.

`kernel` picks the implementation: "auto" (Triton for CUDA tensors the kernels support, else the
reference), "reference", or "triton" (an error where Triton cannot serve the call). On CPU, "triton"
runs only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported): that is how the
tests run the kernels without a GPU.
"""
from __future__ import annotations

from types import ModuleType
from typing import get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from megacpp.errors import MegacppError
from megacpp.ops import kernel_prewarm
from megacpp.ops.mamba3_limits import ScanKernel, triton_size_reason
from megacpp.ops.mamba3_scan import State, _augmented_initial_state, _coefficients, _heads, mamba3_scan
from megacpp.ops.triton_choice import TRITON_FLOATS, asks_for_triton, triton_runs_on

try:
    from megacpp.ops import mamba3_triton
except ImportError:  # no triton (CPU-only installs): the reference serves every call
    mamba3_triton = None


class ScanKernelError(MegacppError):
    """The requested Mamba-3 scan implementation cannot run these inputs."""


def rotate_pairs(v: Tensor, theta: Tensor) -> Tensor:
    """Rotate the interleaved pairs (2i, 2i+1), i < theta.shape[-1], of v's last dim by theta[..., i]."""
    k = theta.shape[-1]
    pairs = v[..., : 2 * k].unflatten(-1, (k, 2))
    v0, v1 = pairs[..., 0], pairs[..., 1]
    cos, sin = theta.cos(), theta.sin()
    rotated = torch.stack((v0 * cos - v1 * sin, v0 * sin + v1 * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, v[..., 2 * k :]), dim=-1)


def biased_heads(v: Tensor, bias: Tensor) -> Tensor:
    """(..., g, n) per group -> (..., h, n) per head plus the per-head bias (h, n): head i reads group
    i // (h / g)."""
    return _heads(v, bias.shape[0] // v.shape[-2]) + bias


def mamba3_fused_scan_reference(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    adt: Tensor, dt: Tensor, lam: Tensor, D: Tensor, doc_ids: Tensor | None = None,
    initial_state: State | None = None, chunk_size: int = 64, return_final_state: bool = False,
    matmul_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, State]:
    """Per-head biases, rotation, then the chunked pure-PyTorch `mamba3_scan` (the mixer's computation
    before the fused op, operation for operation)."""
    B = rotate_pairs(biased_heads(B, B_bias), theta)
    C = rotate_pairs(biased_heads(C, C_bias), theta)
    if matmul_dtype is not None:
        # B and C enter the matmuls rounded anyway: rounding them here halves what is saved for backward.
        B, C = B.to(matmul_dtype), C.to(matmul_dtype)
    return mamba3_scan(
        x, B, C, adt, dt, lam, D=D, z=z, initial_state=initial_state, doc_ids=doc_ids, chunk_size=chunk_size,
        return_final_state=return_final_state, matmul_dtype=matmul_dtype,
    )


def triton_unsupported_reason(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor, adt: Tensor,
    dt: Tensor, lam: Tensor, D: Tensor, initial_state: State | None, chunk_size: int,
    matmul_dtype: torch.dtype | None,
) -> str | None:
    """None when the Triton kernels can serve this call, else why not (static facts only: device,
    dtypes, sizes; no data is read, so it traces under torch.compile)."""
    if mamba3_triton is None:
        return "triton is not importable"
    if not triton_runs_on(x.device):
        return f"the Triton kernels need CUDA tensors, got {x.device.type}"
    if matmul_dtype is not None and matmul_dtype not in TRITON_FLOATS:
        return f"matmul_dtype must be float32, bfloat16 or float16, got {matmul_dtype}"
    tensors = (x, z, B, C, B_bias, C_bias, theta, adt, dt, lam, D, *(initial_state or ()))
    if any(v.dtype not in TRITON_FLOATS for v in tensors):
        return "float32, bfloat16 or float16 tensors only, got " + ", ".join(sorted({str(v.dtype) for v in tensors}))
    b, t = x.shape[:2]
    if b < 1 or t < 1:
        return f"empty input: b={b}, t={t}"
    return triton_size_reason(x.shape[-1], B.shape[-1], theta.shape[-1], chunk_size)


def mamba3_fused_scan(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    adt: Tensor, dt: Tensor, lam: Tensor, D: Tensor, doc_ids: Tensor | None = None,
    initial_state: State | None = None, chunk_size: int = 64, return_final_state: bool = False,
    matmul_dtype: torch.dtype | None = None, kernel: ScanKernel = "auto",
) -> Tensor | tuple[Tensor, State]:
    """Same semantics as `mamba3_fused_scan_reference`; `kernel` picks the implementation (module doc)."""
    if kernel not in get_args(ScanKernel):
        raise ScanKernelError(f"mamba3_fused_scan: kernel must be one of {get_args(ScanKernel)}, got {kernel!r}")
    args = (x, z, B, C, B_bias, C_bias, theta, adt, dt, lam, D)
    if asks_for_triton(kernel, x.device):
        reason = triton_unsupported_reason(*args, initial_state, chunk_size, matmul_dtype)
        if reason is None:
            return _triton_scan(*args, doc_ids, initial_state, chunk_size, return_final_state, matmul_dtype)
        if kernel == "triton":
            raise ScanKernelError(f"Mamba-3 scan_kernel 'triton' cannot run this call: {reason}; "
                                  "expected CUDA tensors of a supported size, or scan_kernel 'auto'")
    return mamba3_fused_scan_reference(*args, doc_ids=doc_ids, initial_state=initial_state, chunk_size=chunk_size,
                                       return_final_state=return_final_state, matmul_dtype=matmul_dtype)


def _triton_scan(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor, adt: Tensor,
    dt: Tensor, lam: Tensor, D: Tensor, doc_ids: Tensor | None, initial_state: State | None, chunk_size: int,
    return_final_state: bool, matmul_dtype: torch.dtype | None,
) -> Tensor | tuple[Tensor, State]:
    f32 = torch.float32
    log_decay, gamma, beta_tilde = _coefficients(adt, dt, lam, doc_ids, f32)
    # Token t's key weight takes β̃_{t+1} (the trapezoid's second endpoint); the kernels' diagonal uses γ.
    sigma = gamma + F.pad(beta_tilde[:, 1:], (0, 0, 0, 1))
    init = _augmented_initial_state(initial_state, beta_tilde[:, 0], 1, f32)
    y, H, _, _ = _fused_fwd(x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, init, chunk_size,
                            matmul_dtype or f32)
    if not return_final_state:
        return y
    B_last = rotate_pairs(biased_heads(B[:, -1], B_bias), theta[:, -1])
    if matmul_dtype is not None:
        B_last = B_last.to(matmul_dtype)  # as the reference, whose scan saw B in the matmul dtype
    return y, (H, B_last, x[:, -1])


def _kernels() -> ModuleType:
    """The Triton kernels' module, or an error naming what is missing."""
    if mamba3_triton is None:
        raise ScanKernelError("megacpp::mamba3_fused_fwd/_bwd: triton is not importable; expected triton "
                              "installed (torch's CUDA wheels bring it)")
    return mamba3_triton


# flexible_layout: Inductor may hand the ops x, z, B and C as views of the in_proj output with its padded
# row stride (the kernels read any (b, t, h) strides) instead of copying them to eager's strides first:
# the copies cost ~0.22 ms per M layer at `small` on an H200.
@torch.library.custom_op("megacpp::mamba3_fused_fwd", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _fused_fwd(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, initial: Tensor | None, chunk_size: int,
    matmul_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gated output (b, t, h, p) in x's dtype; final state (b, h, p, n), fp32; every chunk's entering state
    (b, h, chunks, p, n) in matmul_dtype (the products round it to that); the output before the gate in
    x's dtype (for dL/dz). log_decay is -inf where a document starts; initial is the augmented state.
    The first call of each layout also starts compiling the backward's kernels (`ops.kernel_prewarm`)."""
    kernels = _kernels()
    out = kernels.fused_fwd(x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, initial, chunk_size,
                            matmul_dtype)
    inputs = (x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D)
    kernel_prewarm.warm_in_background(("mamba3_fused_bwd", chunk_size, matmul_dtype), inputs, x.device,
                                      lambda: kernels.backward_launches(*inputs, chunk_size, matmul_dtype))
    return out


@_fused_fwd.register_fake
def _fused_fwd_fake(x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, initial, chunk_size,
                    matmul_dtype):
    b, t, h, p = x.shape
    n = B.shape[-1]
    chunks = (t + chunk_size - 1) // chunk_size
    f32 = torch.float32
    return (x.new_empty(b, t, h, p), x.new_empty(b, h, p, n, dtype=f32),
            x.new_empty(b, h, chunks, p, n, dtype=matmul_dtype), x.new_empty(b, t, h, p))


@torch.library.custom_op("megacpp::mamba3_fused_bwd", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _fused_bwd(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, states: Tensor, y_pre: Tensor, grad_y: Tensor,
    grad_final: Tensor | None, chunk_size: int, matmul_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the forward's eleven tensor inputs and of its initial state (fp32), contiguous. The
    first call notes whether the helper compiling its kernels was done (`kernel_prewarm.note_helpers`)."""
    kernel_prewarm.note_helpers("mamba3_fused_bwd")
    return _kernels().fused_bwd(x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, y_pre,
                                grad_y, grad_final, chunk_size, matmul_dtype)


@_fused_bwd.register_fake
def _fused_bwd_fake(x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, y_pre, grad_y,
                    grad_final, chunk_size, matmul_dtype):
    b, h, _, p, n = states.shape
    like = (x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D)
    grads = tuple(torch.empty(v.shape, dtype=v.dtype, device=v.device) for v in like)
    return (*grads, x.new_empty(b, h, p, n, dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    *tensors, initial, chunk_size, matmul_dtype = inputs
    ctx.save_for_backward(*tensors, output[2], output[3])
    ctx.chunk_size, ctx.matmul_dtype, ctx.has_initial = chunk_size, matmul_dtype, initial is not None
    ctx.mark_non_differentiable(output[2], output[3])
    # Unused outputs (the final state, the saved chunk states) get None, not a zero tensor to read.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y: Tensor | None, grad_final: Tensor | None, _grad_states: Tensor | None,
              _grad_y_pre: Tensor | None):
    *tensors, states, y_pre = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(tensors[0])
    grads = _fused_bwd(*tensors, states, y_pre, grad_y.contiguous(), grad_final, ctx.chunk_size, ctx.matmul_dtype)
    return (*grads[:-1], grads[-1] if ctx.has_initial else None, None, None)


_fused_fwd.register_autograd(_backward, setup_context=_setup_context)
