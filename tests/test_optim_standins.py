"""Small stand-ins that follow docs/architecture.md's contracts, for the optimizer tests.

TinyAttention follows the MuonClip hook contract (qkv rows [q heads | k heads | v heads], query head h
uses kv head h // (n_heads / n_kv_heads), per-head `logit_bound` written in the forward without a host
sync). TinyHybrid follows the HybridLM surface names and the parameter-hint contract. The tests at the
bottom check the stand-ins themselves.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.hints import ParamHint


class TinyAttention(nn.Module):
    def __init__(self, d_model: int = 32, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 8) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        q_rows, kv_rows = n_heads * head_dim, n_kv_heads * head_dim
        self.qkv = nn.Linear(d_model, q_rows + 2 * kv_rows, bias=False)
        self.param_hints = {"qkv.weight": ParamHint(qkv_split=(q_rows, kv_rows, kv_rows))}
        self.out = nn.Linear(q_rows, d_model, bias=False)
        self.register_buffer("logit_bound", torch.zeros(n_heads), persistent=False)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2, -1)
        r = self.n_heads // self.n_kv_heads
        heads = (b, t, -1, self.head_dim)
        q = q.reshape(heads).transpose(1, 2)
        k = k.reshape(heads).transpose(1, 2).repeat_interleave(r, dim=1)
        v = v.reshape(heads).transpose(1, 2).repeat_interleave(r, dim=1)
        return q, k, v

    def bound(self, x: Tensor) -> Tensor:
        """Per query head max_t |q_t| * max_s |k_s| / sqrt(head_dim), max over the batch (fp32)."""
        q, k, _ = self._qkv(x)
        q_max = q.float().norm(dim=-1).amax(dim=(0, 2))
        k_max = k.float().norm(dim=-1).amax(dim=(0, 2))
        return q_max * k_max / math.sqrt(self.head_dim)

    def max_logit(self, x: Tensor) -> Tensor:
        """Exact per-head max pre-softmax logit over the batch (for checking the bound)."""
        q, k, _ = self._qkv(x)
        return (q @ k.transpose(-1, -2)).amax(dim=(0, 2, 3)) / math.sqrt(self.head_dim)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        self.logit_bound.copy_(self.bound(x).detach())
        q, k, v = self._qkv(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2))


class TinyMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, hidden, bias=False)
        self.fc_out = nn.Linear(hidden, d_model, bias=True)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        return self.fc_out(F.relu(self.fc_in(x)).square())


class TinyMoE(nn.Module):
    """Dense soft mixture over stacked experts (E, A, B); the router gate is tagged for AdamW."""

    def __init__(self, d_model: int, hidden: int, n_experts: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(n_experts, hidden, d_model) / math.sqrt(d_model))
        self.w_down = nn.Parameter(torch.randn(n_experts, d_model, hidden) / math.sqrt(hidden))
        self.param_hints = {"gate.weight": ParamHint(optimizer="adamw"),
                            "w_up": ParamHint(lr_scaling="match_rms_adamw", routed_expert=True),
                            "w_down": ParamHint(lr_scaling="match_rms_adamw", routed_expert=True)}

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        weights = self.gate(x).softmax(-1)  # (b, t, E)
        h = F.relu(torch.einsum("btd,ehd->bteh", x, self.w_up))
        return torch.einsum("bteh,edh,bte->btd", h, self.w_down, weights)


class TinySSM(nn.Module):
    """Gated causal running mean; has a 1-D decay vector and a >= 2-D bias table tagged for AdamW."""

    def __init__(self, d_model: int, d_state: int = 16) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d_model, 2 * d_state, bias=False)
        self.decay = nn.Parameter(torch.zeros(d_state))
        self.bc_bias = nn.Parameter(torch.zeros(2, d_state))
        self.param_hints = {"bc_bias": ParamHint(optimizer="adamw")}
        self.out_proj = nn.Linear(d_state, d_model, bias=False)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        u, g = self.in_proj(x).chunk(2, dim=-1)
        u = u + self.bc_bias[0]
        steps = torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]
        h = u.cumsum(dim=1) / steps * torch.sigmoid(self.decay)
        return self.out_proj(h * torch.sigmoid(g + self.bc_bias[1]))


class Block(nn.Module):
    def __init__(self, kind: str, mixer: nn.Module, d_model: int, engram: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.RMSNorm(d_model)
        self.mixer = mixer
        self.engram = nn.Sequential(nn.Linear(d_model, 8, bias=False), nn.Linear(8, d_model, bias=False)) \
            if engram else None

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mixer(self.norm(x))
        return x + self.engram(x) if self.engram is not None else x


class TinyHybrid(nn.Module):
    """Blocks A, M, E, F; tok_embed, ngram_embed, norm_f, lm_head and one MTP head, as in HybridLM."""

    def __init__(self, vocab: int = 64, d_model: int = 32) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(vocab, d_model)
        self.ngram_embed = nn.Embedding(2 * vocab, d_model)
        self.blocks = nn.ModuleList([
            Block("A", TinyAttention(d_model), d_model),
            Block("M", TinySSM(d_model), d_model, engram=True),
            Block("E", TinyMoE(d_model, 2 * d_model), d_model),
            Block("F", TinyMLP(d_model, 4 * d_model), d_model),
        ])
        self.norm_f = nn.RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.mtp = nn.ModuleList([nn.Linear(d_model, vocab, bias=False)])

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x = self.tok_embed(idx) + self.ngram_embed(idx)
        for block in self.blocks:
            x = block(x)
        x = self.norm_f(x)
        loss = F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())
        mtp = F.cross_entropy(self.mtp[0](x[:, :-1]).flatten(0, 1), targets[:, 1:].flatten())
        return loss + 0.1 * mtp


def batch(vocab: int = 64, b: int = 2, t: int = 12, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(vocab, (b, t + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def test_tier3_attention_bound_is_an_upper_bound() -> None:
    torch.manual_seed(0)
    attn = TinyAttention()
    x = torch.randn(2, 10, 32)
    attn(x)
    assert (attn.max_logit(x) <= attn.logit_bound).all()


def test_tier2_tiny_hybrid_trains_a_step() -> None:
    torch.manual_seed(0)
    model = TinyHybrid()
    idx, tgt = batch()
    model(idx, tgt).backward()
    assert all(p.grad is not None for p in model.parameters())
