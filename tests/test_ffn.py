"""FFN mixer (F): relu^2 and SwiGLU against a float64 reference, init, decode step, torch.compile."""
from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

from megacpp.model.ffn import FFN
from megacpp.model.ffn_config import FFNConfig
from megacpp.model.segments import document_segments

D_MODEL, HIDDEN = 16, 24
FP32_TOL = 200 * torch.finfo(torch.float32).eps  # fp32 module vs float64 reference, O(1) outputs
ACTIVATIONS = ["relu2", "swiglu"]


def make(seed: int, activation: str) -> FFN:
    """FFN with a random (not zero) down projection so outputs are informative."""
    torch.manual_seed(seed)
    module = FFN(D_MODEL, FFNConfig(hidden=HIDDEN, activation=activation), layer_idx=0)
    nn.init.normal_(module.down.weight, std=HIDDEN**-0.5)
    return module


def rand(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference_ffn(module: FFN, x: Tensor) -> Tensor:
    x = x.double()
    up = x @ module.up.weight.double().T
    if module.cfg.activation == "relu2":
        hidden = up.clamp(min=0) ** 2
    else:
        gate = x @ module.gate.weight.double().T
        hidden = gate / (1 + torch.exp(-gate)) * up
    return hidden @ module.down.weight.double().T


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_tier3_ffn_matches_reference(activation: str) -> None:
    module = make(1, activation)
    x = rand(2, 2, 7, D_MODEL)
    out = module(x)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), reference_ffn(module, x), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_tier1_ffn_zero_init_and_step(activation: str) -> None:
    fresh = FFN(D_MODEL, FFNConfig(hidden=HIDDEN, activation=activation), layer_idx=0)
    x = rand(3, 2, 5, D_MODEL)
    assert torch.equal(fresh(x), torch.zeros_like(x))
    assert (fresh.gate is not None) == (activation == "swiglu")
    module = make(4, activation)
    cache = module.init_cache(2, max_len=5, device="cpu", dtype=torch.float32)
    assert cache == {}
    assert torch.equal(module.forward_step(x[:, 2:3], cache), module(x[:, 2:3]))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_tier1_ffn_compile_fullgraph_no_breaks(activation: str) -> None:
    module = make(5, activation)
    x, segments = rand(6, 2, 7, D_MODEL), document_segments(torch.tensor([[0, 0, 1, 1, 1, 2, 2]] * 2))
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(module, backend="eager", fullgraph=True)(x, segments)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(out, module(x, segments))
