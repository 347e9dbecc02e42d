"""Mamba-3 mixer (M block): decode vs forward, packed-document isolation, compile, init, mamba_ssm mapping.

float32 tolerances are 1e-4 of the reference's max magnitude (different summation orders of the
chunked scan and the recurrence); bfloat16 autocast is checked at 5e-2 (8-bit mantissa).
"""
from __future__ import annotations

import math

import pytest
import torch

from megacpp.model.hints import collect_param_hints
from megacpp.model.mamba3 import Mamba3
from megacpp.model.mamba3_config import Mamba3Config
from megacpp.model.mamba3_convert import (
    config_from_mamba_ssm,
    config_to_mamba_ssm,
    from_mamba_ssm,
    to_mamba_ssm,
)
from megacpp.model.segments import document_segments
from megacpp.ops.mamba3_fused import rotate_pairs
from tests.helpers import assert_close_scaled, documents, spans

F32_TOL = 1e-4
BF16_TOL = 5e-2
D_MODEL = 16


def make_mixer(seed: int = 0, **overrides) -> Mamba3:
    """Tiny mixer with every parameter perturbed, so no term of the computation is trivially zero or one."""
    cfg = Mamba3Config(**{"d_state": 8, "head_dim": 4, "n_groups": 2, "chunk_size": 8, **overrides})
    torch.manual_seed(seed)
    mixer = Mamba3(D_MODEL, cfg, layer_idx=0)
    with torch.no_grad():
        for param in mixer.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return mixer


def tokens(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randn(b, t, D_MODEL, generator=torch.Generator().manual_seed(seed))


def decode(mixer: Mamba3, x: torch.Tensor) -> torch.Tensor:
    cache = mixer.init_cache(x.shape[0], x.shape[1], x.device, x.dtype)
    return torch.cat([mixer.forward_step(x[:, i : i + 1], cache) for i in range(x.shape[1])], dim=1)


@pytest.mark.parametrize("overrides", [{}, {"n_groups": 1, "rope_fraction": 1.0}])
def test_tier3_forward_step_matches_forward(overrides):
    mixer = make_mixer(1, **overrides)
    x = tokens(2, 21, seed=2)
    with torch.no_grad():
        assert_close_scaled(decode(mixer, x), mixer(x), F32_TOL)


def test_tier3_forward_step_mutates_cache_in_place():
    mixer = make_mixer(3)
    cache = mixer.init_cache(2, 4, "cpu", torch.float32)
    before = {k: (v.data_ptr(), v.clone()) for k, v in cache.items()}
    with torch.no_grad():
        mixer.forward_step(tokens(2, 1, seed=4), cache)
    for key, (ptr, old) in before.items():
        assert cache[key].data_ptr() == ptr
        assert not torch.equal(cache[key], old), key


def test_tier3_packed_documents_are_isolated():
    """Breaks when the scan sees no document starts (doc_boundaries all False): state leaks across documents."""
    mixer = make_mixer(5)
    x = tokens(1, 30, seed=6)
    bounds = [0, 7, 8, 19, 30]
    doc_ids = documents(bounds)
    with torch.no_grad():
        packed = mixer(x, document_segments(doc_ids))
        for lo, hi in spans(bounds):
            assert_close_scaled(packed[:, lo:hi], mixer(x[:, lo:hi]), F32_TOL)


def test_tier3_rotation_is_complex_multiplication_of_interleaved_pairs():
    gen = torch.Generator().manual_seed(31)
    v = torch.randn(3, 8, dtype=torch.float64, generator=gen)
    theta = torch.randn(3, 2, dtype=torch.float64, generator=gen)
    out = rotate_pairs(v, theta)
    pairs = torch.view_as_complex(v[:, :4].reshape(3, 2, 2).contiguous())
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(theta), theta)).reshape(3, 4)
    assert_close_scaled(out[:, :4], expected, 1e-12)
    assert torch.equal(out[:, 4:], v[:, 4:])


def test_tier3_gradients_finite_with_documents():
    mixer = make_mixer(7)
    x = tokens(2, 19, seed=8).requires_grad_()
    doc_ids = torch.tensor([[0] * 8 + [1] * 11, [0] * 3 + [1] * 16])
    mixer(x, document_segments(doc_ids)).square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_tier3_bf16_autocast_close_to_float32():
    mixer = make_mixer(9)
    x = tokens(2, 12, seed=10)
    with torch.no_grad():
        ref = mixer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mixer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert_close_scaled(y, ref, BF16_TOL)


def test_tier1_activation_scan_matmuls_with_fp32_activations_is_the_fp32_path():
    """Without autocast the activation dtype is fp32, so "activation" narrows nothing."""
    x = tokens(2, 13, seed=17)
    segments = document_segments(torch.tensor([[0] * 5 + [1] * 8] * 2))
    with torch.no_grad():
        assert torch.equal(make_mixer(9, scan_matmuls="activation")(x, segments), make_mixer(9)(x, segments))


def test_tier3_activation_scan_matmuls_under_bf16_autocast_close_to_float32():
    mixer = make_mixer(9, scan_matmuls="activation")
    x = tokens(2, 21, seed=10)
    with torch.no_grad():
        ref = mixer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mixer(x.bfloat16())
            y_fp32_scan = make_mixer(9)(x.bfloat16())
    assert_close_scaled(y, ref, BF16_TOL)
    assert not torch.equal(y, y_fp32_scan)  # the scan's matmuls really ran in bf16


def test_scan_matmuls_rejects_unknown_values():
    with pytest.raises(ValueError, match="Mamba3Config.scan_matmuls: expected one of"):
        make_mixer(0, scan_matmuls="bf16")


def test_tier2_forward_rerun_identical():
    mixer = make_mixer(11)
    x = tokens(2, 13, seed=12)
    doc_ids = torch.tensor([[0] * 5 + [1] * 8] * 2)
    with torch.no_grad():
        assert torch.equal(mixer(x, document_segments(doc_ids)), mixer(x, document_segments(doc_ids)))


def test_tier1_compile_fullgraph_eager_backend_no_graph_breaks():
    from torch._dynamo.utils import counters

    mixer = make_mixer(13)
    x = tokens(2, 13, seed=14)
    doc_ids = torch.tensor([[0] * 5 + [1] * 8] * 2)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mixer, fullgraph=True, backend="eager")
    y = compiled(x, document_segments(doc_ids))
    y.sum().backward()
    assert not counters["graph_break"]
    with torch.no_grad():
        assert torch.equal(y.detach(), mixer(x, document_segments(doc_ids)))


def test_tier3_compile_inductor_no_graph_breaks():
    from torch._dynamo.utils import counters

    mixer = make_mixer(15, d_state=4, n_groups=1)
    x = tokens(1, 10, seed=16)
    doc_ids = torch.tensor([[0] * 4 + [1] * 6])
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        y = torch.compile(mixer, fullgraph=True)(x, document_segments(doc_ids))
        assert not counters["graph_break"]
        assert_close_scaled(y, mixer(x, document_segments(doc_ids)), F32_TOL)


def test_tier1_reset_parameters_follows_reference_init():
    cfg = Mamba3Config(d_state=8, head_dim=4, dt_min=0.01, dt_max=0.05, dt_init_floor=1e-4)
    torch.manual_seed(17)
    mixer = Mamba3(D_MODEL, cfg, layer_idx=0)
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    tol = 1e-6  # float32 softplus(inverse softplus(dt)) round trip
    assert ((dt >= cfg.dt_min - tol) & (dt <= cfg.dt_max + tol)).all()
    assert torch.equal(mixer.out_proj.weight, torch.zeros_like(mixer.out_proj.weight))  # house rule
    for ones in (mixer.B_bias, mixer.C_bias, mixer.D, mixer.B_norm.weight, mixer.C_norm.weight):
        assert torch.equal(ones, torch.ones_like(ones))
    bound = 1 / math.sqrt(D_MODEL)  # nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert mixer.in_proj.weight.abs().max() <= bound
    assert torch.equal(mixer(tokens(1, 5, seed=18)), torch.zeros(1, 5, D_MODEL))


def test_tier1_optimizer_hints():
    mixer = make_mixer(19)
    hints = collect_param_hints(mixer)
    assert {name for name, h in hints.items() if h.optimizer == "adamw"} == {"B_bias", "C_bias"}
    assert all(h.no_decay for h in hints.values())


# Parameter names and shapes of mamba_ssm 2.3.2 `Mamba3` (SISO, is_outproj_norm=False), derived by
# reading mamba_ssm/modules/mamba3.py at tag v2.3.2 (Mamba3.__init__): in_proj rows are
# [z, x, B, C, dd_dt, dd_A, trap, angles] = 2*d_inner + 2*d_state*ngroups + 3*nheads + num_rope_angles.
def mamba_ssm_shapes(d_model, d_state, expand, headdim, ngroups, rope_fraction) -> dict[str, tuple[int, ...]]:
    d_inner = expand * d_model
    nheads = d_inner // headdim
    rotated = int(d_state * rope_fraction)
    n_angles = (rotated - rotated % 2) // 2
    return {
        "in_proj.weight": (2 * d_inner + 2 * d_state * ngroups + 3 * nheads + n_angles, d_model),
        "dt_bias": (nheads,),
        "B_bias": (nheads, 1, d_state),
        "C_bias": (nheads, 1, d_state),
        "B_norm.weight": (d_state,),
        "C_norm.weight": (d_state,),
        "D": (nheads,),
        "out_proj.weight": (d_model, d_inner),
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {"d_state": 8, "expand": 2, "headdim": 4, "ngroups": 2, "rope_fraction": 0.5},
        {"d_state": 6, "expand": 1, "headdim": 8, "ngroups": 1, "rope_fraction": 1.0},
        {"d_state": 10, "expand": 2, "headdim": 8, "ngroups": 4, "rope_fraction": 0.5},  # odd rotated count
    ],
)
def test_tier1_parameter_names_and_shapes_match_mamba_ssm(kwargs):
    mixer = Mamba3(D_MODEL, config_from_mamba_ssm({"d_model": D_MODEL, **kwargs}), layer_idx=0)
    theirs = to_mamba_ssm(mixer.state_dict())
    assert {k: tuple(v.shape) for k, v in theirs.items()} == mamba_ssm_shapes(D_MODEL, **kwargs)


def test_tier1_converter_round_trip_and_load():
    mixer = make_mixer(20)
    prefix = "backbone.layers.2.mixer."
    ours = {prefix + k: v for k, v in mixer.state_dict().items()}
    theirs = to_mamba_ssm(ours)
    back = from_mamba_ssm(theirs)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    fresh = Mamba3(D_MODEL, mixer.cfg, layer_idx=0)
    fresh.load_state_dict({k[len(prefix) :]: v for k, v in back.items()}, strict=True)
    x = tokens(1, 6, seed=21)
    with torch.no_grad():
        assert torch.equal(fresh(x), mixer(x))


@pytest.mark.parametrize("key", ["mimo_x", "norm.weight", "layers.0.mixer.mimo_o"])
def test_tier1_converter_rejects_non_siso_parameters(key):
    with pytest.raises(ValueError):
        from_mamba_ssm({key: torch.zeros(2, 1, 4)})


def test_tier1_config_mapping_round_trip():
    cfg = Mamba3Config(d_state=32, expand=2, head_dim=16, n_groups=2, rope_fraction=1.0, chunk_size=32)
    kwargs = config_to_mamba_ssm(D_MODEL, cfg)
    assert kwargs["headdim"] == 16 and kwargs["ngroups"] == 2 and not kwargs["is_mimo"]
    assert config_from_mamba_ssm(kwargs) == cfg
    assert config_from_mamba_ssm({"d_model": D_MODEL}).d_state == 128  # mamba_ssm's defaults fill gaps
    with pytest.raises(ValueError):
        config_from_mamba_ssm({"is_mimo": True})
