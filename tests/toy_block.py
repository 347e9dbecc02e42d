"""A toy block kind's mixer, written as a new kind's mixer module is: the mixer, nothing else.

Its config section is tests/toy_block_config.py; tests/test_extending.py adds the kind to the model with
one registry line and one ModelConfig field. The mixer is a gated linear unit: ``down(a * sigmoid(b))``
with ``a | b = up(x)``.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from megacpp.model.segments import WHOLE_ROWS, Segments
from megacpp.rules import check_alone
from tests.toy_block_config import ToyConfig


class ToyMixer(nn.Module):
    def __init__(self, d_model: int, cfg: ToyConfig, layer_idx: int) -> None:
        super().__init__()
        check_alone(cfg, d_model=d_model)
        self.cfg, self.layer_idx, self.d_model = cfg, layer_idx, d_model
        self.up = nn.Linear(d_model, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden // 2, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """up ~ N(0, 1/d_model); down = 0, so the block starts as the identity."""
        nn.init.normal_(self.up.weight, std=self.d_model**-0.5)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        values, gates = self.up(x).chunk(2, dim=-1)
        return self.down(values * torch.sigmoid(gates)).to(x.dtype)

    def init_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
                   ) -> dict[str, Tensor]:
        return {}

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        return self.forward(x)
