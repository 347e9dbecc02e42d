"""MuonClip / QK-clip in weight space, run after the optimizer step.

Attention records per query head h a bound S_h >= max pre-softmax logit (docs/architecture.md,
"Attention hooks for MuonClip"). Scaling the query rows of head h by eta and the key rows of its kv
head g by gamma scales that bound by eta * gamma (RoPE is a rotation inside each head, so it commutes
with the scaling).

GQA rule (r = n_heads / n_kv_heads query heads share kv head g; query head h uses kv head h // r):
    M_g     = max over the group's heads of S_h
    gamma_g = sqrt(min(1, tau / M_g))                   key rows of kv head g
    eta_h   = min(1, tau / (S_h * gamma_g))             query rows of head h
so every head ends at min(S_h * gamma_g, tau) <= tau: the group's largest head gets the symmetric
sqrt(tau / S) on both sides (plain MuonClip when r = 1), other offenders of the group get just enough
query scaling to reach tau. Effect on non-offending heads of an offending group: their query rows are
untouched, but they share the scaled key rows, so their bound drops by gamma_g. Heads of other kv
groups and all value rows are multiplied by exactly 1.0, i.e. bit-for-bit untouched.

Everything is tensor ops (no .item(), no host sync); metrics stay on the device as 0-D tensors.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from megacpp.optim.local import local_tensor, row_range

_ATTENTION_ATTRS = ("logit_bound", "qkv", "n_heads", "n_kv_heads", "head_dim")


def find_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that follow the MuonClip hook contract (duck typing on its attribute names)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in _ATTENTION_ATTRS)]


def qk_clip_scales(bound: Tensor, n_kv_heads: int, tau: float) -> tuple[Tensor, Tensor]:
    """(query-head scales (n_heads,), kv-head scales (n_kv_heads,)) for per-head bounds `bound`."""
    bound = bound.float()
    group_max = bound.view(n_kv_heads, -1).amax(dim=1)
    k_scale = (tau / group_max.clamp_min(1e-30)).clamp(max=1.0).sqrt()
    reach = bound * k_scale.repeat_interleave(bound.numel() // n_kv_heads)
    q_scale = (tau / reach.clamp_min(1e-30)).clamp(max=1.0)
    return q_scale, k_scale


@torch.no_grad()
def clip_attention_(attn: nn.Module, tau: float) -> tuple[Tensor, Tensor]:
    """Rescale one attention module's qkv rows in place; returns (max bound, number of heads over tau)."""
    bound = attn.logit_bound.float()
    q_scale, k_scale = qk_clip_scales(bound, attn.n_kv_heads, tau)
    hd = attn.head_dim
    weight = attn.qkv.weight
    n_qk = (attn.n_heads + attn.n_kv_heads) * hd
    row_scale = torch.cat([
        q_scale.repeat_interleave(hd),
        k_scale.repeat_interleave(hd),
        torch.ones(weight.shape[0] - n_qk, device=weight.device),
    ])
    _scale_rows_(weight, row_scale)
    if attn.qkv.bias is not None:
        _scale_rows_(attn.qkv.bias, row_scale)
    return bound.max(), (bound > tau).sum()


def _scale_rows_(t: Tensor, row_scale: Tensor) -> None:
    """Multiply each dim-0 row of `t` by its scale, on the rows this rank holds when `t` is sharded."""
    start, stop = row_range(t)
    local = local_tensor(t)
    scale = row_scale[start:stop].to(local.dtype)
    local.mul_(scale.view(-1, *([1] * (local.ndim - 1))))


class MuonClip:
    """Post-step QK-clip over every attention module; mode "weight" rescales, "activation" only reports
    (the forward clips activations itself). Metrics of the last `apply()`: max_logit, n_clipped, n_total.
    """

    def __init__(self, modules: list[nn.Module], tau: float = 100.0, mode: str = "weight") -> None:
        if mode not in ("weight", "activation"):
            raise ValueError(f"MuonClip mode {mode!r}; expected 'weight' or 'activation'")
        self.modules = modules
        self.tau = tau
        self.mode = mode
        self.n_total = sum(int(m.n_heads) for m in modules)
        self.metrics: dict[str, Tensor] = {}

    @classmethod
    def for_model(cls, model: nn.Module) -> MuonClip | None:
        """The clip the model's attention asks for: QK-clip is configured on the attention modules
        (``model.attention.qk_clip`` / ``qk_clip_tau``, exposed as ``qk_clip`` / ``qk_clip_tau``), since
        its activation mode and the bound recording live in their forward. None when all are off."""
        modules = [m for m in find_attention_modules(model) if getattr(m, "qk_clip", "off") != "off"]
        if not modules:
            return None
        settings = {(m.qk_clip, float(m.qk_clip_tau)) for m in modules}
        if len(settings) > 1:
            raise ValueError(f"attention modules disagree on QK-clip settings: {sorted(settings)}")
        (mode, tau), = settings
        return cls(modules, tau=tau, mode=mode)

    @torch.no_grad()
    def apply(self) -> dict[str, Tensor]:
        maxima, counts = [], []
        for attn in self.modules:
            if self.mode == "weight":
                m, n = clip_attention_(attn, self.tau)
            else:
                bound = attn.logit_bound.float()
                m, n = bound.max(), (bound > self.tau).sum()
            maxima.append(m)
            counts.append(n)
        if maxima:
            self.metrics = {
                "muon_clip/max_logit": torch.stack(maxima).max(),
                "muon_clip/n_clipped": torch.stack(counts).sum(),
                "muon_clip/n_total": torch.tensor(self.n_total),
            }
        return self.metrics

    def state_dict(self) -> dict[str, Any]:
        return {"metrics": {k: v.detach().clone() for k, v in self.metrics.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.metrics = {k: v.clone() for k, v in state["metrics"].items()}
