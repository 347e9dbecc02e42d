"""Triton kernel of `megacpp::linear_softcap_xent_rows` (megacpp/ops/softcap_xent.py has the contract and
the reference): per row of logits u, the soft-capped cross-entropy and its gradient in one launch.

With z = cap * tanh(u / cap), every z lies in (-cap, cap), so exp(z - cap) needs no running maximum: the
row sum of exp(z - cap) lies in [e^(-2 cap), V] and lse = cap + log(sum). For cap <= 40 (`MAX_CAP` in
megacpp/ops/softcap_xent_limits.py) even the smallest term, e^(-2 cap) >= e^-80, is a normal fp32 number
(2^-126 ~ e^-87.3), so the sum never underflows to zero. One program walks its row twice in blocks: the
sum, then p = exp(z - lse) and the gradient (p - [v == target]) * (1 - (z / cap)^2), written in the
logits' dtype over the logits themselves (the loss holds one (n, V) buffer, not two). The second walk
re-reads a row the first has just read (64 KiB at a 32k vocabulary in bf16), mostly from L2. Each row's
sum is one program's fixed-order reduction: no atomics, run-to-run identical.

At `small`'s head (32,768 rows of 32,768 bf16 logits) on an H200 the kernel takes 2.3-2.4 ms, where
Inductor's compiled loss ran two reductions over the logits (2.0-2.1 ms each, libdevice tanh). It is
bound by the special-function unit (two exp2 and one reciprocal per logit and walk), not by memory
(docs/benchmarks_archive.md, 2026-11-25).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Logits per block of a row's walk, and warps per program: at `small`'s head on an H200, 2048 / 8 took
# 2.37 ms, 4096 / 16 2.35, 1024 / 4 2.38, 4096 / 8 2.61, 8192 / 8 2.93 (docs/benchmarks_archive.md).
BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _softcap(u, cap, inv_cap):
    # cap * tanh(u / cap) through exp of a non-positive argument: no overflow at any |u|.
    a = u * inv_cap
    e = tl.exp(-2.0 * tl.abs(a))
    th = (1.0 - e) / (1.0 + e)
    return cap * tl.where(a < 0, -th, th)


@triton.jit
def _rows_kernel(logits_ptr, targets_ptr, loss_ptr, V, cap, inv_cap, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * V
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        inside = start + cols < V
        u = tl.load(logits_row + start + cols, mask=inside, other=0.0).to(tl.float32)
        total += tl.where(inside, tl.exp(_softcap(u, cap, inv_cap) - cap), 0.0)
    lse = cap + tl.log(tl.sum(total, axis=0))
    # A target outside [0, V) other than ignore_index is the caller's error (F.cross_entropy raises; the
    # embedding of the same ids already does in training): clamped, it can never read outside the row.
    safe_target = tl.minimum(tl.maximum(tl.where(valid, target, 0), 0), V - 1)
    z_target = _softcap(tl.load(logits_row + safe_target).to(tl.float32), cap, inv_cap)
    tl.store(loss_ptr + row, tl.where(valid, lse - z_target, 0.0))
    # Each block is loaded before its gradient overwrites it, in this program alone: in place is safe.
    for start in range(0, V, BLOCK):
        inside = start + cols < V
        u = tl.load(logits_row + start + cols, mask=inside, other=0.0).to(tl.float32)
        z = _softcap(u, cap, inv_cap)
        p = tl.exp(z - lse)
        p = tl.where(start + cols == target, p - 1.0, p)
        scaled = z * inv_cap
        grad = tl.where(valid, p * (1.0 - scaled * scaled), 0.0)
        tl.store(logits_row + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=inside)


def softcap_xent_rows_(logits: Tensor, targets: Tensor, cap: float, ignore_index: int) -> Tensor:
    """Each row's loss (n,) in fp32, with logits (n, V), contiguous, overwritten by the gradient: the
    contract of `megacpp.ops.softcap_xent.softcap_xent_rows_reference`, the gradient in place."""
    if not logits.is_contiguous():
        raise ValueError("softcap_xent_rows_ overwrites its logits in place: they must be contiguous")
    n_rows, vocab = logits.shape
    row_loss = logits.new_empty(n_rows, dtype=torch.float32)
    if n_rows:
        _rows_kernel[(n_rows,)](logits, targets.contiguous(), row_loss, vocab, float(cap), 1.0 / cap, ignore_index,
                                BLOCK=BLOCK, num_warps=NUM_WARPS)
    return row_loss
