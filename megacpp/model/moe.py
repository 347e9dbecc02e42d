"""E block: mixture-of-experts FFN with static-shape dispatch.

Token choice (default): each token picks its top-k experts by sigmoid score plus a per-expert
selection bias (aux-loss-free balancing); the combine weights are the selected *unbiased* scores
normalised to sum 1. Every expert has a fixed capacity per sequence (a power of two computed from the
static sequence length), so shapes follow the input shape and the batch axis may stay dynamic:
assignments past capacity are dropped in token order within their sequence and counted. Rows never
compete for slots, so a row's output does not depend on the rest of the batch.

Token choice has two dispatches of the routed rows to the experts (``MoEConfig.dispatch``): padded
(above; the reference and the CPU path) and grouped (dropless: the b*t*k routed rows sorted by expert
and run through one grouped GEMM per projection, nothing dropped; the CUDA path under bf16 autocast).
When nothing overflows the padded capacity the two compute the same rows: bitwise where the GEMMs are
exact, otherwise up to their summation order.

Expert choice (experimental): each expert picks its top-capacity tokens of each sequence. It looks
at future tokens, so it is not causal and `forward_step` does not reproduce `forward`.

See docs/blocks_moe_m2rnn.md for the design notes.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.activations import relu_squared
from megacpp.model.hints import ParamHint
from megacpp.model.moe_config import MoEConfig, grouped_dispatch_problem
from megacpp.model.segments import WHOLE_ROWS, Segments
from megacpp.rules import check_alone


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert for a sequence of n_tokens: ceil(capacity_factor * n_tokens * top_k / n_experts)
    rounded up to a power of two (few distinct shapes, hence few compiled graphs), clamped to n_tokens
    (an expert never receives more than one assignment per token)."""
    raw = max(1, math.ceil(capacity_factor * n_tokens * top_k / n_experts))
    return min(1 << (raw - 1).bit_length(), n_tokens)


def token_choice_route(scores: Tensor, bias: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Select top-k experts of (scores + bias) over the last axis; return (expert_idx, weights), both
    shaped like scores with the last axis k.

    The bias changes which experts are selected, never the weights: those are the selected unbiased
    scores normalised to sum 1 per token.

    The picks are top_k rounds of argmax (highest first, as topk sorts them; a tie goes to the lower
    expert) and each picked score is a masked sum over the expert axis, where it is the only non-zero
    term, so exact. Compiled, selection, weights and their backward fuse into the kernels around them:
    torch.topk and the gather's scatter-add backward were four library kernels of their own, and
    topk alone ~75 µs a call at `small` (docs/benchmarks_archive.md, issue 12)."""
    experts = torch.arange(scores.shape[-1], device=scores.device)
    candidates = scores + bias
    picks, picked = [], []
    for _ in range(top_k):
        pick = candidates.argmax(dim=-1, keepdim=True)
        chosen = experts == pick
        picks.append(pick)
        picked.append(torch.where(chosen, scores, 0).sum(dim=-1, keepdim=True))
        candidates = candidates.masked_fill(chosen, -math.inf)
    expert_idx, picked_scores = torch.cat(picks, dim=-1), torch.cat(picked, dim=-1)
    return expert_idx, picked_scores / picked_scores.sum(dim=-1, keepdim=True)


def dispatch_slots(expert_idx: Tensor, n_experts: int, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """Place each assignment of each sequence in its expert's buffer.

    expert_idx (b, m): the m = t*k assignments of a row in (token, slot) order. Within a row they are
    ranked per expert by a cumsum over a one-hot (stable, deterministic); rank >= capacity is dropped.
    The buffer has n_experts*b*capacity + 1 rows laid out (expert, row, slot) so that it views as
    (n_experts, b*capacity, d); its last row is a trash row for dropped assignments.
    Returns dest (b, m), keep (b, m) bool, tokens_per_expert (n_experts,) counted before capacity."""
    b = expert_idx.shape[0]
    one_hot = (expert_idx.unsqueeze(-1) == torch.arange(n_experts, device=expert_idx.device)).long()
    position = one_hot.cumsum(dim=1).gather(2, expert_idx.unsqueeze(-1)).squeeze(-1) - 1
    keep = position < capacity
    row = torch.arange(b, device=expert_idx.device).unsqueeze(1)
    slot = expert_idx * (b * capacity) + row * capacity + position
    dest = torch.where(keep, slot, torch.full_like(slot, n_experts * b * capacity))
    return dest, keep, one_hot.sum(dim=(0, 1))


def batched_experts(expert_in: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """(E, C, d) -> (E, C, d): all experts as two batched matmuls, relu^2 in between."""
    return torch.bmm(relu_squared(torch.bmm(expert_in, w_up)), w_down)


def padded_expert_rows(
    x: Tensor, expert_idx: Tensor, w_up: Tensor, w_down: Tensor, capacity: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Every (token, slot) assignment's expert output through the padded static-capacity buffer.

    x (b, t, d); expert_idx (b, t, k); w_up (E, d, h); w_down (E, h, d). Returns rows (b, t, k, d) (a
    dropped assignment's row holds whatever expert row its clamped index reads: mask it with keep),
    keep (b, t, k) bool and tokens_per_expert (E,) counted before capacity."""
    b, t, k = expert_idx.shape
    d, n_exp = x.shape[-1], w_up.shape[0]
    dest, keep, counts = dispatch_slots(expert_idx.reshape(b, t * k), n_exp, capacity)
    dest = dest.reshape(-1)
    # Destinations are unique except the trash row, so the copy (and its gather backward) is
    # deterministic for every row that is used.
    x_rep = x.unsqueeze(2).expand(b, t, k, d).reshape(b * t * k, d)
    buf = x.new_zeros(n_exp * b * capacity + 1, d).index_copy(0, dest, x_rep)
    out = batched_experts(buf[:-1].view(n_exp, b * capacity, d), w_up, w_down).view(n_exp * b * capacity, d)
    # Gather per (token, slot); the caller sums over k in a fixed order: no float scatter-add.
    rows = out.index_select(0, dest.clamp(max=n_exp * b * capacity - 1)).view(b, t, k, d)
    return rows, keep.view(b, t, k), counts


class _PermuteRows(torch.autograd.Function):
    """rows[i] = x[index[i]] for a permutation `index` whose inverse is `inverse`. The backward is the
    inverse permutation's gather, not the scatter-add autograd derives for a gather: both directions
    are plain gathers (deterministic, no atomics), which Inductor fuses into the passes beside them."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """x[index] along axis 0, differentiable through the inverse permutation `inverse` (index[inverse[j]]
    == j for every j)."""
    return _PermuteRows.apply(x, index, inverse)


def expert_order(routed: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """A stable sort of routed rows by expert, without a sort: (order, position, counts).

    routed (b, m) holds each routed row's expert, b batch rows of m each, flattened row-major. order[j]
    is the routed row at sorted position j (what ``argsort(routed.flatten(), stable=True)`` returns),
    position its inverse (routed row -> sorted position) and counts (n_experts,) the rows per expert.
    A routed row's sorted position is its expert's first position, plus that expert's rows in earlier
    batch rows, plus its rank among that expert's rows in its own: a running count along m per (batch
    row, expert), which Inductor fuses with the one-hot, where a radix sort over the int64 ids is a
    chain of library kernels, each a launch the host pays for (E is host-bound on slower hosts;
    docs/benchmarks_archive.md, issue 12). The count runs along m, not along all b*m rows: one scan per (row,
    expert), in parallel (3.5 µs at `small` on an H200, where one scan over all rows took 88.5)."""
    b, m = routed.shape
    experts = torch.arange(n_experts, device=routed.device)
    one_hot = (routed.unsqueeze(1) == experts.view(1, -1, 1)).int()  # (b, E, m)
    seen = one_hot.cumsum(dim=-1, dtype=torch.int32)  # rows routed to each expert so far in the row
    per_row = seen[..., -1]  # (b, E)
    counts = per_row.sum(dim=0, dtype=torch.int64)
    first = counts.cumsum(dim=0) - counts
    earlier = per_row.cumsum(dim=0, dtype=torch.int32) - per_row  # (b, E): in earlier batch rows
    rank = seen.gather(1, routed.unsqueeze(1)).squeeze(1) - 1 + earlier.gather(1, routed)
    position = (rank.long() + first[routed]).reshape(b * m)
    order = torch.empty_like(position).index_copy_(0, position, torch.arange(b * m, device=routed.device))
    return order, position, counts


def grouped_expert_rows(
    x: Tensor, expert_idx: Tensor, w_up: Tensor, w_down: Tensor, dtype: torch.dtype, weights: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Every (token, slot) assignment's expert output, dropless, as two grouped GEMMs in `dtype`.

    Same arguments and rows as `padded_expert_rows` (nothing is dropped, so no keep mask); rows come
    back in `dtype`. The b*t*k routed rows are put in expert order (`expert_order`, stable: within an
    expert, (row, token, slot) order), each projection is one grouped GEMM over the experts' contiguous row
    ranges, and the rows go back to (token, slot) order. Both moves are gathers by a permutation whose
    backward gathers by the inverse one (`permute_rows`): deterministic, and compiled, each fuses into
    its neighbour (the cast and the k-fold copy of x; the caller's combine), where scattering into
    zeroed buffers cost two extra passes over the routed rows each way. The number of rows is static;
    the group ends (``offs``) are data on the device: routing shifts change no shape and sync nothing.

    weights (b, t, k), when given, are the combine weights, folded into the down projection's input: each
    row comes back as weight * expert output (the hidden row relu(h)^2 * weight is formed in fp32 and
    rounded once to `dtype`), so the caller's combine is a plain sum over k. The weights' gradient is then
    a sum over the hidden row in the pass that already forms relu^2's gradient, and the combine saves no
    rows for its backward (where rows * weights did: their gather and its gradient's reduction over d)."""
    b, t, k = expert_idx.shape
    d, n_exp = x.shape[-1], w_up.shape[0]
    n = b * t * k
    order, position, counts = expert_order(expert_idx.reshape(b, t * k), n_exp)
    offs = counts.cumsum(dim=0).to(torch.int32)
    x_rep = x.to(dtype).unsqueeze(2).expand(b, t, k, d).reshape(n, d)
    x_sorted = permute_rows(x_rep, order, position)
    up = F.grouped_mm(x_sorted, w_up.to(dtype), offs=offs)
    if weights is None:
        hidden = relu_squared(up)
    else:
        weights_sorted = permute_rows(weights.reshape(n, 1), order, position)
        hidden = (relu_squared(up.float()) * weights_sorted).to(dtype)
    out_sorted = F.grouped_mm(hidden, w_down.to(dtype), offs=offs)
    rows = permute_rows(out_sorted, position, order)
    return rows.view(b, t, k, d), counts


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls on x run in: the autocast dtype when autocast is on for x's device, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class MoE(nn.Module):
    """Mixture-of-experts FFN mixer (pattern symbol E); relu^2 experts, optional shared expert."""

    param_hints = {
        "gate.weight": ParamHint(optimizer="adamw"),  # the router stays fp32 and off Muon
        "w_up": ParamHint(lr_scaling="match_rms_adamw", routed_expert=True),
        "w_down": ParamHint(lr_scaling="match_rms_adamw", routed_expert=True),
    }
    # Each rank routes its own tokens; the bias update must see the counts of the whole global batch.
    reduced_buffers = {"tokens_per_expert": "sum", "overflow": "sum"}

    def __init__(self, d_model: int, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        check_alone(cfg, d_model=d_model)
        self.grouped_possible = not grouped_dispatch_problem(d_model, cfg)
        self.d_model = d_model
        self.cfg = cfg
        self.layer_idx = layer_idx
        n_exp, hidden = cfg.n_experts, cfg.expert_hidden
        self.gate = nn.Linear(d_model, n_exp, bias=False)
        self.w_up = nn.Parameter(torch.empty(n_exp, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(n_exp, hidden, d_model))
        self.shared_up = nn.Linear(d_model, hidden, bias=False) if cfg.shared_expert else None
        self.shared_down = nn.Linear(hidden, d_model, bias=False) if cfg.shared_expert else None
        # Selection bias is training state (checkpointed); the statistics are per-forward bookkeeping.
        self.register_buffer("expert_bias", torch.zeros(n_exp))
        self.register_buffer("tokens_per_expert", torch.zeros(n_exp, dtype=torch.long), persistent=False)
        self.register_buffer("overflow", torch.zeros((), dtype=torch.long), persistent=False)
        # Where the routed rows are computed when not here: set from outside (expert parallelism,
        # megacpp.distributed.expert_parallel, installs an exchange with the ranks holding the experts).
        # Called like `padded_expert_rows`, with the grouped dtype (None for the reference) last.
        self.routed_experts: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Gate and up-projections N(0, 1/d_model); down-projections (output) zero; bias zero."""
        std = self.d_model**-0.5
        nn.init.normal_(self.gate.weight, std=std)
        nn.init.normal_(self.w_up, std=std)
        nn.init.zeros_(self.w_down)
        if self.shared_up is not None:
            nn.init.normal_(self.shared_up.weight, std=std)
            nn.init.zeros_(self.shared_down.weight)
        self.expert_bias.zero_()

    def inactive_parameters(self) -> int:
        """Routed-expert parameters a token does not touch (top_k of n_experts are active)."""
        experts = self.w_up.numel() + self.w_down.numel()
        return experts - experts * self.cfg.top_k // self.cfg.n_experts

    def capacity(self, seq_len: int) -> int:
        """Slots per expert per sequence: from the static sequence length, never the batch size, which
        the compile policy marks dynamic."""
        return expert_capacity(seq_len, self.cfg.top_k, self.cfg.n_experts, self.cfg.capacity_factor)

    def router_scores(self, x: Tensor) -> Tensor:
        """Sigmoid gate scores (..., E) in at least fp32 with autocast off: routing decisions must not
        flip on bf16 rounding."""
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return torch.sigmoid(F.linear(x.to(acc), self.gate.weight.to(acc)))

    def forward(self, x: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        """x (b, t, d) -> (b, t, d) in x.dtype. segments is unused: the FFN acts per token."""
        scores = self.router_scores(x)
        if self.cfg.routing == "token_choice":
            y = self._token_choice(x, scores)
        else:
            y = self._expert_choice(x, scores)
        if self.shared_up is not None:
            y = y + self.shared_down(relu_squared(self.shared_up(x))).to(y.dtype)
        return y.to(x.dtype)

    def grouped_dtype(self, x: Tensor) -> torch.dtype | None:
        """The dtype of the grouped dispatch for input x, or None for the padded one.

        auto takes the grouped GEMMs only where they are the fast path: CUDA with bf16 operands (fp32
        operands fall back to a per-expert loop with a host sync)."""
        if self.cfg.dispatch == "padded":
            return None
        if self.cfg.dispatch == "grouped":
            return compute_dtype(x)
        if self.grouped_possible and x.device.type == "cuda" and compute_dtype(x) == torch.bfloat16:
            return torch.bfloat16
        return None

    def _token_choice(self, x: Tensor, scores: Tensor) -> Tensor:
        t, k = x.shape[1], self.cfg.top_k
        expert_idx, weights = token_choice_route(scores, self.expert_bias, k)  # (b, t, k)
        dtype = self.grouped_dtype(x)
        if self.routed_experts is not None:
            rows, keep, counts = self.routed_experts(x, expert_idx, self.w_up, self.w_down, dtype)
            combine = torch.where(keep, weights, torch.zeros_like(weights))
            self.overflow.copy_((~keep).sum())
        elif dtype is None:
            rows, keep, counts = padded_expert_rows(x, expert_idx, self.w_up, self.w_down, self.capacity(t))
            combine = torch.where(keep, weights, torch.zeros_like(weights))
            self.overflow.copy_((~keep).sum())
        else:
            # Dropless, the combine weights folded into the down projection's input: the combine's own
            # backward (the weights' gradient over d, the saved rows' gather) goes, ~0.1 ms of each E layer
            # at `small`; its step ran +0.35% in the median of five alternated pairs and its peak memory is
            # 1 GiB lower (BENCHMARKS.md, V23-V25).
            rows, counts = grouped_expert_rows(x, expert_idx, self.w_up, self.w_down, dtype, weights)
            self.overflow.zero_()
            self.tokens_per_expert.copy_(counts)
            return rows.to(weights.dtype).sum(dim=2)  # over k in a fixed order, in the router's precision
        self.tokens_per_expert.copy_(counts)
        # Weighted sum over k in a fixed order, in the router's precision (at least fp32).
        return (rows.to(combine.dtype) * combine.unsqueeze(-1)).sum(dim=2)

    def _expert_choice(self, x: Tensor, scores: Tensor) -> Tensor:
        b, t, d = x.shape
        n_exp = self.cfg.n_experts
        cap = self.capacity(t)
        top = torch.topk(scores.transpose(1, 2), cap, dim=-1)  # each expert picks within each row
        rows = torch.arange(b, device=x.device).view(b, 1, 1) * t
        token_idx = (top.indices + rows).transpose(0, 1).reshape(n_exp, b * cap)  # flat token ids
        gate_w = top.values.transpose(0, 1).reshape(n_exp, b * cap, 1)
        x_flat = x.reshape(b * t, d)
        flat_idx = token_idx.reshape(-1)
        picks = torch.zeros(b * t, dtype=torch.long, device=x.device).index_add(0, flat_idx, torch.ones_like(flat_idx))
        self.tokens_per_expert.copy_(torch.ones_like(token_idx).sum(dim=1))
        self.overflow.copy_((picks == 0).sum())
        # Per-expert loops: indices are unique within one expert, so gathers, index_adds and their
        # backwards never race on a row, and experts are summed in a fixed order.
        expert_in = torch.stack([x_flat.index_select(0, token_idx[e]) for e in range(n_exp)])
        out = batched_experts(expert_in, self.w_up, self.w_down).to(gate_w.dtype) * gate_w
        y = x_flat.new_zeros(b * t, d, dtype=gate_w.dtype)
        for e in range(n_exp):
            y.index_add_(0, token_idx[e], out[e])
        return y.view(b, t, d)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Aux-loss-free balancing: bias_e += rate * sign(mean_load - load_e), from the last forward's
        tokens_per_expert. Call outside the compiled graph after the optimizer step; under data
        parallelism tokens_per_expert is summed over ranks first (``reduced_buffers``), so every rank
        applies the same update."""
        load = self.tokens_per_expert.float()
        self.expert_bias.add_(torch.sign(load.mean() - load), alpha=self.cfg.bias_update_rate)

    def after_optimizer_step(self) -> None:
        self.update_bias()

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> dict[str, Tensor]:
        return {}

    def prefill(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """x (b, t, d) as t steps would see it: each token a sequence of one (capacity 1: nothing
        overflows, and expert choice cannot look ahead), in one forward over b*t such rows. The same as
        `forward` whenever nothing overflows there. The padded dispatch then runs every expert on every
        token (n_experts / top_k times the routed rows' FLOPs, still one pass); the grouped one only the
        routed rows."""
        b, t, d = x.shape
        return self.forward(x.reshape(b * t, 1, d)).view(b, t, d)

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """x (b, 1, d): the FFN is stateless, so a step is a forward on one position."""
        return self.forward(x)
