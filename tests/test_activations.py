"""The feed-forward mixers' shared activations (megacpp/model/activations.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacpp.model.activations import relu_squared


@pytest.mark.parametrize("shape", [(7, 13), (3, 5, 129)])
def test_tier1_relu_squared_equals_the_square_autocast_would_run_in_fp32(shape):
    """`relu_squared` (h * h in h's dtype) against relu(h).square() as CUDA autocast runs it (the square in fp32,
    rounded to bf16 by the next projection's cast), and against square() in fp32: the same values and the same
    gradient bit for bit, on fresh random inputs of odd sizes with exact zeros and negatives."""
    gen = torch.Generator().manual_seed(sum(shape))
    for dtype in (torch.bfloat16, torch.float32):
        h = (torch.randn(shape, generator=gen) * 3).to(dtype)
        h.view(-1)[::5] = 0.0
        grad = torch.randn(shape, generator=gen).to(dtype)
        ours = h.clone().requires_grad_()
        theirs = h.clone().requires_grad_()
        out = relu_squared(ours)
        ref = F.relu(theirs).float().square().to(dtype)
        out.backward(grad)
        ref.backward(grad)
        assert out.dtype == dtype and torch.equal(out, ref)
        assert torch.equal(ours.grad, theirs.grad)
