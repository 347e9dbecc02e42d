"""Fused Triton kernels for the Mamba-3 SISO scan: the implementation of `megacpp::mamba3_fused_fwd` and
`megacpp::mamba3_fused_bwd` (megacpp/ops/mamba3_fused.py wraps them; docs/mamba3.md has the algebra).

What the kernels compute, per (batch row, head), in chunks of L tokens (the chunked SSD form of the
trapezoidal recurrence, see megacpp/ops/mamba3_scan.py):

    B_t, C_t = rotate(B_group,t + B_bias, Θ_t), rotate(C_group,t + C_bias, Θ_t)      (inside the kernel)
    S_t      = exp(a_t) S_{t-1} + σ_t x_t B_tᵀ        (a_t = -inf where a document starts)
    y_t      = S_t C_t - β̃_{t+1} (C_t·B_t) x_t + D x_t,      out_t = y_t · silu(z_t)

so within a chunk, with S the state entering it:
    y_t = decay(t, enter) S C_t + Σ_{s<t} decay(t, s) σ_s (C_t·B_s) x_s + γ_t (C_t·B_t) x_t + D x_t

The diagonal uses γ_t instead of σ_t = γ_t + β̃_{t+1}: that is the reference's diagonal correction,
folded in before the sum instead of subtracted after it. Rotations act on interleaved pairs (2i, 2i+1):
the kernels load contiguous column blocks of B and C, split each block into its even and odd columns,
rotate, and join them back, so every contraction over the state dimension is one `tl.dot` per block.

Decays inside a chunk come from a cumulative sum of the log-decays (base 2: exp2 with log2(e) scaling);
a document start is a log-decay of -inf, which the kernels turn into a segment id (the number of
starts so far in the chunk) and a zero log-decay: decay(t, s) = exp2(A_t - A_s) when s <= t in the same
segment, else exactly 0 (masked to -inf before exp2, so nothing overflows and no inf meets inf).

The chains of states over chunks (v <- qL v + what the chunk adds) are one program per (block of state
columns, batch row, head) walking the chunks in order, the carry in fp32 registers; what a chunk adds is
a product that does not depend on the carry, so only a multiply-add is on the chain and the pipelined
loads of the next chunks overlap it. Every other kernel is chunk-parallel. The forward takes 0.80 ms at
`small`'s sizes on an H200 with bf16 operands, against 1.10 with the products stored in fp32 slots for an
elementwise chain and 2.93 with the whole output on the chain (docs/benchmarks_archive.md).
The state dimension is walked in blocks of 2 KB columns (`Tiling`), or spread over the grid where
columns are independent. Blocks past the n_angles rotated pairs skip the angles and the rotation: a
compile-time specialization of the programs of the forward chain and the dB/dC kernel, a loop of their
own in the output kernel (the register-capped chunk backward rotates them at zero angles). Software
pipelining in the chains and in the dB/dC kernel's loop over a group's heads, with 16-bit operands;
register caps (Triton's maxnreg) on the output and chunk-backward kernels, with 16-bit operands, where
more programs per SM paid for a few spills (`tilings`). `benchmarks/tools/check_mamba3_resources.py` compiles
every kernel for sm_90 and reports its budget.

Kernels (programs over chunks c, batch rows b, heads h; "state" = (p, n) per chunk boundary):
- forward: `_fwd_states_kernel` (column block, b·h) walks the chunks in order and stores every
  chunk's entering state (in the operand dtype: every reader rounds it to that) and the final state
  (fp32); `_fwd_scan_kernel` (c, b·h) writes chunk c's gated output from its entering state, and the
  output before the gate, which the backward reads for dL/dz.
- backward: `_gate_bwd_kernel` (blocks of (b, t, h) rows) writes the gate's gradients, dL/dz and dy =
  dL/dy before the gate (operand dtype, for the three kernels after it, which only multiply it or use it
  where it is rounded anyway); `_bwd_states_kernel` (column block, b·h) walks the chunks from the last
  one down and stores dL/dS at every chunk's exit (operand dtype) and dL/d(initial state), and these
  columns' parts of dL/dq (q: the decay from the entering state) and of dL/dqL (the gradient of each
  chunk's whole decay); `_bwd_chunk_kernel` (c, b·h) writes the gradients of x, the decays, σ, γ and D
  and stores dL/d(C Bᵀ) per chunk; `_bwd_bc_kernel` (column block, c, b·group) writes dΘ and the biases'
  parts of each head of the group, and dB, dC summed over those heads in order, its tiles moved by
  tensor descriptors (TMA on Hopper; the interpreter runs them too), as are the reverse chain's loads;
  the forward chain on descriptors was faster alone and slower in the mixer (X1), so it keeps pointers.
  The chunk kernel is register-bound: the terms that need the entering state or the gate's inputs are
  computed where those are at hand.
The biases' and D's gradients are per-chunk partials summed over batch and chunks in PyTorch afterwards,
in a fixed order: no atomics anywhere, so every result is run-to-run deterministic.

Matmul operands: fp32 as "tf32x3" (three TF32 tensor-core products, fp32-equivalent accuracy; "tf32"
when torch allows TF32 for fp32 matmuls, as the reference's einsums would use; "ieee" before sm_80),
or bf16/fp16 when the caller asks for activation-dtype matmuls (the mixer's `scan_matmuls =
"activation"`); accumulation is fp32 always, and so are decays and the chains' carries.
Supported sizes and dtypes: `megacpp.ops.mamba3_fused.triton_unsupported_reason` (checked before a
launch; that module imports without triton).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megacpp.ops import kernel_prewarm
from megacpp.ops.kernel_prewarm import Launch, run_launch

_MM_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
LOG2E = tl.constexpr(1.4426950408889634)  # exp(a) = exp2(a * log2(e))


@triton.jit
def _dot(a, b, MM: tl.constexpr, PREC: tl.constexpr):
    """a @ b accumulated in fp32; operands rounded to bf16 (MM 1) or fp16 (MM 2), or fp32 (MM 0)."""
    if MM == 1:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    elif MM == 2:
        out = tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
    else:
        out = tl.dot(a, b, input_precision=PREC, out_dtype=tl.float32)
    return out


@triton.jit
def _load_rows(ptr, row_off, cols, mask):
    """(rows, cols) tile of fp32 values at ptr + row_off[:, None] + cols[None, :]; 0 where masked."""
    return tl.load(ptr + row_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _angles(th_ptr, tok, valid, k0, NA: tl.constexpr, KB: tl.constexpr):
    """cos and sin (L, KB) of the angles of the KB pairs from column k0 on (angle 0 from n_angles on:
    those pairs do not rotate)."""
    pairs = k0 // 2 + tl.arange(0, KB)
    theta = _load_rows(th_ptr, tok * NA, pairs, valid[:, None] & (pairs < NA)[None, :])
    return tl.cos(theta), tl.sin(theta)


@triton.jit
def _split_pairs(v, R: tl.constexpr, KB: tl.constexpr):
    """Even and odd columns (R, KB) of an (R, 2 KB) tile."""
    return tl.split(tl.reshape(v, (R, KB, 2)))


@triton.jit
def _join_pairs(even, odd, R: tl.constexpr, KB: tl.constexpr):
    """The (R, 2 KB) tile whose even and odd columns are the given halves."""
    return tl.reshape(tl.join(even, odd), (R, 2 * KB))


@triton.jit
def _rotate_pairs(v, cos, sin, R: tl.constexpr, KB: tl.constexpr):
    """The (R, 2 KB) tile v with its column pairs rotated by the angles."""
    even, odd = _split_pairs(v, R, KB)
    return _join_pairs(even * cos - odd * sin, even * sin + odd * cos, R, KB)


@triton.jit
def _no_angles(R: tl.constexpr, KB: tl.constexpr):
    """cos and sin of zero angles: placeholders for blocks of columns that do not rotate, which nothing reads."""
    return tl.full((R, KB), 1.0, tl.float32), tl.zeros((R, KB), dtype=tl.float32)


@triton.jit
def _block_angles(th_ptr, tok, valid, k0, NA: tl.constexpr, R: tl.constexpr, KB: tl.constexpr,
                  ROTATE: tl.constexpr):
    """`_angles` where the block of columns from k0 on holds rotated pairs (ROTATE), else `_no_angles`."""
    if ROTATE:
        return _angles(th_ptr, tok, valid, k0, NA, KB)
    return _no_angles(R, KB)


@triton.jit
def _bias_row(bias_ptr, cols, cmask):
    """A head's bias over these columns, as a (1, columns) row."""
    return tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]


@triton.jit
def _head_tile(v, cos, sin, mask, R: tl.constexpr, KB: tl.constexpr, ROTATE: tl.constexpr):
    """A (R, 2 KB) fp32 tile of B or C with a head's bias added, its column pairs rotated by the angles where
    the columns hold rotated pairs (ROTATE: columns past them skip the rotation, half of them at `small`,
    where 32 of 64 pairs rotate); 0 where masked."""
    if ROTATE:
        v = _rotate_pairs(v, cos, sin, R, KB)
    return tl.where(mask, v, 0.0)


@triton.jit
def _block_tile(ptr, row_off, bias_ptr, cos, sin, cols, mask, cmask, R: tl.constexpr, KB: tl.constexpr,
                ROTATE: tl.constexpr):
    """`_head_tile` of the tile at ptr + row_off[:, None] + cols[None, :] plus the bias at bias_ptr."""
    return _head_tile(_load_rows(ptr, row_off, cols, mask) + _bias_row(bias_ptr, cols, cmask), cos, sin, mask, R, KB,
                      ROTATE)


@triton.jit
def _rotated_end(N: tl.constexpr, NA: tl.constexpr, KB: tl.constexpr):
    """The first column of the first block of 2 KB columns that holds no rotated pair (N if none)."""
    return min(N, (2 * NA + 2 * KB - 1) // (2 * KB) * (2 * KB))


@triton.jit
def _chunk_decays(ld_ptr, tok, valid, L: tl.constexpr):
    """From the chunk's log-decays (-inf at document starts): the cumulative log2-decay A (L,), segment
    ids (L,), the decay from the entering state to each token q (L,), from each token to the chunk's end
    e (L,), the whole chunk's qL (scalar) and a mask of the starts."""
    ld = tl.load(ld_ptr + tok, mask=valid, other=0.0)
    start = ld == float("-inf")
    a2 = tl.where(start, 0.0, ld) * LOG2E
    A = tl.cumsum(a2, 0)
    seg = tl.cumsum(start.to(tl.int32), 0)
    total = tl.sum(a2, 0)
    seg_last = tl.sum(start.to(tl.int32), 0)
    q = tl.where(seg == 0, tl.exp2(A), 0.0)
    e = tl.where(seg == seg_last, tl.exp2(total - A), 0.0)
    qL = tl.where(seg_last == 0, tl.exp2(total), 0.0)
    return A, seg, q, e, qL, start


@triton.jit
def _decay_matrix(A, seg, rows):
    """M[i, j] = exp(A_i - A_j) for j <= i in the same segment, else exactly 0."""
    keep = (rows[:, None] >= rows[None, :]) & (seg[:, None] == seg[None, :])
    return tl.exp2(tl.where(keep, A[:, None] - A[None, :], float("-inf")))


@triton.jit
def _chunk_rows(c, T, P: tl.constexpr, L: tl.constexpr, PB: tl.constexpr):
    """Row indices of chunk c and of head_dim, head_dim's mask, the chunk's times t and their validity."""
    rows = tl.arange(0, L)
    rows_p = tl.arange(0, PB)
    t = c * L + rows
    return rows, rows_p, rows_p < P, t, t < T


@triton.jit
def _chunk_program(T, H, REP, P: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, CHUNK_AXIS: tl.constexpr):
    """Where a chunk-parallel program works: chunk c (grid axis CHUNK_AXIS), head and batch row (the
    next axis), the head's group, `_chunk_rows`, and the (b, t, h) index tok of each of the chunk's
    tokens."""
    c = tl.program_id(CHUNK_AXIS)
    pid = tl.program_id(CHUNK_AXIS + 1)
    hd = pid % H
    bi = (pid // H).to(tl.int64)
    rows, rows_p, pmask, t, valid = _chunk_rows(c, T, P, L, PB)
    return c, hd, bi, hd // REP, rows, rows_p, pmask, t, valid, (bi * T + t) * H + hd


@triton.jit
def _state_program(T, H, REP, N: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr):
    """Where a program of the chains over chunks works: state columns k0 + [0, 2 KB) (grid axis 0), all
    of head_dim, head and batch row (axis 1), the head's group, and the offsets and mask of its
    (2 KB, PB) tile of a (p, n) state, transposed: the chain's products come out in that orientation."""
    k0 = tl.program_id(0) * 2 * KB
    pid = tl.program_id(1)
    hd = pid % H
    bi = (pid // H).to(tl.int64)
    cols = k0 + tl.arange(0, 2 * KB)
    cmask = cols < N
    rows_p = tl.arange(0, PB)
    pmask = rows_p < P
    tile = rows_p[None, :] * N + cols[:, None]
    return k0, hd, bi, hd // REP, cols, cmask, rows_p, pmask, tile, cmask[:, None] & pmask[None, :]


@triton.jit
def _chain_start(ptr, bh, tile, smask, HAS_START: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                 PB: tl.constexpr, KB: tl.constexpr):
    """A chain's first value on this program's tile: from ptr (b·h, p, n) in fp32, or zero."""
    if HAS_START:
        return tl.load(ptr + bh * P * N + tile, mask=smask, other=0.0)
    return tl.zeros((2 * KB, PB), dtype=tl.float32)


@triton.jit
def _fwd_states_kernel(
    x_ptr, B_ptr, Bb_ptr, th_ptr, ld_ptr, sig_ptr, s0_ptr, states_ptr, final_ptr,
    T, H, REP, NC,
    sx_b, sx_t, sx_h, sB_b, sB_t, sB_g,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """Program (block of 2 KB state columns, batch row * head): the state's chain over the chunks, in
    order. Chunk c's entering state goes to slot c of `states` (in its dtype: every reader rounds it to
    the operand dtype), then v <- qL v + Σ_t e_t σ_t x_t B_tᵀ (e: the decay from t to the chunk's end) in
    fp32, from `s0` (or zero); the last v is the final state. Only the multiply-add is on the chain: the
    product does not depend on v, so the next chunk's loads and product overlap this one's."""
    k0 = tl.program_id(0) * 2 * KB
    # One compile-time branch per program: a runtime one around the rotation inside the loop stalled its
    # pipelining (0.32 -> 0.35 ms at `small` on an H200).
    if k0 // 2 < NA:
        _fwd_chain(x_ptr, B_ptr, Bb_ptr, th_ptr, ld_ptr, sig_ptr, s0_ptr, states_ptr, final_ptr, T, H, REP, NC,
                   sx_b, sx_t, sx_h, sB_b, sB_t, sB_g, P, N, NA, L, PB, KB, MM, PREC, HAS_INIT, True)
    else:
        _fwd_chain(x_ptr, B_ptr, Bb_ptr, th_ptr, ld_ptr, sig_ptr, s0_ptr, states_ptr, final_ptr, T, H, REP, NC,
                   sx_b, sx_t, sx_h, sB_b, sB_t, sB_g, P, N, NA, L, PB, KB, MM, PREC, HAS_INIT, False)


@triton.jit
def _fwd_chain(
    x_ptr, B_ptr, Bb_ptr, th_ptr, ld_ptr, sig_ptr, s0_ptr, states_ptr, final_ptr,
    T, H, REP, NC,
    sx_b, sx_t, sx_h, sB_b, sB_t, sB_g,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr, ROTATE: tl.constexpr,
):
    """`_fwd_states_kernel`'s program; ROTATE: whether its columns hold rotated pairs."""
    k0, hd, bi, gp, cols, cmask, rows_p, pmask, tile, smask = _state_program(T, H, REP, N, P, PB, KB)
    bh = bi * H + hd
    v = _chain_start(s0_ptr, bh, tile, smask, HAS_INIT, P, N, PB, KB)
    for c in range(NC):
        t = c * L + tl.arange(0, L)
        valid = t < T
        tok = (bi * T + t) * H + hd
        _, _, _, e, qL, _ = _chunk_decays(ld_ptr, tok, valid, L)
        es = e * tl.load(sig_ptr + tok, mask=valid, other=0.0)
        x = _load_rows(x_ptr, bi * sx_b + t * sx_t + hd * sx_h, rows_p, valid[:, None] & pmask[None, :])
        cos, sin = _block_angles(th_ptr, tok, valid, k0, NA, L, KB, ROTATE)
        br = _block_tile(B_ptr, bi * sB_b + t * sB_t + gp * sB_g, Bb_ptr + hd * N, cos, sin, cols,
                         valid[:, None] & cmask[None, :], cmask, L, KB, ROTATE)
        tl.store(states_ptr + (bh * NC + c) * P * N + tile, v.to(states_ptr.dtype.element_ty), mask=smask)
        v = qL * v + _dot(tl.trans(br * es[:, None]), x, MM, PREC)
    tl.store(final_ptr + bh * P * N + tile, v, mask=smask)


@triton.jit
def _scan_columns(C_ptr, C_row, Cb_ptr, B_ptr, B_row, Bb_ptr, th_ptr, tok, valid, states_ptr, state, pmask, k0,
                  N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, KB: tl.constexpr, MM: tl.constexpr,
                  PREC: tl.constexpr, ROTATE: tl.constexpr):
    """The output kernel's contractions over the 2 KB state columns from k0 on: the readout C_t Sᵀ and
    C Bᵀ (rotated where ROTATE)."""
    cols = k0 + tl.arange(0, 2 * KB)
    cmask = cols < N
    vmask_n = valid[:, None] & cmask[None, :]
    cos, sin = _block_angles(th_ptr, tok, valid, k0, NA, L, KB, ROTATE)
    cr = _block_tile(C_ptr, C_row, Cb_ptr, cos, sin, cols, vmask_n, cmask, L, KB, ROTATE)
    readout = _dot(cr, tl.trans(_load_rows(states_ptr, state, cols, pmask[:, None] & cmask[None, :])), MM, PREC)
    br = _block_tile(B_ptr, B_row, Bb_ptr, cos, sin, cols, vmask_n, cmask, L, KB, ROTATE)
    return readout, _dot(cr, tl.trans(br), MM, PREC)


@triton.jit
def _fwd_scan_kernel(
    x_ptr, z_ptr, B_ptr, C_ptr, Bb_ptr, Cb_ptr, th_ptr, ld_ptr, sig_ptr, gam_ptr, D_ptr, states_ptr, y_ptr, ypre_ptr,
    T, H, REP, NC,
    sx_b, sx_t, sx_h, sz_b, sz_t, sz_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr,
):
    """Program (chunk, batch row * head): the gated output of chunk c from the state entering it,
    y = (W ⊙ C Bᵀ) x + diag(q) C Sᵀ + D x (W: decays, σ below the diagonal, γ on it), times silu(z);
    y before the gate is stored too, for dL/dz in the backward. Chunks are independent here. The state
    dimension is walked in blocks of 2 KB columns."""
    c, hd, bi, gp, rows, rows_p, pmask, t, valid, tok = _chunk_program(T, H, REP, P, L, PB, 0)
    vmask_p = valid[:, None] & pmask[None, :]
    state = ((bi * H + hd) * NC + c) * P * N + rows_p * N
    cb = tl.zeros((L, L), dtype=tl.float32)
    readout = tl.zeros((L, PB), dtype=tl.float32)
    C_row = bi * sC_b + t * sC_t + gp * sC_g
    B_row = bi * sB_b + t * sB_t + gp * sB_g
    # The blocks with rotated pairs, then those without.
    for k0 in range(0, _rotated_end(N, NA, KB), 2 * KB):
        readout_part, cb_part = _scan_columns(
            C_ptr, C_row, Cb_ptr + hd * N, B_ptr, B_row, Bb_ptr + hd * N, th_ptr, tok, valid, states_ptr, state, pmask,
            k0, N, NA, L, KB, MM, PREC, True)
        readout += readout_part
        cb += cb_part
    for k0 in range(_rotated_end(N, NA, KB), N, 2 * KB):
        readout_part, cb_part = _scan_columns(
            C_ptr, C_row, Cb_ptr + hd * N, B_ptr, B_row, Bb_ptr + hd * N, th_ptr, tok, valid, states_ptr, state, pmask,
            k0, N, NA, L, KB, MM, PREC, False)
        readout += readout_part
        cb += cb_part
    A, seg, q, _, _, _ = _chunk_decays(ld_ptr, tok, valid, L)
    sig = tl.load(sig_ptr + tok, mask=valid, other=0.0)
    gam = tl.load(gam_ptr + tok, mask=valid, other=0.0)
    scores = _decay_matrix(A, seg, rows) * tl.where(rows[:, None] > rows[None, :], sig[None, :],
                                                    gam[None, :]) * cb
    x = _load_rows(x_ptr, bi * sx_b + t * sx_t + hd * sx_h, rows_p, vmask_p)
    y = _dot(scores, x, MM, PREC) + q[:, None] * readout + tl.load(D_ptr + hd).to(tl.float32) * x
    tl.store(ypre_ptr + (tok * P)[:, None] + rows_p[None, :], y.to(ypre_ptr.dtype.element_ty), mask=vmask_p)
    z = _load_rows(z_ptr, bi * sz_b + t * sz_t + hd * sz_h, rows_p, vmask_p)
    y = y * z * tl.sigmoid(z)
    tl.store(y_ptr + (tok * P)[:, None] + rows_p[None, :], y.to(y_ptr.dtype.element_ty), mask=vmask_p)


@triton.jit
def _gate_bwd_kernel(gy_ptr, z_ptr, ypre_ptr, dy_ptr, gz_ptr, T, H, ROWS, sz_b, sz_t, sz_h,
                     P: tl.constexpr, PB: tl.constexpr, R: tl.constexpr):
    """Program (block of R (batch row, time, head) rows): the gate's gradients, dL/dz and dy = dL/dy
    before the gate in the operand dtype, which the three kernels after it read (their products round
    it to that anyway). Done per chunk inside the reverse chain, it kept the chain from splitting its
    columns; apart, the chain took 0.59 ms instead of 0.88 at `small` on an H200, for 0.12 ms here."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    valid = r < ROWS
    hd = r % H
    bt = r // H
    rr = r.to(tl.int64)
    rows_p = tl.arange(0, PB)
    vmask_p = valid[:, None] & (rows_p < P)[None, :]
    z_row = (bt // T).to(tl.int64) * sz_b + (bt % T) * sz_t + hd * sz_h
    gout = _load_rows(gy_ptr, rr * P, rows_p, vmask_p)
    z = _load_rows(z_ptr, z_row, rows_p, vmask_p)
    sz = tl.sigmoid(z)
    dy = gout * z * sz
    rows_out = (rr * P)[:, None] + rows_p[None, :]
    tl.store(dy_ptr + rows_out, dy.to(dy_ptr.dtype.element_ty), mask=vmask_p)
    y = _load_rows(ypre_ptr, rr * P, rows_p, vmask_p)
    gz = gout * y * sz * (1.0 + z * (1.0 - sz))
    tl.store(gz_ptr + rows_out, gz.to(gz_ptr.dtype.element_ty), mask=vmask_p)


@triton.jit
def _bwd_states_kernel(
    C_desc, Cb_ptr, th_desc, ld_ptr, dy_desc, S_desc, gfinal_ptr, gstates_ptr, ginit_ptr, dq_ptr, dqL_ptr,
    T, H, REP, NC,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr, HAS_FINAL: tl.constexpr,
):
    """Program (block of 2 KB state columns, batch row * head): dL/dS's chain over the chunks, from the
    last one down. The gradient of chunk c's exit state goes to slot c of `gstates` (in its dtype), then
    v <- qL v + Σ_t q_t C_t dy_tᵀ (q: the decay from the entering state to t) in fp32, from `gfinal` (or
    zero); the last v is dL/d(initial state). Per chunk it also stores these columns' parts of
    dL/dq_t = dy_t · (S C_t) and of dL/dqL = Σ G ⊙ S (S: the state entering the chunk, G: the gradient
    of its exit state), in the column block's slots of `dq` (column blocks, b, t, h) and `dqL`
    (b, h, chunks, column blocks), for `_bwd_chunk_kernel`'s log-decay gradient: this kernel has C, dy
    and S at hand, where the chunk kernel is register-bound. dy is `_gate_bwd_kernel`'s.
    C, the angles, dy and S arrive by tensor descriptors, as in `_bwd_bc_kernel`: the next chunks' tiles
    load into shared memory without holding registers while this one's products run (the M sublayer at
    `small` on an H100: 5.68-5.70 ms of device time against 5.75-5.76 with pointer loads, I2)."""
    k0 = tl.program_id(0) * 2 * KB
    if k0 // 2 < NA:  # columns past the rotated pairs skip the angles, as in `_fwd_states_kernel`
        _bwd_chain(C_desc, Cb_ptr, th_desc, ld_ptr, dy_desc, S_desc, gfinal_ptr, gstates_ptr, ginit_ptr, dq_ptr,
                   dqL_ptr, T, H, REP, NC, P, N, NA, L, PB, KB, MM, PREC, HAS_FINAL, True)
    else:
        _bwd_chain(C_desc, Cb_ptr, th_desc, ld_ptr, dy_desc, S_desc, gfinal_ptr, gstates_ptr, ginit_ptr, dq_ptr,
                   dqL_ptr, T, H, REP, NC, P, N, NA, L, PB, KB, MM, PREC, HAS_FINAL, False)


@triton.jit
def _bwd_chain(
    C_desc, Cb_ptr, th_desc, ld_ptr, dy_desc, S_desc, gfinal_ptr, gstates_ptr, ginit_ptr, dq_ptr, dqL_ptr,
    T, H, REP, NC,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr, HAS_FINAL: tl.constexpr, ROTATE: tl.constexpr,
):
    """`_bwd_states_kernel`'s program; ROTATE: whether its columns hold rotated pairs. A descriptor's tile
    reads zeros past its tensor's end (the last chunk's rows, head_dim's padding)."""
    k0, hd, bi, gp, cols, cmask, rows_p, pmask, tile, smask = _state_program(T, H, REP, N, P, PB, KB)
    row = tl.program_id(1) // H  # the batch row, as a descriptor coordinate (int32)
    bh = bi * H + hd
    v = _chain_start(gfinal_ptr, bh, tile, smask, HAS_FINAL, P, N, PB, KB)
    dq_block = dq_ptr + tl.program_id(0) * (tl.num_programs(1).to(tl.int64) * T)
    for i in range(NC):
        c = NC - 1 - i
        t0 = c * L
        t = t0 + tl.arange(0, L)
        valid = t < T
        tok = (bi * T + t) * H + hd
        _, _, q, _, qL, _ = _chunk_decays(ld_ptr, tok, valid, L)
        dy = dy_desc.load([row, t0, hd, 0]).reshape(L, PB).to(tl.float32)
        if ROTATE:
            theta = th_desc.load([row, t0, hd, k0 // 2]).reshape(L, KB)
            cos, sin = tl.cos(theta), tl.sin(theta)
        else:
            cos, sin = _no_angles(L, KB)
        cb = C_desc.load([row, t0, gp, k0]).reshape(L, 2 * KB).to(tl.float32) + _bias_row(Cb_ptr + hd * N, cols, cmask)
        cr = _head_tile(cb, cos, sin, valid[:, None] & cmask[None, :], L, KB, ROTATE)
        slot_index = (row * H + hd) * NC + c
        s = tl.trans(S_desc.load([slot_index, 0, k0]).reshape(PB, 2 * KB)).to(tl.float32)
        readout = _dot(cr, s, MM, PREC)  # S C_t, these columns
        tl.store(dq_block + tok, tl.sum(dy * readout, 1), mask=valid)
        tl.store(gstates_ptr + (bh * NC + c) * P * N + tile, v.to(gstates_ptr.dtype.element_ty), mask=smask)
        tl.store(dqL_ptr + (bh * NC + c) * tl.num_programs(0) + tl.program_id(0), tl.sum(tl.sum(v * s, 1), 0))
        # q scales C, not the stored dy, so that each term rounds twice (C q, dy), as the other products.
        v = qL * v + _dot(tl.trans(cr * q[:, None]), dy, MM, PREC)
    tl.store(ginit_ptr + bh * P * N + tile, v, mask=smask)


@triton.jit
def _bias_grad(bias_ptr, g, cols, cmask, mask):
    """g (dL/d(v + bias)) where mask holds, else 0; its sum over the chunk's tokens is stored at bias_ptr
    (this chunk's part of dL/dbias)."""
    g = tl.where(mask, g, 0.0)
    tl.store(bias_ptr + cols, tl.sum(g, 0), mask=cmask)
    return g


@triton.jit
def _unrotated(bias_ptr, g_rot, cos, sin, cols, cmask, mask, R: tl.constexpr, KB: tl.constexpr):
    """dL/d(v + bias) from the gradient of the rotated tile (the transposed rotation), as `_bias_grad`."""
    gre, gro = _split_pairs(g_rot, R, KB)
    return _bias_grad(bias_ptr, _join_pairs(gre * cos + gro * sin, gro * cos - gre * sin, R, KB), cols, cmask, mask)


@triton.jit
def _angle_grad(g_rot, rot, R: tl.constexpr, KB: tl.constexpr):
    """dL/d(angle) of each pair through one rotated tile: d(angle) = dRe * (-Ro) + dRo * Re."""
    ge, go = _split_pairs(g_rot, R, KB)
    re, ro = _split_pairs(rot, R, KB)
    return go * re - ge * ro


@triton.jit
def _bwd_chunk_kernel(
    x_ptr, B_ptr, C_ptr, Bb_ptr, Cb_ptr, th_ptr, ld_ptr, sig_ptr, gam_ptr, D_ptr,
    gstates_ptr, dy_ptr, dq_ptr, dqL_ptr,
    gx_ptr, gld_ptr, gsig_ptr, ggam_ptr, gD_ptr, dcb_ptr,
    T, H, REP, NC, COL_BLOCKS,
    sx_b, sx_t, sx_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr,
):
    """Every gradient of chunk c that is neither the state chain, the gate nor B's or C's. With W[i, j] =
    decay(i, j) (σ_j below the diagonal, γ_i on it), y = (W ⊙ C Bᵀ) x + diag(q) C Sᵀ + D x and S_exit = qL S
    + (diag(eσ) x)ᵀ B: dP = dy xᵀ; dx = (W ⊙ C Bᵀ)ᵀ dy + D dy + diag(eσ) B Gᵀ (G = dL/dS_exit); the
    log-decays get the W, q, e and qL terms, reverse-accumulated over the chunk (dL/dq and dL/dqL in COL_BLOCKS
    column-block parts from `_bwd_states_kernel`). One pass over the state dimension in blocks sums its
    contractions (C Bᵀ, B Gᵀ); dy is the state backward's. dL/d(C Bᵀ) = W ⊙ dP is stored for
    `_bwd_bc_kernel`, which writes dB, dC and dΘ. This kernel is register-bound, so everything that needs
    the entering state S or the gate's inputs is computed elsewhere: with bf16 operands at `small` on an
    H200 it takes 0.92 ms (8 warps capped at 128 registers), where recomputing y, the readout S C_t and
    Σ G ⊙ S here took 1.84 (docs/benchmarks_archive.md)."""
    c, hd, bi, gp, rows, rows_p, pmask, t, valid, tok = _chunk_program(T, H, REP, P, L, PB, 0)
    bh = bi * H + hd
    vmask_p = valid[:, None] & pmask[None, :]
    B_row = bi * sB_b + t * sB_t + gp * sB_g
    C_row = bi * sC_b + t * sC_t + gp * sC_g
    state = (bh * NC + c) * P * N + rows_p * N

    cb = tl.zeros((L, L), dtype=tl.float32)
    bg = tl.zeros((L, PB), dtype=tl.float32)  # G B_t
    # One loop with every block rotated (at zero angles past n_angles): split in two like the output
    # kernel's, to skip those rotations, it spilled more under its register cap (0.90 -> 1.00 ms).
    for k0 in range(0, N, 2 * KB):
        cols = k0 + tl.arange(0, 2 * KB)
        cmask = cols < N
        vmask_n = valid[:, None] & cmask[None, :]
        smask = pmask[:, None] & cmask[None, :]
        cos, sin = _angles(th_ptr, tok, valid, k0, NA, KB)
        cr = _block_tile(C_ptr, C_row, Cb_ptr + hd * N, cos, sin, cols, vmask_n, cmask, L, KB, True)
        br = _block_tile(B_ptr, B_row, Bb_ptr + hd * N, cos, sin, cols, vmask_n, cmask, L, KB, True)
        g = _load_rows(gstates_ptr, state, cols, smask)
        cb += _dot(cr, tl.trans(br), MM, PREC)
        bg += _dot(br, tl.trans(g), MM, PREC)

    # The order below ends each tile's life early: the kernel is register-bound, and what is live
    # together is what spills.
    A, seg, q, e, qL, start = _chunk_decays(ld_ptr, tok, valid, L)
    sig = tl.load(sig_ptr + tok, mask=valid, other=0.0)
    gam = tl.load(gam_ptr + tok, mask=valid, other=0.0)
    below = rows[:, None] > rows[None, :]
    w = _decay_matrix(A, seg, rows) * tl.where(below, sig[None, :], gam[None, :])
    Dh = tl.load(D_ptr + hd).to(tl.float32)
    x = _load_rows(x_ptr, bi * sx_b + t * sx_t + hd * sx_h, rows_p, vmask_p)
    scores = w * cb
    dy = _load_rows(dy_ptr, tok * P, rows_p, vmask_p)
    tl.store(gD_ptr + bh * NC + c, tl.sum(tl.sum(dy * x, 1), 0))

    # x: through the scores, the skip and the chunk's exit state.
    es = e * sig
    gx = _dot(tl.trans(scores), dy, MM, PREC) + Dh * dy + es[:, None] * bg
    tl.store(gx_ptr + tok[:, None] * P + rows_p[None, :], gx.to(gx_ptr.dtype.element_ty), mask=vmask_p)
    ves = tl.sum(x * bg, 1)  # dL/d(e σ)

    # Decay weights: W = M (σ below the diagonal, γ on it), q, e and qL are exponentials of the
    # cumulative log-decay A; dL/dA is accumulated, then dL/da_k = Σ_{i >= k} dL/dA_i.
    dp = _dot(dy, tl.trans(x), MM, PREC)  # dL/dscores
    dw = cb * dp
    tl.store(dcb_ptr + (bh * NC + c) * L * L + rows[:, None] * L + rows[None, :],
             (w * dp).to(dcb_ptr.dtype.element_ty))
    tl.store(ggam_ptr + tok, tl.sum(tl.where(rows[:, None] == rows[None, :], dw, 0.0), 1), mask=valid)
    dm = tl.where(below, dw * _decay_matrix(A, seg, rows), 0.0)
    tl.store(gsig_ptr + tok, tl.sum(dm, 0) + ves * e, mask=valid)
    r = dm * sig[None, :]
    de = ves * sig * e
    dq = tl.zeros((L,), dtype=tl.float32)
    dqL = 0.0
    for part in range(COL_BLOCKS):
        dqL += tl.load(dqL_ptr + (bh * NC + c) * COL_BLOCKS + part)
        dq += tl.load(dq_ptr + part * (tl.num_programs(1).to(tl.int64) * T) + tok, mask=valid, other=0.0)
    dA = tl.sum(r, 1) - tl.sum(r, 0) + dq * q - de
    dA += tl.where(rows == L - 1, tl.sum(de, 0) + dqL * qL, 0.0)
    tl.store(gld_ptr + tok, tl.where(start, 0.0, tl.cumsum(dA, 0, reverse=True)), mask=valid)


@triton.jit
def _bwd_bc_kernel(
    x_desc, B_desc, C_desc, Bb_ptr, Cb_ptr, th_desc, ld_ptr, sig_ptr,
    S_desc, G_desc, dy_desc, dcb_desc,
    gB_ptr, gC_ptr, gBb_ptr, gCb_ptr, gth_ptr,
    T, H, REP, NC,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr,
):
    """Program (block of 2 KB state columns, chunk, batch row * group): dL/dB and dL/dC of those columns
    of chunk c, summed over the group's heads in order, back through each head's rotation, and each
    head's angle and bias parts, from the chunk kernel's dL/d(C Bᵀ), the state backward's dy and the
    state and its gradient:
    dC = dL/d(C Bᵀ) B + diag(q) dy S, dB = dL/d(C Bᵀ)ᵀ C + diag(eσ) x G (rotated; then unrotated).
    Columns are independent here, so the state dimension is spread over the grid. Summing the heads
    here rather than after the launch saves writing and reading back per-head fp32 gradients of B and C
    (2 x 400 MB per `small` M layer): the backward's kernels take 4.30 ms against 4.62 on an H200.
    The tiles (x, dy, B, C, the angles, S, G, dL/d(C Bᵀ)) arrive by tensor descriptors (TMA on Hopper), which
    load into shared memory without registers, so the next head's loads are in flight during this one's
    products: at `small` on an H100 1.01 ms alone against 1.25 with pointer loads (X3)."""
    k0 = tl.program_id(0) * 2 * KB
    # Columns past the rotated pairs do not rotate: their programs skip the angles, the rotations and the
    # angle gradients (half of the programs at `small`, where 32 of 64 pairs rotate: 1.24 -> 1.07 ms on an
    # H200), in a compile-time specialization of their own.
    if k0 // 2 < NA:
        _bc_heads(x_desc, B_desc, C_desc, Bb_ptr, Cb_ptr, th_desc, ld_ptr, sig_ptr, S_desc, G_desc, dy_desc,
                  dcb_desc, gB_ptr, gC_ptr, gBb_ptr, gCb_ptr, gth_ptr, k0, T, H, REP, NC,
                  P, N, NA, L, PB, KB, MM, PREC, True)
    else:
        _bc_heads(x_desc, B_desc, C_desc, Bb_ptr, Cb_ptr, th_desc, ld_ptr, sig_ptr, S_desc, G_desc, dy_desc,
                  dcb_desc, gB_ptr, gC_ptr, gBb_ptr, gCb_ptr, gth_ptr, k0, T, H, REP, NC,
                  P, N, NA, L, PB, KB, MM, PREC, False)


@triton.jit
def _bc_heads(
    x_desc, B_desc, C_desc, Bb_ptr, Cb_ptr, th_desc, ld_ptr, sig_ptr,
    S_desc, G_desc, dy_desc, dcb_desc,
    gB_ptr, gC_ptr, gBb_ptr, gCb_ptr, gth_ptr,
    k0, T, H, REP, NC,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr, ROTATE: tl.constexpr,
):
    """`_bwd_bc_kernel`'s program from column k0 on; ROTATE: whether these columns hold rotated pairs. A
    descriptor's tile reads zeros past its tensor's end (the last chunk's rows, head_dim's padding)."""
    c = tl.program_id(1)
    pid = tl.program_id(2)
    G = H // REP
    gp = pid % G
    row = pid // G  # the batch row, as a descriptor coordinate (int32)
    bi = row.to(tl.int64)
    rows, rows_p, pmask, t, valid = _chunk_rows(c, T, P, L, PB)
    t0 = c * L
    cols = k0 + tl.arange(0, 2 * KB)
    cmask = cols < N
    vmask_n = valid[:, None] & cmask[None, :]
    pairs = k0 // 2 + tl.arange(0, KB)
    grad_B = tl.zeros((L, 2 * KB), dtype=tl.float32)
    grad_C = tl.zeros((L, 2 * KB), dtype=tl.float32)
    for r in range(REP):
        hd = gp * REP + r
        bh = bi * H + hd
        tok = (bi * T + t) * H + hd
        _, _, q, e, _, _ = _chunk_decays(ld_ptr, tok, valid, L)
        es = e * tl.load(sig_ptr + tok, mask=valid, other=0.0)
        x = x_desc.load([row, t0, hd, 0]).reshape(L, PB).to(tl.float32)
        dy = dy_desc.load([row, t0, hd, 0]).reshape(L, PB).to(tl.float32)
        slot = (row * H + hd) * NC + c
        dcb = dcb_desc.load([slot, 0, 0]).reshape(L, L)  # operands' dtype
        s = S_desc.load([slot, 0, k0]).reshape(PB, 2 * KB).to(tl.float32)
        g = G_desc.load([slot, 0, k0]).reshape(PB, 2 * KB).to(tl.float32)
        # The group's B and C tiles are the same for every head, reloaded for each (from L2): kept across
        # the loop, two more fp32 tiles were live and spilled (150 bytes per thread at 32 pairs, X1).
        cb = C_desc.load([row, t0, gp, k0]).reshape(L, 2 * KB).to(tl.float32)
        cb += _bias_row(Cb_ptr + hd * N, cols, cmask)
        bb = B_desc.load([row, t0, gp, k0]).reshape(L, 2 * KB).to(tl.float32)
        bb += _bias_row(Bb_ptr + hd * N, cols, cmask)
        if ROTATE:
            theta = th_desc.load([row, t0, hd, k0 // 2]).reshape(L, KB)
            cos, sin = tl.cos(theta), tl.sin(theta)
        else:
            cos, sin = _no_angles(L, KB)
        cr = _head_tile(cb, cos, sin, vmask_n, L, KB, ROTATE)
        br = _head_tile(bb, cos, sin, vmask_n, L, KB, ROTATE)
        # Taken transposed, so that the tiles shared by every column block are the second operands.
        gcr = tl.trans(_dot(tl.trans(br), tl.trans(dcb), MM, PREC) + _dot(tl.trans(s), tl.trans(dy), MM, PREC)
                       * q[None, :])
        gbr = tl.trans(_dot(tl.trans(cr), dcb, MM, PREC) + _dot(tl.trans(g), tl.trans(x), MM, PREC) * es[None, :])
        # The biases are per head: their per-chunk parts (b, h, chunks, n) are summed over batch and
        # chunks after the launch.
        bias_part = (bh * NC + c) * N
        if ROTATE:
            tl.store(gth_ptr + (tok * NA)[:, None] + pairs[None, :], _angle_grad(gbr, br, L, KB) +
                     _angle_grad(gcr, cr, L, KB), mask=valid[:, None] & (pairs < NA)[None, :])
            grad_B += _unrotated(gBb_ptr + bias_part, gbr, cos, sin, cols, cmask, vmask_n, L, KB)
            grad_C += _unrotated(gCb_ptr + bias_part, gcr, cos, sin, cols, cmask, vmask_n, L, KB)
        else:
            grad_B += _bias_grad(gBb_ptr + bias_part, gbr, cols, cmask, vmask_n)
            grad_C += _bias_grad(gCb_ptr + bias_part, gcr, cols, cmask, vmask_n)
    out_row = ((bi * T + t) * G + gp) * N  # dB and dC are contiguous (b, t, g, n)
    tl.store(gB_ptr + out_row[:, None] + cols[None, :], grad_B, mask=vmask_n)
    tl.store(gC_ptr + out_row[:, None] + cols[None, :], grad_C, mask=vmask_n)


@dataclass(frozen=True)
class Tiling:
    """How one kernel's work is cut: block_p state rows per program (head_dim padded to a power of two:
    every program takes all of it), block_pairs rotation pairs (2 block_pairs state columns) per program
    or per step of the loop over the state dimension, and launch options."""

    block_p: int
    block_pairs: int
    num_warps: int
    num_stages: int = 1
    max_registers: int | None = None  # per thread (Triton's maxnreg); None: the compiler's choice


# Rows of head_dim per program and warps of `_gate_bwd_kernel`: at `small` on an H200 32 rows and 4 warps
# took 0.120 ms, 64 and 4 0.128, 128 and 8 0.131.
GATE_ROWS = 32
GATE_WARPS = 4


def _pow2(size: int, least: int) -> int:
    return max(least, triton.next_power_of_2(size))


@functools.cache
def tilings(head_dim: int, d_state: int, chunk_size: int, matmul_dtype: torch.dtype) -> Mapping[str, Tiling]:
    """The tiling of each kernel at these sizes: every program takes all of head_dim. Picked by timing
    the compiled M mixer on an H200 at `small`'s sizes with bf16 operands (the sweeps:
    docs/benchmarks_archive.md), and checked with benchmarks/tools/check_mamba3_resources.py for sm_90
    (shared memory under the limit). Cached, hence read-only: the ops run it at every call, on the
    host's critical path. What decided each (kernel ms):
    - state columns per block: 64; the dB/dC kernel 1.23 against 1.37 (32 columns) and 1.83 (16).
    - the output kernel: 8 warps, 0.62 against 0.82 at 4; capped at 80 registers with 16-bit operands
      (3 programs per SM instead of 2; 40 bytes of spills), 0.50 against 0.65.
    - the dB/dC kernel, which walks a group's heads: 4 warps, 1.65 against 1.72 at 8 with bf16
      operands, and two stages (the next head's tiles load while this one's multiply), 1.29 against
      1.44 with one and 2.40 with three. Register caps made it slower (168: 2.15). With its tiles on
      tensor descriptors (H100, X3): 32 columns per block, 1.01 ms alone (26 bytes spilled) against 1.08
      at 64 (74 bytes), 1.02 at three stages, 1.63 at 8 warps, 1.83 at 2; in the M sublayer 1.03 against
      the pointer kernel's 1.14 (64 columns). fp32 operands, not timed, keep 64 columns, 8 warps and one
      stage: at 4 warps they would spill 3.2 KB.
    - the chunk backward, 16-bit operands, chunks of 64: 8 warps capped at 128 registers (two programs
      per SM, each with twice the warps), 0.91–0.93 against 0.99 at 4 warps uncapped; 4 warps capped
      at 168 or 200: 2.47, 1.20. Other sizes keep 4 warps (8 with fp32 operands and chunks over 32).
    - the chains with their products (the kernels alone at the mixer's input layout; ms of the whole
      forward / backward): the forward's 64 columns per program, 8 warps, three stages, 0.83 (32
      columns at 4 warps: 1.05; 8 warps with two stages: 0.85, four: 1.02). The backward's chain, in
      the mixer, with the gate's gradients in a kernel of their own: 64 columns, 4 warps, three stages,
      0.59–0.60 ms (two stages 0.62; 8 warps 0.66; 128 columns at 8 warps 0.62; 32 columns 0.60–0.66),
      timed with pointer loads and kept for its tensor descriptors (not swept again). Splitting head_dim
      over programs instead was slower in both directions (0.86–1.55, 3.30–4.38).
      fp32 operands, not timed, take 32 columns and 4 warps forward, 8 backward (no spills at `small`
      and `nam52`)."""
    # At least 32 rows of head_dim per tile: at 16 (head_dim 16, fp32 operands, chunks of 64) Triton 3.6's
    # output kernel read past its shared memory on an H100 (compute-sanitizer; a 300-token prefill faulted),
    # while 32-row tiles, masked down to 16, ran clean. Presets have head_dim >= 32.
    block_p = _pow2(head_dim, 32)
    pairs = min(_pow2(d_state // 2, 8), 16)  # 2 * pairs >= 16: tl.dot's smallest extent
    mid = min(_pow2(d_state // 2, 8), 32)
    narrow = matmul_dtype.itemsize == 2
    # The register caps hold where they were timed: 16-bit operands, chunks of 64 and `small`'s tiles
    # (head_dim 64, d_state 128). Bigger tiles would spill far more under them, smaller ones need no cap.
    capped = narrow and chunk_size == 64 and block_p == 64 and 64 <= d_state <= 128
    if capped:
        chunk = Tiling(block_p, mid, 8, max_registers=128)
    else:
        chunk = Tiling(block_p, mid, 4 if chunk_size <= 32 or narrow else 8)
    return MappingProxyType({
        "fwd_states": Tiling(block_p, mid, 8, 3) if narrow else Tiling(block_p, pairs, 4),
        "fwd_scan": Tiling(block_p, pairs, 8, max_registers=80 if capped else None),
        "bwd_states": Tiling(block_p, mid, 4, 3) if narrow else Tiling(block_p, pairs, 8),
        "bwd_chunk": chunk,
        "bwd_bc": Tiling(block_p, pairs, 4, 2) if narrow else Tiling(block_p, mid, 8),
    })


@functools.cache
def _has_tf32_cores(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def dot_precision(device: torch.device) -> str:
    """input_precision of the fp32 `tl.dot`s. "tf32x3" (three TF32 tensor-core products, fp32-equivalent
    accuracy, deterministic) replaces "ieee" FMA loops, which are several times slower and need far more
    registers (the M2RNN kernels measured 2.4x); "tf32" exactly when torch's fp32 matmuls (the reference
    path's einsums) would use TF32; "ieee" before Ampere, which has no TF32 tensor cores."""
    if not _has_tf32_cores(device):
        return "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"


def _tma_readable(v: Tensor) -> Tensor:
    """v, or a copy of it that TMA can read. TMA needs the base and every stride but the last 16-byte
    aligned: where v's are not (odd sizes, views at odd offsets), the copy's rows are padded to 16 bytes
    (a copy the mixer's layouts never need)."""
    size = v.element_size()
    if v.stride(-1) != 1 or v.data_ptr() % 16 or any(step * size % 16 for step in v.stride()[:-1]):
        unit = 16 // math.gcd(16, size)
        padded = v.new_empty((*v.shape[:-1], -(-v.shape[-1] // unit) * unit))
        v = padded[..., :v.shape[-1]].copy_(v)
    return v


def _descriptor(v: Tensor, block: list[int]) -> TensorDescriptor:
    """A tensor descriptor of v's tiles of shape `block`, over `_tma_readable(v)`."""
    v = _tma_readable(v)
    return TensorDescriptor(v, list(v.shape), list(v.stride()), block)


def _rows_unit_stride(v: Tensor) -> Tensor:
    """The kernels take any strides over (b, t, h) but need the last dim contiguous."""
    return v if v.stride(-1) == 1 else v.contiguous()


def _sizes(x: Tensor, B: Tensor, theta: Tensor, chunk_size: int) -> tuple[int, ...]:
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    return b, t, h, p, g, n, theta.shape[-1], triton.cdiv(t, chunk_size)


def _meta(tiling: Tiling, p: int, n: int, na: int, chunk_size: int, matmul_dtype: torch.dtype,
          device: torch.device) -> dict[str, Any]:
    return dict(P=p, N=n, NA=na, L=chunk_size, PB=tiling.block_p, KB=tiling.block_pairs,
                MM=_MM_CODES[matmul_dtype], PREC=dot_precision(device), num_warps=tiling.num_warps,
                num_stages=tiling.num_stages,
                **({} if tiling.max_registers is None else {"maxnreg": tiling.max_registers}))


def fused_fwd(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, initial: Tensor | None,
    chunk_size: int, matmul_dtype: torch.dtype, launch: Callable[[Launch], Any] = run_launch,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gated output (b, t, h, p) in x's dtype, final state (b, h, p, n) in fp32, every chunk's entering
    state (b, h, chunks, p, n) in matmul_dtype and the output before the gate (x's dtype, for the
    backward). Contract: `megacpp::mamba3_fused_fwd` (mamba3_fused.py). `launch` runs the kernel launch
    (benchmarks/tools/check_mamba3_resources.py passes one that only records it)."""
    b, t, h, p, g, n, na, nc = _sizes(x, B, theta, chunk_size)
    x, z, B, C = (_rows_unit_stride(v) for v in (x, z, B, C))
    B_bias, C_bias, theta, log_decay, sigma, gamma, D = (
        v.contiguous() for v in (B_bias, C_bias, theta, log_decay, sigma, gamma, D))
    f32 = torch.float32
    y = x.new_empty(b, t, h, p)
    y_pre = x.new_empty(b, t, h, p)
    # Every chunk's entering state in the operand dtype: the products that read it round it to that
    # anyway, so narrower than fp32 it halves what the chain writes, what three kernels read and what
    # the forward saves (400 to 200 MB per `small` M layer with bf16 operands).
    states = x.new_empty(b, h, nc, p, n, dtype=matmul_dtype)
    final = x.new_empty(b, h, p, n, dtype=f32)
    s0 = initial.to(f32).contiguous() if initial is not None else final  # unread without HAS_INIT
    tiling = tilings(p, n, chunk_size, matmul_dtype)
    rows = (*x.stride()[:3], *z.stride()[:3], *B.stride()[:3], *C.stride()[:3])
    st = tiling["fwd_states"]
    launch(Launch(_fwd_states_kernel, (triton.cdiv(n, 2 * st.block_pairs), b * h), (
        x, B, B_bias, theta, log_decay, sigma, s0, states, final, t, h, h // g, nc, *rows[:3], *rows[6:9],
    ), dict(_meta(st, p, n, na, chunk_size, matmul_dtype, x.device), HAS_INIT=initial is not None)))
    launch(Launch(_fwd_scan_kernel, (nc, b * h), (
        x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, y, y_pre, t, h, h // g, nc, *rows,
    ), _meta(tiling["fwd_scan"], p, n, na, chunk_size, matmul_dtype, x.device)))
    return y, final, states, y_pre


def backward_launches(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, chunk_size: int, matmul_dtype: torch.dtype,
) -> list[Launch]:
    """The launches `fused_bwd` makes after a `fused_fwd` on these inputs, described on meta tensors with
    the inputs' layouts (what `ops.kernel_prewarm` compiles ahead): the backward reads the forward's inputs
    as they were, its other inputs contiguous. Both variants of the state kernel are described, with and
    without a gradient of the final state (whether one arrives is the caller's graph's business)."""
    b, t, h, p, g, n, na, nc = _sizes(x, B, theta, chunk_size)
    inputs = [kernel_prewarm.meta_like(v) for v in (x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D)]
    meta = inputs[0]
    states = meta.new_empty(b, h, nc, p, n, dtype=matmul_dtype)
    y_pre, grad_y = meta.new_empty(b, t, h, p), meta.new_empty(b, t, h, p)
    launches: list[Launch] = []
    fused_bwd(*inputs, states, y_pre, grad_y, None, chunk_size, matmul_dtype, launch=launches.append)
    with_final: list[Launch] = []
    grad_final = meta.new_empty(b, h, p, n, dtype=torch.float32)
    fused_bwd(*inputs, states, y_pre, grad_y, grad_final, chunk_size, matmul_dtype, launch=with_final.append)
    launches += [launch for launch in with_final if launch.meta.get("HAS_FINAL")]
    return launches


def fused_bwd(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, states: Tensor, y_pre: Tensor, grad_y: Tensor,
    grad_final: Tensor | None, chunk_size: int, matmul_dtype: torch.dtype,
    launch: Callable[[Launch], Any] = run_launch,
) -> tuple[Tensor, ...]:
    """Gradients of x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D and the initial state,
    contiguous, each in its input's dtype (the initial state's in fp32). Contract:
    `megacpp::mamba3_fused_bwd` (mamba3_fused.py); `launch` as in `fused_fwd`."""
    b, t, h, p, g, n, na, nc = _sizes(x, B, theta, chunk_size)
    x, z, B, C = (_rows_unit_stride(v) for v in (x, z, B, C))
    B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, y_pre, grad_y = (
        v.contiguous() for v in (B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, y_pre, grad_y))
    f32 = torch.float32
    grad_states = torch.empty(states.shape, dtype=matmul_dtype, device=states.device)  # at each chunk's exit
    grad_init = x.new_empty(b, h, p, n, dtype=f32)
    gfinal = grad_final.to(f32).contiguous() if grad_final is not None else grad_init  # unread without it
    tiling = tilings(p, n, chunk_size, matmul_dtype)
    st = tiling["bwd_states"]
    blocks = triton.cdiv(n, 2 * st.block_pairs)
    grad_q_parts = x.new_empty(blocks, b, t, h, dtype=f32)  # dL/dq per state-column block
    grad_qL_parts = x.new_empty(b, h, nc, blocks, dtype=f32)  # dL/dqL, the same
    grad_pre = x.new_empty(b, t, h, p, dtype=matmul_dtype)  # dL/dy before the gate, for three kernels
    grad_z = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    rows = b * t * h
    launch(Launch(_gate_bwd_kernel, (triton.cdiv(rows, GATE_ROWS),), (
        grad_y, z, y_pre, grad_pre, grad_z, t, h, rows, *z.stride()[:3],
    ), dict(P=p, PB=st.block_p, R=GATE_ROWS, num_warps=GATE_WARPS)))
    L = chunk_size
    slots = b * h * nc
    # With no rotated pairs no program reads the angles, but a descriptor needs a non-empty tensor. What both
    # the chain and the dB/dC kernel read by descriptors is made TMA-readable once (after the gate kernel
    # has written grad_pre).
    angles = theta if na else theta.new_zeros(1, 1, 1, 1)
    C_tma, angles, grad_pre_tma, states_tma = (
        _tma_readable(v) for v in (C, angles, grad_pre, states.view(slots, p, n)))
    launch(Launch(_bwd_states_kernel, (blocks, b * h), (
        _descriptor(C_tma, [1, L, 1, 2 * st.block_pairs]), C_bias, _descriptor(angles, [1, L, 1, st.block_pairs]),
        log_decay, _descriptor(grad_pre_tma, [1, L, 1, st.block_p]),
        _descriptor(states_tma, [1, st.block_p, 2 * st.block_pairs]),
        gfinal, grad_states, grad_init, grad_q_parts, grad_qL_parts, t, h, h // g, nc,
    ), dict(_meta(st, p, n, na, chunk_size, matmul_dtype, x.device), HAS_FINAL=grad_final is not None)))
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_ld, grad_sig, grad_gam = (torch.empty_like(v, dtype=f32) for v in (log_decay, sigma, gamma))
    grad_D_parts = x.new_empty(b, h, nc, dtype=f32)
    # dL/d(C Bᵀ) of every chunk, in the dtype the products round it to anyway (so the split changes no bit).
    grad_cb = x.new_empty(b, h, nc, chunk_size, chunk_size, dtype=matmul_dtype)
    launch(Launch(_bwd_chunk_kernel, (nc, b * h), (
        x, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, grad_states, grad_pre,
        grad_q_parts, grad_qL_parts, grad_x, grad_ld, grad_sig, grad_gam, grad_D_parts, grad_cb,
        t, h, h // g, nc, blocks, *x.stride()[:3], *B.stride()[:3], *C.stride()[:3],
    ), _meta(tiling["bwd_chunk"], p, n, na, chunk_size, matmul_dtype, x.device)))
    grad_B = x.new_empty(b, t, g, n, dtype=f32)
    grad_C = x.new_empty(b, t, g, n, dtype=f32)
    grad_theta = torch.empty_like(theta, dtype=f32)
    grad_B_bias_parts = x.new_empty(b, h, nc, n, dtype=f32)
    grad_C_bias_parts = x.new_empty(b, h, nc, n, dtype=f32)
    bc = tiling["bwd_bc"]
    head_tile, col_tile = [1, L, 1, bc.block_p], [1, L, 1, 2 * bc.block_pairs]  # of (b, t, heads or groups, -)
    state_tile = [1, bc.block_p, 2 * bc.block_pairs]  # of (b * h * chunks, p, n)
    launch(Launch(_bwd_bc_kernel, (triton.cdiv(n, 2 * bc.block_pairs), nc, b * g), (
        _descriptor(x, head_tile), _descriptor(B, col_tile), _descriptor(C_tma, col_tile), B_bias, C_bias,
        _descriptor(angles, [1, L, 1, bc.block_pairs]), log_decay, sigma,
        _descriptor(states_tma, state_tile), _descriptor(grad_states.view(slots, p, n), state_tile),
        _descriptor(grad_pre_tma, head_tile), _descriptor(grad_cb.view(slots, L, L), [1, L, L]),
        grad_B, grad_C, grad_B_bias_parts, grad_C_bias_parts, grad_theta, t, h, h // g, nc,
    ), _meta(bc, p, n, na, chunk_size, matmul_dtype, x.device)))
    # Fixed-order reductions (no atomics): batch and chunks for the per-head biases and D.
    return (
        grad_x, grad_z, grad_B.to(B.dtype), grad_C.to(C.dtype),
        grad_B_bias_parts.sum((0, 2)).to(B_bias.dtype), grad_C_bias_parts.sum((0, 2)).to(C_bias.dtype),
        grad_theta.to(theta.dtype), grad_ld.to(log_decay.dtype), grad_sig.to(sigma.dtype),
        grad_gam.to(gamma.dtype), grad_D_parts.sum((0, 2)).to(D.dtype), grad_init,
    )


# Fixes each kernel's Triton cache key at import, the same in the trainer and in its compile helpers.
kernel_prewarm.pin_cache_keys(globals())
