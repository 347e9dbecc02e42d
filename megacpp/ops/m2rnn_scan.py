"""M2RNN recurrence: sequential scan and single decode step.

Per batch row and head, with matrix state h (key_dim x value_dim):

    h_t = tanh(f_t * h_{t-1} @ W + k_t v_t^T)        y_t = q_t^T h_t   (value_dim)

f_t in (0, 1] is the per-head decay, W (value_dim x value_dim) a per-head matrix. The recurrence is
nonlinear, so there is no parallel form: the scan loops over time. The loop lives inside an opaque
custom op (`megacpp::m2rnn_scan_fwd`) with a hand-written backward through time
(`megacpp::m2rnn_scan_bwd`): under torch.compile the scan is one graph node, so compile time does not
grow with the sequence length (an unrolled Python loop of 64 steps took minutes to lower with Inductor
on CPU), and there is no graph break. Everything runs in at least fp32 with autocast off; y is
returned in v's dtype, states in the compute dtype.

Shapes: q, k (b, t, H, dk); v (b, t, H, dv); f (b, t, H); W (H, dv, dv); state (b, H, dk, dv);
doc_ids (b, t) integer.

Two op pairs, one per determinism mode; `m2rnn_scan` picks one while it is traced:
- exact, `megacpp::m2rnn_scan_fwd` / `_bwd`: fp32 throughout, every state kept in fp32. Bitwise mode
  (torch.are_deterministic_algorithms_enabled()), every CPU call and every shape the kernels do not
  serve take it. When triton imports, fused kernels (megacpp/ops/m2rnn_triton.py: one launch per
  direction, time loop on chip, products as three TF32 passes) are its CUDA implementation.
- fast, `megacpp::m2rnn_scan_fast_fwd` / `_bwd`: CUDA in the default (fast) mode. One tensor-core pass
  per product (fp16/bf16 operands or TF32, `FastScan.half_dot`), tanh.approx, the states saved in fp16
  (`FastScan.half_states`); megacpp/ops/m2rnn_triton_fast.py. Its reference is the exact reference
  with the states rounded to their storage dtype: the kernels differ from it by operand rounding only.
The mode is read while tracing: Dynamo guards compiled graphs on it (a global-state guard), so a
graph traced in one mode is never replayed in the other. CUDA inputs the kernels do not support (not
float32, key/value dims not a power of two in [16, 128], empty) fall back to the references;
`_scan_fwd.set_kernel_enabled("cuda", False)` (and the same for the other ops) switches CUDA back to
the reference, e.g. to compare.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megacpp.ops import kernel_prewarm

try:
    from megacpp.ops import m2rnn_triton, m2rnn_triton_fast
except ImportError:  # no triton (CPU-only installs): the reference serves every device
    m2rnn_triton = m2rnn_triton_fast = None


@dataclass(frozen=True)
class FastScan:
    """The fast path's precision: fp16 (forward) / bf16 (backward) tensor-core operands instead of TF32,
    and the states saved for the backward in fp16 instead of fp32. Both are one rounding of unit
    roundoff 2^-11 per operand (bf16's 2^-8 in the backward's products); the tests bound the effect."""

    half_dot: bool = True
    half_states: bool = True


# What `m2rnn_scan` runs in fast mode on CUDA; benchmarks/bench_m2rnn.py times the alternatives.
FAST_SCAN = FastScan()
# Head sizes the Triton kernels take (m2rnn_triton.unsupported_reason).
KERNEL_SIZES = (16, 32, 64, 128)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _keep_mask(doc_ids: Tensor) -> Tensor:
    """(b, t) bool: False where a new document starts at t >= 1 (state reset), else True. Position 0
    keeps the initial state: a caller passes initial_state only when position 0 continues its document."""
    same = doc_ids[:, 1:] == doc_ids[:, :-1]
    first = torch.ones_like(doc_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, same], dim=1)


# The ops take the callers' layout, q, k (b, t, H, dk); v (b, t, H, dv); f (b, t, H), plus W (H, dv, dv)
# and h0 (H, b, dk, dv), and work time-major, heads-first inside: a state (H, b, dk, dv) views as
# (H, b*dk, dv), so one bmm per step applies W without expanding it over the batch. Keeping the layout
# changes inside the opaque op means no permute's backward feeds an elementwise backward outside it
# (torch's fake strides for such a chain can disagree with the real ones under AOTAutograd). They
# return y (t, H, b, dv) and every state (t, H, b, dk, dv): the backward needs them (tanh' = 1 - h^2).


def _time_major(q: Tensor, k: Tensor, v: Tensor, f: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*(x.permute(1, 2, 0, 3).contiguous() for x in (q, k, v)), f.permute(1, 2, 0).contiguous())


def _scan_fwd_reference(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    qs, ks, vs, fs = _time_major(q, k, v, f)
    t, n_heads, b, dk = qs.shape
    dv = vs.shape[-1]
    states = qs.new_empty(t, n_heads, b, dk, dv)
    pre = qs.new_empty(n_heads, b, dk, dv)  # reused every step: no per-step allocation
    h = h0
    for i in range(t):
        torch.bmm(h.reshape(n_heads, b * dk, dv), W, out=pre.view(n_heads, b * dk, dv))
        pre.mul_(fs[i][..., None, None]).addcmul_(ks[i].unsqueeze(-1), vs[i].unsqueeze(-2))
        h = torch.tanh(pre, out=states[i])
    y = torch.einsum("thbk,thbkv->thbv", qs, states)
    return y, states


_scan_fwd = torch.library.custom_op("megacpp::m2rnn_scan_fwd", mutates_args=())(_scan_fwd_reference)


@_scan_fwd.register_fake
def _scan_fwd_fake(q, k, v, f, W, h0):
    b, t, n_heads, dk = q.shape
    dv = v.shape[-1]
    return q.new_empty(t, n_heads, b, dv), q.new_empty(t, n_heads, b, dk, dv)


def _scan_bwd_reference(
    q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, h0: Tensor, states: Tensor,
    grad_y: Tensor, grad_states: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward through time. With p_t = f_t h_{t-1} W + k_t v_t^T and h_t = tanh(p_t):
    dL/dp_t = (dL/dh_t) (1 - h_t^2), dL/dh_{t-1} = f_t dL/dp_t W^T; the rest follows from dL/dp_t."""
    qs, ks, vs, fs = _time_major(q, k, v, f)
    t, n_heads, b, dk = qs.shape
    dv = vs.shape[-1]
    grad_pre = torch.empty_like(states)  # dL/dp_t for every t
    carry = h0.new_zeros(n_heads, b, dk, dv)  # dL/dh_t from later steps; reused every step
    w_t = W.transpose(1, 2)
    has_grad_states = grad_states.numel() > 0  # empty: nothing reached the states output
    for i in range(t - 1, -1, -1):
        if has_grad_states:
            carry.add_(grad_states[i])
        carry.addcmul_(qs[i].unsqueeze(-1), grad_y[i].unsqueeze(-2))
        dp = torch.mul(carry, 1 - states[i].square(), out=grad_pre[i])
        torch.bmm(dp.view(n_heads, b * dk, dv), w_t, out=carry.view(n_heads, b * dk, dv))
        carry.mul_(fs[i][..., None, None])
    prev = torch.cat([h0.unsqueeze(0), states[:-1]])  # h_{t-1} for every t
    prev_w = torch.einsum("thbkv,hvw->thbkw", prev, W)
    grad_f = (grad_pre * prev_w).sum(dim=(-2, -1))
    grad_w = torch.einsum("thbkv,thbkw->hvw", prev * fs[..., None, None], grad_pre)
    grad_k = torch.einsum("thbkv,thbv->thbk", grad_pre, vs)
    grad_v = torch.einsum("thbkv,thbk->thbv", grad_pre, ks)
    grad_q = torch.einsum("thbkv,thbv->thbk", states, grad_y)
    # Back to the callers' layout, contiguous as the fake promises (empty_like): a real output whose
    # strides differ from its fake's breaks the views AOTAutograd plans around it.
    grad_q, grad_k, grad_v = (g.permute(2, 0, 1, 3).contiguous() for g in (grad_q, grad_k, grad_v))
    return grad_q, grad_k, grad_v, grad_f.permute(2, 0, 1).contiguous(), grad_w.contiguous(), carry.contiguous()


_scan_bwd = torch.library.custom_op("megacpp::m2rnn_scan_bwd", mutates_args=())(_scan_bwd_reference)


@_scan_bwd.register_fake
def _scan_bwd_fake(q, k, v, f, W, h0, states, grad_y, grad_states):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(f),
            torch.empty_like(W), torch.empty_like(h0))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, output[1])
    # Training reads y only: an unmaterialised (None) states gradient saves a zero-filled tensor the
    # size of every state (3.2 GB per layer on `small`) and the kernel's reads of it.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y: Tensor | None, grad_states: Tensor | None):
    saved = ctx.saved_tensors
    states = saved[-1]
    if grad_y is None:
        grad_y = states.new_zeros(states.shape[:-2] + states.shape[-1:])
    # An empty tensor stands for "no states gradient": the op's signature stays all-tensor.
    grad_states = states.new_empty(0) if grad_states is None else grad_states.contiguous()
    return _scan_bwd(*saved, grad_y.contiguous(), grad_states)


_scan_fwd.register_autograd(_backward, setup_context=_setup_context)



def _storage_dtype(compute: torch.dtype, half_states: bool) -> torch.dtype:
    return torch.float16 if half_states else compute


def _scan_fast_fwd_reference(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, h0: Tensor, half_dot: bool,
                             half_states: bool) -> tuple[Tensor, Tensor, Tensor]:
    """y (t, H, b, dv), the last state (H, b, dk, dv), and h0 then every state (t + 1, H, b, dk, dv) in
    their storage dtype (fp16 when half_states), which the backward reads. half_dot picks the kernels'
    operand precision; here the products keep the inputs' precision."""
    y, states = _scan_fwd_reference(q, k, v, f, W, h0)
    kept = torch.cat([h0.unsqueeze(0), states]).to(_storage_dtype(states.dtype, half_states))
    return y, states[-1].clone(), kept


_scan_fast_fwd = torch.library.custom_op("megacpp::m2rnn_scan_fast_fwd", mutates_args=())(_scan_fast_fwd_reference)


@_scan_fast_fwd.register_fake
def _scan_fast_fwd_fake(q, k, v, f, W, h0, half_dot, half_states):
    b, t, n_heads, dk = q.shape
    dv = v.shape[-1]
    return (q.new_empty(t, n_heads, b, dv), torch.empty_like(h0),
            q.new_empty(t + 1, n_heads, b, dk, dv, dtype=_storage_dtype(q.dtype, half_states)))


def _scan_fast_bwd_reference(
    q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, states: Tensor, grad_y: Tensor, grad_last: Tensor,
    half_dot: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Grads of q, k, v, f, W and h0 from the stored states (upcast), as the exact backward computes
    them. An empty grad_last means no gradient reached the last state."""
    states = states.to(q.dtype)
    grad_states = grad_last.new_empty(0)
    if grad_last.numel() > 0:
        grad_states = torch.zeros_like(states[1:])
        grad_states[-1] = grad_last
    return _scan_bwd_reference(q, k, v, f, W, states[0], states[1:], grad_y, grad_states)


_scan_fast_bwd = torch.library.custom_op("megacpp::m2rnn_scan_fast_bwd", mutates_args=())(_scan_fast_bwd_reference)


@_scan_fast_bwd.register_fake
def _scan_fast_bwd_fake(q, k, v, f, W, states, grad_y, grad_last, half_dot):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(f),
            torch.empty_like(W), q.new_empty(states.shape[1:]))


def _fast_setup_context(ctx, inputs, output) -> None:
    q, k, v, f, W, _h0, half_dot, _half_states = inputs
    ctx.save_for_backward(q, k, v, f, W, output[2])
    ctx.half_dot = half_dot
    ctx.mark_non_differentiable(output[2])  # saved for the backward only; m2rnn_scan never returns it
    ctx.set_materialize_grads(False)


def _fast_backward(ctx, grad_y: Tensor | None, grad_last: Tensor | None, _grad_states: None):
    q, k, v, f, W, states = ctx.saved_tensors
    if grad_y is None:
        grad_y = q.new_zeros(states.shape[0] - 1, *states.shape[1:-2], states.shape[-1])
    grad_last = q.new_empty(0) if grad_last is None else grad_last.contiguous()
    return (*_scan_fast_bwd(q, k, v, f, W, states, grad_y.contiguous(), grad_last, ctx.half_dot), None, None)


_scan_fast_fwd.register_autograd(_fast_backward, setup_context=_fast_setup_context)


def _scan_fwd_fast_and_warm(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, h0: Tensor, half_dot: bool,
                            half_states: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The fast forward; its first call of each layout also starts compiling the backward's kernels."""
    out = m2rnn_triton_fast.scan_fwd_fast(q, k, v, f, W, h0, half_dot, half_states)
    m2rnn_triton_fast.warm_backward(q, k, v, f, W, half_dot, half_states)
    return out


def _scan_bwd_fast_noting_helper(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, states: Tensor,
                                 grad_y: Tensor, grad_last: Tensor, half_dot: bool,
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fast backward; its first call notes whether the helper compiling its kernels was done."""
    kernel_prewarm.note_helpers("m2rnn_scan_fast_bwd")
    return m2rnn_triton_fast.scan_bwd_fast(q, k, v, f, W, states, grad_y, grad_last, half_dot)


if m2rnn_triton is not None:
    # The references serve the CUDA inputs the kernels do not support (see m2rnn_triton.unsupported_reason).
    _scan_fwd.register_kernel("cuda")(m2rnn_triton.with_fallback(m2rnn_triton.scan_fwd_triton, _scan_fwd_reference))
    _scan_bwd.register_kernel("cuda")(m2rnn_triton.with_fallback(m2rnn_triton.scan_bwd_triton, _scan_bwd_reference))
    _scan_fast_fwd.register_kernel("cuda")(
        m2rnn_triton_fast.with_fallback(_scan_fwd_fast_and_warm, _scan_fast_fwd_reference))
    _scan_fast_bwd.register_kernel("cuda")(
        m2rnn_triton_fast.with_fallback(_scan_bwd_fast_noting_helper, _scan_fast_bwd_reference))


def uses_fast_scan(device_type: str, dtype: torch.dtype, dk: int, dv: int) -> bool:
    """Whether `m2rnn_scan` takes the fast op: CUDA, fast mode (bitwise mode keeps the exact path), float32
    compute and head sizes the kernels take. Evaluated while tracing, on static properties and the
    deterministic-algorithms flag, which Dynamo guards."""
    return (m2rnn_triton_fast is not None and device_type == "cuda" and dtype == torch.float32
            and dk in KERNEL_SIZES and dv in KERNEL_SIZES and not torch.are_deterministic_algorithms_enabled())


def m2rnn_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f: Tensor,
    W: Tensor,
    initial_state: Tensor | None = None,
    doc_ids: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sequential scan. Returns y (b, t, H, dv), and the final state (b, H, dk, dv) when
    return_final_state. Where doc_ids changes between t-1 and t the previous state is treated as 0."""
    b, _, n_heads, dk = q.shape
    dv = v.shape[-1]
    acc, out_dtype = _compute_dtype(v), v.dtype
    with torch.autocast(device_type=q.device.type, enabled=False):
        if doc_ids is not None:
            f = f * _keep_mask(doc_ids).to(f.dtype).unsqueeze(-1)  # f = 0 forgets the previous state
        if initial_state is None:
            h0 = q.new_zeros(n_heads, b, dk, dv, dtype=acc)
        else:
            h0 = initial_state.to(acc).transpose(0, 1).contiguous()
        q, k, v, f = (x.to(acc).contiguous() for x in (q, k, v, f))
        if uses_fast_scan(q.device.type, acc, dk, dv):
            y, last, _ = _scan_fast_fwd(q, k, v, f, W.to(acc).contiguous(), h0, FAST_SCAN.half_dot,
                                        FAST_SCAN.half_states)
        else:
            y, states = _scan_fwd(q, k, v, f, W.to(acc).contiguous(), h0)
            last = states[-1]
    y = y.permute(2, 0, 1, 3).to(out_dtype)  # (t, H, b, dv) -> (b, t, H, dv)
    if return_final_state:
        return y, last.transpose(0, 1)
    return y


def m2rnn_step(q: Tensor, k: Tensor, v: Tensor, f: Tensor, W: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One decode step. q, k (b, H, dk); v (b, H, dv); f (b, H); state (b, H, dk, dv).
    Returns y (b, H, dv) in v's dtype and the new state (b, H, dk, dv) in the compute dtype."""
    acc = _compute_dtype(v)
    with torch.autocast(device_type=q.device.type, enabled=False):
        hw = torch.matmul(state.to(acc), W.to(acc))
        outer = k.to(acc).unsqueeze(-1) * v.to(acc).unsqueeze(-2)
        new_state = torch.tanh(torch.addcmul(outer, f.to(acc)[..., None, None], hw))
        y = torch.matmul(q.to(acc).unsqueeze(-2), new_state).squeeze(-2)
    return y.to(v.dtype), new_state
