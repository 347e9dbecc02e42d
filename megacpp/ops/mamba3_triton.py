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

Resources: one program holds a few (L, L), (L, p) and (L, 2 KB) fp32 tiles in registers; the state
dimension n is walked in blocks of 2 KB columns (`Tiling`), so n never sets the register footprint.
The sequential kernels carry their (p, n) state through the buffer they store anyway (every chunk's
entering state, read back from L2 by the same program after a barrier) instead of in registers, and
split head_dim over the grid (state rows are independent). No software pipelining (num_stages 1):
the chunk loop is a dependency chain, and pipelined copies were what overflowed shared memory.
`benchmarks/check_mamba3_resources.py` compiles every kernel for sm_90 and checks the budget.

Kernels:
- `_fwd_kernel`, grid (heads, batch, head_dim blocks): walks the chunks in order; writes the gated
  output, every chunk's entering state (fp32, for the backward) and the final state.
- `_bwd_state_kernel`, grid (heads, batch, head_dim blocks): walks the chunks backwards carrying dL/dS
  and writes it at every chunk boundary, and dL/d(initial state).
- `_bwd_chunk_kernel`, grid (chunks, batch * heads): every other gradient of one chunk from its
  entering state and the gradient of its exit state; chunks are independent here.
Gradients of the group-shared B and C are written per head and summed over each group's heads in
PyTorch afterwards, in a fixed order; the biases' and D's are per-chunk partials summed over batch and
chunks the same way: no atomics anywhere, so every result is run-to-run deterministic.

Matmul operands: fp32 as "tf32x3" (three TF32 tensor-core products, fp32-equivalent accuracy; "tf32"
when torch allows TF32 for fp32 matmuls, as the reference's einsums would use; "ieee" before sm_80),
or bf16/fp16 when the caller asks for activation-dtype matmuls (the mixer's `scan_matmuls =
"activation"`); accumulation is fp32 always, and so are decays and states.
Supported sizes and dtypes: `megacpp.ops.mamba3_fused.triton_unsupported_reason` (checked before a
launch; that module imports without triton).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

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
def _rotated(ptr, row_off, bias_ptr, cos, sin, cols, mask, cmask, R: tl.constexpr, KB: tl.constexpr):
    """(R, 2 KB) tile of (v + bias) with its column pairs rotated by the angles; 0 where masked."""
    v = _load_rows(ptr, row_off, cols, mask) + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
    even, odd = _split_pairs(v, R, KB)
    return tl.where(mask, _join_pairs(even * cos - odd * sin, even * sin + odd * cos, R, KB), 0.0)


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
def _store_transposed(ptr, row_off, cols, value_t, mask):
    """Store value_t, the transpose of a (rows, cols) tile, at ptr + row_off[:, None] + cols[None, :]."""
    tl.store(ptr + row_off[None, :] + cols[:, None], value_t, mask=tl.trans(mask))


@triton.jit
def _fwd_kernel(
    x_ptr, z_ptr, B_ptr, C_ptr, Bb_ptr, Cb_ptr, th_ptr, ld_ptr, sig_ptr, gam_ptr, D_ptr, s0_ptr,
    y_ptr, states_ptr, final_ptr,
    T, H, REP, NC,
    sx_b, sx_t, sx_h, sz_b, sz_t, sz_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """Program (head, batch row, block of PB state rows): the chunks in order. Chunk c reads its entering
    state from `states` (stored there by this program at chunk c - 1) block by block and stores the
    exit state as chunk c + 1's, so only one block of 2 KB state columns is in registers at a time."""
    hd = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    rows_p = tl.program_id(2) * PB + tl.arange(0, PB)
    gp = hd // REP
    rows = tl.arange(0, L)
    pmask = rows_p < P
    Dh = tl.load(D_ptr + hd).to(tl.float32)
    bh = bi * H + hd
    first = bh * NC * P * N + rows_p * N  # chunk 0's entering state, this program's rows
    for k0 in range(0, N, 2 * KB):
        cols = k0 + tl.arange(0, 2 * KB)
        smask = pmask[:, None] & (cols < N)[None, :]
        if HAS_INIT:
            s = _load_rows(s0_ptr, bh * P * N + rows_p * N, cols, smask)
        else:
            s = tl.zeros((PB, 2 * KB), dtype=tl.float32)
        tl.store(states_ptr + first[:, None] + cols[None, :], s, mask=smask)
    for c in range(NC):
        tl.debug_barrier()  # the entering state, stored by other threads of this program, is visible
        t = c * L + rows
        valid = t < T
        tok = (bi * T + t) * H + hd  # (b, t, h) index
        vmask_p = valid[:, None] & pmask[None, :]
        A, seg, q, e, qL, _ = _chunk_decays(ld_ptr, tok, valid, L)
        sig = tl.load(sig_ptr + tok, mask=valid, other=0.0)
        es = e * sig
        x = _load_rows(x_ptr, bi * sx_b + t * sx_t + hd * sx_h, rows_p, vmask_p)
        enter = first + c * P * N
        cb = tl.zeros((L, L), dtype=tl.float32)
        readout = tl.zeros((L, PB), dtype=tl.float32)
        for k0 in range(0, N, 2 * KB):
            cols = k0 + tl.arange(0, 2 * KB)
            cmask = cols < N
            vmask_n = valid[:, None] & cmask[None, :]
            smask = pmask[:, None] & cmask[None, :]
            cos, sin = _angles(th_ptr, tok, valid, k0, NA, KB)
            cr = _rotated(C_ptr, bi * sC_b + t * sC_t + gp * sC_g, Cb_ptr + hd * N, cos, sin, cols, vmask_n, cmask,
                          L, KB)
            s = _load_rows(states_ptr, enter, cols, smask)
            readout += _dot(cr, tl.trans(s), MM, PREC)
            br = _rotated(B_ptr, bi * sB_b + t * sB_t + gp * sB_g, Bb_ptr + hd * N, cos, sin, cols, vmask_n, cmask,
                          L, KB)
            cb += _dot(cr, tl.trans(br), MM, PREC)
            # The exit state, transposed: x, the same for every block, is the product's second operand.
            s_t = qL * tl.trans(s) + _dot(tl.trans(br * es[:, None]), x, MM, PREC)
            if c + 1 < NC:
                _store_transposed(states_ptr, enter + P * N, cols, s_t, smask)
            else:
                _store_transposed(final_ptr, bh * P * N + rows_p * N, cols, s_t, smask)
        gam = tl.load(gam_ptr + tok, mask=valid, other=0.0)
        scores = _decay_matrix(A, seg, rows) * tl.where(rows[:, None] > rows[None, :], sig[None, :],
                                                        gam[None, :]) * cb
        y = _dot(scores, x, MM, PREC) + q[:, None] * readout + Dh * x
        z = _load_rows(z_ptr, bi * sz_b + t * sz_t + hd * sz_h, rows_p, vmask_p)
        y = y * z * tl.sigmoid(z)
        tl.store(y_ptr + (tok * P)[:, None] + rows_p[None, :], y.to(y_ptr.dtype.element_ty), mask=vmask_p)


@triton.jit
def _gated_grad(gy_ptr, z_ptr, tok, z_row, rows_p, vmask_p, P: tl.constexpr):
    """dL/dy before the gate, silu(z) and sigmoid(z), from dL/d(gated output)."""
    gout = _load_rows(gy_ptr, tok * P, rows_p, vmask_p)
    z = _load_rows(z_ptr, z_row, rows_p, vmask_p)
    sz = tl.sigmoid(z)
    return gout * z * sz, gout, z, sz


@triton.jit
def _bwd_state_kernel(
    z_ptr, C_ptr, Cb_ptr, th_ptr, ld_ptr, gy_ptr, gfinal_ptr,
    gstates_ptr, ginit_ptr,
    T, H, REP, NC,
    sz_b, sz_t, sz_h, sC_b, sC_t, sC_g,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr, HAS_GFINAL: tl.constexpr,
):
    """dL/dS_exit of chunk c, for every c, from dS_enter(c) = qL(c) dS_exit(c) + Σ_t q_t dy_t C_tᵀ; carried
    through `gstates` like the forward carries S (same program layout)."""
    hd = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    rows_p = tl.program_id(2) * PB + tl.arange(0, PB)
    gp = hd // REP
    rows = tl.arange(0, L)
    pmask = rows_p < P
    bh = bi * H + hd
    first = bh * NC * P * N + rows_p * N
    last = first + (NC - 1) * P * N
    for k0 in range(0, N, 2 * KB):
        cols = k0 + tl.arange(0, 2 * KB)
        smask = pmask[:, None] & (cols < N)[None, :]
        if HAS_GFINAL:
            g = _load_rows(gfinal_ptr, bh * P * N + rows_p * N, cols, smask)
        else:
            g = tl.zeros((PB, 2 * KB), dtype=tl.float32)
        tl.store(gstates_ptr + last[:, None] + cols[None, :], g, mask=smask)
    for i in range(NC):
        c = NC - 1 - i
        tl.debug_barrier()  # the exit-state gradient, stored by other threads of this program, is visible
        t = c * L + rows
        valid = t < T
        tok = (bi * T + t) * H + hd
        vmask_p = valid[:, None] & pmask[None, :]
        _, _, q, _, qL, _ = _chunk_decays(ld_ptr, tok, valid, L)
        dy, _, _, _ = _gated_grad(gy_ptr, z_ptr, tok, bi * sz_b + t * sz_t + hd * sz_h, rows_p, vmask_p, P)
        dyq = dy * q[:, None]
        exit_ = first + c * P * N
        for k0 in range(0, N, 2 * KB):
            cols = k0 + tl.arange(0, 2 * KB)
            cmask = cols < N
            smask = pmask[:, None] & cmask[None, :]
            cos, sin = _angles(th_ptr, tok, valid, k0, NA, KB)
            cr = _rotated(C_ptr, bi * sC_b + t * sC_t + gp * sC_g, Cb_ptr + hd * N, cos, sin, cols,
                          valid[:, None] & cmask[None, :], cmask, L, KB)
            g = _load_rows(gstates_ptr, exit_, cols, smask)
            g_t = qL * tl.trans(g) + _dot(tl.trans(cr), dyq, MM, PREC)  # transposed, like the forward's state
            if c > 0:
                _store_transposed(gstates_ptr, exit_ - P * N, cols, g_t, smask)
            else:
                _store_transposed(ginit_ptr, bh * P * N + rows_p * N, cols, g_t, smask)


@triton.jit
def _unrotate_store(ptr, row_off, bias_ptr, g_rot, cos, sin, cols, mask, cmask, R: tl.constexpr,
                    KB: tl.constexpr):
    """dL/d(v + bias) from the gradient of the rotated tile (the transposed rotation): stored per token
    at ptr, and summed over the chunk's tokens at bias_ptr (this chunk's part of dL/dbias)."""
    gre, gro = _split_pairs(g_rot, R, KB)
    g = tl.where(mask, _join_pairs(gre * cos + gro * sin, gro * cos - gre * sin, R, KB), 0.0)
    tl.store(ptr + row_off[:, None] + cols[None, :], g, mask=mask)
    tl.store(bias_ptr + cols, tl.sum(g, 0), mask=cmask)


@triton.jit
def _angle_grad(g_rot, rot, R: tl.constexpr, KB: tl.constexpr):
    """dL/d(angle) of each pair through one rotated tile: d(angle) = dRe * (-Ro) + dRo * Re."""
    ge, go = _split_pairs(g_rot, R, KB)
    re, ro = _split_pairs(rot, R, KB)
    return go * re - ge * ro


@triton.jit
def _bwd_chunk_kernel(
    x_ptr, z_ptr, B_ptr, C_ptr, Bb_ptr, Cb_ptr, th_ptr, ld_ptr, sig_ptr, gam_ptr, D_ptr,
    states_ptr, gstates_ptr, gy_ptr,
    gx_ptr, gz_ptr, gB_ptr, gC_ptr, gBb_ptr, gCb_ptr, gth_ptr, gld_ptr, gsig_ptr, ggam_ptr, gD_ptr,
    T, H, REP, NC,
    sx_b, sx_t, sx_h, sz_b, sz_t, sz_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr,
):
    """Every gradient of chunk c that is not the state chain. With W[i, j] = decay(i, j) (σ_j below the
    diagonal, γ_i on it), y = (W ⊙ C Bᵀ) x + diag(q) C Sᵀ + D x and S_exit = qL S + (diag(eσ) x)ᵀ B:
    dP = dy xᵀ; dx = (W ⊙ C Bᵀ)ᵀ dy + D dy + diag(eσ) B Gᵀ; dC = (W ⊙ dP) B + diag(q) dy S;
    dB = (W ⊙ dP)ᵀ C + diag(eσ) x G (G = dL/dS_exit); the log-decays get the W, q, e and qL terms,
    reverse-accumulated over the chunk. Two passes over the state dimension in blocks: the first sums
    the contractions over it (C Bᵀ, C Sᵀ, B Gᵀ, Σ G ⊙ S), the second writes dB, dC and dΘ block by block."""
    c = tl.program_id(0)
    pid = tl.program_id(1)
    hd = pid % H
    bi = (pid // H).to(tl.int64)
    gp = hd // REP
    rows = tl.arange(0, L)
    rows_p = tl.arange(0, PB)
    pmask = rows_p < P
    bh = bi * H + hd
    t = c * L + rows
    valid = t < T
    tok = (bi * T + t) * H + hd
    vmask_p = valid[:, None] & pmask[None, :]
    B_row = bi * sB_b + t * sB_t + gp * sB_g
    C_row = bi * sC_b + t * sC_t + gp * sC_g
    state = (bh * NC + c) * P * N + rows_p * N

    cb = tl.zeros((L, L), dtype=tl.float32)
    cs = tl.zeros((L, PB), dtype=tl.float32)  # S C_t, the state readout
    bg = tl.zeros((L, PB), dtype=tl.float32)  # G B_t
    dqL = 0.0
    for k0 in range(0, N, 2 * KB):
        cols = k0 + tl.arange(0, 2 * KB)
        cmask = cols < N
        vmask_n = valid[:, None] & cmask[None, :]
        smask = pmask[:, None] & cmask[None, :]
        cos, sin = _angles(th_ptr, tok, valid, k0, NA, KB)
        cr = _rotated(C_ptr, C_row, Cb_ptr + hd * N, cos, sin, cols, vmask_n, cmask, L, KB)
        br = _rotated(B_ptr, B_row, Bb_ptr + hd * N, cos, sin, cols, vmask_n, cmask, L, KB)
        s = _load_rows(states_ptr, state, cols, smask)
        g = _load_rows(gstates_ptr, state, cols, smask)
        cb += _dot(cr, tl.trans(br), MM, PREC)
        cs += _dot(cr, tl.trans(s), MM, PREC)
        bg += _dot(br, tl.trans(g), MM, PREC)
        dqL += tl.sum(tl.sum(g * s, 1), 0)

    # Recompute y (before the gate) for dL/dz. The order below ends each tile's life early: the
    # kernel is register-bound, and what is live together is what spills.
    A, seg, q, e, qL, start = _chunk_decays(ld_ptr, tok, valid, L)
    sig = tl.load(sig_ptr + tok, mask=valid, other=0.0)
    gam = tl.load(gam_ptr + tok, mask=valid, other=0.0)
    below = rows[:, None] > rows[None, :]
    w = _decay_matrix(A, seg, rows) * tl.where(below, sig[None, :], gam[None, :])
    Dh = tl.load(D_ptr + hd).to(tl.float32)
    x = _load_rows(x_ptr, bi * sx_b + t * sx_t + hd * sx_h, rows_p, vmask_p)
    scores = w * cb
    y = _dot(scores, x, MM, PREC) + q[:, None] * cs + Dh * x
    dy, gout, z, sz = _gated_grad(gy_ptr, z_ptr, tok, bi * sz_b + t * sz_t + hd * sz_h, rows_p, vmask_p, P)
    gz = gout * y * sz * (1.0 + z * (1.0 - sz))
    tl.store(gz_ptr + tok[:, None] * P + rows_p[None, :], gz.to(gz_ptr.dtype.element_ty), mask=vmask_p)
    tl.store(gD_ptr + bh * NC + c, tl.sum(tl.sum(dy * x, 1), 0))
    dq = tl.sum(dy * cs, 1)

    # x: through the scores, the skip and the chunk's exit state.
    es = e * sig
    gx = _dot(tl.trans(scores), dy, MM, PREC) + Dh * dy + es[:, None] * bg
    tl.store(gx_ptr + tok[:, None] * P + rows_p[None, :], gx.to(gx_ptr.dtype.element_ty), mask=vmask_p)
    ves = tl.sum(x * bg, 1)  # dL/d(e σ)

    # Decay weights: W = M (σ below the diagonal, γ on it), q, e and qL are exponentials of the
    # cumulative log-decay A; dL/dA is accumulated, then dL/da_k = Σ_{i >= k} dL/dA_i.
    dp = _dot(dy, tl.trans(x), MM, PREC)  # dL/dscores
    dw = cb * dp
    dcb = w * dp
    tl.store(ggam_ptr + tok, tl.sum(tl.where(rows[:, None] == rows[None, :], dw, 0.0), 1), mask=valid)
    dm = tl.where(below, dw * _decay_matrix(A, seg, rows), 0.0)
    tl.store(gsig_ptr + tok, tl.sum(dm, 0) + ves * e, mask=valid)
    r = dm * sig[None, :]
    de = ves * sig * e
    dA = tl.sum(r, 1) - tl.sum(r, 0) + dq * q - de
    dA += tl.where(rows == L - 1, tl.sum(de, 0) + dqL * qL, 0.0)
    da = tl.sum(tl.where(rows[:, None] >= rows[None, :], dA[:, None], 0.0), 0)
    tl.store(gld_ptr + tok, tl.where(start, 0.0, da), mask=valid)

    # B and C (rotated), then back through the rotation, block by block. Per-head gradients of
    # (v + bias), (b, t, h, n), are summed over the heads of a group afterwards; the biases' per-chunk
    # parts (b, h, chunks, n) over batch and chunks. The products are taken transposed so that the
    # tiles every block shares (dcb, dy, x) are their second operands.
    dcb_t = tl.trans(dcb)
    dy_t = tl.trans(dy)
    x_t = tl.trans(x)
    bias_part = (bh * NC + c) * N
    for k0 in range(0, N, 2 * KB):
        cols = k0 + tl.arange(0, 2 * KB)
        cmask = cols < N
        vmask_n = valid[:, None] & cmask[None, :]
        smask = pmask[:, None] & cmask[None, :]
        cos, sin = _angles(th_ptr, tok, valid, k0, NA, KB)
        cr = _rotated(C_ptr, C_row, Cb_ptr + hd * N, cos, sin, cols, vmask_n, cmask, L, KB)
        br = _rotated(B_ptr, B_row, Bb_ptr + hd * N, cos, sin, cols, vmask_n, cmask, L, KB)
        s = _load_rows(states_ptr, state, cols, smask)
        g = _load_rows(gstates_ptr, state, cols, smask)
        gcr = tl.trans(_dot(tl.trans(br), dcb_t, MM, PREC) + _dot(tl.trans(s), dy_t, MM, PREC) * q[None, :])
        gbr = tl.trans(_dot(tl.trans(cr), dcb, MM, PREC) + _dot(tl.trans(g), x_t, MM, PREC) * es[None, :])
        pairs = k0 // 2 + tl.arange(0, KB)
        tl.store(gth_ptr + (tok * NA)[:, None] + pairs[None, :], _angle_grad(gbr, br, L, KB) +
                 _angle_grad(gcr, cr, L, KB), mask=valid[:, None] & (pairs < NA)[None, :])
        _unrotate_store(gB_ptr, tok * N, gBb_ptr + bias_part, gbr, cos, sin, cols, vmask_n, cmask, L, KB)
        _unrotate_store(gC_ptr, tok * N, gCb_ptr + bias_part, gcr, cos, sin, cols, vmask_n, cmask, L, KB)


@dataclass(frozen=True)
class Tiling:
    """How one kernel's work is cut: block_p state rows per program (the sequential kernels split
    head_dim over the grid by it; the chunk kernel takes all of head_dim), block_pairs rotation pairs
    (2 block_pairs state columns) per step of the loop over the state dimension, and launch options."""

    block_p: int
    block_pairs: int
    num_warps: int
    num_stages: int = 1


def _pow2(size: int, least: int) -> int:
    return max(least, triton.next_power_of_2(size))


def tilings(head_dim: int, d_state: int, chunk_size: int) -> dict[str, Tiling]:
    """The tiling of each kernel ("fwd", "bwd_state", "bwd_chunk") at these sizes. Chosen with
    benchmarks/check_mamba3_resources.py for sm_90 (no spills at `tiny`, `small` and `nam52`, well
    under the shared-memory limit): tiles of at most 32 state columns, and 32 state rows per program
    in the sequential kernels (two programs per head at head_dim 64: twice the parallelism)."""
    block_p = _pow2(head_dim, 16)
    pairs = min(_pow2(d_state // 2, 8), 16)  # 2 * pairs >= 16: tl.dot's smallest extent
    return {
        "fwd": Tiling(min(block_p, 32), pairs, 4 if chunk_size <= 32 else 8),
        "bwd_state": Tiling(min(block_p, 32), pairs, 4),
        "bwd_chunk": Tiling(block_p, pairs, 4 if chunk_size <= 32 else 8),
    }


def dot_precision(device: torch.device) -> str:
    """input_precision of the fp32 `tl.dot`s. "tf32x3" (three TF32 tensor-core products, fp32-equivalent
    accuracy, deterministic) replaces "ieee" FMA loops, which are several times slower and need far more
    registers (the M2RNN kernels measured 2.4x); "tf32" exactly when torch's fp32 matmuls (the reference
    path's einsums) would use TF32; "ieee" before Ampere, which has no TF32 tensor cores."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"


@dataclass(frozen=True)
class Launch:
    """One kernel launch, `kernel[grid](*args, **meta)`; meta holds the constexprs and launch options."""

    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple
    meta: dict[str, Any]


def run_launch(launch: Launch) -> Any:
    """Launch it; returns triton's compiled kernel."""
    return launch.kernel[launch.grid](*launch.args, **launch.meta)


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
                num_stages=tiling.num_stages)


def fused_fwd(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, initial: Tensor | None,
    chunk_size: int, matmul_dtype: torch.dtype, launch: Callable[[Launch], Any] = run_launch,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gated output (b, t, h, p) in x's dtype, final state (b, h, p, n) and every chunk's entering state
    (b, h, chunks, p, n), both fp32. Contract: `megacpp::mamba3_fused_fwd` (mamba3_fused.py). `launch`
    runs the kernel launch (benchmarks/check_mamba3_resources.py passes one that only records it)."""
    b, t, h, p, g, n, na, nc = _sizes(x, B, theta, chunk_size)
    x, z, B, C = (_rows_unit_stride(v) for v in (x, z, B, C))
    B_bias, C_bias, theta, log_decay, sigma, gamma, D = (
        v.contiguous() for v in (B_bias, C_bias, theta, log_decay, sigma, gamma, D))
    f32 = torch.float32
    y = x.new_empty(b, t, h, p)
    states = x.new_empty(b, h, nc, p, n, dtype=f32)
    final = x.new_empty(b, h, p, n, dtype=f32)
    s0 = initial.to(f32).contiguous() if initial is not None else final  # unread without HAS_INIT
    tiling = tilings(p, n, chunk_size)["fwd"]
    launch(Launch(_fwd_kernel, (h, b, triton.cdiv(p, tiling.block_p)), (
        x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, s0, y, states, final,
        t, h, h // g, nc, *x.stride()[:3], *z.stride()[:3], *B.stride()[:3], *C.stride()[:3],
    ), dict(HAS_INIT=initial is not None, **_meta(tiling, p, n, na, chunk_size, matmul_dtype, x.device))))
    return y, final, states


def fused_bwd(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, states: Tensor, grad_y: Tensor,
    grad_final: Tensor | None, chunk_size: int, matmul_dtype: torch.dtype,
    launch: Callable[[Launch], Any] = run_launch,
) -> tuple[Tensor, ...]:
    """Gradients of x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D and the initial state,
    contiguous, each in its input's dtype (the initial state's in fp32). Contract:
    `megacpp::mamba3_fused_bwd` (mamba3_fused.py); `launch` as in `fused_fwd`."""
    b, t, h, p, g, n, na, nc = _sizes(x, B, theta, chunk_size)
    x, z, B, C = (_rows_unit_stride(v) for v in (x, z, B, C))
    B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, grad_y = (
        v.contiguous() for v in (B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, grad_y))
    f32 = torch.float32
    grad_states = torch.empty_like(states)
    grad_init = x.new_empty(b, h, p, n, dtype=f32)
    gfinal = grad_final.to(f32).contiguous() if grad_final is not None else grad_init  # unread without it
    tiling = tilings(p, n, chunk_size)
    launch(Launch(_bwd_state_kernel, (h, b, triton.cdiv(p, tiling["bwd_state"].block_p)), (
        z, C, C_bias, theta, log_decay, grad_y, gfinal, grad_states, grad_init,
        t, h, h // g, nc, *z.stride()[:3], *C.stride()[:3],
    ), dict(HAS_GFINAL=grad_final is not None,
            **_meta(tiling["bwd_state"], p, n, na, chunk_size, matmul_dtype, x.device))))
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_z = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    grad_B_heads = x.new_empty(b, t, h, n, dtype=f32)  # per head: summed over each group's heads below
    grad_C_heads = x.new_empty(b, t, h, n, dtype=f32)
    grad_theta = torch.empty_like(theta, dtype=f32)
    grad_ld, grad_sig, grad_gam = (torch.empty_like(v, dtype=f32) for v in (log_decay, sigma, gamma))
    grad_B_bias_parts = x.new_empty(b, h, nc, n, dtype=f32)
    grad_C_bias_parts = x.new_empty(b, h, nc, n, dtype=f32)
    grad_D_parts = x.new_empty(b, h, nc, dtype=f32)
    launch(Launch(_bwd_chunk_kernel, (nc, b * h), (
        x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, grad_states, grad_y,
        grad_x, grad_z, grad_B_heads, grad_C_heads, grad_B_bias_parts, grad_C_bias_parts, grad_theta, grad_ld,
        grad_sig, grad_gam, grad_D_parts,
        t, h, h // g, nc, *x.stride()[:3], *z.stride()[:3], *B.stride()[:3], *C.stride()[:3],
    ), _meta(tiling["bwd_chunk"], p, n, na, chunk_size, matmul_dtype, x.device)))
    # Fixed-order reductions (no atomics): the heads of each group; batch and chunks for the per-head
    # biases and D.
    grad_B, grad_C = (v if g == h else v.view(b, t, g, h // g, n).sum(3) for v in (grad_B_heads, grad_C_heads))
    return (
        grad_x, grad_z, grad_B.to(B.dtype), grad_C.to(C.dtype),
        grad_B_bias_parts.sum((0, 2)).to(B_bias.dtype), grad_C_bias_parts.sum((0, 2)).to(C_bias.dtype),
        grad_theta.to(theta.dtype), grad_ld.to(log_decay.dtype), grad_sig.to(sigma.dtype),
        grad_gam.to(gamma.dtype), grad_D_parts.sum((0, 2)).to(D.dtype), grad_init,
    )
