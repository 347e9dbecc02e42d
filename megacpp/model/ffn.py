"""F block mixer: dense feed-forward, relu^2 (default) or SwiGLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.activations import relu_squared
from megacpp.model.ffn_config import FFNConfig
from megacpp.model.segments import WHOLE_ROWS, Segments
from megacpp.rules import check_alone


class FFN(nn.Module):
    """Position-wise MLP. SwiGLU keeps its gate as a separate matrix (not fused into ``up``) so
    Muon orthogonalizes gate and up independently."""

    def __init__(self, d_model: int, cfg: FFNConfig, layer_idx: int) -> None:
        super().__init__()
        check_alone(cfg, d_model=d_model)
        self.cfg, self.layer_idx, self.d_model = cfg, layer_idx, d_model
        self.up = nn.Linear(d_model, cfg.hidden, bias=False)
        self.gate = nn.Linear(d_model, cfg.hidden, bias=False) if cfg.activation == "swiglu" else None
        self.down = nn.Linear(cfg.hidden, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """up (and gate) ~ N(0, 1/d_model); down = 0 so the block starts as identity."""
        nn.init.normal_(self.up.weight, std=self.d_model**-0.5)
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, std=self.d_model**-0.5)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        """x (b, t, d) -> (b, t, d) in x.dtype; segments is unused: the MLP acts per token."""
        if self.gate is None:
            hidden = relu_squared(self.up(x))
        else:
            hidden = F.silu(self.gate(x)) * self.up(x)
        return self.down(hidden).to(x.dtype)

    def init_cache(
        self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        return {}

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        return self.forward(x)

    def prefill(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """Stateless: the prompt's forward."""
        return self.forward(x)
