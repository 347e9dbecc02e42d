"""M block mixer: Mamba-3 SISO (trapezoidal scan, data-dependent RoPE on B/C), see docs/mamba3.md.

The parameter layout maps one-to-one onto mamba_ssm 2.3.2's `Mamba3` (SISO, is_outproj_norm=False);
`megacpp.model.mamba3_convert` translates state dicts.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.hints import ParamHint
from megacpp.model.mamba3_config import Mamba3Config, num_rope_angles
from megacpp.model.segments import WHOLE_ROWS, Segments
from megacpp.ops.mamba3_angles import document_angles, document_angles_reference
from megacpp.ops.mamba3_fused import biased_heads, mamba3_fused_scan, rotate_pairs
from megacpp.ops.mamba3_scan import State, mamba3_step
from megacpp.rules import (
    check_alone,
)


class _Projected(NamedTuple):
    z: Tensor  # (b, t, h, p), activation dtype
    x: Tensor  # (b, t, h, p), activation dtype
    B: Tensor  # (b, t, g, n) fp32 per group, normed; the per-head bias and rotation come in the scan
    C: Tensor  # (b, t, g, n)
    adt: Tensor  # (b, t, h) fp32
    dt: Tensor  # (b, t, h)
    lam: Tensor  # (b, t, h)
    angles: Tensor  # (b, t, h, n_angles): pi * tanh(theta_s) * dt_s summed over s <= t in t's document


class Mamba3(nn.Module):
    # B/C biases are per-head bias tables: AdamW, and never decayed, like every other bias.
    param_hints = {"B_bias": ParamHint(optimizer="adamw", no_decay=True),
                   "C_bias": ParamHint(optimizer="adamw", no_decay=True)}

    def __init__(self, d_model: int, cfg: Mamba3Config, layer_idx: int) -> None:
        super().__init__()
        check_alone(cfg, d_model=d_model)
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.d_inner = cfg.expand * d_model
        self.n_heads = self.d_inner // cfg.head_dim
        self.n_angles = num_rope_angles(cfg.d_state, cfg.rope_fraction)
        bc = cfg.d_state * cfg.n_groups
        # in_proj rows: [z, x, B, C, dd_dt, dd_A, trap, angles]
        self.split_sizes = (self.d_inner, self.d_inner, bc, bc, self.n_heads, self.n_heads, self.n_heads,
                            self.n_angles)
        self.in_proj = nn.Linear(d_model, sum(self.split_sizes), bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        # B/C are per group but their biases are per head (as in mamba_ssm): the scan adds them per head.
        self.B_bias = nn.Parameter(torch.empty(self.n_heads, cfg.d_state))
        self.C_bias = nn.Parameter(torch.empty(self.n_heads, cfg.d_state))
        self.B_norm = nn.RMSNorm(cfg.d_state, eps=cfg.norm_eps)
        self.C_norm = nn.RMSNorm(cfg.d_state, eps=cfg.norm_eps)
        self.D = nn.Parameter(torch.empty(self.n_heads))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """mamba_ssm's init (default Linear in_proj, log-uniform dt, unit biases/norms/D); out_proj zero."""
        cfg = self.cfg
        self.in_proj.reset_parameters()
        with torch.no_grad():
            log_dt = torch.empty_like(self.dt_bias).uniform_(math.log(cfg.dt_min), math.log(cfg.dt_max))
            dt = log_dt.exp().clamp(min=cfg.dt_init_floor)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            self.B_bias.fill_(1.0)
            self.C_bias.fill_(1.0)
            self.D.fill_(1.0)
        self.B_norm.reset_parameters()
        self.C_norm.reset_parameters()
        nn.init.zeros_(self.out_proj.weight)

    def forward(self, x: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        proj = self._project(x, segments.start_offsets)
        return self.out_proj(self._scan(proj, segments.doc_ids).flatten(2))

    def _scan(self, proj: _Projected, doc_ids: Tensor | None, return_final_state: bool = False
              ) -> Tensor | tuple[Tensor, State]:
        """The fused scan over the projection, with this layer's settings (kernel, chunk, matmul dtype)."""
        matmul_dtype = proj.x.dtype if self.cfg.scan_matmuls == "activation" else None
        return mamba3_fused_scan(
            proj.x, proj.z, proj.B, proj.C, self.B_bias, self.C_bias, proj.angles, proj.adt, proj.dt, proj.lam, self.D,
            doc_ids=doc_ids, chunk_size=self.cfg.chunk_size, return_final_state=return_final_state,
            matmul_dtype=matmul_dtype, kernel=self.cfg.scan_kernel,
        )

    def prefill(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """The prompt x (b, t, d) into a fresh cache in one pass: the forward's chunked scan (its Triton
        kernels where the forward takes them), whose final state gives H, B_prev (the last token's biased,
        rotated B) and x_prev, and the last token's cumulative angle, reduced mod 2 pi as the step keeps it."""
        proj = self._project(x)
        y, (H, B_last, x_last) = self._scan(proj, None, return_final_state=True)
        angle = torch.remainder(proj.angles[:, -1], 2 * math.pi)
        for key, value in (("angle", angle), ("H", H), ("B_prev", B_last), ("x_prev", x_last)):
            cache[key].copy_(value)
        return self.out_proj(y.flatten(2))

    def init_cache(
        self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        """Fixed-size recurrent state (max_len is not needed): angle, H (fp32 or wider), B_prev, x_prev."""
        h, p, n = self.n_heads, self.cfg.head_dim, self.cfg.d_state
        wide = torch.promote_types(dtype, torch.float32)
        return {
            "angle": torch.zeros(batch_size, h, self.n_angles, device=device, dtype=wide),
            "H": torch.zeros(batch_size, h, p, n, device=device, dtype=wide),
            "B_prev": torch.zeros(batch_size, h, n, device=device, dtype=wide),
            "x_prev": torch.zeros(batch_size, h, p, device=device, dtype=dtype),
        }

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        proj = self._project(x)  # one token: its angles are its own step
        angle = torch.remainder(cache["angle"] + proj.angles[:, 0], 2 * math.pi)
        state = (cache["H"], cache["B_prev"], cache["x_prev"])
        B = rotate_pairs(biased_heads(proj.B[:, 0], self.B_bias), angle)
        C = rotate_pairs(biased_heads(proj.C[:, 0], self.C_bias), angle)
        y, (H, B, x_last) = mamba3_step(
            proj.x[:, 0], B, C,
            proj.adt[:, 0], proj.dt[:, 0], proj.lam[:, 0], state, D=self.D, z=proj.z[:, 0],
        )
        for key, value in (("angle", angle), ("H", H), ("B_prev", B), ("x_prev", x_last)):
            cache[key].copy_(value)
        return self.out_proj(y.flatten(1)).unsqueeze(1)

    def _project(self, u: Tensor, start_offsets: Tensor | None = None) -> _Projected:
        """The in_proj split into the scan's inputs; start_offsets (b, t) as `Segments.start_offsets`."""
        b, t, _ = u.shape
        h, p, g, n = self.n_heads, self.cfg.head_dim, self.cfg.n_groups, self.cfg.d_state
        z, x, B, C, dd_dt, dd_A, trap, theta = self.in_proj(u).split(self.split_sizes, dim=-1)
        dt = F.softplus(dd_dt.float() + self.dt_bias)
        A = torch.clamp(-F.softplus(dd_A.float()), max=-self.cfg.A_floor)
        # Before the other uses of dt: autograd adds dt's gradients in reverse order of its uses, and
        # this order keeps the CPU gradients bit for bit those of the tests' pinned formula.
        angles = _angles(math.pi * torch.tanh(theta.float()), dt, start_offsets)
        return _Projected(
            z=z.view(b, t, h, p),
            x=x.view(b, t, h, p),
            B=self.B_norm(B.float().view(b, t, g, n)),
            C=self.C_norm(C.float().view(b, t, g, n)),
            adt=A * dt,
            dt=dt,
            lam=torch.sigmoid(trap.float()),
            angles=angles,
        )


def _angles(rate: Tensor, dt: Tensor, start_offsets: Tensor | None) -> Tensor:
    """Every token's rotation angles (b, t, h, n_angles): rate * dt summed over its document so far.

    On CUDA the fused op (megacpp/ops/mamba3_angles.py: Triton kernels, no (b, t, h, n_angles) step
    tensor, 0.25 against 0.70 ms forward + backward per `small` layer on an H200). Elsewhere its
    reference called as plain torch ops, so autograd and Inductor see the same graph as before the op
    existed and the CPU numerics the tests pin do not move."""
    if rate.is_cuda:
        return document_angles(rate, dt, start_offsets)
    return document_angles_reference(rate, dt, start_offsets)
