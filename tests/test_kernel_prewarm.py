"""megacpp/ops/kernel_prewarm.py: the backward's Triton kernels described at the forward, as the backward will
launch them, and compiled once per layout in worker threads."""
from __future__ import annotations

import pytest
import torch

from megacpp.ops import kernel_prewarm, mamba3_triton


def _spec(value):
    """What Triton specializes a launch argument on: a tensor's dtype and 16-byte alignment (its shape and
    strides enter as the integer arguments), an integer's value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.data_ptr() % 16)
    return value


def _launch_specs(launches):
    return [(launch.kernel, launch.grid, tuple(_spec(a) for a in launch.args), launch.meta) for launch in launches]


def _mixer_layout(b, t, h, p, g, n, na, act, offset, device="cpu"):
    """x, z, B, C as the compiled mixer hands them over: views of one in_proj output with a padded row
    stride (and, with `offset`, a buffer that does not start 16-byte aligned), the rest contiguous."""
    cols = 2 * h * p + 2 * g * n
    padded = cols + 24
    proj = torch.randn(offset + b * t * padded, dtype=act, device=device)[offset:].view(b, t, padded)
    z = proj[..., :h * p].unflatten(-1, (h, p))
    x = proj[..., h * p:2 * h * p].unflatten(-1, (h, p))
    B = proj[..., 2 * h * p:2 * h * p + g * n].unflatten(-1, (g, n))
    C = proj[..., 2 * h * p + g * n:cols].unflatten(-1, (g, n))
    f32 = torch.float32
    rest = (torch.randn(h, n), torch.randn(h, n), torch.randn(b, t, h, na), torch.randn(b, t, h),
            torch.rand(b, t, h), torch.rand(b, t, h), torch.randn(h))
    return (x, z, B, C, *(v.to(device, f32) for v in rest))


@pytest.mark.parametrize("act,matmul,offset", [(torch.float32, torch.float32, 0), (torch.bfloat16, torch.bfloat16, 0),
                                              (torch.bfloat16, torch.bfloat16, 3)])
def test_tier1_the_description_is_what_the_backward_launches(act, matmul, offset):
    """Every launch of the real backward (recorded, not run) has a described twin with the same kernel, grid,
    launch options and argument specialization; both variants of the state kernel are described."""
    b, t, h, p, g, n, na, chunk = 2, 77, 4, 32, 2, 48, 8, 32
    inputs = _mixer_layout(b, t, h, p, g, n, na, act, offset)
    recorded = []
    _, _, states, y_pre = mamba3_triton.fused_fwd(*inputs, None, chunk, matmul, launch=recorded.append)
    grad_y = torch.randn(b, t, h, p, dtype=act).contiguous()
    backward = []
    mamba3_triton.fused_bwd(*inputs, states, y_pre, grad_y, None, chunk, matmul, launch=backward.append)
    with_final = []
    mamba3_triton.fused_bwd(*inputs, states, y_pre, grad_y, torch.zeros(b, h, p, n), chunk, matmul,
                            launch=with_final.append)
    described = _launch_specs(mamba3_triton.backward_launches(*inputs, chunk, matmul))
    real = _launch_specs(backward)
    assert [d for d in described if d in real] == real  # each real launch, in order
    final_states = [s for s in _launch_specs(with_final) if s[3].get("HAS_FINAL")]
    assert len(final_states) == 1 and final_states[0] in described
    assert len(described) == len(real) + 1
    if offset:  # the views really start off 16 bytes: the description must say so, not assume alignment
        misaligned = ("tensor", act, inputs[0].data_ptr() % 16)
        assert misaligned[2] != 0 and any(misaligned in d[2] for d in described)


def test_tier1_meta_like_keeps_layout_and_alignment():
    base = torch.randn(5, 9)
    view = base[1:, 3:].t()
    meta = kernel_prewarm.meta_like(view)
    assert meta.device.type == "meta" and meta.shape == view.shape and meta.stride() == view.stride()
    assert meta.storage_offset() == view.storage_offset() and meta.data_ptr() % 16 == view.data_ptr() % 16


class _Launch:
    def __init__(self, name):
        self.kernel, self.grid, self.args, self.meta = name, (1,), (), {}


def test_tier1_one_submission_per_layout(monkeypatch):
    warmed, described = [], []
    monkeypatch.setattr(kernel_prewarm, "enabled", lambda device: True)
    monkeypatch.setattr(kernel_prewarm, "_warm", lambda launch, device: warmed.append(launch.kernel))
    monkeypatch.setattr(kernel_prewarm, "_submitted", {})

    def describe():
        described.append(1)
        return [_Launch("a"), _Launch("b")]

    x = torch.zeros(4, 6)
    device = torch.device("cuda", 0)
    first = kernel_prewarm.warm_in_background("op", [x], device, describe)
    again = kernel_prewarm.warm_in_background("op", [torch.ones(4, 6)], device, describe)  # same layout
    other = kernel_prewarm.warm_in_background("op", [x.t()], device, describe)  # strides differ
    kernel_prewarm.wait_all()
    assert (len(first), len(again), len(other)) == (2, 0, 2) and len(described) == 2
    assert sorted(warmed) == ["a", "a", "b", "b"]


def test_tier1_off_on_cpu_and_by_the_environment(monkeypatch):
    assert not kernel_prewarm.enabled(torch.device("cpu"))
    assert kernel_prewarm.enabled(torch.device("cuda", 0))
    monkeypatch.setenv(kernel_prewarm.ENV_SWITCH, "0")
    assert not kernel_prewarm.enabled(torch.device("cuda", 0))
    assert kernel_prewarm.warm_in_background("op", [torch.zeros(2)], torch.device("cuda", 0), lambda: 1 / 0) == []
