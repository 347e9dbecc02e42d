"""Orthogonalization of update matrices: Polar Express (default) or the classic quintic iteration.

Both are odd matrix polynomials X <- a X + (b A + c A^2) X with A = X X^T, run in bf16 on the short
side of each matrix. They map a matrix U S V^T to roughly U V^T without an SVD.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megacpp.ops.gram import gram_polynomial

Coefficients = tuple[tuple[float, float, float], ...]

# Polar Express tuples for 5 iterations (safety factor 0.02, cushion 0.02). Each is the optimal odd
# quintic for the singular-value interval the previous one leaves behind.
POLAR_EXPRESS: Coefficients = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# The classic Newton-Schulz quintic (maximal slope at zero), the same tuple every iteration.
QUINTIC: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

NORMALIZATIONS = ("polar_express", "torch")
# The stacks whose Gram products take the Triton kernel (stack size x rows^2 x cols of the short side, the
# Gram product's multiply-adds). Each call of the kernel's custom op costs the host ~60 µs more than a cuBLAS
# call in the compiled step (BENCHMARKS.md, V19), so only large stacks gain: on every stack of `small` (~90
# calls a step) the step's gain was not established (V18); on the experts' stacks only (160 x 768^2 x 1024, 12
# calls) Muon's device time fell from 9.8 to 8.9 ms and the step ran 0.6-1.1% faster in three alternated pairs
# (V21); `nam52`'s at depth 12 (64 x 1024^2 x 2048) ran 2.8% faster (V22).
GRAM_KERNEL_MIN_WORK = 2**35
# "auto": the kernel for the stacks above on CUDA; "reference": cuBLAS and Inductor's pass for every stack.
GRAM_KERNELS = ("auto", "reference")


def coefficient_schedule(
    coefficients: str | Sequence[float] | Sequence[Sequence[float]], steps: int
) -> Coefficients:
    """Per-iteration (a, b, c) tuples for `steps` iterations.

    "polar_express" repeats its last tuple beyond 5 iterations (that tuple is tuned for an interval
    already close to 1); "quintic" or one explicit (a, b, c) is used for every iteration; an explicit
    sequence of tuples is used as given and must be at least `steps` long.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if coefficients == "polar_express":
        return POLAR_EXPRESS[:steps] + (POLAR_EXPRESS[-1],) * max(0, steps - len(POLAR_EXPRESS))
    if coefficients == "quintic":
        return (QUINTIC,) * steps
    if isinstance(coefficients, str):
        raise ValueError(f"unknown coefficient set {coefficients!r}; expected polar_express or quintic")
    seq = list(coefficients)
    if len(seq) == 3 and all(isinstance(v, (int, float)) for v in seq):
        a, b, c = (float(v) for v in seq)
        return ((a, b, c),) * steps
    tuples = tuple((float(a), float(b), float(c)) for a, b, c in seq)
    if len(tuples) < steps:
        raise ValueError(f"{len(tuples)} coefficient tuples given for {steps} steps")
    return tuples[:steps]


def orthogonalize(
    G: Tensor,
    steps: int = 5,
    split_sizes: Sequence[int] | None = None,
    coefficients: str | Sequence[float] | Sequence[Sequence[float]] = "polar_express",
    *,
    normalization: str = "polar_express",
    eps: float = 1e-6,
    fold_identity: bool | None = None,
    gram_kernel: str = "auto",
) -> Tensor:
    """Approximate U V^T of G = U S V^T for a matrix or a stack of matrices (..., A, B); returns bf16.

    normalization: "polar_express" divides by 1.02 * ||X||_F + eps (the safety factor keeps every
    singular value inside the interval the coefficients were computed for); "torch" divides by
    max(||X||_F, eps), torch.optim.Muon's rule. Norms are per matrix, over the last two dims.
    split_sizes: split along the output dim (-2), orthogonalize each slice on its own, concatenate.
    fold_identity: how each iteration's products are formed. False: B = b A + c A^2 and X <- a X + B X
    as `baddbmm`s, each sum rounded once in the product's epilogue (the CPU path, whose numerics the
    tests pin). True: X <- (a I + b A + c A^2) X with A and the polynomial as `gram_polynomial`s (on
    CUDA, for stacks of GRAM_KERNEL_MIN_WORK and more, one Triton kernel each, the polynomial's terms
    summed in its epilogue; otherwise cuBLAS and the polynomial summed in fp32 in one elementwise pass).
    cuBLAS's baddbmm first copies its addend into a fresh output buffer: on `small` those were 159 copies
    and 2.5 of an optimizer step's 19.5 ms of device time on an H200 (docs/benchmarks_archive.md); the
    folded form has none. Both land equally close to U V^T (the
    tests compare them). None (default): folded on CUDA under torch.compile; eager, the reference's
    separate fp32 passes cost more than the copies (`small`'s eager Muon step 55 against 41 ms), so eager
    and CPU steps take the epilogue form.
    gram_kernel: "auto" lets the folded form's large stacks take the Triton kernel; "reference" keeps every
    stack on cuBLAS (megacpp.ops.gram's reference), the products as they were before the kernel.
    """
    if G.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a stack of matrices, got shape {tuple(G.shape)}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"unknown normalization {normalization!r}; expected one of {NORMALIZATIONS}")
    if gram_kernel not in GRAM_KERNELS:
        raise ValueError(f"unknown gram_kernel {gram_kernel!r}; expected one of {GRAM_KERNELS}")
    schedule = coefficient_schedule(coefficients, steps)
    if split_sizes is None:
        return _orthogonalize(G, schedule, normalization, eps, fold_identity, gram_kernel)
    if sum(split_sizes) != G.shape[-2]:
        raise ValueError(f"split_sizes {tuple(split_sizes)} do not sum to {G.shape[-2]} rows")
    parts = torch.split(G, list(split_sizes), dim=-2)
    return torch.cat([_orthogonalize(p, schedule, normalization, eps, fold_identity, gram_kernel) for p in parts],
                     dim=-2)


def _orthogonalize(G: Tensor, schedule: Coefficients, normalization: str, eps: float,
                   fold_identity: bool | None, gram_kernel: str) -> Tensor:
    batch_shape, (rows, cols) = G.shape[:-2], G.shape[-2:]
    X = G.to(torch.bfloat16).reshape(-1, rows, cols)
    tall = rows > cols  # work on the short side: the Gram matrix is min(A, B)^2
    if G.is_cuda and torch.compiler.is_compiling() if fold_identity is None else fold_identity:
        X = _folded_iterations(_normalized(X, normalization, eps), schedule, tall, gram_kernel)
    else:
        X = _epilogue_iterations(_normalized(X.mT if tall else X, normalization, eps), schedule)
        X = X.mT if tall else X
    return X.reshape(*batch_shape, rows, cols)


def _normalized(X: Tensor, normalization: str, eps: float) -> Tensor:
    norm = X.norm(dim=(-2, -1), keepdim=True)
    if normalization == "polar_express":
        return X / (norm * 1.02 + eps)
    return X / norm.clamp_min(eps)


def _epilogue_iterations(X: Tensor, schedule: Coefficients) -> Tensor:
    """The iterations on wide matrices X (n, m, k), m <= k: B = b A + c A^2 and X <- a X + B X."""
    for a, b, c in schedule:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def _folded_iterations(X: Tensor, schedule: Coefficients, tall: bool, gram_kernel: str) -> Tensor:
    """The iterations X <- (a I + b A + c A^2) X on X's short side, X (n, rows, cols) as stored. A tall
    stack is read through transposed views (cuBLAS and the Gram kernel take them as they are) and the
    last product is formed transposed, X^T P^T, so every elementwise pass and the result keep the stored
    layout: a norm and an update pass over transposed views of `small`'s expert stacks cost 0.8 and 0.9 ms.
    A and the polynomial are `gram_polynomial`s: symmetric, so on CUDA their kernel computes half the
    tiles and folds the polynomial's sum into its products (no elementwise pass of its own), for the stacks
    of GRAM_KERNEL_MIN_WORK and more (unless gram_kernel is "reference")."""
    if tall:
        X = X.mT
    n, rows, cols = X.shape
    large = n * rows * rows * cols >= GRAM_KERNEL_MIN_WORK
    kernel = "auto" if gram_kernel == "auto" and large else "reference"
    *steps, (a, b, c) = schedule
    for a_i, b_i, c_i in steps:
        X = gram_polynomial(gram_polynomial(X, 0, 0, 1, kernel), a_i, b_i, c_i, kernel) @ X
    P = gram_polynomial(gram_polynomial(X, 0, 0, 1, kernel), a, b, c, kernel)
    return X.mT @ P.mT if tall else P @ X
