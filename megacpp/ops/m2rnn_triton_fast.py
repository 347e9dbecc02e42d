"""The M2RNN scan's fast path on CUDA: `megacpp::m2rnn_scan_fast_fwd` / `_bwd` (megacpp/ops/m2rnn_scan.py
has the recurrence, the layouts and the reference). The exact kernels (megacpp/ops/m2rnn_triton.py) stay
bitwise mode's path.

What makes it fast, against the exact kernels' 1.8 us per forward step at `small`'s sizes (H200):
- each step's (rows x dv) @ (dv x dv) product is one tensor-core pass with fp32 accumulation: fp16
  operands in the forward (|h| < 1 and W near the unit sphere fit fp16's range; its unit roundoff
  2^-11 equals TF32's at twice TF32's rate), bf16 in the backward (dL/dp has no bounded range), or
  single-pass "tf32" on fp32 operands (`half_dot=False`). The exact kernels run three TF32 passes;
- tanh is one `tanh.approx.f32` (one special-function op where the exact formula has an exp and a
  division, relative error <= 2^-10.99) on GPUs that have it;
- the states saved for the backward can be fp16 (`half_states`): half the bytes of the forward's
  stores and the backward's reads (1.6 instead of 3.2 GB per R layer at `small`), rounded as the
  forward's fp16 dot operand already was;
- each program holds one (batch row, head, `block` state rows) tile and, at 1 warp per 16 rows, the
  product's output is the next step's operand in the same registers (no exchange between warps); the
  inputs of the next `stages - 1` steps are copied in asynchronously while a step computes;
- the backward can be one kernel (`fused_backward`): the chain through time also makes every
  gradient, so no dL/dp buffer is written and nothing is read twice; or the exact path's structure
  (chain, then a gradients kernel over a dL/dp buffer, bf16 with `half_dot`).

The states buffer has t + 1 slots: slot 0 holds h0 (as stored), slot s the state after step s, so the
backward reads h_{t-1} and h_t uniformly. Everything is deterministic: partial sums are written per
program and added up after the launch in a fixed order, no atomics.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from megacpp.ops import kernel_prewarm
from megacpp.ops import m2rnn_triton as exact
from megacpp.ops.kernel_prewarm import Launch, run_launch


@dataclass
class FastTuning:
    """Launch settings of the fast kernels. They change the speed, and the order of the sums over
    state rows (y, grad_v, grad_f) and programs (grad_W), never the per-element arithmetic.
    benchmarks/bench_m2rnn.py times the alternatives."""

    # State rows per program: tl.dot's minimum, the most programs (b * H * dk / 16 = 384 at `small`, on
    # 132 SMs x 4 schedulers) and the shortest step.
    block: int = 16
    # 1 warp: the product's output is the next step's operand in the same registers (no exchange through
    # shared memory). At `small`'s sizes for sm_90 (ptxas): 128 registers, 416 instructions per step
    # (4 warps: 168 each and 6 barriers).
    fwd_warps: int = 1
    # The fused backward holds grad_W's (dv x dv) fp32 tile: at 64 x 64 it spills at 1 warp (484 bytes)
    # and 2 (60), fits at 4 (128 registers); the split backward's chain fits 1 warp (133 registers).
    bwd_warps: int = 4
    # The fused backward at dv <= NARROW_DV (`small`'s and `nam52`'s width, 16): the 16 x 16 tiles fit one
    # warp, whose reductions over rows and columns then need no exchange between warps. At `small`'s R
    # sizes on an H200: 1.36 ms against 1.92 at 4 warps (1.42 at 2), and the step +1.6% (BENCHMARKS.md, R4, V27).
    narrow_bwd_warps: int = 1
    stages: int = 3  # the next two steps' inputs are in flight during a step (software pipelining)
    fused_backward: bool = True  # one backward kernel, no dL/dp buffer (dv <= FUSED_MAX_DV)
    approx_tanh: bool = True  # `tanh.approx.f32` on CUDA (sm_75+); the formula elsewhere


TUNING = FastTuning()
# The widest value dimension that takes `narrow_bwd_warps` (the width it was measured at).
NARROW_DV = 16
# The fused backward keeps a (dv x dv) fp32 grad_W tile per program; at dv 128 it spills even at 4 warps
# (sm_90: 32 bytes), so wider heads take the split backward.
FUSED_MAX_DV = 64


@triton.jit
def _act(x, APPROX: tl.constexpr):
    if APPROX:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return exact._tanh(x)


@triton.jit
def _tf32(x):
    """x rounded to TF32 as the tensor cores' operand conversion does (10-bit mantissa, to nearest, ties
    away from zero: cvt.rna.tf32.f32), returned as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _mma(a, b, acc, OPERAND: tl.constexpr, EMULATE: tl.constexpr):
    """acc + a @ b, one tensor-core pass with fp32 accumulation: OPERAND is the operands' type (tl.float16,
    tl.bfloat16, or tl.float32 for single-pass TF32). EMULATE, for Triton's CPU interpreter (which ignores
    TF32 and multiplies bf16 bit patterns as integers), rounds the operands alike and multiplies in fp32;
    16-bit and TF32 products are exact in fp32, so only the order of the additions can differ."""
    if EMULATE:
        if OPERAND == tl.float32:
            a, b = _tf32(a), _tf32(b)
        else:
            a, b = a.to(OPERAND).to(tl.float32), b.to(OPERAND).to(tl.float32)
        return tl.dot(a, b, acc, input_precision="ieee")
    elif OPERAND == tl.float32:
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a.to(OPERAND), b.to(OPERAND), acc)


@triton.jit
def _fast_fwd_kernel(q_ptr, k_ptr, v_ptr, f_ptr, w_ptr, h0_ptr, y_part_ptr, last_ptr, states_ptr, T, H, B,
                     DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, OPERAND: tl.constexpr,
                     APPROX: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr):
    b, hd, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = kb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, DV)
    tile = rows[:, None] * DV + cols[None, :]
    w = tl.load(w_ptr + hd * DV * DV + cols[:, None] * DV + cols[None, :]).to(OPERAND)  # rounded once
    zero = tl.zeros((BLOCK, DV), dtype=tl.float32)
    head_row = hd * B + b  # (H, b) index
    h = tl.load(h0_ptr + head_row * DK * DV + tile)
    # The loop carries the state as the next product's operand: with fp16 states and operands, the
    # rounding for the store is the operand's (the sm_90 loop has one fp32 -> fp16 conversion, not two).
    h_op = h.to(OPERAND)
    tl.store(states_ptr + head_row * DK * DV + tile, h.to(states_ptr.dtype.element_ty))  # slot 0: h0
    slots = H * B
    for i in tl.range(T, num_stages=STAGES):
        ti = tl.cast(i, tl.int64)  # states hold (t + 1) * H * b * dk * dv elements: past int32 at full size
        tok = (b * T + ti) * H + hd  # (b, t, H) index of the inputs
        f, k = tl.load(f_ptr + tok), tl.load(k_ptr + tok * DK + rows)
        v, q = tl.load(v_ptr + tok * DV + cols), tl.load(q_ptr + tok * DK + rows)
        h = _act(f * _mma(h_op, w, zero, OPERAND, EMULATE) + k[:, None] * v[None, :], APPROX)
        h_op = h.to(OPERAND)
        step = ti * slots + head_row  # (t, H, b) index of the outputs
        tl.store(states_ptr + (step + slots) * DK * DV + tile, h.to(states_ptr.dtype.element_ty))
        tl.store(y_part_ptr + (kb * T * slots + step) * DV + cols, tl.sum(q[:, None] * h, axis=0))
    tl.store(last_ptr + head_row * DK * DV + tile, h)


@triton.jit
def _fast_chain_kernel(q_ptr, f_ptr, w_ptr, states_ptr, gy_ptr, gl_ptr, dp_ptr, gh0_ptr, T, H, B,
                       DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, OPERAND: tl.constexpr,
                       HAS_GL: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr):
    """The split backward's chain: dL/dh carried back through time; dL/dp of every step to dp_ptr (in its
    dtype) for the gradients kernel, and dL/dh0."""
    b, hd, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = kb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, DV)
    tile = rows[:, None] * DV + cols[None, :]
    w_t = tl.load(w_ptr + hd * DV * DV + cols[None, :] * DV + cols[:, None]).to(OPERAND)  # W^T
    zero = tl.zeros((BLOCK, DV), dtype=tl.float32)
    head_row = hd * B + b
    carry = tl.zeros((BLOCK, DV), dtype=tl.float32)  # dL/dh_t from later steps
    if HAS_GL:
        carry = tl.load(gl_ptr + head_row * DK * DV + tile)  # the final state's gradient
    slots = H * B
    for i in tl.range(T, num_stages=STAGES):
        ti = tl.cast(T - 1 - i, tl.int64)
        step = ti * slots + head_row  # (t, H, b) index
        tok = (b * T + ti) * H + hd  # (b, t, H) index
        h = tl.load(states_ptr + (step + slots) * DK * DV + tile).to(tl.float32)
        q, f, gy = tl.load(q_ptr + tok * DK + rows), tl.load(f_ptr + tok), tl.load(gy_ptr + step * DV + cols)
        carry += q[:, None] * gy[None, :]
        dp = carry * (1.0 - h * h)
        tl.store(dp_ptr + step * DK * DV + tile, dp.to(dp_ptr.dtype.element_ty))
        carry = f * _mma(dp, w_t, zero, OPERAND, EMULATE)
    tl.store(gh0_ptr + head_row * DK * DV + tile, carry)


@triton.jit
def _fused_bwd_kernel(q_ptr, k_ptr, v_ptr, f_ptr, w_ptr, states_ptr, gy_ptr, gl_ptr,
                      gq_ptr, gk_ptr, gv_part_ptr, gf_part_ptr, gw_part_ptr, gh0_ptr, T, H, B,
                      DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, OPERAND: tl.constexpr,
                      HAS_GL: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr):
    """The whole backward in one pass back through time, for BLOCK rows of one (batch row, head). Per step,
    with dp = dL/dp_t and g = dp W^T: dL/dh_{t-1} = f_t g, grad_f_t = <h_{t-1}, g>, grad_W += f_t
    h_{t-1}^T dp, grad_q_t = h_t gy_t, grad_k_t = dp v_t, grad_v_t = dp^T k_t. grad_v and grad_f are
    partials per row block, grad_W per program: summed after the launch. Only g feeds the next step;
    the rest is off the chain."""
    b, hd, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = kb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, DV)
    tile = rows[:, None] * DV + cols[None, :]
    w_t = tl.load(w_ptr + hd * DV * DV + cols[None, :] * DV + cols[:, None]).to(OPERAND)  # W^T
    zero = tl.zeros((BLOCK, DV), dtype=tl.float32)
    head_row = hd * B + b
    carry = tl.zeros((BLOCK, DV), dtype=tl.float32)
    if HAS_GL:
        carry = tl.load(gl_ptr + head_row * DK * DV + tile)
    gw = tl.zeros((DV, DV), dtype=tl.float32)
    # This row block's slice of the (b, t, H) grad_f and (b, t, H, dv) grad_v partials.
    gf_part_ptr += tl.cast(kb, tl.int64) * B * T * H
    gv_part_ptr += tl.cast(kb, tl.int64) * B * T * H * DV
    slots = H * B
    h = tl.load(states_ptr + (tl.cast(T, tl.int64) * slots + head_row) * DK * DV + tile).to(tl.float32)
    for i in tl.range(T, num_stages=STAGES):
        ti = tl.cast(T - 1 - i, tl.int64)
        step = ti * slots + head_row  # (t, H, b) index; slot step + slots holds h_t, slot step h_{t-1}
        tok = (b * T + ti) * H + hd  # (b, t, H) index
        h_prev = tl.load(states_ptr + step * DK * DV + tile).to(tl.float32)
        q, k, f = tl.load(q_ptr + tok * DK + rows), tl.load(k_ptr + tok * DK + rows), tl.load(f_ptr + tok)
        v, gy = tl.load(v_ptr + tok * DV + cols), tl.load(gy_ptr + step * DV + cols)
        carry += q[:, None] * gy[None, :]
        tl.store(gq_ptr + tok * DK + rows, tl.sum(h * gy[None, :], axis=1))
        dp = carry * (1.0 - h * h)
        g = _mma(dp, w_t, zero, OPERAND, EMULATE)
        gw = _mma(tl.trans(f * h_prev), dp, gw, OPERAND, EMULATE)
        tl.store(gk_ptr + tok * DK + rows, tl.sum(dp * v[None, :], axis=1))
        tl.store(gv_part_ptr + tok * DV + cols, tl.sum(k[:, None] * dp, axis=0))
        tl.store(gf_part_ptr + tok, tl.sum(tl.sum(h_prev * g, axis=1), axis=0))
        carry = f * g
        h = h_prev
    tl.store(gh0_ptr + head_row * DK * DV + tile, carry)
    program = (b * H + hd) * tl.num_programs(2) + kb
    tl.store(gw_part_ptr + program * DV * DV + cols[:, None] * DV + cols[None, :], gw)


def _check(q: Tensor, v: Tensor, tensors: tuple[Tensor, ...]) -> tuple[int, int, int, int, int]:
    b, t, n_heads, dk = q.shape
    dv = v.shape[-1]
    reason = exact.unsupported_reason(tensors, dk, dv, b, t)
    if reason is not None:
        raise ValueError(f"m2rnn fast Triton scan: {reason}")
    return b, t, n_heads, dk, dv


def _approx_tanh(device: torch.device) -> bool:
    """tanh.approx.f32 exists from sm_75; Triton's CPU interpreter cannot run inline PTX."""
    return TUNING.approx_tanh and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (7, 5)


def _emulate(device: torch.device) -> bool:
    """CPU tensors reach the kernels only under Triton's interpreter (see `_mma`); meta tensors only describe
    CUDA launches (`backward_launches`)."""
    return device.type not in ("cuda", "meta")


def _block(dk: int) -> int:
    return min(TUNING.block, dk)


def _warps(tuned: int, dv: int) -> int:
    """At dv 128 the (dv x dv) W tile and the state's rows need 4 warps: at fewer the forward spills (sm_90,
    24 bytes at 1 warp, 264 in TF32 at 2)."""
    return max(tuned, 4) if dv > 64 else tuned


def scan_fwd_fast(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, h0: Tensor,
                  half_dot: bool, half_states: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as the reference `megacpp::m2rnn_scan_fast_fwd`: y (t, H, b, dv) fp32, the last
    state (H, b, dk, dv) fp32, and the states (t + 1, H, b, dk, dv), fp16 when half_states."""
    q, k, v, f, W, h0 = (x.contiguous() for x in (q, k, v, f, W, h0))
    b, t, n_heads, dk, dv = _check(q, v, (q, k, v, f, W, h0))
    block = _block(dk)
    y_part = q.new_empty(dk // block, t, n_heads, b, dv)
    last = torch.empty_like(h0)
    states = q.new_empty(t + 1, n_heads, b, dk, dv, dtype=torch.float16 if half_states else torch.float32)
    _fast_fwd_kernel[(b, n_heads, dk // block)](
        q, k, v, f, W, h0, y_part, last, states, t, n_heads, b, DK=dk, DV=dv, BLOCK=block,
        OPERAND=tl.float16 if half_dot else tl.float32, APPROX=_approx_tanh(q.device), STAGES=TUNING.stages,
        EMULATE=_emulate(q.device), num_warps=_warps(TUNING.fwd_warps, dv))
    return y_part.sum(0), last, states


def scan_bwd_fast(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, states: Tensor, grad_y: Tensor,
                  grad_last: Tensor, half_dot: bool, launch: Callable[[Launch], Any] = run_launch,
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Same contract as the reference `megacpp::m2rnn_scan_fast_bwd`: grads of q, k, v, f, W and h0, fp32,
    contiguous, in the inputs' layouts. An empty grad_last means no gradient reached the last state.
    `launch` runs each kernel launch (`backward_launches` passes one that records them)."""
    q, k, v, f, W, states, grad_y, grad_last = (
        x.contiguous() for x in (q, k, v, f, W, states, grad_y, grad_last))
    b, t, n_heads, dk, dv = _check(q, v, (q, k, v, f, W, grad_y, grad_last))
    block = _block(dk)
    grid = (b, n_heads, dk // block)
    grad_h0 = q.new_empty(n_heads, b, dk, dv)
    has_gl = grad_last.numel() > 0
    # bf16 operands in the backward: dL/dp's range is not bounded like the states'.
    operand = tl.bfloat16 if half_dot else tl.float32
    meta = {"DK": dk, "DV": dv, "BLOCK": block, "OPERAND": operand, "HAS_GL": has_gl, "STAGES": TUNING.stages,
            "EMULATE": _emulate(q.device), "num_warps": _warps(TUNING.bwd_warps, dv)}
    if TUNING.fused_backward and dv <= FUSED_MAX_DV:
        if dv <= NARROW_DV:
            meta["num_warps"] = TUNING.narrow_bwd_warps
        grad_q, grad_k = torch.empty_like(q), torch.empty_like(k)
        grad_v_part = v.new_empty(grid[2], *v.shape)
        grad_f_part = f.new_empty(grid[2], *f.shape)
        grad_w_part = q.new_empty(*grid, dv, dv)
        launch(Launch(_fused_bwd_kernel, grid, (
            q, k, v, f, W, states, grad_y, grad_last, grad_q, grad_k, grad_v_part, grad_f_part, grad_w_part, grad_h0,
            t, n_heads, b), meta))
        return grad_q, grad_k, grad_v_part.sum(0), grad_f_part.sum(0), grad_w_part.sum((0, 2)), grad_h0
    # The split backward: dL/dp as the chain's product takes it (bf16 operands: half the buffer's bytes).
    grad_pre = q.new_empty(t, n_heads, b, dk, dv, dtype=torch.bfloat16 if half_dot else torch.float32)
    launch(Launch(_fast_chain_kernel, grid, (q, f, W, states, grad_y, grad_last, grad_pre, grad_h0, t, n_heads, b),
                  meta))
    grad_q, grad_k = torch.empty_like(q), torch.empty_like(k)
    rows = min(dk, exact.GRADS_ROWS)
    row_blocks = dk // rows
    grads_grid = (b, n_heads, triton.cdiv(t, exact.GRADS_STEPS) * row_blocks)
    grad_v_part = v.new_empty(row_blocks, *v.shape)
    grad_f_part = f.new_empty(row_blocks, *f.shape)
    grad_w_part = q.new_empty(*grads_grid, dv, dv)
    # 16-bit states and dL/dp are exact in TF32: one pass adds no operand rounding. On the CPU interpreter
    # "tf32" is an fp32 product, which is the same here.
    launch(Launch(exact._bwd_grads_kernel, grads_grid, (
        k, v, f, W, states[0], states[1:], grad_y, grad_pre, grad_q, grad_k, grad_v_part, grad_f_part, grad_w_part,
        t, n_heads, b), dict(DK=dk, DV=dv, ROWS=rows, STEPS=exact.GRADS_STEPS, PRECISION="tf32",
                             **exact._grads_tiling(rows, dv))))
    return grad_q, grad_k, grad_v_part.sum(0), grad_f_part.sum(0), grad_w_part.sum((0, 2)), grad_h0


def backward_launches(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, half_dot: bool, half_states: bool,
                      ) -> list[Launch]:
    """The launches `scan_bwd_fast` makes after a `scan_fwd_fast` on these inputs, described on meta tensors
    (what `ops.kernel_prewarm` compiles ahead): the backward's inputs are contiguous and follow from the
    forward's sizes and dtypes. Both variants are described, with and without a gradient of the last state
    (whether one arrives is the caller's graph's business)."""
    b, t, n_heads, dk = q.shape
    dv = v.shape[-1]
    q, k, v, f, W = (torch.empty(x.shape, dtype=x.dtype, device="meta") for x in (q, k, v, f, W))
    states = q.new_empty(t + 1, n_heads, b, dk, dv, dtype=torch.float16 if half_states else q.dtype)
    grad_y = q.new_empty(t, n_heads, b, dv)
    launches: list[Launch] = []
    scan_bwd_fast(q, k, v, f, W, states, grad_y, q.new_empty(0), half_dot, launch=launches.append)
    with_last: list[Launch] = []
    scan_bwd_fast(q, k, v, f, W, states, grad_y, q.new_empty(n_heads, b, dk, dv), half_dot, launch=with_last.append)
    return launches + [launch for launch in with_last if launch.meta.get("HAS_GL")]


def warm_backward(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, half_dot: bool, half_states: bool) -> None:
    """At a forward: have a helper compile this layout's backward kernels (`ops.kernel_prewarm`)."""
    kernel_prewarm.warm_in_background(("m2rnn_scan_fast_bwd", half_dot, half_states), (q, k, v, f, W), q.device,
                                      lambda: backward_launches(q, k, v, f, W, half_dot, half_states))


def with_fallback(fast: Callable[..., tuple[Tensor, ...]],
                  reference: Callable[..., tuple[Tensor, ...]]) -> Callable[..., tuple[Tensor, ...]]:
    """`fast` where the kernels support q, k, v, f and W (the rest follow their dtype), else `reference`."""
    def impl(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, *rest: Tensor | bool) -> tuple[Tensor, ...]:
        b, t, _, dk = q.shape
        supported = exact.unsupported_reason((q, k, v, f, W), dk, v.shape[-1], b, t) is None
        return (fast if supported else reference)(q, k, v, f, W, *rest)

    return impl


# Fixes each kernel's Triton cache key at import, the same in the trainer and in its compile helpers.
kernel_prewarm.pin_cache_keys(globals())
