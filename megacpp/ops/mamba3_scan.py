"""Mamba-3 SISO scan (trapezoidal rule): chunked parallel form, sequential reference, one-token step.

Recurrence (per head; x_t (p,), B_t, C_t (n,) of the head's group; H_t (p, n)):

    alpha_t = exp(adt_t)    beta_t = (1 - lam_t) * dt_t * alpha_t    gamma_t = lam_t * dt_t
    H_t = alpha_t H_{t-1} + beta_t x_{t-1} B_{t-1}^T + gamma_t x_t B_t^T
    y_t = H_t C_t + D x_t            (times silu(z_t) when z is given)

A document starts at t = 0 (unless an initial state is given, which is always used at t = 0) and
wherever doc_ids[:, t] != doc_ids[:, t-1]; there H_{t-1} and the beta term are dropped.
docs/mamba3.md derives the chunked algorithm used by `mamba3_scan`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# (H (b, h, p, n) in the compute dtype, B_prev (b, g, n), x_prev (b, h, p))
State = tuple[Tensor, Tensor, Tensor]


def doc_boundaries(doc_ids: Tensor) -> Tensor:
    """(b, t) bool: True where a new document starts at t >= 1 (t = 0 is never a boundary)."""
    change = doc_ids[:, 1:] != doc_ids[:, :-1]
    return F.pad(change, (1, 0), value=False)


def mamba3_step(
    x: Tensor,
    B: Tensor,
    C: Tensor,
    adt: Tensor,
    dt: Tensor,
    lam: Tensor,
    state: State,
    D: Tensor | None = None,
    z: Tensor | None = None,
) -> tuple[Tensor, State]:
    """One token. x, z (b, h, p); B, C (b, g, n); adt, dt, lam (b, h). A zero state is a fresh start."""
    H, B_prev, x_prev = state
    cdt = _compute_dtype(x)
    rep = x.shape[1] // B.shape[1]
    alpha = adt.to(cdt).exp()
    dt_c, lam_c = dt.to(cdt), lam.to(cdt)
    beta = (1 - lam_c) * dt_c * alpha
    gamma = lam_c * dt_c
    x_c = x.to(cdt)
    H = (
        alpha[..., None, None] * H.to(cdt)
        + beta[..., None, None] * _outer(x_prev.to(cdt), _heads(B_prev, rep).to(cdt))
        + gamma[..., None, None] * _outer(x_c, _heads(B, rep).to(cdt))
    )
    y = (H * _heads(C, rep).to(cdt)[..., None, :]).sum(-1)  # elementwise: autocast cannot narrow it
    return _skip_and_gate(y, x_c, D, z).to(x.dtype), (H, B, x)


def mamba3_scan_sequential(
    x: Tensor,
    B: Tensor,
    C: Tensor,
    adt: Tensor,
    dt: Tensor,
    lam: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    initial_state: State | None = None,
    doc_ids: Tensor | None = None,
    chunk_size: int = 64,
    return_final_state: bool = False,
    matmul_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, State]:
    """Per-token loop over `mamba3_step`: the reference. chunk_size and matmul_dtype are accepted for
    parity and ignored (the loop always runs in the compute dtype)."""
    state = initial_state if initial_state is not None else _zero_state(x, B)
    starts = doc_boundaries(doc_ids) if doc_ids is not None else None
    ys = []
    for i in range(x.shape[1]):
        if starts is not None:
            state = _reset_rows(state, starts[:, i])
        z_i = None if z is None else z[:, i]
        y, state = mamba3_step(x[:, i], B[:, i], C[:, i], adt[:, i], dt[:, i], lam[:, i], state, D, z_i)
        ys.append(y)
    y = torch.stack(ys, dim=1)
    return (y, state) if return_final_state else y


def mamba3_scan(
    x: Tensor,
    B: Tensor,
    C: Tensor,
    adt: Tensor,
    dt: Tensor,
    lam: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    initial_state: State | None = None,
    doc_ids: Tensor | None = None,
    chunk_size: int = 64,
    return_final_state: bool = False,
    matmul_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, State]:
    """Chunked parallel scan; same semantics as `mamba3_scan_sequential`, traceable with fullgraph=True.

    matmul_dtype (default: the compute dtype, fp32) is the operand dtype of the four large
    contractions (C·B scores, scores·x, chunk states, state readout). bf16 roughly halves their cost and
    memory traffic on GPUs; products still accumulate in fp32 and decays, exponentials, the
    inter-chunk state passing and the final state stay in the compute dtype.
    """
    cdt = _compute_dtype(x)
    rep = x.shape[2] // B.shape[2]
    x_c, B_c, C_c = x.to(cdt), B.to(cdt), C.to(cdt)
    log_decay, gamma, beta_tilde = _coefficients(adt, dt, lam, doc_ids, cdt)
    # beta_{t+1} / alpha_{t+1} joins token t's key weight; the diagonal then over-counts it by exactly that.
    beta_next = F.pad(beta_tilde[:, 1:], (0, 0, 0, 1))
    init = _augmented_initial_state(initial_state, beta_tilde[:, 0], rep, cdt)
    with torch.autocast(x.device.type, enabled=False):  # operand dtypes are chosen here, not by autocast
        y, H = _chunked_ssd(x_c, B_c, C_c, log_decay, gamma + beta_next, init, chunk_size, matmul_dtype or cdt)
    diag = _heads((C_c * B_c).sum(-1, keepdim=True), rep)
    y = y - (beta_next[..., None] * diag) * x_c
    y = _skip_and_gate(y, x_c, D, z).to(x.dtype)
    return (y, (H, B[:, -1], x[:, -1])) if return_final_state else y


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _heads(v: Tensor, rep: int) -> Tensor:
    """(..., g, n) -> (..., g * rep, n): head i reads group i // rep."""
    return v if rep == 1 else v.repeat_interleave(rep, dim=-2)


def _outer(x: Tensor, b: Tensor) -> Tensor:
    return x[..., :, None] * b[..., None, :]


def _skip_and_gate(y: Tensor, x: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * x
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def _zero_state(x: Tensor, B: Tensor) -> State:
    b, _, h, p = x.shape
    n = B.shape[-1]
    H = x.new_zeros(b, h, p, n, dtype=_compute_dtype(x))
    return H, B.new_zeros(b, B.shape[2], n), x.new_zeros(b, h, p)


def _reset_rows(state: State, start: Tensor) -> State:
    """Zero the whole state of the rows where a document starts (drops H_{t-1} and the beta term)."""
    return tuple(torch.where(start.view(-1, *([1] * (s.dim() - 1))), torch.zeros_like(s), s) for s in state)


def _coefficients(
    adt: Tensor, dt: Tensor, lam: Tensor, doc_ids: Tensor | None, cdt: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """log-decay (-inf at document starts), gamma = lam*dt, beta/alpha = (1-lam)*dt (0 at starts).

    alpha = 0 already removes beta = (1-lam)*dt*alpha; zeroing beta/alpha too keeps the chunked form's
    diagonal correction from cancelling a term that is not there (exact zeros, zero gradients).
    """
    adt, dt, lam = adt.to(cdt), dt.to(cdt), lam.to(cdt)
    beta_tilde = (1 - lam) * dt
    if doc_ids is not None:
        start = doc_boundaries(doc_ids)[..., None]
        adt = adt.masked_fill(start, float("-inf"))
        beta_tilde = beta_tilde.masked_fill(start, 0.0)
    return adt, lam * dt, beta_tilde


def _augmented_initial_state(
    initial_state: State | None, beta_tilde0: Tensor, rep: int, cdt: torch.dtype
) -> Tensor | None:
    """H_{-1} + beta_0/alpha_0 x_prev B_prev^T: the state the chunked form decays into token 0."""
    if initial_state is None:
        return None
    H, B_prev, x_prev = initial_state
    kv = _outer(x_prev.to(cdt), _heads(B_prev, rep).to(cdt))
    return H.to(cdt) + beta_tilde0[..., None, None] * kv


def _segsum(a: Tensor) -> Tensor:
    """(..., L) -> (..., L, L): out[..., i, j] = sum_{j < k <= i} a_k, -inf for j > i.

    Built by a masked cumsum rather than cumsum differences so -inf log-decays never meet -inf - -inf.
    """
    L = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, L)
    ones = torch.ones(L, L, dtype=torch.bool, device=a.device)
    out = rows.masked_fill(~ones.tril(-1), 0.0).cumsum(dim=-2)
    return out.masked_fill(ones.triu(1), float("-inf"))


def _pad_time(v: Tensor, pad: int) -> Tensor:
    """Zero-pad dim 1; padded tokens have zero key weight and zero log-decay, so they change nothing."""
    return F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) if pad else v


def _chunked_ssd(
    x: Tensor, B: Tensor, C: Tensor, log_decay: Tensor, key_weight: Tensor, init: Tensor | None, L: int,
    mm: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """S_t = exp(log_decay_t) S_{t-1} + key_weight_t x_t B_t^T, y_t = S_t C_t, by chunks of L tokens.

    Shapes: x (b,t,h,p), B, C (b,t,g,n), log_decay, key_weight (b,t,h), init (b,h,p,n) or None.
    Returns y (b,t,h,p) and the state after the last token (b,h,p,n), in x's dtype (the compute dtype).
    `mm` is the operand dtype of the four large contractions; with mm == x.dtype every cast is a no-op.
    """
    cdt = x.dtype
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g
    pad = (-t) % L
    nc = (t + pad) // L
    x, B, C, log_decay, key_weight = (_pad_time(v, pad) for v in (x, B, C, log_decay, key_weight))
    x = x.view(b, nc, L, g, r, p)
    B = B.view(b, nc, L, g, n)
    C = C.view(b, nc, L, g, n)
    a = log_decay.view(b, nc, L, g, r).permute(0, 3, 4, 1, 2)  # (b, g, r, c, L)
    w = key_weight.view(b, nc, L, g, r).permute(0, 3, 4, 1, 2)

    decay = _segsum(a).exp()  # (b, g, r, c, L, L)
    C_mm, B_mm = C.to(mm), B.to(mm)
    scores = torch.einsum("bclgn,bcsgn->bgcls", C_mm, B_mm).to(cdt)[:, :, None] * decay * w[..., None, :]
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", scores.to(mm), x.to(mm)).to(cdt)

    # Two-operand contractions only: with three, opt_einsum picks a path from the concrete sizes and
    # Dynamo guards on them (the batch axis included), recompiling for every new batch size.
    to_end = decay[..., -1, :] * w  # decay from each token to its chunk's end
    x_to_end = x * to_end.permute(0, 3, 4, 1, 2)[..., None]  # (b, c, s, g, r, p)
    states = torch.einsum("bcsgrp,bcsgn->bcgrpn", x_to_end.to(mm), B_mm).to(cdt)
    start = x.new_zeros(b, h, p, n) if init is None else init
    states = torch.cat([start.view(b, 1, g, r, p, n), states], dim=1)
    chunk_decay = _segsum(F.pad(a.sum(-1), (1, 0))).exp()  # (b, g, r, c+1, c+1)
    states = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states)

    from_start = a.cumsum(-1).exp()  # decay from the chunk's entering state to each token
    y_state = torch.einsum("bclgn,bcgrpn->bclgrp", C_mm, states[:, :-1].to(mm)).to(cdt)
    y = y + y_state * from_start.permute(0, 3, 4, 1, 2)[..., None]
    return y.reshape(b, nc * L, h, p)[:, :t], states[:, -1].reshape(b, h, p, n)
