"""Model configuration: the pattern, the widths, and one sub-config per block kind.

Torch-free like every section it composes (each kind's `<kind>_config` module), so reading a configuration
(`megacpp config`) does not load torch; tests/test_layering.py holds it to that."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megacpp.model.attention_config import AttentionConfig
from megacpp.model.engram_config import EngramConfig
from megacpp.model.ffn_config import FFNConfig
from megacpp.model.m2rnn_config import M2RNNConfig
from megacpp.model.mamba3_config import Mamba3Config
from megacpp.model.moe_config import MoEConfig
from megacpp.model.pattern import PatternConfigError, PatternError, expand_pattern, validate_pattern
from megacpp.model.registry import BLOCK_KINDS
from megacpp.ops.softcap_xent_limits import MAX_CAP, LossKernel
from megacpp.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigSection, Interval, Keys

MAX_DEPTH = 10_000  # blocks: far beyond any model trained here (nam52 has 52), far below a hang

# Model settings that trees of megacpp once wrote into checkpoints and that have since been removed, none of
# which changed what the weights are: a saved config read back (resume, eval, sample, finetune) drops them.
# moe.fuse_shared_expert ran the shared expert in the routed experts' grouped GEMMs, the same values with the
# same parameters, and lost on a GPU (docs/decisions.md).
RETIRED_MODEL_SETTINGS = ("moe.fuse_shared_expert",)


def without_retired(saved_model: dict[str, Any]) -> dict[str, Any]:
    """A saved model config (`to_dict`'s shape) without the RETIRED_MODEL_SETTINGS it records."""
    retired = {tuple(dotted.split(".")) for dotted in RETIRED_MODEL_SETTINGS}

    def kept(section: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        return {key: kept(value, (*path, key)) if isinstance(value, dict) else value
                for key, value in section.items() if (*path, key) not in retired}

    return kept(saved_model, ())


@dataclass
class ModelConfig(ConfigSection):
    vocab_size: int = 4096  # replaced by the tokenizer's size when training
    d_model: int = 128
    depth: int = 10
    pattern: str = "AEMFR"
    norm_eps: float = 1e-6
    logit_softcap: float = 15.0  # final-logit soft cap; 0 = off
    # Implementation of the training loss head (megacpp/ops/softcap_xent.py): "auto" runs the fused
    # Triton loss on CUDA where it can (a soft-cap in (0, 40]) and the pure-PyTorch reference elsewhere
    # (CPU always); "reference" and "triton" force one ("triton" fails where it cannot run). The library
    # default stays "reference"; `small` and the GPU presets built on it turn "auto" on.
    loss_kernel: LossKernel = "reference"
    mtp_depth: int = 0  # multi-token-prediction heads (0 = off)
    mtp_loss_weight: float = 0.3
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mamba: Mamba3Config = field(default_factory=Mamba3Config)
    moe: MoEConfig = field(default_factory=MoEConfig)
    rnn: M2RNNConfig = field(default_factory=M2RNNConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    engram: EngramConfig = field(default_factory=EngramConfig)

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {
            "vocab_size": AT_LEAST_1,
            "d_model": AT_LEAST_1,
            # The pattern is expanded to depth as a Python string and the model builds one module per
            # block: a depth beyond any real model overflowed (OverflowError) or hung there instead of failing.
            "depth": Interval(1, MAX_DEPTH),
            "norm_eps": POSITIVE,
            "logit_softcap": NON_NEGATIVE,  # 0 = off
            "mtp_depth": NON_NEGATIVE,
            "mtp_loss_weight": NON_NEGATIVE,
        }

    def check(self, k: Keys) -> None:
        """The pattern, then the rules of each block kind it uses (in registry order), the Engram branches
        and the loss head. A kind's section is read by nothing but its blocks: its ranges hold everywhere,
        its rules only where the pattern builds it."""
        _pattern_fills_depth(self, k)
        for symbol, kind in BLOCK_KINDS.items():
            if symbol in self.pattern:
                getattr(self, kind.config_field).check(k.at(kind.config_field, d_model="d_model"))
        _engram_layers_in_depth(self, k)
        self.engram.check(k.at("engram"))
        _fused_loss_cap(self, k)


def _pattern_fills_depth(cfg: ModelConfig, k: Keys) -> None:
    """Unknown symbols and empty patterns; a depth shorter than the pattern, which would silently drop
    block kinds. A PatternConfigError, which code expecting the pattern parser's PatternError catches."""
    try:
        validate_pattern(cfg.pattern)
    except PatternError as exc:
        raise k.error("pattern", f"is not a valid pattern: {exc}", PatternConfigError) from None
    try:
        expand_pattern(cfg.pattern, cfg.depth)
    except PatternError as exc:
        raise k.error_among(("depth", "pattern"), str(exc), PatternConfigError) from None


def _engram_layers_in_depth(cfg: ModelConfig, k: Keys) -> None:
    """An Engram layer index outside [0, depth) matches no block: the branch would silently not exist."""
    bad = [i for i in cfg.engram.layers if not 0 <= i < cfg.depth]
    if bad:
        raise k.error_among(("engram.layers", "depth"),
                            f"block indices {bad} are outside [0, depth): no block would get the branch")


def _fused_loss_cap(cfg: ModelConfig, k: Keys) -> None:
    """loss_kernel "triton" asks for the fused loss, whose kernel needs a soft-cap in (0, MAX_CAP]; "auto"
    would fall back to the reference silently, an explicit request should fail before the first step."""
    cap = cfg.logit_softcap
    if cfg.loss_kernel == "triton" and not 0 < cap <= MAX_CAP:
        raise k.error_among(("loss_kernel", "logit_softcap"),
                            f"the fused loss kernel needs a logit_softcap in (0, {MAX_CAP:g}], got {cap:g}")
