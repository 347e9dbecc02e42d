"""A small stand-in that follows the HybridLM contract, for compile tests and the compile benchmark.

It has what matters to compile: ``model.blocks`` (an ``nn.ModuleList`` of residual blocks with
``kind``, ``norm``, ``mixer``, ``engram``), one mixer class per pattern symbol (A attention with
document masking, M and R pure-PyTorch scans that reset at document starts, E a top-k MoE with static
dense dispatch and routing statistics in non-persistent buffers, F a relu^2 MLP), ``doc_ids``, and a
loss when ``targets`` are given, computed by a ``loss`` method named in ``method_regions`` as the
hybrid's is. Its numerics are not the real mixers'; its compile surface is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _doc_mask(doc_ids: Tensor | None, b: int, t: int, device: torch.device) -> Tensor:
    """(b, t, t) bool: query i may see key j (j <= i, same document)."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    if doc_ids is None:
        return causal.expand(b, t, t)
    return causal & (doc_ids[:, :, None] == doc_ids[:, None, :])


class AttentionMixer(nn.Module):
    def __init__(self, d_model: int, n_heads: int = 2) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        mask = _doc_mask(doc_ids, b, t, x.device)[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class ScanMixer(nn.Module):
    """h_t = a_t * h_{t-1} + u_t per channel, in closed form; reset at document starts (M and R)."""

    def __init__(self, d_model: int, gated_value: bool) -> None:
        super().__init__()
        self.gated_value = gated_value  # R: tanh value (a nonlinear recurrence stand-in)
        self.in_proj = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        u, a = self.in_proj(x).float().chunk(2, dim=-1)
        u = torch.tanh(u) if self.gated_value else u
        log_a = F.logsigmoid(a).cumsum(dim=1)  # accumulate in fp32
        decay = (log_a[:, :, None, :] - log_a[:, None, :, :]).clamp(max=0).exp()  # (b, t_i, t_j, d)
        weights = decay * _doc_mask(doc_ids, b, t, x.device)[..., None]
        h = torch.einsum("bijd,bjd->bid", weights, u)
        return self.out(h.to(x.dtype))


class MoEMixer(nn.Module):
    """Top-k routing, every expert computed densely (static shapes), combine weights in fp32."""

    def __init__(self, d_model: int, n_experts: int = 4, top_k: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(n_experts, d_model, hidden) * d_model**-0.5)
        self.w_out = nn.Parameter(torch.zeros(n_experts, hidden, d_model))
        self.register_buffer("bias", torch.zeros(n_experts), persistent=False)
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts), persistent=False)
        self.register_buffer("overflow", torch.zeros(()), persistent=False)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        logits = self.router(x).float()
        chosen = (logits + self.bias).topk(self.top_k, dim=-1).indices
        gates = torch.zeros_like(logits).scatter(-1, chosen, logits.gather(-1, chosen).softmax(-1))
        with torch.no_grad():
            counts = F.one_hot(chosen, logits.size(-1)).flatten(0, -2).sum(0).float()
            self.tokens_per_expert.copy_(counts)
            capacity = counts.sum() / counts.numel()
            self.overflow.copy_((counts - capacity).clamp(min=0).sum())
        h = F.relu(torch.einsum("btd,edh->bteh", x, self.w_in)).square()
        y = torch.einsum("bteh,ehd->bted", h, self.w_out)
        return (y.float() * gates[..., None]).sum(-2).to(x.dtype)

    @torch.no_grad()
    def update_bias(self, rate: float = 1e-2) -> None:
        """Outside the graph, after the step: push selection away from overloaded experts."""
        self.bias -= rate * torch.sign(self.tokens_per_expert - self.tokens_per_expert.mean())


class FFNMixer(nn.Module):
    def __init__(self, d_model: int, hidden: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        return self.down(F.relu(self.up(x)).square())


def make_mixer(kind: str, d_model: int) -> nn.Module:
    if kind == "A":
        return AttentionMixer(d_model)
    if kind in "MR":
        return ScanMixer(d_model, gated_value=kind == "R")
    if kind == "E":
        return MoEMixer(d_model)
    if kind == "F":
        return FFNMixer(d_model)
    raise ValueError(f"unknown block kind {kind!r}")


class Block(nn.Module):
    def __init__(self, kind: str, d_model: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.RMSNorm(d_model)
        self.mixer = make_mixer(kind, d_model)
        self.engram = None

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        return x + self.mixer(self.norm(x), doc_ids)


class StandInLM(nn.Module):
    method_regions = ("loss",)  # as HybridLM: `blocks` mode compiles the loss head as a region of its own

    def __init__(self, pattern: str = "AMERF", vocab: int = 64, d_model: int = 32) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(vocab, d_model)
        self.ngram_embed = None
        self.blocks = nn.ModuleList(Block(kind, d_model) for kind in pattern)
        self.norm_f = nn.RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.mtp = nn.ModuleList()

    def forward(self, idx: Tensor, targets: Tensor | None = None, doc_ids: Tensor | None = None) -> Tensor:
        x = self.tok_embed(idx)
        for block in self.blocks:
            x = block(x, doc_ids)
        if targets is None:
            return self.lm_head(self.norm_f(x))
        return self.loss(x, targets, doc_ids)

    def loss(self, h: Tensor, targets: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        return F.cross_entropy(self.lm_head(self.norm_f(h)).float().flatten(0, 1), targets.flatten())


def build_standin(pattern: str = "AMERF", vocab: int = 64, d_model: int = 32) -> StandInLM:
    """Model factory (importable as ``tests.compile_fixtures.standin:build_standin``)."""
    return StandInLM(pattern, vocab, d_model)

