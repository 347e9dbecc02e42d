"""Convert between megacpp `Mamba3` and mamba_ssm 2.3.2 `Mamba3` (SISO) state dicts and configs.

Both sides use the same parameter names; only the B/C bias tables differ in shape: mamba_ssm keeps a
mimo-rank axis, (nheads, 1, d_state), megacpp stores (n_heads, d_state). Keys may carry any common
prefix (e.g. "backbone.layers.3.mixer."), which is kept. The mapping table is in docs/mamba3.md.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from megacpp.model.mamba3_config import Mamba3Config

# Local parameter names of one SISO mixer; identical on both sides.
PARAM_NAMES = (
    "in_proj.weight", "dt_bias", "B_bias", "C_bias", "B_norm.weight", "C_norm.weight", "D", "out_proj.weight",
)
_RANK_AXIS = ("B_bias", "C_bias")  # (nheads, 1, d_state) in mamba_ssm

# mamba_ssm 2.3.2 Mamba3.__init__ defaults, used for keys missing from a mamba_ssm config.
MAMBA_SSM_DEFAULTS: dict[str, Any] = {
    "d_state": 128, "expand": 2, "headdim": 64, "ngroups": 1, "rope_fraction": 0.5, "dt_min": 0.001,
    "dt_max": 0.1, "dt_init_floor": 1e-4, "A_floor": 1e-4, "is_outproj_norm": False, "is_mimo": False,
    "chunk_size": 64,
}
# megacpp field -> mamba_ssm keyword
_CONFIG_NAMES = {
    "d_state": "d_state", "expand": "expand", "head_dim": "headdim", "n_groups": "ngroups",
    "rope_fraction": "rope_fraction", "dt_min": "dt_min", "dt_max": "dt_max",
    "dt_init_floor": "dt_init_floor", "A_floor": "A_floor", "chunk_size": "chunk_size",
}
_IGNORED_KWARGS = {"d_model", "dropout", "layer_idx", "n_layer", "device", "dtype", "mimo_rank"}


def from_mamba_ssm(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """mamba_ssm SISO Mamba3 state dict -> megacpp Mamba3 state dict."""
    out = {}
    for key, value in state_dict.items():
        name = _local_name(key)
        if name in _RANK_AXIS:
            if value.dim() != 3 or value.shape[1] != 1:
                raise ValueError(f"{key}: expected (nheads, 1, d_state) of SISO, got {tuple(value.shape)}")
            value = value.squeeze(1)
        out[key] = value
    return out


def to_mamba_ssm(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """megacpp Mamba3 state dict -> mamba_ssm SISO Mamba3 state dict."""
    out = {}
    for key, value in state_dict.items():
        out[key] = value.unsqueeze(1) if _local_name(key) in _RANK_AXIS else value
    return out


def config_from_mamba_ssm(kwargs: dict[str, Any]) -> Mamba3Config:
    """mamba_ssm Mamba3 constructor keywords -> Mamba3Config (d_model is passed to Mamba3 separately)."""
    unknown = set(kwargs) - set(MAMBA_SSM_DEFAULTS) - _IGNORED_KWARGS
    if unknown:
        raise ValueError(f"unsupported mamba_ssm Mamba3 arguments: {sorted(unknown)}")
    merged = {**MAMBA_SSM_DEFAULTS, **kwargs}
    if merged["is_mimo"] or merged["is_outproj_norm"]:
        raise ValueError("only the SISO variant without the output norm (is_mimo=is_outproj_norm=False) maps")
    return Mamba3Config(**{ours: merged[theirs] for ours, theirs in _CONFIG_NAMES.items()})


def config_to_mamba_ssm(d_model: int, cfg: Mamba3Config) -> dict[str, Any]:
    """Mamba3Config -> mamba_ssm Mamba3 constructor keywords."""
    if cfg.rope_fraction not in (0.5, 1.0):
        raise ValueError(f"mamba_ssm accepts rope_fraction 0.5 or 1.0, got {cfg.rope_fraction}")
    if cfg.norm_eps != 1e-5:
        raise ValueError(f"mamba_ssm fixes the B/C RMSNorm eps at 1e-5, got {cfg.norm_eps}")
    kwargs = {theirs: getattr(cfg, ours) for ours, theirs in _CONFIG_NAMES.items()}
    return {"d_model": d_model, **kwargs, "is_mimo": False, "is_outproj_norm": False}


def _local_name(key: str) -> str:
    """The mixer-local parameter name of key; raises for anything a SISO layer does not have."""
    for name in PARAM_NAMES:
        if key == name or key.endswith("." + name):
            return name
    raise ValueError(f"{key!r} is not a SISO Mamba3 parameter (MIMO and output-norm layers do not map)")
