"""On a CUDA machine: expert parallelism's grouped local experts (bf16 grouped GEMMs over the rows in
expert order, padding outside every group) against the reference (every local expert on every row, in
fp32, selected by id). Run with `python -m pytest -m gpu tests/test_gpu_expert_rows.py`."""
from __future__ import annotations

import pytest
import torch

from megacpp.distributed.expert_parallel import local_expert_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("rows", "n_local", "d", "h"), [(37, 3, 64, 128), (512, 4, 128, 256), (1000, 1, 64, 64)])
def test_tier3_grouped_local_experts_match_the_reference(rows, n_local, d, h):
    """Inputs and weights are bf16-representable, so the two differ by the grouped GEMMs' bf16 hidden
    activations and outputs alone: bounded at 2% of the output's scale (bf16 has 8 bits of mantissa, and
    the hidden layer's rounding passes through the down projection's sum over h)."""
    torch.manual_seed(rows)
    device = torch.device("cuda")
    x = torch.randn(rows, d, device=device).bfloat16().float()
    w_up = (torch.randn(n_local, d, h, device=device) / d**0.5).bfloat16().float()
    w_down = (torch.randn(n_local, h, d, device=device) / h**0.5).bfloat16().float()
    ids = torch.randint(0, n_local + 1, (rows,), device=device)  # id n_local: padding
    ids[:3] = n_local  # some padding even when the draw gives none
    reference = local_expert_rows(x, ids, w_up, w_down, None)
    grouped = local_expert_rows(x, ids, w_up, w_down, torch.bfloat16).float()
    padding = ids == n_local
    assert torch.equal(grouped[padding], torch.zeros_like(grouped[padding]))
    assert torch.equal(reference[padding], torch.zeros_like(reference[padding]))
    scale = reference.abs().max()
    assert (grouped - reference).abs().max() <= 0.02 * scale
