"""Mamba-3's config section (pattern symbol M) and the rules its widths follow.

Torch-free, so the configuration (`megacpp config`, `megacpp.run_config.load_config`) loads without torch;
the mixer (megacpp/model/mamba3.py) imports it from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megacpp.ops.mamba3_limits import ScanKernel, triton_size_reason
from megacpp.rules import ABOVE_0_UNIT, AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigSection, Interval, Keys, check_ordered

ScanMatmuls = Literal["fp32", "activation"]


@dataclass
class Mamba3Config(ConfigSection):
    d_state: int = 16
    expand: int = 2
    head_dim: int = 32
    n_groups: int = 1
    rope_fraction: float = 0.5
    A_floor: float = 1e-4
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    chunk_size: int = 64
    norm_eps: float = 1e-5
    # Operand dtype of the scan's large matmuls: "fp32" (exact path), or "activation" (bf16 under bf16
    # autocast, like mamba_ssm's kernels; fp32 accumulation either way). See docs/mamba3.md.
    scan_matmuls: ScanMatmuls = "fp32"
    # Implementation of the fused scan (megacpp/ops/mamba3_fused.py): "auto" runs the Triton kernels on
    # CUDA tensors they support and the pure-PyTorch reference elsewhere (CPU always); "reference" and
    # "triton" force one ("triton" fails where it cannot run). The library default stays "reference":
    # the kernels are measured faster only with bf16 operands at `small`'s sizes (6.47 against 10.12 ms
    # per compiled M sublayer on an H200; with fp32 operands at `nam52`'s, 22.70 against 19.29:
    # BENCHMARKS.md), which is where `small` turns them on.
    scan_kernel: ScanKernel = "reference"

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {
            "d_state": AT_LEAST_1, "expand": AT_LEAST_1, "head_dim": AT_LEAST_1, "n_groups": AT_LEAST_1,
            "rope_fraction": ABOVE_0_UNIT, "A_floor": NON_NEGATIVE,
            "dt_min": POSITIVE, "dt_max": POSITIVE,  # log-uniform init: log(0) is -inf
            "dt_init_floor": NON_NEGATIVE, "chunk_size": AT_LEAST_1, "norm_eps": POSITIVE,
        }

    def check(self, k: Keys) -> None:
        """The widths the mixer is built from, with the model's d_model; see each rule."""
        for rule in (_heads_fit, _groups_divide, _rope_angles, _triton_sizes, _dt_range):
            rule(self, k)


_WIDTH = ("head_dim", "expand", "d_model")


def _heads_fit(cfg: Mamba3Config, k: Keys) -> None:
    """Mamba-3 splits its inner width expand * d_model into heads of head_dim."""
    inner = cfg.expand * k.value("d_model")
    if inner % cfg.head_dim:
        raise k.error_among(_WIDTH, f"head_dim must divide Mamba-3's inner width expand * d_model = {inner}")


def _groups_divide(cfg: Mamba3Config, k: Keys) -> None:
    """B and C are shared by groups of heads, so the head count splits into n_groups."""
    heads = cfg.expand * k.value("d_model") // cfg.head_dim
    if heads % cfg.n_groups:
        raise k.error_among(("n_groups", *_WIDTH),
                            f"n_groups must divide the {heads} Mamba-3 heads (expand * d_model / head_dim)")


def _rope_angles(cfg: Mamba3Config, k: Keys) -> None:
    """The data-dependent RoPE on B/C needs at least one rotated pair of state dimensions."""
    if num_rope_angles(cfg.d_state, cfg.rope_fraction) < 1:
        raise k.error_among(("rope_fraction", "d_state"),
                            "rope_fraction * d_state must cover at least one pair of state dimensions (>= 2)")


def _triton_sizes(cfg: Mamba3Config, k: Keys) -> None:
    """scan_kernel "triton" asks for the fused kernels, which support a range of sizes; "auto" would fall
    back to the reference silently, an explicit request should fail before the first forward instead."""
    if cfg.scan_kernel != "triton":
        return
    n_angles = num_rope_angles(cfg.d_state, cfg.rope_fraction)
    reason = triton_size_reason(cfg.head_dim, cfg.d_state, n_angles, cfg.chunk_size)
    if reason is not None:
        raise k.error_among(("scan_kernel", "chunk_size", "d_state", "head_dim"),
                            f"the Triton scan kernels do not support this size: {reason}")


def _dt_range(cfg: Mamba3Config, k: Keys) -> None:
    """dt starts log-uniform in [dt_min, dt_max]; torch refuses a reversed range at model build."""
    check_ordered(k, "dt_min", "dt_max")


def num_rope_angles(d_state: int, rope_fraction: float) -> int:
    """Rotated pairs: the even part of d_state * rope_fraction, halved (mamba_ssm's rule)."""
    rotated = int(d_state * rope_fraction)
    return (rotated - rotated % 2) // 2
