"""megacpp/ops/kernel_prewarm.py: the M, R and angle ops' backward Triton kernels described at the forward, as
the backward will launch them, compiled once per layout by a helper, with cache keys fixed at import."""
from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megacpp.ops import kernel_prewarm, mamba3_triton


def _spec(value):
    """What Triton specializes a launch argument on: a tensor's dtype and 16-byte alignment (its shape and
    strides enter as the integer arguments), a tensor descriptor's dtype and tile (its tensor's layout is
    part of the launch, as for a tensor) and an integer's value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.data_ptr() % 16)
    if isinstance(value, TensorDescriptor):
        return ("descriptor", value.base.dtype, tuple(value.block_shape), tuple(value.shape), tuple(value.strides),
                value.base.data_ptr() % 16)
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


class _Helper:
    def wait(self, timeout_s):
        return 0


def test_tier1_one_helper_per_layout_and_at_most_max_keys(monkeypatch, tmp_path):
    started, described = [], []
    monkeypatch.setattr(kernel_prewarm, "enabled", lambda device: True)
    monkeypatch.setattr(kernel_prewarm, "_shared_triton_cache_dir", lambda index: str(tmp_path))
    monkeypatch.setattr(kernel_prewarm, "_start", lambda spec, where: started.append((spec, where)) or _Helper())
    monkeypatch.setattr(kernel_prewarm, "_submitted", {})
    monkeypatch.setattr(kernel_prewarm, "_per_name", {})

    def describe():
        described.append(1)
        return []

    x = torch.zeros(4, 6)
    device = torch.device("cuda", 1)
    first = kernel_prewarm.warm_in_background("op", [x], device, describe)
    again = kernel_prewarm.warm_in_background("op", [torch.ones(4, 6)], device, describe)  # the same layout
    other = kernel_prewarm.warm_in_background("op", [x.t()], device, describe)  # strides differ
    assert first is not None and again is None and other is not None and len(described) == 2
    assert started[0] == ({"device": 1, "launches": []}, str(tmp_path))
    for size in range(kernel_prewarm.MAX_KEYS):  # new layouts, until the cap
        kernel_prewarm.warm_in_background("op", [torch.zeros(size + 1)], device, describe)
    assert len(started) == kernel_prewarm.MAX_KEYS and kernel_prewarm.wait_all() == [0] * kernel_prewarm.MAX_KEYS
    # The cap is per op: another op's first layout still gets its helper.
    assert kernel_prewarm.warm_in_background("other op", [x], device, describe) is not None


def _started(monkeypatch, helpers_by_name):
    """Helpers as `warm_in_background` registers them, by prewarm name, in fresh module state."""
    monkeypatch.setattr(kernel_prewarm, "enabled", lambda device: True)
    monkeypatch.setattr(kernel_prewarm, "_shared_triton_cache_dir", lambda index: "unused")
    for name in ("_submitted", "_per_name", "_outcomes"):
        monkeypatch.setattr(kernel_prewarm, name, {})
    monkeypatch.setattr(kernel_prewarm, "_noted", set())
    for name, helpers in helpers_by_name.items():
        for i, helper in enumerate(helpers):
            monkeypatch.setattr(kernel_prewarm, "_start", lambda spec, where, helper=helper: helper)
            kernel_prewarm.warm_in_background(name, [torch.zeros(i + 1)], torch.device("cuda", 0), lambda: [])


def _process(seconds: float, code: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({code})"])


def test_tier1_a_backward_notes_its_ops_helpers_once_and_never_waits(monkeypatch):
    """The first backward of an op notes whether its helpers (every layout, every parameter of its name) are
    done, without waiting for one still compiling; later backwards and other ops' helpers are left alone."""
    running, done = _process(60.0), _process(0.0)
    other = _process(0.0)
    try:
        _started(monkeypatch, {("mamba3_fused_bwd", 64, torch.bfloat16): [running, done],
                               ("m2rnn_scan_fast_bwd",): [other]})
        done.wait(10)
        other.wait(10)
        assert kernel_prewarm.outcomes() is None  # no backward has run yet
        started = time.perf_counter()
        kernel_prewarm.note_helpers("mamba3_fused_bwd")
        assert time.perf_counter() - started < 1.0 and running.poll() is None  # not waited for
        kernel_prewarm.note_helpers("mamba3_fused_bwd")  # seen through: nothing more
        kernel_prewarm.note_helpers("never prewarmed")
        assert kernel_prewarm.outcomes() == "kernel prewarm: mamba3_fused_bwd still compiling when its backward began"
        kernel_prewarm.note_helpers("m2rnn_scan_fast_bwd")
        assert kernel_prewarm.outcomes().endswith(", m2rnn_scan_fast_bwd ready")
    finally:
        running.kill()
        running.wait(10)


def test_tier1_failed_helpers_are_named_with_where_their_logs_are(monkeypatch):
    done, failed = _process(0.0), _process(0.0, code=1)
    _started(monkeypatch, {("mamba3_document_angles_bwd",): [done, failed]})
    done.wait(10)
    failed.wait(10)
    kernel_prewarm.note_helpers("mamba3_document_angles_bwd")
    line = kernel_prewarm.outcomes()
    assert line.startswith("kernel prewarm: mamba3_document_angles_bwd ready (1 helper(s) failed: see ")
    assert line.endswith(f"megacpp-kernel-prewarm-*.log in {tempfile.gettempdir()})")


def test_tier1_a_described_launch_comes_back_as_the_same_specialization():
    """What the helper rebuilds from the plain-data description: the same JIT function, grid and options, and
    arguments that specialize alike (layouts, dtypes, 16-byte alignment, integers)."""
    b, t, h, p, g, n, na, chunk = 2, 50, 4, 32, 1, 32, 8, 16
    inputs = _mixer_layout(b, t, h, p, g, n, na, torch.bfloat16, 5)
    for launch in mamba3_triton.backward_launches(*inputs, chunk, torch.bfloat16):
        plain = pickle.loads(pickle.dumps(kernel_prewarm.describe_launch(launch)))
        kernel = getattr(importlib.import_module(plain["module"]), plain["name"])
        rebuilt = [kernel_prewarm.rebuild_arg(a) for a in plain["args"]]
        assert kernel is launch.kernel and plain["grid"] == launch.grid and plain["meta"] == launch.meta
        assert [_spec(a) for a in rebuilt] == [_spec(a) for a in launch.args]
        assert [a.stride() for a in rebuilt if isinstance(a, torch.Tensor)] == [
            a.stride() for a in launch.args if isinstance(a, torch.Tensor)]


def test_tier1_the_helper_leaves_a_log_when_it_fails_and_never_its_spec(tmp_path):
    spec = tmp_path / "job.pkl"
    spec.write_bytes(pickle.dumps({"device": 0, "launches": [{"module": "megacpp.no_such_module", "name": "k",
                                                              "grid": (1,), "args": [], "meta": {}}]}))
    assert kernel_prewarm.main([str(spec)]) == 1
    assert not spec.exists() and "megacpp.no_such_module" in (tmp_path / "job.log").read_text()


def test_tier1_off_on_cpu_and_by_the_environment(monkeypatch):
    assert not kernel_prewarm.enabled(torch.device("cpu"))
    assert kernel_prewarm.enabled(torch.device("cuda", 0))
    monkeypatch.setenv(kernel_prewarm.ENV_SWITCH, "0")
    assert not kernel_prewarm.enabled(torch.device("cuda", 0))
    assert kernel_prewarm.warm_in_background("op", [torch.zeros(2)], torch.device("cuda", 0), lambda: 1 / 0) is None


def test_tier1_a_description_that_fails_warns_and_never_fails_the_forward(monkeypatch):
    monkeypatch.setattr(kernel_prewarm, "enabled", lambda device: True)
    monkeypatch.setattr(kernel_prewarm, "_submitted", {})
    monkeypatch.setattr(kernel_prewarm, "_per_name", {})
    with pytest.warns(RuntimeWarning, match="kernel prewarm of 'op' skipped.*ZeroDivisionError"):
        assert kernel_prewarm.warm_in_background("op", [torch.zeros(2)], torch.device("cuda", 0), lambda: 1 / 0) is None


def _without_emulation(specs):
    """The described launches are CUDA's (EMULATE off); the recorded CPU ones would run under the
    interpreter (EMULATE on). Everything else must agree."""
    return [(kernel, grid, args, {k: v for k, v in meta.items() if k != "EMULATE"})
            for kernel, grid, args, meta in specs]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("half_dot,half_states", [(True, True), (False, False), (True, False)])
def test_tier1_the_recurrence_backward_is_described_as_it_launches(fused, half_dot, half_states, monkeypatch):
    """R's fast backward, fused or split: each launch (recorded, not run) for an empty and for a real gradient
    of the last state has a described twin, and the description is the CUDA launch's (no emulation)."""
    from megacpp.ops import m2rnn_triton_fast as fast

    monkeypatch.setattr(fast, "TUNING", fast.FastTuning(fused_backward=fused))
    b, t, h, dk, dv = 3, 19, 2, 32, 64
    q, k = torch.randn(b, t, h, dk), torch.randn(b, t, h, dk)
    v, f, W = torch.randn(b, t, h, dv), torch.rand(b, t, h), torch.randn(h, dv, dv)
    states = torch.randn(t + 1, h, b, dk, dv).to(torch.float16 if half_states else torch.float32)
    grad_y = torch.randn(t, h, b, dv)
    real = []
    for grad_last in (torch.empty(0), torch.randn(h, b, dk, dv)):
        recorded = []
        fast.scan_bwd_fast(q, k, v, f, W, states, grad_y, grad_last, half_dot, launch=recorded.append)
        real += [s for s in _launch_specs(recorded) if s not in real]
    launches = fast.backward_launches(q, k, v, f, W, half_dot, half_states)
    assert all(launch.meta.get("EMULATE", False) is False for launch in launches)
    assert _without_emulation(_launch_specs(launches)) == _without_emulation(real)
    assert len(launches) == (2 if fused else 3)  # the grads kernel has no last-state variant


@pytest.mark.parametrize("documents", [False, True])
def test_tier1_the_angles_backward_is_described_as_it_launches(documents):
    """The angles' backward reads rate and dt through their strides (slices of the projection here) and
    the document starts when there are any: the description keeps those layouts."""
    from megacpp.ops import mamba3_angles

    b, t, h, na = 2, 37, 3, 5
    proj = torch.randn(b, t, 40)
    rate, dt = proj[..., 3:3 + na], proj[..., 20:20 + h]
    offsets = torch.zeros(b, t, dtype=torch.int64) if documents else None
    recorded = []
    mamba3_angles.document_angles_bwd_triton(rate, dt, offsets, torch.randn(b, t, h, na), launch=recorded.append)
    described = mamba3_angles.backward_launches(rate, dt, offsets)
    assert _launch_specs(described) == _launch_specs(recorded) and len(recorded) == 1


def test_tier1_the_kernel_modules_fix_their_cache_keys_at_import():
    """Every Triton JIT function that a prewarmed op's module defines has its cache key computed when the
    module has imported (`kernel_prewarm.pin_cache_keys`), before any launch can change the order."""
    from triton.runtime.jit import JITFunction

    from megacpp.ops import m2rnn_triton, m2rnn_triton_fast, mamba3_angles

    for module in (mamba3_triton, m2rnn_triton, m2rnn_triton_fast, mamba3_angles):
        own = [v for v in vars(module).values() if isinstance(v, JITFunction) and v.__module__ == module.__name__]
        assert own and all(v.hash is not None for v in own), module.__name__


def test_tier1_no_helpers_where_no_backward_follows_and_again_after(monkeypatch):
    monkeypatch.delenv(kernel_prewarm.ENV_SWITCH, raising=False)
    cuda = torch.device("cuda", 0)
    with kernel_prewarm.no_backward_follows():
        assert not kernel_prewarm.enabled(cuda)
        with kernel_prewarm.no_backward_follows():
            assert not kernel_prewarm.enabled(cuda)
        assert not kernel_prewarm.enabled(cuda)  # the inner block's end keeps the outer one's setting
        assert kernel_prewarm.warm_in_background("op", [torch.zeros(2)], cuda, lambda: 1 / 0) is None
    assert kernel_prewarm.enabled(cuda)
    with pytest.raises(RuntimeError, match="inside"), kernel_prewarm.no_backward_follows():
        raise RuntimeError("inside")
    assert kernel_prewarm.enabled(cuda)
