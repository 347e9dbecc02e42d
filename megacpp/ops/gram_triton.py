"""Triton kernel of `megacpp::gram_polynomial` (megacpp/ops/gram.py has the contract and the reference):
a I + b M + c M Mᵀ for a stack of matrices M, computed on the upper triangle of tiles only and mirrored.

The result is symmetric, so of an (m, m) output in T × T tiles only the T (T + 1) / 2 tiles on and above
the diagonal are products; each off-diagonal tile is stored twice, as itself and transposed. At
`small`'s Gram matrices (m = 768 in tiles of 128: 21 of 36 tiles) that is 58% of a full product's work.
Each program accumulates its tile over the inner dimension in fp32 and adds a I and b M (M's tile at the
same place, for the square, symmetric M of the polynomial) before rounding once to the output's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gram_poly_kernel(m_ptr, out_ptr, a, b, c, rows, inner, tiles,
                      s_mb, s_mr, s_mk, s_ob, s_or, s_oc,
                      HAS_B: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    # Program 0, 1, ... walks the upper tiles row by row: (0, 0), (0, 1), ..., (0, T-1), (1, 1), ...
    pid = tl.program_id(0)
    matrix = tl.program_id(1).to(tl.int64)
    ti = 0
    rest = pid
    while rest >= tiles - ti:
        rest -= tiles - ti
        ti += 1
    tj = ti + rest
    rows_i = ti * BLOCK + tl.arange(0, BLOCK)
    rows_j = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BK)
    base = m_ptr + matrix * s_mb
    in_i = rows_i[:, None] < rows
    in_j = rows_j[:, None] < rows
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, inner, BK):
        kk = k0 + ks
        k_in = kk[None, :] < inner
        left = tl.load(base + rows_i[:, None] * s_mr + kk[None, :] * s_mk, mask=in_i & k_in, other=0.0)
        right = tl.load(base + rows_j[:, None] * s_mr + kk[None, :] * s_mk, mask=in_j & k_in, other=0.0)
        acc = tl.dot(left, tl.trans(right), acc, input_precision=PRECISION)
    inside = in_i & (rows_j[None, :] < rows)
    value = c * acc
    if HAS_B:
        own = tl.load(base + rows_i[:, None] * s_mr + rows_j[None, :] * s_mk, mask=inside, other=0.0)
        value += b * own.to(tl.float32)
    value = tl.where(rows_i[:, None] == rows_j[None, :], value + a, value)
    value = value.to(out_ptr.dtype.element_ty)
    out = out_ptr + matrix * s_ob
    tl.store(out + rows_i[:, None] * s_or + rows_j[None, :] * s_oc, value, mask=inside)
    if tj != ti:
        tl.store(out + rows_j[:, None] * s_or + rows_i[None, :] * s_oc, tl.trans(value), mask=tl.trans(inside))


def gram_polynomial_triton(M: Tensor, a: float, b: float, c: float, block: int = 128, block_k: int = 64,
                           num_warps: int = 4, num_stages: int = 3) -> Tensor:
    """The contract of `megacpp.ops.gram.gram_polynomial_reference` for M (..., m, k) in any strides; the
    result is contiguous, in M's dtype. The default tiling was the fastest of six at `small`'s expert stacks
    on an H200 (128 x 128 tiles over 64 columns, 4 warps, 3 stages; BENCHMARKS.md, V17)."""
    *batch, rows, inner = M.shape
    stack = M.reshape(-1, rows, inner)
    out = torch.empty(stack.shape[0], rows, rows, dtype=M.dtype, device=M.device)
    tiles = triton.cdiv(rows, block)
    if out.numel():
        precision = "ieee" if M.dtype == torch.float32 else "tf32"
        _gram_poly_kernel[(tiles * (tiles + 1) // 2, stack.shape[0])](
            stack, out, float(a), float(b), float(c), rows, inner, tiles, *stack.stride(), *out.stride(),
            HAS_B=b != 0, BLOCK=block, BK=block_k, PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    return out.view(*batch, rows, rows)
