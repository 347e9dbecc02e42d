"""`gram_polynomial`: a I + b M + c M Mᵀ for a stack of matrices M, the products of Muon's Newton-Schulz
iterations (megacpp/optim/orthogonalize.py): the Gram matrix A = X Xᵀ (a = b = 0, c = 1) and the
polynomial a I + b A + c A² of the symmetric A (A² = A Aᵀ).

The result is symmetric, so the Triton kernel (megacpp/ops/gram_triton.py) computes the tiles on and above
the diagonal only and mirrors them, with a I + b M added before its one rounding. At `small`'s expert
stacks (160 matrices of 768 × 1024) on an H200 one whole iteration X <- P X took 0.72-0.74 ms against
0.90 for cuBLAS's products with Inductor's polynomial pass (BENCHMARKS.md, V17), and the compiled three
iterations 2.22 against 2.73 ms, for 0.78 against 0.42 ms of the host's time (V19). The op is opaque to
Inductor (a custom op): as a `torch.library.triton_op`, which Inductor launches itself, the host paid
less (0.25 ms) but the device 3.18 ms, and `small`'s step ran slower (V19).

Contract: M (..., m, k) in any strides; where b != 0, M is square and symmetric (the b M term is read on
the upper triangle). Returns (..., m, m) in M's dtype, contiguous. The reference is the products as
`orthogonalize` formed them before the kernel: M Mᵀ in M's dtype, the polynomial's terms summed in fp32
and rounded once. It is the CPU path, and on CUDA the path of the stacks too small for the kernel to pay
(orthogonalize's GRAM_KERNEL_MIN_WORK).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megacpp.ops.kernel_choice import KernelChoice
from megacpp.ops.triton_choice import asks_for_triton, triton_runs_on

# The dtypes the kernel serves: the 16-bit ones Muon iterates in, and fp32 (IEEE products) for the
# interpreter's tests, whose bf16 products are wrong (docs/mamba3.md).
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gram_polynomial_reference(M: Tensor, a: float, b: float, c: float) -> Tensor:
    """a I + b M + c M Mᵀ: M Mᵀ in M's dtype; where a or b is non-zero the terms summed in fp32 and rounded
    once to M's dtype."""
    _check(M, b)
    product = M @ M.mT
    if a == 0 and b == 0:
        return product if c == 1 else (c * product.float()).to(M.dtype)
    total = c * product.float()
    if b != 0:
        total = total + b * M.float()
    if a != 0:
        total = total + a * torch.eye(M.shape[-2], dtype=torch.float32, device=M.device)
    return total.to(M.dtype)


def gram_polynomial(M: Tensor, a: float, b: float, c: float, kernel: KernelChoice = "auto") -> Tensor:
    """a I + b M + c M Mᵀ (the module's contract): the Triton kernel for CUDA tensors of its dtypes under
    "auto" (or wherever Triton runs under "triton"), else the reference."""
    if asks_for_triton(kernel, M.device) and triton_runs_on(M.device) and M.dtype in KERNEL_DTYPES:
        _check(M, b)
        return torch.ops.megacpp.gram_polynomial(M, float(a), float(b), float(c))
    if kernel == "triton":
        raise ValueError(f"gram_polynomial's Triton kernel cannot serve {M.dtype} on {M.device}: it takes "
                         f"{', '.join(str(d) for d in KERNEL_DTYPES)} on CUDA (or on CPU under TRITON_INTERPRET=1)")
    return gram_polynomial_reference(M, a, b, c)


def _check(M: Tensor, b: float) -> None:
    if M.ndim < 2:
        raise ValueError(f"gram_polynomial takes a matrix or a stack of matrices, got shape {tuple(M.shape)}")
    if b != 0 and M.shape[-1] != M.shape[-2]:
        raise ValueError(f"gram_polynomial's b M term needs square matrices, got {tuple(M.shape[-2:])}")


@torch.library.custom_op("megacpp::gram_polynomial", mutates_args=())
def _gram_polynomial_op(M: Tensor, a: float, b: float, c: float) -> Tensor:
    from megacpp.ops.gram_triton import gram_polynomial_triton  # triton is imported where the kernel runs

    return gram_polynomial_triton(M, a, b, c)


@_gram_polynomial_op.register_fake
def _gram_polynomial_fake(M: Tensor, a: float, b: float, c: float) -> Tensor:
    return M.new_empty(*M.shape[:-1], M.shape[-2])

