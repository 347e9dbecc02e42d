"""E block: mixture-of-experts FFN with static-shape dispatch.

Token choice (default): each token picks its top-k experts by sigmoid score plus a per-expert
selection bias (aux-loss-free balancing); the combine weights are the selected *unbiased* scores
normalised to sum 1. Every expert has a fixed capacity per sequence (a power of two computed from the
static sequence length), so shapes follow the input shape and the batch axis may stay dynamic:
assignments past capacity are dropped in token order within their sequence and counted. Rows never
compete for slots, so a row's output does not depend on the rest of the batch.

Expert choice (experimental): each expert picks its top-capacity tokens of each sequence. It looks
at future tokens, so it is not causal and `forward_step` does not reproduce `forward`.

See docs/blocks_moe_m2rnn.md for the design notes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.hints import ParamHint

Routing = Literal["token_choice", "expert_choice"]
ROUTINGS = get_args(Routing)


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    shared_expert: bool = True
    capacity_factor: float = 1.25
    routing: Routing = "token_choice"
    bias_update_rate: float = 1e-3


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
    scores normalised to sum 1 per token."""
    expert_idx = torch.topk(scores + bias, top_k, dim=-1).indices
    picked = scores.gather(-1, expert_idx)
    return expert_idx, picked / picked.sum(dim=-1, keepdim=True)


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


class MoE(nn.Module):
    """Mixture-of-experts FFN mixer (pattern symbol E); relu^2 experts, optional shared expert."""

    param_hints = {
        "gate.weight": ParamHint(optimizer="adamw"),  # the router stays fp32 and off Muon
        "w_up": ParamHint(lr_scaling="match_rms_adamw"),
        "w_down": ParamHint(lr_scaling="match_rms_adamw"),
    }
    # Each rank routes its own tokens; the bias update must see the counts of the whole global batch.
    reduced_buffers = {"tokens_per_expert": "sum", "overflow": "sum"}

    def __init__(self, d_model: int, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        if cfg.routing not in ROUTINGS:
            raise ValueError(f"MoEConfig.routing must be one of {ROUTINGS}, got {cfg.routing!r}")
        if not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(f"MoEConfig.top_k={cfg.top_k} must be in [1, n_experts={cfg.n_experts}]")
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

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """x (b, t, d) -> (b, t, d) in x.dtype. doc_ids is unused: the FFN acts per token."""
        scores = self.router_scores(x)
        if self.cfg.routing == "token_choice":
            y = self._token_choice(x, scores)
        else:
            y = self._expert_choice(x, scores)
        if self.shared_up is not None:
            y = y + self.shared_down(F.relu(self.shared_up(x)).square()).to(y.dtype)
        return y.to(x.dtype)

    def _experts(self, expert_in: Tensor) -> Tensor:
        """(E, C, d) -> (E, C, d): all experts as two batched matmuls."""
        return torch.bmm(F.relu(torch.bmm(expert_in, self.w_up)).square(), self.w_down)

    def _token_choice(self, x: Tensor, scores: Tensor) -> Tensor:
        b, t, d = x.shape
        k, n_exp = self.cfg.top_k, self.cfg.n_experts
        cap = self.capacity(t)
        expert_idx, weights = token_choice_route(scores, self.expert_bias, k)  # (b, t, k)
        dest, keep, counts = dispatch_slots(expert_idx.reshape(b, t * k), n_exp, cap)
        self.tokens_per_expert.copy_(counts)
        self.overflow.copy_((~keep).sum())
        dest = dest.reshape(-1)
        # Destinations are unique except the trash row, so the copy (and its gather backward) is
        # deterministic for every row that is used.
        x_rep = x.unsqueeze(2).expand(b, t, k, d).reshape(b * t * k, d)
        buf = x.new_zeros(n_exp * b * cap + 1, d).index_copy(0, dest, x_rep)
        out = self._experts(buf[:-1].view(n_exp, b * cap, d)).view(n_exp * b * cap, d)
        # Gather per (token, slot), then sum over k in a fixed order: no float scatter-add.
        gathered = out.index_select(0, dest.clamp(max=n_exp * b * cap - 1)).view(b, t, k, d)
        combine = torch.where(keep.view(b, t, k), weights, torch.zeros_like(weights))
        return (gathered.to(combine.dtype) * combine.unsqueeze(-1)).sum(dim=2)

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
        out = self._experts(expert_in).to(gate_w.dtype) * gate_w
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

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """x (b, 1, d): the FFN is stateless, so a step is a forward on one position."""
        return self.forward(x)
