"""Fused Triton kernels for the M2RNN scan: the CUDA implementation of `megacpp::m2rnn_scan_fwd` and
`megacpp::m2rnn_scan_bwd` (see megacpp/ops/m2rnn_scan.py for the recurrence, layouts and the reference).

Rows of the state are independent: h[i, :]_t = tanh(f_t h[i, :]_{t-1} W + k_t[i] v_t), so one program
owns BLOCK_K rows of one (batch row, head) and loops over time with its state tile and W in registers;
one launch per direction instead of a few per token. Each program writes its rows of every state; y (a
sum over rows) goes to per-block partial buffers summed after the launch.

The backward is two launches. The chain kernel carries dL/dh back through time and does nothing else
per step: dp = dL/dp_t (p the pre-activation) to a (t, H, b, dk, dv) buffer, then one product with W^T.
The gradients kernel then reads dp and the states in parallel over (batch row, head, block of steps) and
makes every other gradient, with grad_W's per-program shares summed after the launch. Until 2026-11-24
one kernel did both, and its per-step grad_W product (a wgmma that each step waited for) and row sums
sat on the chain: 10.5 ms against 3.5 + 4.5 ms now at `small`'s sizes on an H200 (BENCHMARKS.md).
No atomics anywhere, so results are deterministic. Everything is fp32; `tl.dot` runs as "tf32x3"
(split-TF32 tensor-core products, fp32-equivalent accuracy) to match the reference's fp32 matmuls at
tensor-core latency (see `_dot_precision`). Each chain step's inputs are loaded during the step before,
so memory latency overlaps the chain, and a states gradient that is absent (training reads y only) is
neither read nor zero-filled.

Supported: float32 tensors, key_dim and value_dim powers of two in [16, 128], t >= 1 and b >= 1
(`unsupported_reason` says why not; `with_fallback` sends such calls to the reference).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.ops import kernel_prewarm

# Rows of the state per program: tl.dot needs at least 16, and the smallest block gives the most
# programs (b * H * dk / 16) and the shortest per-step chain, which is what bounds a sequential scan.
BLOCK_K = 16
_SIZES = (16, 32, 64, 128)
# Steps per program of the backward's gradients kernel: 32 to 256 were within 0.2 ms at `small`'s sizes
# on an H200 (BENCHMARKS.md); fewer programs write fewer grad_W shares.
GRADS_STEPS = 64
# Rows per program of the gradients kernel: the whole state up to 64 rows; beyond, row blocks keep the
# tf32x3 operands of its (rows x dv) tiles within shared memory.
GRADS_ROWS = 64


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
def _bwd_chain_kernel(q_ptr, f_ptr, w_ptr, states_ptr, gy_ptr, gs_ptr, dp_ptr, gh0_ptr, T, H, B,
                      DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                      HAS_GS: tl.constexpr):
    """dL/dh carried back through time for BLOCK rows of one (batch row, head); stores dL/dp_t of
    every step (the gradients kernel reads it) and dL/dh0. Nothing else is on the chain."""
    b, hd, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = kb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, DV)
    tile = rows[:, None] * DV + cols[None, :]
    w_t = tl.load(w_ptr + hd * DV * DV + cols[None, :] * DV + cols[:, None])  # W^T
    carry = tl.zeros((BLOCK, DV), dtype=tl.float32)  # dL/dh_t from later steps
    # Step ti's inputs are loaded during step ti + 1: memory latency overlaps the chain.
    last = tl.cast(T - 1, tl.int64)
    step = (last * H + hd) * B + b  # (t, H, b) index
    tok = (b * T + last) * H + hd  # (b, t, H) index
    h = tl.load(states_ptr + step * DK * DV + tile)
    gs = tl.zeros((BLOCK, DV), dtype=tl.float32)
    if HAS_GS:
        gs = tl.load(gs_ptr + step * DK * DV + tile)
    q, f, gy = tl.load(q_ptr + tok * DK + rows), tl.load(f_ptr + tok), tl.load(gy_ptr + step * DV + cols)
    for i in range(T):
        ti = last - i
        nxt = tl.maximum(ti - 1, 0)
        step_n = (nxt * H + hd) * B + b
        tok_n = (b * T + nxt) * H + hd
        h_n = tl.load(states_ptr + step_n * DK * DV + tile)
        gs_n = gs
        if HAS_GS:
            gs_n = tl.load(gs_ptr + step_n * DK * DV + tile)
        q_n, f_n = tl.load(q_ptr + tok_n * DK + rows), tl.load(f_ptr + tok_n)
        gy_n = tl.load(gy_ptr + step_n * DV + cols)
        if HAS_GS:
            carry += gs
        carry += q[:, None] * gy[None, :]
        dp = carry * (1.0 - h * h)
        tl.store(dp_ptr + step * DK * DV + tile, dp)
        carry = f * tl.dot(dp, w_t, input_precision=PRECISION)
        h, gs, q, f, gy, step = h_n, gs_n, q_n, f_n, gy_n, step_n
    tl.store(gh0_ptr + (hd * B + b) * DK * DV + tile, carry)


@triton.jit
def _bwd_grads_kernel(k_ptr, v_ptr, f_ptr, w_ptr, h0_ptr, states_ptr, gy_ptr, dp_ptr,
                      gq_ptr, gk_ptr, gv_part_ptr, gf_part_ptr, gw_part_ptr, T, H, B,
                      DK: tl.constexpr, DV: tl.constexpr, ROWS: tl.constexpr, STEPS: tl.constexpr,
                      PRECISION: tl.constexpr):
    """Every gradient but dL/dh0 from the stored dL/dp, for ROWS rows and STEPS steps of one (batch row,
    head): no chain, so all (b, H, step block, row block) programs run at once. With G_t = h_{t-1}^T dp_t
    over these rows: grad_W += f_t G_t, grad_f_t = <h_{t-1} W, dp_t> = <W, G_t>, grad_q_t = h_t gy_t,
    grad_k_t = dp_t v_t, grad_v_t = dp_t^T k_t. grad_f and grad_v are partials per row block, grad_W
    per program: summed after the launch."""
    b, hd, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tb, rb = block // (DK // ROWS), block % (DK // ROWS)  # (step block, row block)
    rows, cols = rb * ROWS + tl.arange(0, ROWS), tl.arange(0, DV)
    tile = rows[:, None] * DV + cols[None, :]
    w = tl.load(w_ptr + hd * DV * DV + cols[:, None] * DV + cols[None, :])
    gw = tl.zeros((DV, DV), dtype=tl.float32)
    # This row block's slice of the (b, t, H) grad_f and (b, t, H, dv) grad_v partials.
    gf_part_ptr += tl.cast(rb, tl.int64) * B * T * H
    gv_part_ptr += tl.cast(rb, tl.int64) * B * T * H * DV
    t0 = tb * STEPS
    # The fast path's states and dL/dp may be 16-bit; the upcasts are no-ops on the exact path's fp32.
    if t0 == 0:
        h_prev = tl.load(h0_ptr + (hd * B + b) * DK * DV + tile).to(tl.float32)
    else:
        h_prev = tl.load(states_ptr + ((tl.cast(t0 - 1, tl.int64) * H + hd) * B + b) * DK * DV + tile).to(tl.float32)
    for t in range(t0, tl.minimum(t0 + STEPS, T)):
        ti = tl.cast(t, tl.int64)
        step = (ti * H + hd) * B + b  # (t, H, b) index
        tok = (b * T + ti) * H + hd  # (b, t, H) index
        dp = tl.load(dp_ptr + step * DK * DV + tile).to(tl.float32)
        h = tl.load(states_ptr + step * DK * DV + tile).to(tl.float32)
        k, v = tl.load(k_ptr + tok * DK + rows), tl.load(v_ptr + tok * DV + cols)
        f, gy = tl.load(f_ptr + tok), tl.load(gy_ptr + step * DV + cols)
        g = tl.dot(tl.trans(h_prev), dp, input_precision=PRECISION)
        gw += f * g
        tl.store(gf_part_ptr + tok, tl.sum(tl.sum(w * g, axis=1), axis=0))
        tl.store(gq_ptr + tok * DK + rows, tl.sum(h * gy[None, :], axis=1))
        tl.store(gk_ptr + tok * DK + rows, tl.sum(dp * v[None, :], axis=1))
        tl.store(gv_part_ptr + tok * DV + cols, tl.sum(k[:, None] * dp, axis=0))
        h_prev = h
    program = (b * H + hd) * tl.num_programs(2) + block
    tl.store(gw_part_ptr + program * DV * DV + cols[:, None] * DV + cols[None, :], gw)


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
    # The forward and the backward's chain hold the (dv x dv) W tile in registers and want ~32 fp32
    # values per thread at most: 4 warps up to 64 x 64, 8 beyond. At `small`'s sizes on an H200 the
    # forward took 3.8 ms at 4 warps (2: 4.5, 8: 5.4), the chain 3.5 ms (2: +0.35).
    return 4 if dv * dv <= 4096 else 8


def _grads_tiling(dk: int, dv: int) -> dict[str, int]:
    """Warps and pipeline stages of the backward's gradients kernel, whose (dk x dv) tiles of dp and
    h_{t-1} are staged in shared memory per stage. Up to 64 x 64: 4 warps, 3 stages (8 warps: +3.7 ms,
    1 stage: +0.65 ms at `small`'s sizes); beyond, 8 warps and 1 stage to stay within sm_90's 227 KiB."""
    return {"num_warps": 4, "num_stages": 3} if dk * dv <= 4096 else {"num_warps": 8, "num_stages": 1}


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
    in the inputs' layouts. Two launches: the chain through time, then every other gradient from the
    dL/dp it stored (a (t, H, b, dk, dv) buffer like the states)."""
    q, k, v, f, W, h0, states, grad_y, grad_states = (
        x.contiguous() for x in (q, k, v, f, W, h0, states, grad_y, grad_states))
    b, t, n_heads, dk, dv = _check((q, k, v, f, W, h0, states, grad_y, grad_states), q, v)
    precision = _dot_precision(q.device)
    grad_pre, grad_h0 = torch.empty_like(states), torch.empty_like(h0)
    has_gs = grad_states.numel() > 0  # empty: no gradient reaches the states output (the usual case)
    _bwd_chain_kernel[(b, n_heads, dk // BLOCK_K)](q, f, W, states, grad_y, grad_states, grad_pre, grad_h0,
                                                   t, n_heads, b, DK=dk, DV=dv, BLOCK=BLOCK_K,
                                                   PRECISION=precision, HAS_GS=has_gs,
                                                   num_warps=_num_warps(dv))
    grad_q, grad_k = torch.empty_like(q), torch.empty_like(k)
    rows = min(dk, GRADS_ROWS)
    row_blocks = dk // rows
    grid = (b, n_heads, triton.cdiv(t, GRADS_STEPS) * row_blocks)
    # Partials, added up below in a fixed order (no atomics): grad_v and grad_f per row block, grad_W
    # per program.
    grad_v_part = v.new_empty(row_blocks, *v.shape)
    grad_f_part = f.new_empty(row_blocks, *f.shape)
    grad_w_part = q.new_empty(*grid, dv, dv)
    _bwd_grads_kernel[grid](k, v, f, W, h0, states, grad_y, grad_pre, grad_q, grad_k, grad_v_part, grad_f_part,
                            grad_w_part, t, n_heads, b, DK=dk, DV=dv, ROWS=rows, STEPS=GRADS_STEPS,
                            PRECISION=precision, **_grads_tiling(rows, dv))
    return grad_q, grad_k, grad_v_part.sum(0), grad_f_part.sum(0), grad_w_part.sum((0, 2)), grad_h0


def with_fallback(fast: Callable[..., tuple[Tensor, ...]],
                  reference: Callable[..., tuple[Tensor, ...]]) -> Callable[..., tuple[Tensor, ...]]:
    """`fast` where the kernels support the inputs, else `reference` (float64, odd head sizes, t = 0)."""
    def impl(*args: Tensor) -> tuple[Tensor, ...]:
        q, v = args[0], args[2]
        b, t, _, dk = q.shape
        supported = unsupported_reason(args, dk, v.shape[-1], b, t) is None
        return fast(*args) if supported else reference(*args)

    return impl


# Fixes each kernel's Triton cache key at import, the same in the trainer and in its compile helpers.
kernel_prewarm.pin_cache_keys(globals())
