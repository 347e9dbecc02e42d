"""On a CUDA machine: `moe.fuse_shared_expert` at `small`'s E shapes (d 768, 16 experts of 1024, top-2,
shared expert), under bf16 autocast with the grouped dispatch: the shared expert in the routed experts'
grouped GEMMs against its own GEMMs. Run with `python -m pytest -m gpu tests/test_gpu_shared_expert.py`."""
from __future__ import annotations

import pytest
import torch

from megacpp.model.moe import MoE
from megacpp.model.moe_config import MoEConfig

pytestmark = pytest.mark.gpu

D, EXPERTS, HIDDEN, NONZERO = 768, 16, 1024, 8


def _sparse_signs(shape: tuple[int, ...], per_row: int, gen: torch.Generator) -> torch.Tensor:
    """Rows with `per_row` entries of +-1, the rest zero."""
    rows = torch.zeros(shape).view(-1, shape[-1])
    for row in rows:
        signs = torch.randint(0, 2, (per_row,), generator=gen).float() * 2 - 1
        row[torch.randperm(shape[-1], generator=gen)[:per_row]] = signs
    return rows.view(shape)


def _block(fuse: bool) -> MoE:
    """Every routed and shared weight in {-1, 0, 1}, the gate as initialised (same seed for both)."""
    torch.manual_seed(0)
    m = MoE(D, MoEConfig(n_experts=EXPERTS, top_k=2, expert_hidden=HIDDEN, dispatch="grouped",
                         fuse_shared_expert=fuse), layer_idx=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("w_up", "w_down", "shared_up.weight", "shared_down.weight"):
            weight = m.get_parameter(name)
            weight.copy_(torch.randint(-1, 2, weight.shape, generator=gen).float())
    return m.cuda()


def _forward_and_backward(fuse: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The block's output, its counts per expert and every gradient (input and parameters) on one batch of
    4 x 512 rows, each with 8 entries of +-1."""
    gen = torch.Generator().manual_seed(2)
    x = _sparse_signs((4, 512, D), NONZERO, gen).cuda().requires_grad_()
    upstream = torch.randn(4, 512, D, generator=gen).cuda()
    m = _block(fuse)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(x)
    (y.float() * upstream).sum().backward()
    return y.detach(), m.tokens_per_expert.clone(), {"x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


def test_tier1_the_fused_forward_is_the_separate_one():
    """Every hidden value is an integer of magnitude <= 8, its square <= 64 and every output sum <= 65,536:
    exact in the GEMMs' fp32 accumulators, then rounded to bf16 the same way in both."""
    (y_separate, counts_separate, _), (y_fused, counts_fused, _) = (_forward_and_backward(f) for f in (False, True))
    assert torch.equal(counts_separate, counts_fused) and int((counts_fused > 0).sum()) > 1
    assert torch.equal(y_separate, y_fused)


def test_tier3_the_fused_gradients_are_within_bf16_rounding_of_the_separate_ones():
    """The backward carries the router's fp32 combine weights, which no operand choice makes exact: held
    to 1% of each gradient's scale (bf16's rounding, 2^-8, once more through each GEMM's sum)."""
    (_, _, separate), (_, _, fused) = (_forward_and_backward(f) for f in (False, True))
    for name, grad in separate.items():
        assert (fused[name] - grad).abs().max() <= 0.01 * grad.abs().max(), name
