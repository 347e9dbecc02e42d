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
folded in before the sum instead of subtracted after it. Rotations act on interleaved pairs (2i, 2i+1);
the kernels load the even and the odd state dimensions as two halves, so a rotation is elementwise
arithmetic on two (L, n/2) tiles and every contraction over n is the sum of two `tl.dot`s.

Decays inside a chunk come from a cumulative sum of the log-decays (base 2: exp2 with log2(e) scaling);
a document start is a log-decay of -inf, which the kernels turn into a segment id (the number of
starts so far in the chunk) and a zero log-decay: decay(t, s) = exp2(A_t - A_s) when s <= t in the same
segment, else exactly 0 (masked to -inf before exp2, so nothing overflows and no inf meets inf).

Kernels:
- `_fwd_kernel`, grid (heads, batch): walks the chunks in order with the (p, n) state in fp32
  registers; writes the gated output, every chunk's entering state (fp32, for the backward) and the
  final state.
- `_bwd_state_kernel`, grid (heads, batch): walks the chunks backwards carrying dL/dS (p, n) in fp32
  and writes it at every chunk boundary, and dL/d(initial state).
- `_bwd_chunk_kernel`, grid (chunks, batch * heads): every other gradient of one chunk from its
  entering state and the gradient of its exit state; chunks are independent here.
Gradients of the group-shared B and C are written per head and summed over each group's heads in
PyTorch afterwards, in a fixed order; the biases' and D's are per-chunk partials summed over batch and
chunks the same way: no atomics anywhere, so every result is run-to-run deterministic.

Matmul operands: fp32 ("ieee", or "tf32" when torch allows TF32 for fp32 matmuls, as the reference's
einsums would use), or bf16/fp16 when the caller asks for activation-dtype matmuls (the mixer's
`scan_matmuls = "activation"`); accumulation is fp32 always, and so are decays and states.
Supported sizes and dtypes: `megacpp.ops.mamba3_fused.triton_unsupported_reason` (checked before a
launch; that module imports without triton).
"""
from __future__ import annotations

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
def _rotated_pairs(ptr, row_off, bias_ptr, cos, sin, cols_k, mask, kmask):
    """Even and odd halves of (v + bias) rotated by the angles: v's pair k is columns (2k, 2k+1)."""
    even = _load_rows(ptr, row_off, 2 * cols_k, mask) + tl.load(bias_ptr + 2 * cols_k, mask=kmask, other=0.0)[None, :]
    odd = _load_rows(ptr, row_off, 2 * cols_k + 1, mask) + tl.load(bias_ptr + 2 * cols_k + 1, mask=kmask,
                                                                    other=0.0)[None, :]
    rot_even = tl.where(mask, even * cos - odd * sin, 0.0)
    rot_odd = tl.where(mask, even * sin + odd * cos, 0.0)
    return rot_even, rot_odd


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
def _load_state(ptr, base, rows_p, cols_k, smask, N: tl.constexpr):
    """Even and odd column halves of the row-major (p, n) state at ptr + base, in fp32."""
    off = base + rows_p[:, None] * N + 2 * cols_k[None, :]
    return (tl.load(ptr + off, mask=smask, other=0.0).to(tl.float32),
            tl.load(ptr + off + 1, mask=smask, other=0.0).to(tl.float32))


@triton.jit
def _store_state(ptr, base, he, ho, rows_p, cols_k, smask, N: tl.constexpr):
    """Write the two column halves back as a row-major (p, n) state at ptr + base."""
    off = base + rows_p[:, None] * N + 2 * cols_k[None, :]
    tl.store(ptr + off, he, mask=smask)
    tl.store(ptr + off + 1, ho, mask=smask)


@triton.jit
def _fwd_kernel(
    x_ptr, z_ptr, B_ptr, C_ptr, Bb_ptr, Cb_ptr, th_ptr, ld_ptr, sig_ptr, gam_ptr, D_ptr, s0_ptr,
    y_ptr, states_ptr, final_ptr,
    T, H, REP, NC,
    sx_b, sx_t, sx_h, sz_b, sz_t, sz_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g,
    P: tl.constexpr, N: tl.constexpr, NA: tl.constexpr, L: tl.constexpr, PB: tl.constexpr, KB: tl.constexpr,
    MM: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr,
):
    hd = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    gp = hd // REP
    rows = tl.arange(0, L)
    rows_p = tl.arange(0, PB)
    cols_k = tl.arange(0, KB)
    pmask = rows_p < P
    kmask = cols_k < N // 2
    amask = cols_k < NA
    smask = pmask[:, None] & kmask[None, :]
    Dh = tl.load(D_ptr + hd).to(tl.float32)
    bh = bi * H + hd
    if HAS_INIT:
        he, ho = _load_state(s0_ptr, bh * P * N, rows_p, cols_k, smask, N)
    else:
        he = tl.zeros((PB, KB), dtype=tl.float32)
        ho = tl.zeros((PB, KB), dtype=tl.float32)
    for c in range(NC):
        t = c * L + rows
        valid = t < T
        tok = (bi * T + t) * H + hd  # (b, t, h) index
        vmask_p = valid[:, None] & pmask[None, :]
        vmask_k = valid[:, None] & kmask[None, :]
        x = _load_rows(x_ptr, bi * sx_b + t * sx_t + hd * sx_h, rows_p, vmask_p)
        theta = _load_rows(th_ptr, tok * NA, cols_k, valid[:, None] & amask[None, :])
        cos, sin = tl.cos(theta), tl.sin(theta)
        be, bo = _rotated_pairs(B_ptr, bi * sB_b + t * sB_t + gp * sB_g, Bb_ptr + hd * N, cos, sin, cols_k,
                                vmask_k, kmask)
        ce, co = _rotated_pairs(C_ptr, bi * sC_b + t * sC_t + gp * sC_g, Cb_ptr + hd * N, cos, sin, cols_k,
                                vmask_k, kmask)
        sig = tl.load(sig_ptr + tok, mask=valid, other=0.0)
        gam = tl.load(gam_ptr + tok, mask=valid, other=0.0)
        A, seg, q, e, qL, _ = _chunk_decays(ld_ptr, tok, valid, L)
        M = _decay_matrix(A, seg, rows)
        w = M * tl.where(rows[:, None] > rows[None, :], sig[None, :], gam[None, :])
        scores = w * (_dot(ce, tl.trans(be), MM, PREC) + _dot(co, tl.trans(bo), MM, PREC))
        y = _dot(scores, x, MM, PREC)
        y += q[:, None] * (_dot(ce, tl.trans(he), MM, PREC) + _dot(co, tl.trans(ho), MM, PREC))
        y += Dh * x
        z = _load_rows(z_ptr, bi * sz_b + t * sz_t + hd * sz_h, rows_p, vmask_p)
        y = y * z * tl.sigmoid(z)
        y_off = tok * P
        tl.store(y_ptr + y_off[:, None] + rows_p[None, :], y.to(y_ptr.dtype.element_ty), mask=vmask_p)
        _store_state(states_ptr, (bh * NC + c) * P * N, he, ho, rows_p, cols_k, smask, N)
        xw = tl.trans(x * (e * sig)[:, None])
        he = qL * he + _dot(xw, be, MM, PREC)
        ho = qL * ho + _dot(xw, bo, MM, PREC)
    _store_state(final_ptr, bh * P * N, he, ho, rows_p, cols_k, smask, N)


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
    """dL/dS_exit of chunk c, for every c, from dS_enter(c) = qL(c) dS_exit(c) + Σ_t q_t dy_t C_tᵀ."""
    hd = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    gp = hd // REP
    rows = tl.arange(0, L)
    rows_p = tl.arange(0, PB)
    cols_k = tl.arange(0, KB)
    pmask = rows_p < P
    kmask = cols_k < N // 2
    amask = cols_k < NA
    smask = pmask[:, None] & kmask[None, :]
    bh = bi * H + hd
    if HAS_GFINAL:
        ge, go = _load_state(gfinal_ptr, bh * P * N, rows_p, cols_k, smask, N)
    else:
        ge = tl.zeros((PB, KB), dtype=tl.float32)
        go = tl.zeros((PB, KB), dtype=tl.float32)
    for i in range(NC):
        c = NC - 1 - i
        _store_state(gstates_ptr, (bh * NC + c) * P * N, ge, go, rows_p, cols_k, smask, N)
        t = c * L + rows
        valid = t < T
        tok = (bi * T + t) * H + hd
        vmask_p = valid[:, None] & pmask[None, :]
        vmask_k = valid[:, None] & kmask[None, :]
        theta = _load_rows(th_ptr, tok * NA, cols_k, valid[:, None] & amask[None, :])
        cos, sin = tl.cos(theta), tl.sin(theta)
        ce, co = _rotated_pairs(C_ptr, bi * sC_b + t * sC_t + gp * sC_g, Cb_ptr + hd * N, cos, sin, cols_k,
                                vmask_k, kmask)
        dy, _, _, _ = _gated_grad(gy_ptr, z_ptr, tok, bi * sz_b + t * sz_t + hd * sz_h, rows_p, vmask_p, P)
        _, _, q, _, qL, _ = _chunk_decays(ld_ptr, tok, valid, L)
        dyq = tl.trans(dy * q[:, None])
        ge = qL * ge + _dot(dyq, ce, MM, PREC)
        go = qL * go + _dot(dyq, co, MM, PREC)
    _store_state(ginit_ptr, bh * P * N, ge, go, rows_p, cols_k, smask, N)


@triton.jit
def _unrotate_store(ptr, row_off, bias_ptr, gre, gro, cos, sin, cols_k, mask, kmask):
    """dL/d(v + bias) from the gradients of the rotated halves (the transposed rotation): stored per
    token at ptr, and summed over the chunk's tokens at bias_ptr (this chunk's part of dL/dbias)."""
    ge = tl.where(mask, gre * cos + gro * sin, 0.0)
    go = tl.where(mask, gro * cos - gre * sin, 0.0)
    off = row_off[:, None] + 2 * cols_k[None, :]
    tl.store(ptr + off, ge, mask=mask)
    tl.store(ptr + off + 1, go, mask=mask)
    tl.store(bias_ptr + 2 * cols_k, tl.sum(ge, 0), mask=kmask)
    tl.store(bias_ptr + 2 * cols_k + 1, tl.sum(go, 0), mask=kmask)


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
    reverse-accumulated over the chunk."""
    c = tl.program_id(0)
    pid = tl.program_id(1)
    hd = pid % H
    bi = (pid // H).to(tl.int64)
    gp = hd // REP
    rows = tl.arange(0, L)
    rows_p = tl.arange(0, PB)
    cols_k = tl.arange(0, KB)
    pmask = rows_p < P
    kmask = cols_k < N // 2
    amask = cols_k < NA
    smask = pmask[:, None] & kmask[None, :]
    bh = bi * H + hd
    t = c * L + rows
    valid = t < T
    tok = (bi * T + t) * H + hd
    vmask_p = valid[:, None] & pmask[None, :]
    vmask_k = valid[:, None] & kmask[None, :]
    Dh = tl.load(D_ptr + hd).to(tl.float32)

    x = _load_rows(x_ptr, bi * sx_b + t * sx_t + hd * sx_h, rows_p, vmask_p)
    theta = _load_rows(th_ptr, tok * NA, cols_k, valid[:, None] & amask[None, :])
    cos, sin = tl.cos(theta), tl.sin(theta)
    be, bo = _rotated_pairs(B_ptr, bi * sB_b + t * sB_t + gp * sB_g, Bb_ptr + hd * N, cos, sin, cols_k,
                            vmask_k, kmask)
    ce, co = _rotated_pairs(C_ptr, bi * sC_b + t * sC_t + gp * sC_g, Cb_ptr + hd * N, cos, sin, cols_k,
                            vmask_k, kmask)
    sig = tl.load(sig_ptr + tok, mask=valid, other=0.0)
    gam = tl.load(gam_ptr + tok, mask=valid, other=0.0)
    A, seg, q, e, qL, start = _chunk_decays(ld_ptr, tok, valid, L)
    M = _decay_matrix(A, seg, rows)
    below = rows[:, None] > rows[None, :]
    w = M * tl.where(below, sig[None, :], gam[None, :])
    he, ho = _load_state(states_ptr, (bh * NC + c) * P * N, rows_p, cols_k, smask, N)
    ge, go = _load_state(gstates_ptr, (bh * NC + c) * P * N, rows_p, cols_k, smask, N)

    # Recompute y (before the gate) for dL/dz; cs = S C_t, the state readout.
    cb = _dot(ce, tl.trans(be), MM, PREC) + _dot(co, tl.trans(bo), MM, PREC)
    scores = w * cb
    cs = _dot(ce, tl.trans(he), MM, PREC) + _dot(co, tl.trans(ho), MM, PREC)
    y = _dot(scores, x, MM, PREC) + q[:, None] * cs + Dh * x
    dy, gout, z, sz = _gated_grad(gy_ptr, z_ptr, tok, bi * sz_b + t * sz_t + hd * sz_h, rows_p, vmask_p, P)
    gz = gout * y * sz * (1.0 + z * (1.0 - sz))
    tl.store(gz_ptr + tok[:, None] * P + rows_p[None, :], gz.to(gz_ptr.dtype.element_ty), mask=vmask_p)
    tl.store(gD_ptr + bh * NC + c, tl.sum(tl.sum(dy * x, 1), 0))

    # x: through the scores, the skip and the chunk's exit state.
    es = e * sig
    bg = _dot(be, tl.trans(ge), MM, PREC) + _dot(bo, tl.trans(go), MM, PREC)  # (L, p): G B_t
    gx = _dot(tl.trans(scores), dy, MM, PREC) + Dh * dy + es[:, None] * bg
    tl.store(gx_ptr + tok[:, None] * P + rows_p[None, :], gx.to(gx_ptr.dtype.element_ty), mask=vmask_p)

    # B and C (rotated), then back through the rotation.
    dp = _dot(dy, tl.trans(x), MM, PREC)  # dL/dscores
    dcb = w * dp
    gce = _dot(dcb, be, MM, PREC) + q[:, None] * _dot(dy, he, MM, PREC)
    gco = _dot(dcb, bo, MM, PREC) + q[:, None] * _dot(dy, ho, MM, PREC)
    dcb_t = tl.trans(dcb)
    gbe = _dot(dcb_t, ce, MM, PREC) + es[:, None] * _dot(x, ge, MM, PREC)
    gbo = _dot(dcb_t, co, MM, PREC) + es[:, None] * _dot(x, go, MM, PREC)
    # d(angle) = dRe * (-Ro) + dRo * Re for each rotated pair, B's and C's.
    gth = gbo * be - gbe * bo + gco * ce - gce * co
    tl.store(gth_ptr + tok[:, None] * NA + cols_k[None, :], gth, mask=valid[:, None] & amask[None, :])
    # Per-head gradients of (v + bias), (b, t, h, n), summed over the heads of a group afterwards; the
    # biases' per-chunk parts (b, h, chunks, n) are summed over batch and chunks afterwards.
    _unrotate_store(gB_ptr, tok * N, gBb_ptr + (bh * NC + c) * N, gbe, gbo, cos, sin, cols_k, vmask_k, kmask)
    _unrotate_store(gC_ptr, tok * N, gCb_ptr + (bh * NC + c) * N, gce, gco, cos, sin, cols_k, vmask_k, kmask)

    # Decay weights: W = M (σ below the diagonal, γ on it), q, e and qL are exponentials of the
    # cumulative log-decay A; dL/dA is accumulated, then dL/da_k = Σ_{i >= k} dL/dA_i.
    dw = cb * dp
    dm = tl.where(below, dw * M, 0.0)
    gsig_w = tl.sum(dm, 0)
    r = dm * sig[None, :]
    ves = tl.sum(x * bg, 1)  # dL/d(e σ)
    dq = tl.sum(dy * cs, 1)
    dqL = tl.sum(tl.sum(ge * he + go * ho, 1), 0)
    de = ves * sig * e
    dA = tl.sum(r, 1) - tl.sum(r, 0) + dq * q - de
    dA += tl.where(rows == L - 1, tl.sum(de, 0) + dqL * qL, 0.0)
    da = tl.sum(tl.where(rows[:, None] >= rows[None, :], dA[:, None], 0.0), 0)
    tl.store(gld_ptr + tok, tl.where(start, 0.0, da), mask=valid)
    tl.store(gsig_ptr + tok, gsig_w + ves * e, mask=valid)
    tl.store(ggam_ptr + tok, tl.sum(tl.where(rows[:, None] == rows[None, :], dw, 0.0), 1), mask=valid)


def _block(size: int) -> int:
    """Tile extent for a dimension: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(size))


def _precision(matmul_dtype: torch.dtype) -> tuple[int, str]:
    # fp32 operands use TF32 exactly when torch's fp32 matmuls would (the reference path's einsums).
    return _MM_CODES[matmul_dtype], "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _num_warps(pb: int, kb: int) -> int:
    # Two (p, n/2) fp32 state halves plus the chunk's tiles: 8 warps from p * n = 8192 (small's 64 x 128).
    return 8 if pb * kb >= 4096 else 4


def _rows_unit_stride(v: Tensor) -> Tensor:
    """The kernels take any strides over (b, t, h) but need the last dim contiguous."""
    return v if v.stride(-1) == 1 else v.contiguous()


def _sizes(x: Tensor, B: Tensor, theta: Tensor, chunk_size: int) -> tuple[int, ...]:
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    return b, t, h, p, g, n, theta.shape[-1], triton.cdiv(t, chunk_size)


def fused_fwd(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, initial: Tensor | None,
    chunk_size: int, matmul_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gated output (b, t, h, p) in x's dtype, final state (b, h, p, n) and every chunk's entering state
    (b, h, chunks, p, n), both fp32. Contract: `megacpp::mamba3_fused_fwd` (mamba3_fused.py)."""
    b, t, h, p, g, n, na, nc = _sizes(x, B, theta, chunk_size)
    x, z, B, C = (_rows_unit_stride(v) for v in (x, z, B, C))
    B_bias, C_bias, theta, log_decay, sigma, gamma, D = (
        v.contiguous() for v in (B_bias, C_bias, theta, log_decay, sigma, gamma, D))
    f32 = torch.float32
    y = x.new_empty(b, t, h, p)
    states = x.new_empty(b, h, nc, p, n, dtype=f32)
    final = x.new_empty(b, h, p, n, dtype=f32)
    s0 = initial.to(f32).contiguous() if initial is not None else final  # unread without HAS_INIT
    mm, prec = _precision(matmul_dtype)
    pb, kb = _block(p), _block(n // 2)
    _fwd_kernel[(h, b)](
        x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, s0, y, states, final,
        t, h, h // g, nc, *x.stride()[:3], *z.stride()[:3], *B.stride()[:3], *C.stride()[:3],
        P=p, N=n, NA=na, L=chunk_size, PB=pb, KB=kb, MM=mm, PREC=prec, HAS_INIT=initial is not None,
        num_warps=_num_warps(pb, kb),
    )
    return y, final, states


def fused_bwd(
    x: Tensor, z: Tensor, B: Tensor, C: Tensor, B_bias: Tensor, C_bias: Tensor, theta: Tensor,
    log_decay: Tensor, sigma: Tensor, gamma: Tensor, D: Tensor, states: Tensor, grad_y: Tensor,
    grad_final: Tensor | None, chunk_size: int, matmul_dtype: torch.dtype,
) -> tuple[Tensor, ...]:
    """Gradients of x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D and the initial state,
    contiguous, each in its input's dtype (the initial state's in fp32). Contract:
    `megacpp::mamba3_fused_bwd` (mamba3_fused.py)."""
    b, t, h, p, g, n, na, nc = _sizes(x, B, theta, chunk_size)
    x, z, B, C = (_rows_unit_stride(v) for v in (x, z, B, C))
    B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, grad_y = (
        v.contiguous() for v in (B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, grad_y))
    f32 = torch.float32
    grad_states = torch.empty_like(states)
    grad_init = x.new_empty(b, h, p, n, dtype=f32)
    gfinal = grad_final.to(f32).contiguous() if grad_final is not None else grad_init  # unread without it
    mm, prec = _precision(matmul_dtype)
    pb, kb = _block(p), _block(n // 2)
    shapes = dict(P=p, N=n, NA=na, L=chunk_size, PB=pb, KB=kb, MM=mm, PREC=prec, num_warps=_num_warps(pb, kb))
    _bwd_state_kernel[(h, b)](
        z, C, C_bias, theta, log_decay, grad_y, gfinal, grad_states, grad_init,
        t, h, h // g, nc, *z.stride()[:3], *C.stride()[:3], HAS_GFINAL=grad_final is not None, **shapes,
    )
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_z = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    grad_B_heads = x.new_empty(b, t, h, n, dtype=f32)  # per head: summed over each group's heads below
    grad_C_heads = x.new_empty(b, t, h, n, dtype=f32)
    grad_theta = torch.empty_like(theta, dtype=f32)
    grad_ld, grad_sig, grad_gam = (torch.empty_like(v, dtype=f32) for v in (log_decay, sigma, gamma))
    grad_B_bias_parts = x.new_empty(b, h, nc, n, dtype=f32)
    grad_C_bias_parts = x.new_empty(b, h, nc, n, dtype=f32)
    grad_D_parts = x.new_empty(b, h, nc, dtype=f32)
    _bwd_chunk_kernel[(nc, b * h)](
        x, z, B, C, B_bias, C_bias, theta, log_decay, sigma, gamma, D, states, grad_states, grad_y,
        grad_x, grad_z, grad_B_heads, grad_C_heads, grad_B_bias_parts, grad_C_bias_parts, grad_theta, grad_ld,
        grad_sig, grad_gam, grad_D_parts,
        t, h, h // g, nc, *x.stride()[:3], *z.stride()[:3], *B.stride()[:3], *C.stride()[:3], **shapes,
    )
    # Fixed-order reductions (no atomics): the heads of each group; batch and chunks for the per-head
    # biases and D.
    grad_B, grad_C = (v if g == h else v.view(b, t, g, h // g, n).sum(3) for v in (grad_B_heads, grad_C_heads))
    return (
        grad_x, grad_z, grad_B.to(B.dtype), grad_C.to(C.dtype),
        grad_B_bias_parts.sum((0, 2)).to(B_bias.dtype), grad_C_bias_parts.sum((0, 2)).to(C_bias.dtype),
        grad_theta.to(theta.dtype), grad_ld.to(log_decay.dtype), grad_sig.to(sigma.dtype),
        grad_gam.to(gamma.dtype), grad_D_parts.sum((0, 2)).to(D.dtype), grad_init,
    )
