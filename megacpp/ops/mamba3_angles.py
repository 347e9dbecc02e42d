"""Mamba-3 rotation angles: the per-document cumulative sum of rate * dt, as one op with a hand-written
backward.

The mixer rotates B and C by angles that accumulate over each document:

    rate  (b, t, A)   pi * tanh(theta_raw), fp32          dt (b, t, h), fp32
    theta[b, t, h, a] = sum over s from the start of t's document to t of rate[b, s, a] * dt[b, s, h]

Written with torch ops this builds the (b, t, h, A) fp32 step rate * dt (100 MB at b16 t2048 h24
A32), scans it along t (Inductor strides by h * A along the scan, or the mixer transposes it so t is
last and back), and autograd's gradient of the document restarts is a scatter-add: several kernels and
~0.5 ms per layer forward + backward on an H200. Here the forward goes from (rate, dt, start_offsets)
straight to theta: each Triton program owns one (batch row, head), forms the step in registers one
block of BT tokens at a time, scans it with restarts at document starts and carries the block's last
row into the next block. No (b, t, h, A) intermediate, no transposed copy. The backward is the same
walk in reverse (a reverse segmented cumsum of dL/dtheta, restarting at document ends) and produces
dL/ddt directly and each head's share of dL/drate, summed over heads afterwards in a fixed order:
gradients by scans and plain sums, no scatter and no atomics, so every result is run-to-run bitwise
identical. At b16 t2048 h24 A32 with 1% document starts on an H200 (profiler, GPU time of a compiled
forward + backward from theta_raw and dt), the torch path it replaced (the step, a cumsum with t moved
last and back, a gather backward) took 0.695 ms, this op 0.247 ms (forward kernel 0.076, backward
kernel 0.131, sum over heads 0.032, tanh 0.007); without documents 0.453 and 0.198 ms.

    document_angles(rate, dt, start_offsets=None) -> theta (b, t, h, A), contiguous

`start_offsets` is `Segments.start_offsets` (b, t) integer: the time index of the first token of each
token's document (a token t starts a document where start_offsets[b, t] == t); None means one document
per row. The custom ops take it as an optional tensor (schema ``Tensor? start_offsets``): torch.library
custom ops accept ``Tensor | None`` arguments (megacpp::mamba3_fused_fwd's ``initial`` is one), so None
travels as None through the ops, their fake and autograd registrations and torch.compile, and the
kernels compile a variant without the restart flags for it.

- `document_angles_reference` / `document_angles_bwd_reference` are the pure-PyTorch implementations
  (CPU, and CUDA inputs the kernels do not take). The mixer's CPU path calls the forward reference
  directly as torch ops (autograd through them): it is the formula the mixer used before this op,
  operation for operation, so CPU results did not change.
- `megacpp::mamba3_document_angles` (forward) and `megacpp::mamba3_document_angles_bwd` (backward) are
  the custom ops: fake implementations and a registered autograd formula, so under torch.compile the
  angles are one opaque node each way, without graph break. When triton imports, the kernels below are
  their CUDA implementation; CUDA inputs they do not support (`unsupported_reason`: not float32 rate
  and dt, non-integer start_offsets, an empty tensor) go to the references.
  `_angles_fwd.set_kernel_enabled("cuda", False)` (and the same for `_angles_bwd`) switches CUDA back
  to the references, e.g. to compare.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megacpp.ops import kernel_prewarm
from megacpp.ops.kernel_prewarm import Launch, run_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton (CPU-only installs): the references serve every device
    triton = None

# Tokens per block of the kernels' walk along t, the largest (BT, padded A) fp32 tile of a program, and
# warps per program. At `small`'s sizes (b16 t2048 h24 A32, 1% document starts) on an H200 (do_bench,
# the kernel alone) the forward took 0.132 ms at BT 64 / 4 warps, 0.088 at 128 / 4 (256 / 4: 0.083,
# 128 / 8: 0.114); the backward 0.234 ms at 64 / 4, 0.151 at 128 / 2 and 0.130 at 256 / 2 (256 / 4:
# 0.198), plus 0.037 ms for the sum over heads. Fewer tokens per block where A is wide keep the tile, and
# so the registers per thread, the same.
FWD_BLOCK_T, FWD_MAX_TILE, FWD_WARPS = 128, 4096, 4
BWD_BLOCK_T, BWD_MAX_TILE, BWD_WARPS = 256, 8192, 2


def _compute_dtype(rate: Tensor, dt: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(rate.dtype, dt.dtype), torch.float32)


def _document_ends(start_offsets: Tensor) -> Tensor:
    """(b, t) int64: the (exclusive) end of each token's document, from where each document starts."""
    b, t = start_offsets.shape
    time = torch.arange(t, device=start_offsets.device)
    starts = torch.where(start_offsets == time, time, t)
    next_start = torch.cat([starts[:, 1:], starts.new_full((b, 1), t)], dim=1)
    return next_start.flip(1).cummin(dim=1).values.flip(1)


def document_angles_reference(rate: Tensor, dt: Tensor, start_offsets: Tensor | None) -> Tensor:
    """theta (b, t, h, A), contiguous, in float32 (float64 for float64 inputs). Builds the (b, t, h, A)
    step and sums it as the mixer did before this op existed: the inclusive cumsum along t minus its
    exclusive value at the document's first token. The mixer's CPU path calls it directly."""
    dtype = _compute_dtype(rate, dt)
    step = rate.to(dtype)[:, :, None, :] * dt.to(dtype)[..., None]
    total = step.cumsum(dim=1)
    if start_offsets is None:
        return total
    before = total - step  # exclusive cumsum: what precedes each token in its row
    index = start_offsets.long()[:, :, None, None].expand_as(step)
    return total - before.gather(1, index)


def document_angles_bwd_reference(
    rate: Tensor, dt: Tensor, start_offsets: Tensor | None, grad: Tensor
) -> tuple[Tensor, Tensor]:
    """(dL/drate (b, t, A), dL/ddt (b, t, h)) for grad = dL/dtheta (b, t, h, A), contiguous, in the compute
    dtype. r[s] = the sum of grad over s .. the last token of s's document (a reverse cumsum minus its
    value past the document's end); dL/drate = sum_h r * dt, dL/ddt = sum_a r * rate."""
    dtype = _compute_dtype(rate, dt)
    rate, dt, grad = rate.to(dtype), dt.to(dtype), grad.to(dtype)
    after = grad.flip(1).cumsum(dim=1).flip(1)  # the sum over u >= s in the row
    if start_offsets is None:
        r = after
    else:
        ends = _document_ends(start_offsets.long())[:, :, None, None].expand_as(grad)
        # A zero row past the row's end: documents that end with the row subtract nothing.
        r = after - torch.cat([after, torch.zeros_like(after[:, :1])], dim=1).gather(1, ends)
    d_rate = (r * dt[..., None]).sum(dim=2)
    d_dt = (r * rate[:, :, None, :]).sum(dim=3)
    return d_rate.contiguous(), d_dt.contiguous()


_angles_fwd = torch.library.custom_op("megacpp::mamba3_document_angles", mutates_args=())(
    document_angles_reference)


@_angles_fwd.register_fake
def _angles_fwd_fake(rate, dt, start_offsets):
    b, t, n_angles = rate.shape
    return rate.new_empty(b, t, dt.shape[2], n_angles, dtype=_compute_dtype(rate, dt))


_angles_bwd = torch.library.custom_op("megacpp::mamba3_document_angles_bwd", mutates_args=())(
    document_angles_bwd_reference)


@_angles_bwd.register_fake
def _angles_bwd_fake(rate, dt, start_offsets, grad):
    dtype = _compute_dtype(rate, dt)
    return rate.new_empty(rate.shape, dtype=dtype), dt.new_empty(dt.shape, dtype=dtype)


def _setup_context(ctx, inputs, output) -> None:
    # Only the inputs: the backward needs rate, dt and the documents, never theta.
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: Tensor):
    rate, dt, start_offsets = ctx.saved_tensors
    # Any strides: the kernel reads them, so an expanded or transposed gradient is not copied.
    d_rate, d_dt = _angles_bwd(rate, dt, start_offsets, grad)
    # Gradients in the inputs' dtypes (the ops compute in at least fp32); document starts get none.
    return d_rate.to(rate.dtype), d_dt.to(dt.dtype), None


_angles_fwd.register_autograd(_backward, setup_context=_setup_context)


def unsupported_reason(
    rate: Tensor, dt: Tensor, start_offsets: Tensor | None, grad: Tensor | None = None
) -> str | None:
    """None when the Triton kernels take these inputs, else why not. Static facts only (dtypes, sizes)."""
    floats = (rate, dt) if grad is None else (rate, dt, grad)
    if any(x.dtype != torch.float32 for x in floats):
        return f"float32 rate, dt and gradient only, got {sorted({str(x.dtype) for x in floats})}"
    if start_offsets is not None and (start_offsets.dtype.is_floating_point or start_offsets.dtype.is_complex
                                      or start_offsets.dtype == torch.bool):
        return f"start_offsets must be an integer tensor, got {start_offsets.dtype}"
    if rate.numel() == 0 or dt.numel() == 0:
        return f"empty input: rate {tuple(rate.shape)}, dt {tuple(dt.shape)}"
    return None


def _block_t(n_angles: int, most: int, max_tile: int) -> int:
    """Tokens per block: `most`, fewer where the (BT, padded A) tile would exceed `max_tile` values."""
    return max(1, min(most, max_tile // triton.next_power_of_2(n_angles)))


if triton is not None:

    @triton.jit
    def _restart_sum(value_a, restart_a, value_b, restart_b):
        # Segmented sum over (value, restart) pairs, a before b: b's segment restarts the sum where b
        # holds a restart; associative, so tl.associative_scan may combine in any tree.
        return tl.where(restart_b != 0, value_b, value_a + value_b), restart_a | restart_b

    @triton.jit
    def _scan_block(x, restart, carry, rows, BT: tl.constexpr, AP: tl.constexpr, HAS_DOCS: tl.constexpr):
        """Inclusive scan of the (BT, AP) tile x along its rows, restarting where `restart` (BT,) is set,
        with `carry` (AP,) (the running sum entering the block) added to the rows before the block's
        first restart: it enters as part of row 0 unless row 0 itself restarts."""
        first = rows[:, None] == 0
        if HAS_DOCS:
            x += tl.where(first & (restart[:, None] == 0), carry[None, :], 0.0)
            flags = tl.broadcast_to(restart[:, None], (BT, AP))
            out, _ = tl.associative_scan((x, flags), 0, _restart_sum)
        else:
            x += tl.where(first, carry[None, :], 0.0)
            out = tl.cumsum(x, 0)
        return out

    @triton.jit
    def _last_row(x, rows, BT: tl.constexpr):
        # Row BT - 1 of x as an (AP,) vector: adding zeros is exact, so this is a copy.
        return tl.sum(tl.where(rows[:, None] == BT - 1, x, 0.0), 0)

    @triton.jit
    def _program(rate_ptr, dt_ptr, so_ptr, H, A, s_rb, s_ra, s_db, s_dh, s_sb, BT: tl.constexpr, AP: tl.constexpr):
        """This program's batch row and head, the block's row and column indices, the column mask, and
        the row-start pointers of rate (b, :, a), dt (b, :, hd) and start_offsets (b, :)."""
        pid = tl.program_id(0)
        b = tl.cast(pid // H, tl.int64)  # products with strides pass int32 at full size
        hd = tl.cast(pid % H, tl.int64)
        cols = tl.arange(0, AP)
        return (b, hd, tl.arange(0, BT), cols, cols < A, rate_ptr + b * s_rb + cols[None, :] * s_ra,
                dt_ptr + b * s_db + hd * s_dh, so_ptr + b * s_sb)

    @triton.jit
    def _fwd_kernel(rate_ptr, dt_ptr, so_ptr, theta_ptr, T, H, A,
                    s_rb, s_rt, s_ra, s_db, s_dt, s_dh, s_sb, s_st,
                    BT: tl.constexpr, AP: tl.constexpr, HAS_DOCS: tl.constexpr):
        """One (batch row, head): theta for every t, walking t in blocks of BT tokens."""
        b, hd, rows, cols, cmask, rate_row, dt_row, so_row = _program(
            rate_ptr, dt_ptr, so_ptr, H, A, s_rb, s_ra, s_db, s_dh, s_sb, BT, AP)
        theta_row = theta_ptr + (b * T * H + hd) * A + cols[None, :]  # theta[b, t, hd, a]: ((b T + t) H + hd) A + a
        carry = tl.zeros((AP,), dtype=tl.float32)
        for t0 in range(0, T, BT):
            time = t0 + rows.to(tl.int64)
            tmask = time < T
            mask = tmask[:, None] & cmask[None, :]
            # Rows past T and columns past A load zeros: they add nothing and are never stored.
            rate = tl.load(rate_row + time[:, None] * s_rt, mask=mask, other=0.0)
            dtv = tl.load(dt_row + time * s_dt, mask=tmask, other=0.0)
            restart = tl.zeros((BT,), dtype=tl.int32)
            if HAS_DOCS:
                so = tl.load(so_row + time * s_st, mask=tmask, other=-1)
                restart = (so == time).to(tl.int32)
            theta = _scan_block(rate * dtv[:, None], restart, carry, rows, BT, AP, HAS_DOCS)
            tl.store(theta_row + time[:, None] * H * A, theta, mask=mask)
            # A partial block is the last one: its carry is never read.
            carry = _last_row(theta, rows, BT)

    @triton.jit
    def _bwd_kernel(rate_ptr, dt_ptr, so_ptr, g_ptr, d_dt_ptr, d_rate_part_ptr, T, H, A, B,
                    s_rb, s_rt, s_ra, s_db, s_dt, s_dh, s_sb, s_st, s_gb, s_gt, s_gh, s_ga,
                    BT: tl.constexpr, AP: tl.constexpr, HAS_DOCS: tl.constexpr):
        """One (batch row, head), walking t blocks from the last: r = the reverse segmented cumsum of g
        (restarting at document ends); stores d_dt[b, t, hd] = sum_a r * rate and this head's share of
        d_rate, r * dt, at d_rate_part[hd, b, t, :]. Row i of a block is token t0 + BT - 1 - i, so the
        reverse sum is a forward scan of the block's rows."""
        b, hd, rows, cols, cmask, rate_row, dt_row, so_row = _program(
            rate_ptr, dt_ptr, so_ptr, H, A, s_rb, s_ra, s_db, s_dh, s_sb, BT, AP)
        g_row = g_ptr + b * s_gb + hd * s_gh + cols[None, :] * s_ga
        d_dt_row = d_dt_ptr + b * T * H + hd  # d_dt[b, t, hd]: (b T + t) H + hd
        part_row = d_rate_part_ptr + (hd * B + b) * T * A + cols[None, :]  # part[hd, b, t, a]
        carry = tl.zeros((AP,), dtype=tl.float32)
        n_blocks = tl.cdiv(T, BT)
        for k in range(n_blocks):
            t0 = tl.cast(n_blocks - 1 - k, tl.int64) * BT
            time = t0 + (BT - 1 - rows).to(tl.int64)
            tmask = time < T
            mask = tmask[:, None] & cmask[None, :]
            g = tl.load(g_row + time[:, None] * s_gt, mask=mask, other=0.0)
            # A document ends at t where t + 1 starts one, or at the row's last token; rows past T (the
            # first rows of the last block, which come first here) are zeros before that end.
            end = (time >= T - 1).to(tl.int32)
            if HAS_DOCS:
                nxt = tl.load(so_row + (time + 1) * s_st, mask=time + 1 < T, other=-1)
                end = end | (nxt == time + 1).to(tl.int32)
            r = _scan_block(g, end, carry, rows, BT, AP, HAS_DOCS)
            carry = _last_row(r, rows, BT)
            rate = tl.load(rate_row + time[:, None] * s_rt, mask=mask, other=0.0)
            dtv = tl.load(dt_row + time * s_dt, mask=tmask, other=0.0)
            tl.store(d_dt_row + time * H, tl.sum(r * rate, 1), mask=tmask)
            tl.store(part_row + time[:, None] * A, r * dtv[:, None], mask=mask)


def _check(rate: Tensor, dt: Tensor, start_offsets: Tensor | None, grad: Tensor | None = None) -> None:
    if triton is None:
        raise RuntimeError("mamba3 angles Triton kernels: triton is not importable")
    reason = unsupported_reason(rate, dt, start_offsets, grad)
    if reason is not None:
        raise ValueError(f"mamba3 angles Triton kernels: {reason}")


def _offsets_args(start_offsets: Tensor | None, like: Tensor) -> tuple[Tensor, int, int]:
    # Without documents the kernels never read start_offsets: any tensor stands in for the pointer.
    if start_offsets is None:
        return like, 0, 0
    return start_offsets, start_offsets.stride(0), start_offsets.stride(1)


def document_angles_triton(
    rate: Tensor, dt: Tensor, start_offsets: Tensor | None, block_t: int | None = None
) -> Tensor:
    """The Triton forward: same contract as `document_angles_reference` for float32 rate and dt (any
    strides); block_t (a power of two) overrides the tokens per block, as the tests do."""
    _check(rate, dt, start_offsets)
    b, t, n_angles = rate.shape
    n_heads = dt.shape[2]
    bt = _block_t(n_angles, FWD_BLOCK_T, FWD_MAX_TILE) if block_t is None else block_t
    theta = rate.new_empty(b, t, n_heads, n_angles)
    so, s_sb, s_st = _offsets_args(start_offsets, rate)
    _fwd_kernel[(b * n_heads,)](rate, dt, so, theta, t, n_heads, n_angles, *rate.stride(), *dt.stride(), s_sb, s_st,
                                BT=bt, AP=triton.next_power_of_2(n_angles), HAS_DOCS=start_offsets is not None,
                                num_warps=FWD_WARPS)
    return theta


def document_angles_bwd_triton(
    rate: Tensor, dt: Tensor, start_offsets: Tensor | None, grad: Tensor, block_t: int | None = None,
    launch: Callable[[Launch], Any] = run_launch,
) -> tuple[Tensor, Tensor]:
    """The Triton backward: same contract as `document_angles_bwd_reference` for float32 inputs. Each head's
    share of dL/drate goes to an (h, b, t, A) buffer, then a sum over its leading dim adds the shares in
    a fixed order (no atomics). `launch` runs the kernel launch (`backward_launches` records it)."""
    _check(rate, dt, start_offsets, grad)
    b, t, n_angles = rate.shape
    n_heads = dt.shape[2]
    bt = _block_t(n_angles, BWD_BLOCK_T, BWD_MAX_TILE) if block_t is None else block_t
    d_dt = dt.new_empty(b, t, n_heads)
    d_rate_part = rate.new_empty(n_heads, b, t, n_angles)
    so, s_sb, s_st = _offsets_args(start_offsets, rate)
    launch(Launch(_bwd_kernel, (b * n_heads,), (
        rate, dt, so, grad, d_dt, d_rate_part, t, n_heads, n_angles, b, *rate.stride(), *dt.stride(), s_sb, s_st,
        *grad.stride()), dict(BT=bt, AP=triton.next_power_of_2(n_angles), HAS_DOCS=start_offsets is not None,
                              num_warps=BWD_WARPS)))
    return d_rate_part.sum(0), d_dt


def backward_launches(rate: Tensor, dt: Tensor, start_offsets: Tensor | None) -> list[Launch]:
    """The launch `document_angles_bwd_triton` makes after a forward on these inputs, described on meta
    tensors with their layouts (what `ops.kernel_prewarm` compiles ahead). The gradient is described
    contiguous, as the compiled graphs hand it over; another layout compiles at its first launch."""
    rate_m, dt_m = kernel_prewarm.meta_like(rate), kernel_prewarm.meta_like(dt)
    offsets_m = None if start_offsets is None else kernel_prewarm.meta_like(start_offsets)
    grad = rate_m.new_empty(*rate.shape[:2], dt.shape[2], rate.shape[2])
    launches: list[Launch] = []
    document_angles_bwd_triton(rate_m, dt_m, offsets_m, grad, launch=launches.append)
    return launches


if triton is not None:

    def _fwd_cuda(rate: Tensor, dt: Tensor, start_offsets: Tensor | None) -> Tensor:
        if unsupported_reason(rate, dt, start_offsets) is not None:
            return document_angles_reference(rate, dt, start_offsets)
        theta = document_angles_triton(rate, dt, start_offsets)
        # The first call of each layout also starts compiling the backward's kernel.
        kernel_prewarm.warm_in_background(("mamba3_document_angles_bwd",), (rate, dt, start_offsets), rate.device,
                                          lambda: backward_launches(rate, dt, start_offsets))
        return theta

    def _bwd_cuda(rate: Tensor, dt: Tensor, start_offsets: Tensor | None, grad: Tensor) -> tuple[Tensor, Tensor]:
        if unsupported_reason(rate, dt, start_offsets, grad) is not None:
            return document_angles_bwd_reference(rate, dt, start_offsets, grad)
        kernel_prewarm.note_helpers("mamba3_document_angles_bwd")  # for the first step's log
        return document_angles_bwd_triton(rate, dt, start_offsets, grad)

    _angles_fwd.register_kernel("cuda")(_fwd_cuda)
    _angles_bwd.register_kernel("cuda")(_bwd_cuda)
    # Fixes each kernel's Triton cache key at import, the same in the trainer and in its compile helpers.
    kernel_prewarm.pin_cache_keys(globals())


def document_angles(rate: Tensor, dt: Tensor, start_offsets: Tensor | None = None) -> Tensor:
    """Cumulative rotation angles per document.

    rate (b, t, A): pi * tanh(theta_raw), float32 (any strides); dt (b, t, h) float32; start_offsets
    (b, t) integer, the time index of the first token of each token's document (`Segments.start_offsets`),
    or None for one document per row. Returns theta (b, t, h, A) float32, contiguous:
    theta[b, t, h, a] = sum over s from t's document start to t of rate[b, s, a] * dt[b, s, h].
    Differentiable in rate and dt (gradients in their dtypes); lower-precision inputs are computed in
    float32, float64 ones in float64 (the reference path). On CUDA float32 inputs the Triton kernels run,
    reading rate and dt through their strides (a slice of the projection is not copied); elsewhere the
    PyTorch reference. Deterministic: the same inputs give bitwise the same theta and gradients."""
    if rate.dim() != 3 or dt.dim() != 3 or rate.shape[:2] != dt.shape[:2]:
        raise ValueError(f"expected rate (b, t, A) and dt (b, t, h), got {tuple(rate.shape)} and {tuple(dt.shape)}")
    if start_offsets is not None and start_offsets.shape != rate.shape[:2]:
        raise ValueError(f"expected start_offsets (b, t) = {tuple(rate.shape[:2])}, got {tuple(start_offsets.shape)}")
    return _angles_fwd(rate, dt, start_offsets)
