"""Optimizer configuration: every knob of the Muon + AdamW stack, its schedule and MuonClip.

The ranges of an optimizer's own knobs belong to that optimizer (its `OptimizerSpec.ranges`, beside its
class); this section holds those of what every optimizer shares: the schedule, the gradient clip and the
learning-rate factors per block kind."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megacpp.compile.config import CompileBackend
from megacpp.optim.kind_scales import parse_lr_scales
from megacpp.rules import NON_NEGATIVE, UNIT, ConfigSection, Interval, Keys

LRScaling = Literal["original", "match_rms_adamw"]
CoefficientSet = Literal["polar_express", "quintic"]
MomentumDtype = Literal["bfloat16", "float32"]
ExpertOptimizer = Literal["muon", "adamw"]
DecayShape = Literal["linear", "cosine"]
LR_SCALINGS = get_args(LRScaling)
DECAY_SHAPES = get_args(DecayShape)


@dataclass
class OptimConfig(ConfigSection):
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
    ns_coefficients: CoefficientSet = "polar_express"
    ns_steps: int = 5
    momentum_dtype: MomentumDtype = "bfloat16"  # Muon's momentum buffer; the arithmetic is fp32 either way
    muon_lr_scaling: LRScaling = "original"  # default for 2-D matrices
    expert_lr_scaling: LRScaling = "match_rms_adamw"  # default for stacked (E, A, B) expert weights
    # The routed experts' weights (hinted routed_expert): "adamw" sends them to AdamW ("adamw:hidden"). Muon
    # orthogonalizes every expert every step, whatever few tokens it saw: at `small`'s 32k tokens per
    # step that is most of Muon's products (docs/optim.md, "Experts").
    expert_optimizer: ExpertOptimizer = "muon"
    # Newton-Schulz iterations for the routed experts' weights under Muon (None = ns_steps): their
    # orthogonalization is most of Muon's products at `small` (docs/optim.md, "Experts").
    expert_ns_steps: int | None = None
    # Muon's Gram products on CUDA: "auto" runs megacpp's Triton kernel on the stacks where it measured
    # faster (the routed experts': docs/decisions.md), "reference" keeps every stack on cuBLAS and Inductor
    # (the products as before the kernel: to compare, or to rule the kernel out of a report).
    muon_gram_kernel: Literal["auto", "reference"] = "auto"

    # AdamW (embeddings, heads, norms, biases, scalars, tagged parameters)
    adamw_lr: float = 3e-3
    embed_lr: float | None = None  # tok_embed / ngram_embed; None = adamw_lr
    head_lr: float | None = None  # lm_head / mtp; None = adamw_lr
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.95
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.0
    # AdamW's first moment (exp_avg) storage, updated in fp32 and rounded back; the second moment stays
    # fp32 (docs/optim.md, "State dtypes").
    adamw_momentum_dtype: MomentumDtype = "float32"

    # Learning-rate factor per block kind, as "<kind>=<factor>" entries (megacpp.optim.kind_scales):
    # ["M=0.5", "R=0.25"] multiplies the base lr of every parameter of the M and R blocks (mixer and
    # norm; Engram branches are no block kind), Muon and AdamW groups alike. [] = none.
    lr_scale_by_kind: list[str] = field(default_factory=list)

    # LR schedule: warmup -> stable -> decay, as a multiplier of every group's base lr.
    # *_steps, when set, override the matching *_frac (a fraction of the run's total steps).
    warmup_frac: float = 0.0
    warmup_steps: int | None = None
    decay_frac: float = 0.2
    decay_steps: int | None = None
    decay_shape: DecayShape = "linear"
    final_lr_frac: float = 0.0
    # A resumed run given more train.steps than its checkpoint's run had (megacpp.optim.schedule.extend):
    # "rewarm" follows the schedule of the new length (after a finished decay the rate climbs back to the
    # stable rate); "hold" trains the added steps at the rate the checkpoint's schedule ended with.
    extend_schedule: Literal["rewarm", "hold"] = "rewarm"

    # Step execution
    # Compile each optimizer's whole step into one graph: true, false, or auto (compiled when the
    # parameters are on CUDA, where the fused graph is the fast path; eager elsewhere).
    compile_step: bool | Literal["auto"] = "auto"
    compile_backend: CompileBackend = "inductor"
    grad_clip_norm: float = 1.0  # 0 = off

    @property
    def experts_on_muon(self) -> bool:
        """Whether the routed experts' weights are stepped by Muon (else AdamW's hidden group)."""
        return self.use_muon and self.expert_optimizer == "muon"

    @property
    def routed_expert_ns_steps(self) -> int:
        """The Newton-Schulz iterations of a routed expert's update per step: 0 where the experts are on AdamW."""
        if not self.experts_on_muon:
            return 0
        return self.ns_steps if self.expert_ns_steps is None else self.expert_ns_steps

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {
            "warmup_frac": UNIT,
            "warmup_steps": NON_NEGATIVE,
            "decay_frac": UNIT,
            "decay_steps": NON_NEGATIVE,
            "final_lr_frac": UNIT,
            "grad_clip_norm": NON_NEGATIVE,  # 0 = off
        }

    def check(self, k: Keys) -> None:
        """expert_ns_steps needs the routed experts on Muon. Each lr_scale_by_kind entry is <kind>=<factor>: a
        block letter and a finite factor >= 0, each kind once. The optimizer's own parser decides, so the gate
        and the optimizer cannot disagree."""
        if self.expert_ns_steps is not None and not self.experts_on_muon:
            raise k.error_among(("expert_ns_steps", "expert_optimizer", "use_muon"),
                                "sets the Newton-Schulz iterations of experts on Muon, and the routed experts are "
                                "on AdamW here: it would change nothing")
        try:
            parse_lr_scales(self.lr_scale_by_kind)
        except ValueError as exc:
            raise k.error("lr_scale_by_kind", f"is not a list of <kind>=<factor> entries: {exc}") from None
