"""Optimizer configuration: every knob of the Muon + AdamW stack, its schedule and MuonClip."""
from __future__ import annotations

from dataclasses import dataclass

LR_SCALINGS = ("original", "match_rms_adamw")
COEFFICIENT_SETS = ("polar_express", "quintic")
MOMENTUM_DTYPES = ("bfloat16", "float32")
DECAY_SHAPES = ("linear", "cosine")


@dataclass
class OptimConfig:
    # Muon (hidden matrices). use_muon=False sends them to AdamW ("adamw:hidden", lr adamw_lr).
    use_muon: bool = True
    # muon_lr is the base lr of "original"-scaled matrices; "match_rms_adamw"-scaled ones use
    # muon_rms_lr (None = adamw_lr: that scaling exists so Muon can reuse AdamW's lr).
    muon_lr: float = 0.02
    muon_rms_lr: float | None = None
    weight_decay: float = 0.0  # Muon's decoupled weight decay (p -= lr * wd * p, masked if cautious)
    muon_momentum: float = 0.95
    nesterov: bool = True
    cautious_weight_decay: bool = True
    variance_reduction: bool = True
    variance_beta2: float = 0.95
    ns_coefficients: str = "polar_express"  # polar_express | quintic
    ns_steps: int = 5
    momentum_dtype: str = "bfloat16"  # bfloat16 | float32
    muon_lr_scaling: str = "original"  # default for 2-D matrices: original | match_rms_adamw
    expert_lr_scaling: str = "match_rms_adamw"  # default for stacked (E, A, B) expert weights

    # AdamW (embeddings, heads, norms, biases, scalars, tagged parameters)
    adamw_lr: float = 3e-3
    embed_lr: float | None = None  # tok_embed / ngram_embed; None = adamw_lr
    head_lr: float | None = None  # lm_head / mtp; None = adamw_lr
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.95
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.0

    # LR schedule: warmup -> stable -> decay, as a multiplier of every group's base lr.
    # *_steps, when set, override the matching *_frac (a fraction of the run's total steps).
    warmup_frac: float = 0.0
    warmup_steps: int | None = None
    decay_frac: float = 0.2
    decay_steps: int | None = None
    decay_shape: str = "linear"  # linear | cosine
    final_lr_frac: float = 0.0

    # Step execution
    compile_step: bool = False  # compile each optimizer's whole step into one graph (opt-in)
    compile_backend: str = "inductor"
    grad_clip_norm: float = 1.0  # 0 = off

    def __post_init__(self) -> None:
        _check_choice("muon_lr_scaling", self.muon_lr_scaling, LR_SCALINGS)
        _check_choice("expert_lr_scaling", self.expert_lr_scaling, LR_SCALINGS)
        _check_choice("ns_coefficients", self.ns_coefficients, COEFFICIENT_SETS)
        _check_choice("momentum_dtype", self.momentum_dtype, MOMENTUM_DTYPES)
        _check_choice("decay_shape", self.decay_shape, DECAY_SHAPES)
        if self.ns_steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {self.ns_steps}")
        for name in ("warmup_frac", "decay_frac", "final_lr_frac"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {choices}")
