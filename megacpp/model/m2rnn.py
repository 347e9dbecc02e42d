"""R block mixer: M2RNN, a matrix-state nonlinear recurrence.

Per head: h_t = tanh(f_t * h_{t-1} @ W + k_t v_t^T), y_t = q_t^T h_t, with decay
f_t = exp(-A * softplus(a_t + dt_bias)). Output: out_proj(silu(gate(x)) * y). q and k are
L2-normalised per head, so k v^T is bounded by |v| and |y| by sqrt(key_dim); tanh bounds the state.
See docs/blocks_moe_m2rnn.md.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.hints import ParamHint
from megacpp.model.m2rnn_config import M2RNNConfig
from megacpp.model.segments import WHOLE_ROWS, Segments
from megacpp.ops.m2rnn_scan import m2rnn_scan, m2rnn_step
from megacpp.rules import check_alone


class M2RNN(nn.Module):
    """M2RNN mixer (pattern symbol R)."""

    def __init__(self, d_model: int, cfg: M2RNNConfig, layer_idx: int) -> None:
        super().__init__()
        check_alone(cfg, d_model=d_model)
        self.d_model = d_model
        self.cfg = cfg
        self.layer_idx = layer_idx
        n_heads, dk, dv = cfg.n_heads, cfg.key_dim, cfg.value_dim
        self.qkv = nn.Linear(d_model, n_heads * (2 * dk + dv), bias=False)
        # a_proj has one row per head: a per-head scalar projection, not a hidden matrix.
        self.a_proj = nn.Linear(d_model, n_heads, bias=False)
        self.param_hints = {
            "qkv.weight": ParamHint(qkv_split=(n_heads * dk, n_heads * dk, n_heads * dv)),
            "a_proj.weight": ParamHint(optimizer="adamw"),
        }
        if cfg.w_spectral_cap > 0:
            self.param_hints["W"] = ParamHint(max_spectral_norm=cfg.w_spectral_cap)
        self.gate = nn.Linear(d_model, n_heads * dv, bias=False)
        self.out_proj = nn.Linear(n_heads * dv, d_model, bias=False)
        self.W = nn.Parameter(torch.empty(n_heads, dv, dv))  # 3-D: Muon treats it as H matrices
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Projections N(0, 1/d_model); out_proj zero; W identity per head (with f < 1 the step
        Jacobian has spectral norm < 1 at init); A uniform in [A_init_min, A_init_max]; dt_bias the
        inverse softplus of a log-uniform dt in [dt_min, dt_max] (a spread of time scales)."""
        cfg = self.cfg
        std = self.d_model**-0.5
        for lin in (self.qkv, self.a_proj, self.gate):
            nn.init.normal_(lin.weight, std=std)
        nn.init.zeros_(self.out_proj.weight)
        self.W.copy_(torch.eye(cfg.value_dim).expand_as(self.W))
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(cfg.A_init_min, cfg.A_init_max).log())
        u = torch.rand_like(self.dt_bias)
        dt = torch.exp(u * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (b, t, d) -> q, k (b, t, H, dk) unit-norm; v (b, t, H, dv); f (b, t, H) in (0, 1]."""
        b, t, _ = x.shape
        n_heads, dk, dv = self.cfg.n_heads, self.cfg.key_dim, self.cfg.value_dim
        q, k, v = self.qkv(x).split([n_heads * dk, n_heads * dk, n_heads * dv], dim=-1)
        acc = torch.promote_types(x.dtype, torch.float32)
        q = F.normalize(q.view(b, t, n_heads, dk).to(acc), dim=-1, eps=1e-6)
        k = F.normalize(k.view(b, t, n_heads, dk).to(acc), dim=-1, eps=1e-6)
        a = self.a_proj(x).to(acc)
        f = torch.exp(-torch.exp(self.A_log.to(acc)) * F.softplus(a + self.dt_bias.to(acc)))
        return q, k, v.reshape(b, t, n_heads, dv), f

    def _output(self, x: Tensor, y: Tensor) -> Tensor:
        """y (b, t, H, dv) -> out_proj(silu(gate(x)) * y) in x.dtype."""
        b, t, _ = x.shape
        gated = F.silu(self.gate(x)).to(y.dtype) * y.reshape(b, t, -1)
        return self.out_proj(gated.to(x.dtype)).to(x.dtype)

    def forward(self, x: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        q, k, v, f = self._project(x)
        y = m2rnn_scan(q, k, v.to(q.dtype), f, self.W, doc_ids=segments.doc_ids)
        return self._output(x, y)

    def prefill(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """The prompt x (b, t, d) into a fresh cache in one pass: the forward's scan, whose last state is
        the cache's (on CUDA in the fast mode the kernels' fp32 last state; the states they keep for a
        backward are fp16, the last one is not)."""
        q, k, v, f = self._project(x)
        y, last = m2rnn_scan(q, k, v.to(q.dtype), f, self.W, return_final_state=True)
        cache["h"].copy_(last)
        return self._output(x, y)

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> dict[str, Tensor]:
        """The state is kept in at least fp32 whatever the activation dtype: it accumulates."""
        cfg = self.cfg
        state_dtype = torch.promote_types(dtype, torch.float32)
        h = torch.zeros(batch_size, cfg.n_heads, cfg.key_dim, cfg.value_dim, device=device, dtype=state_dtype)
        return {"h": h}

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """x (b, 1, d); advances cache["h"] in place."""
        q, k, v, f = self._project(x)
        y, new_state = m2rnn_step(q[:, 0], k[:, 0], v[:, 0].to(q.dtype), f[:, 0], self.W, cache["h"])
        cache["h"].copy_(new_state)
        return self._output(x, y.unsqueeze(1))
