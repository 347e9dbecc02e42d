"""Fused Triton kernels for the M2RNN scan: the CUDA implementation of `megacpp::m2rnn_scan_fwd` and
`megacpp::m2rnn_scan_bwd` (see megacpp/ops/m2rnn_scan.py for the recurrence, layouts and the reference).

Rows of the state are independent: h[i, :]_t = tanh(f_t h[i, :]_{t-1} W + k_t[i] v_t), so one program
owns BLOCK_K rows of one (batch row, head) and loops over time with its state tile and W in registers;
one launch per direction instead of a few per token. Each program writes its rows of every state; y (a
sum over rows) goes to per-block partial buffers summed after the launch. The backward's chain is dL/dh
carried back through time; dL/dp of each step is used where it is made and never stored. Per step a
program stores its rows' grad_q, grad_k and grad_f terms and its rows' share of grad_v (sum over rows of
k dp, a partial per row block), and it accumulates grad_W's f_t h_{t-1}^T dp_t over its steps in
registers, stored once at the end. Nothing on the chain reads these, so they can overlap it (on sm_90 at
dv >= 64, though, Triton makes the grad_W product a wgmma that the step waits for). After the launch the
partials are summed over row blocks (grad_v) and over row blocks and batch rows (grad_W), and grad_f
over rows. No atomics anywhere, so results are deterministic. Everything is fp32; `tl.dot` runs as
"tf32x3" (split-TF32 tensor-core products, fp32-equivalent accuracy) to match the reference's fp32
matmuls at tensor-core latency (see `_dot_precision`). Each step's inputs are loaded during the step
before, so memory latency overlaps the chain, and a states gradient that is absent (training reads y
only) is neither read nor zero-filled.

Supported: float32 tensors, key_dim and value_dim powers of two in [16, 128], t >= 1 and b >= 1
(`unsupported_reason` says why not; `with_fallback` sends such calls to the reference).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

# Rows of the state per program: tl.dot needs at least 16, and the smallest block gives the most
# programs (b * H * dk / 16) and the shortest per-step chain, which is what bounds a sequential scan.
BLOCK_K = 16
_SIZES = (16, 32, 64, 128)


@triton.jit
def _tanh(x):
    # exp of a non-positive argument: no overflow at large |x|.
    e = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -th, th)


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, f_ptr, w_ptr, h0_ptr, y_part_ptr, states_ptr, T, H, B,
                DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    b, hd, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = kb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, DV)
    tile = rows[:, None] * DV + cols[None, :]
    w = tl.load(w_ptr + hd * DV * DV + cols[:, None] * DV + cols[None, :])
    h = tl.load(h0_ptr + (hd * B + b) * DK * DV + tile)
    # Token ti's inputs are loaded during step ti - 1 (software prefetch): their latency from memory
    # would otherwise sit on the sequential chain of every step.
    tok = tl.cast(b * T, tl.int64) * H + hd  # (b, t, H) index of token 0's inputs
    f, k = tl.load(f_ptr + tok), tl.load(k_ptr + tok * DK + rows)
    v, q = tl.load(v_ptr + tok * DV + cols), tl.load(q_ptr + tok * DK + rows)
    for i in range(T):
        ti = tl.cast(i, tl.int64)  # states hold t * H * b * dk * dv elements: past int32 at full size
        step = (ti * H + hd) * B + b  # (t, H, b) index of the outputs
        nxt = (b * T + tl.minimum(ti + 1, T - 1)) * H + hd
        f_n, k_n = tl.load(f_ptr + nxt), tl.load(k_ptr + nxt * DK + rows)
        v_n, q_n = tl.load(v_ptr + nxt * DV + cols), tl.load(q_ptr + nxt * DK + rows)
        h = _tanh(f * tl.dot(h, w, input_precision=PRECISION) + k[:, None] * v[None, :])
        tl.store(states_ptr + step * DK * DV + tile, h)
        tl.store(y_part_ptr + (kb * T * H * B + step) * DV + cols, tl.sum(q[:, None] * h, axis=0))
        f, k, v, q = f_n, k_n, v_n, q_n


@triton.jit
def _bwd_step(carry, gw, h, h_prev, gs, w_t, q, k, v, f, gy, tok,
              gq_ptr, gk_ptr, gf_rows_ptr, gv_part_ptr, rows,
              DK: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr, HAS_GS: tl.constexpr):
    """One step back through time given this block's tiles of h_t, h_{t-1}, dL/dh_t from the states
    output (gs, when HAS_GS) and the token's q, k, v, f, dL/dy. With dp = dL/dp_t (p the pre-activation)
    it stores the per-row sums of this block and its rows' share of grad_v, and returns dL/dh_{t-1}
    (before later steps add to it) and gw plus this step's f_t h_{t-1}^T dp."""
    cols = tl.arange(0, DV)
    if HAS_GS:
        carry += gs
    carry += q[:, None] * gy[None, :]
    dp = carry * (1.0 - h * h)
    back = tl.dot(dp, w_t, input_precision=PRECISION)  # dL/dh_{t-1} / f_t
    # Only `back` feeds the next step; nothing on the chain reads the rest, and dp is never stored:
    # sums over rows (grad_v, grad_W) are this block's partials, added up after the launch.
    gw = tl.dot(tl.trans(f * h_prev), dp, gw, input_precision=PRECISION)
    tl.store(gv_part_ptr + tok * DV + cols, tl.sum(k[:, None] * dp, axis=0))
    tl.store(gq_ptr + tok * DK + rows, tl.sum(h * gy[None, :], axis=1))
    tl.store(gk_ptr + tok * DK + rows, tl.sum(dp * v[None, :], axis=1))
    # sum(dp * (h_prev W)) = sum(h_prev * (dp W^T)): reuses `back` instead of a second matmul.
    tl.store(gf_rows_ptr + tok * DK + rows, tl.sum(h_prev * back, axis=1))
    return f * back, gw


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, f_ptr, w_ptr, h0_ptr, states_ptr, gy_ptr, gs_ptr,
                gq_ptr, gk_ptr, gf_rows_ptr, gv_part_ptr, gw_part_ptr, gh0_ptr, T, H, B,
                DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                HAS_GS: tl.constexpr):
    b, hd, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = kb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, DV)
    tile = rows[:, None] * DV + cols[None, :]
    w_t = tl.load(w_ptr + hd * DV * DV + cols[None, :] * DV + cols[:, None])  # W^T
    carry = tl.zeros((BLOCK, DV), dtype=tl.float32)  # dL/dh_t from later steps
    gw = tl.zeros((DV, DV), dtype=tl.float32)  # this block's share of grad_W, summed over its steps
    # This block's (b, t, H, dv) slice of the grad_v partials; int64: past int32 at large b * t.
    gv_part_ptr += tl.cast(kb, tl.int64) * T * H * B * DV
    # Everything step ti reads is loaded during step ti + 1 (h_{ti-1} of one step is h of the next):
    # memory latency then overlaps the math instead of lengthening the sequential chain.
    last = tl.cast(T - 1, tl.int64)
    step = (last * H + hd) * B + b  # (t, H, b) index
    tok = (b * T + last) * H + hd  # (b, t, H) index
    h = tl.load(states_ptr + step * DK * DV + tile)
    gs = tl.zeros((BLOCK, DV), dtype=tl.float32)
    if HAS_GS:
        gs = tl.load(gs_ptr + step * DK * DV + tile)
    h_prev = tl.load(states_ptr + ((tl.maximum(last - 1, 0) * H + hd) * B + b) * DK * DV + tile)
    q, k = tl.load(q_ptr + tok * DK + rows), tl.load(k_ptr + tok * DK + rows)
    v, f = tl.load(v_ptr + tok * DV + cols), tl.load(f_ptr + tok)
    gy = tl.load(gy_ptr + step * DV + cols)
    for i in range(T - 1):  # steps T-1 .. 1; step 0 reads h0 (after the loop)
        ti = last - i
        step_n = ((ti - 1) * H + hd) * B + b
        tok_n = (b * T + ti - 1) * H + hd
        h_prev_n = tl.load(states_ptr + ((tl.maximum(ti - 2, 0) * H + hd) * B + b) * DK * DV + tile)
        gs_n = gs
        if HAS_GS:
            gs_n = tl.load(gs_ptr + step_n * DK * DV + tile)
        q_n, k_n = tl.load(q_ptr + tok_n * DK + rows), tl.load(k_ptr + tok_n * DK + rows)
        v_n, f_n = tl.load(v_ptr + tok_n * DV + cols), tl.load(f_ptr + tok_n)
        gy_n = tl.load(gy_ptr + step_n * DV + cols)
        carry, gw = _bwd_step(carry, gw, h, h_prev, gs, w_t, q, k, v, f, gy, tok,
                              gq_ptr, gk_ptr, gf_rows_ptr, gv_part_ptr, rows, DK, DV, PRECISION, HAS_GS)
        h, h_prev, gs, q, k, v, f, gy, tok = h_prev, h_prev_n, gs_n, q_n, k_n, v_n, f_n, gy_n, tok_n
    h_prev = tl.load(h0_ptr + (hd * B + b) * DK * DV + tile)
    carry, gw = _bwd_step(carry, gw, h, h_prev, gs, w_t, q, k, v, f, gy, tok,
                          gq_ptr, gk_ptr, gf_rows_ptr, gv_part_ptr, rows, DK, DV, PRECISION, HAS_GS)
    tl.store(gh0_ptr + (hd * B + b) * DK * DV + tile, carry)
    n_blocks = tl.num_programs(2)
    tl.store(gw_part_ptr + ((b * H + hd) * n_blocks + kb) * DV * DV + cols[:, None] * DV + cols[None, :], gw)


def unsupported_reason(tensors: tuple[Tensor, ...], dk: int, dv: int, b: int, t: int) -> str | None:
    """None when the kernels handle these inputs, else why not."""
    if any(x.dtype != torch.float32 for x in tensors):
        return f"float32 only, got {sorted({str(x.dtype) for x in tensors})}"
    if dk not in _SIZES or dv not in _SIZES:
        return f"key_dim and value_dim must be one of {_SIZES}, got key_dim={dk}, value_dim={dv}"
    if b < 1 or t < 1:
        return f"empty input: b={b}, t={t}"
    return None


def _check(tensors: tuple[Tensor, ...], q: Tensor, v: Tensor) -> tuple[int, int, int, int, int]:
    b, t, n_heads, dk = q.shape
    dv = v.shape[-1]
    reason = unsupported_reason(tensors, dk, dv, b, t)
    if reason is not None:
        raise ValueError(f"m2rnn Triton scan: {reason}")
    return b, t, n_heads, dk, dv


def _dot_precision(device: torch.device) -> str:
    """The per-step (16 x dv) @ (dv x dv) product is on the sequential chain: "tf32x3" (three TF32
    tensor-core products, fp32-equivalent accuracy) cut the backward scan from 29.1 to 12.3 ms and the
    forward from 5.0 to 3.8 ms at `small`'s sizes on an H200 against fp32 FMAs ("ieee"), moving the
    gradients by 8e-7 relative (BENCHMARKS.md). Before Ampere there are no TF32 tensor cores."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "ieee"
    return "tf32x3"


def _num_warps(dv: int) -> int:
    # The (dv x dv) W tile held in registers wants ~32 fp32 values per thread at most: 4 warps up to
    # 64 x 64, 8 beyond. The backward's grad_W accumulator is a second such tile and it keeps 4 warps
    # anyway: compiled for sm_90 at dv = 64 it spills only 4 local loads per step inside the time loop
    # (none at 8 warps), 8 warps made the backward before the accumulator 14% slower on an H200, and
    # with it at 4 warps the R mixer takes 16.0 ms forward + backward against 17.9 before (8 warps
    # not timed with it; BENCHMARKS.md).
    return 4 if dv * dv <= 4096 else 8


def scan_fwd_triton(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """Same contract as the reference `megacpp::m2rnn_scan_fwd`: y (t, H, b, dv), states (t, H, b, dk, dv)."""
    q, k, v, f, W, h0 = (x.contiguous() for x in (q, k, v, f, W, h0))
    b, t, n_heads, dk, dv = _check((q, k, v, f, W, h0), q, v)
    n_blocks = dk // BLOCK_K
    y_part = q.new_empty(n_blocks, t, n_heads, b, dv)
    states = q.new_empty(t, n_heads, b, dk, dv)
    _fwd_kernel[(b, n_heads, n_blocks)](q, k, v, f, W, h0, y_part, states, t, n_heads, b,
                                        DK=dk, DV=dv, BLOCK=BLOCK_K, PRECISION=_dot_precision(q.device),
                                        num_warps=_num_warps(dv))
    return y_part.sum(0), states


def scan_bwd_triton(
    q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, h0: Tensor, states: Tensor,
    grad_y: Tensor, grad_states: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Same contract as the reference `megacpp::m2rnn_scan_bwd`: grads of q, k, v, f, W, h0, contiguous,
    in the inputs' layouts."""
    q, k, v, f, W, h0, states, grad_y, grad_states = (
        x.contiguous() for x in (q, k, v, f, W, h0, states, grad_y, grad_states))
    b, t, n_heads, dk, dv = _check((q, k, v, f, W, h0, states, grad_y, grad_states), q, v)
    grad_q, grad_k, grad_h0 = torch.empty_like(q), torch.empty_like(k), torch.empty_like(h0)
    grad_f_rows = torch.empty_like(q)  # (b, t, H, dk): grad_f before the sum over rows
    n_blocks = dk // BLOCK_K
    # Per-block partials of the sums over rows, added up below in a fixed order (no atomics):
    # grad_v = k^T dp per token, grad_W = sum over (t, b, rows) of f_t h_{t-1}^T dp_t.
    grad_v_part = q.new_empty(n_blocks, b, t, n_heads, dv)
    grad_w_part = q.new_empty(b, n_heads, n_blocks, dv, dv)
    has_gs = grad_states.numel() > 0  # empty: no gradient reaches the states output (the usual case)
    _bwd_kernel[(b, n_heads, n_blocks)](q, k, v, f, W, h0, states, grad_y, grad_states,
                                        grad_q, grad_k, grad_f_rows, grad_v_part, grad_w_part, grad_h0,
                                        t, n_heads, b, DK=dk, DV=dv, BLOCK=BLOCK_K,
                                        PRECISION=_dot_precision(q.device), HAS_GS=has_gs,
                                        num_warps=_num_warps(dv))
    return grad_q, grad_k, grad_v_part.sum(0), grad_f_rows.sum(-1), grad_w_part.sum((0, 2)), grad_h0


def with_fallback(fast: Callable[..., tuple[Tensor, ...]],
                  reference: Callable[..., tuple[Tensor, ...]]) -> Callable[..., tuple[Tensor, ...]]:
    """`fast` where the kernels support the inputs, else `reference` (float64, odd head sizes, t = 0)."""
    def impl(*args: Tensor) -> tuple[Tensor, ...]:
        q, v = args[0], args[2]
        b, t, _, dk = q.shape
        supported = unsupported_reason(args, dk, v.shape[-1], b, t) is None
        return fast(*args) if supported else reference(*args)

    return impl
