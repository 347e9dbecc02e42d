"""The configuration gate: one pass over a merged Config, before any data or model work.

`validate_config` runs on every configuration a run is built from: at the end of `load_config`
(preset, TOML file, command line), in `from_dict` (a checkpoint's meta.json) and in the Trainer (a
Config built in Python). It checks, in this order, and raises at the first failure:

1. the type of every field, choices included (a Config built in Python never met the merge's checks);
2. the ranges of every section (`ConfigSection.ranges`, megacpp.rules), depth-first in field order, and
   those of the optimizers' settings (`OptimizerSpec.ranges`, from megacpp.optim.registry): sizes and
   intervals >= 1, rates finite and >= 0, fractions in their interval, timeouts > 0;
3. the rules of each section (`ConfigSection.check`), defined beside the section's fields. The model's
   holds each block kind the pattern uses to its own section's rules, found through the block registry
   (megacpp.model.registry): a section the model never reads is held to its ranges only;
4. the rules between sections (`RULES`, below), each with a docstring saying why it exists.

Every error leads with the source of the key it names ("run.toml:4", "command line --model.depth",
"preset 'tiny'", ".../meta.json") and quotes each other key a rule involves with its own source.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from megacpp.config import Config
from megacpp.model.rope_theta import LONG_CONTEXT_THETAS, SHORT_CONTEXT_THETA, rope_theta_for_length
from megacpp.optim.kind_scales import parse_lr_scales
from megacpp.optim.registry import OPTIMIZERS
from megacpp.optim.schedule import WarmupStableDecay
from megacpp.rules import SEED_MAX, Interval, Keys, Provenance, check_ranges, check_types, sections


def section_ranges(path: str, section: Any) -> list[Mapping[str, Interval]]:
    """The ranges the section at dotted ``path`` of a Config is held to: its own, and for the optimizer
    section first those of each registered optimizer's settings, in registry order."""
    if path == "optim":
        return [*(spec.ranges for spec in OPTIMIZERS.values()), section.ranges()]
    return [section.ranges()]


# ---------------------------------------------------------------- rules between sections


Rule = Callable[[Keys], None]


def _uses(k: Keys, symbol: str) -> bool:
    """Whether the model has blocks of this pattern symbol."""
    return symbol in k.value("model.pattern")


def _seq_len_fits_rope(k: Keys) -> None:
    """Attention's RoPE tables have max_seq_len rows; a longer training row fails in the first forward.
    The tables are a model setting, recorded in every checkpoint: the gate asks for them rather than the
    model quietly sizing itself from the data. The message names the documented long-context base period."""
    seq_len = k.value("data.seq_len")
    if _uses(k, "A") and seq_len > k.value("model.attention.max_seq_len"):
        theta = rope_theta_for_length(seq_len) if seq_len <= LONG_CONTEXT_THETAS[-1][0] else None
        advice = f" and, as documented for this length, --model.attention.rope_theta {theta:g}" \
            if theta is not None and theta != SHORT_CONTEXT_THETA else ""
        raise k.error_among(("data.seq_len", "model.attention.max_seq_len"),
                            "data.seq_len exceeds model.attention.max_seq_len, the length of the RoPE tables "
                            f"(raise the latter: --model.attention.max_seq_len {seq_len}{advice})")


def _mtp_within_seq_len(k: Keys) -> None:
    """MTP head k predicts the token k ahead inside the row: with k >= seq_len it has no target and
    its loss is NaN from the first step."""
    if k.value("model.mtp_depth") >= k.value("data.seq_len"):
        raise k.error_among(("model.mtp_depth", "data.seq_len"),
                            "mtp_depth must be < seq_len: the deepest MTP head would have no target")


def _seeds_sum(k: Keys) -> None:
    """The data loader is seeded with train.seed + data.shuffle_seed: the sum, like each seed, must be an
    unsigned 64-bit seed, the range every generator of a run takes."""
    if k.value("train.seed") + k.value("data.shuffle_seed") > SEED_MAX:
        raise k.error_among(("data.shuffle_seed", "train.seed"),
                            f"train.seed + data.shuffle_seed seeds the data loader and must be <= {SEED_MAX} "
                            "(2**64 - 1)")


def _schedule_fits_run(k: Keys) -> None:
    """Warmup plus decay must fit in train.steps; the optimizer refuses it otherwise, but only after the
    data work. The schedule's own constructor decides, so the two cannot disagree."""
    try:
        WarmupStableDecay.from_config(k.value("optim"), k.value("train.steps"))
    except ValueError as exc:
        keys = (_phase_key(k, "warmup"), _phase_key(k, "decay"), "train.steps")
        raise k.error_among(keys, f"the learning-rate schedule does not fit the run: {exc}") from None


def _phase_key(k: Keys, phase: str) -> str:
    """The key that sets a schedule phase's length: *_steps when given, else *_frac."""
    return f"optim.{phase}_steps" if k.value(f"optim.{phase}_steps") is not None else f"optim.{phase}_frac"


def _lr_scales_name_used_kinds(k: Keys) -> None:
    """A learning-rate factor for a block kind the pattern does not use would change nothing: an option
    that does nothing is an error (issue 11)."""
    absent = [kind for kind in parse_lr_scales(k.value("optim.lr_scale_by_kind")) if not _uses(k, kind)]
    if absent:
        raise k.error_among(("optim.lr_scale_by_kind", "model.pattern"),
                            f"block kind(s) {', '.join(absent)} do not occur in the pattern, so their learning-rate "
                            "factors would change nothing (drop them, or pass --optim.lr_scale_by_kind '' for none; "
                            "the `dense` preset is `small` with pattern AF and no factors)")


def _cudagraphs_need_cuda(k: Keys) -> None:
    """CUDA graphs exist only on CUDA: `on` with the CPU named is refused here, before the data work (a device
    left auto is known only when the Trainer starts, which checks it before its own data work)."""
    if k.value("compile.cudagraphs") == "on" and k.value("train.device") == "cpu":
        raise k.error_among(("compile.cudagraphs", "train.device"),
                            "CUDA graphs need a CUDA device (use auto or off)")


RULES: tuple[Rule, ...] = (_seq_len_fits_rope, _mtp_within_seq_len, _seeds_sum, _schedule_fits_run,
                           _lr_scales_name_used_kinds, _cudagraphs_need_cuda)


# ---------------------------------------------------------------- entry point


def validate_config(cfg: Config, sources: Provenance | None = None) -> None:
    """Raise ConfigError (PatternConfigError for the pattern) at the first problem, naming the key and,
    when ``sources`` is given, where its value came from."""
    k = Keys(cfg, "", sources)
    check_types(cfg, k.label)
    for path, section in sections(cfg):
        if path:  # the Config itself is no section: its rules are those between sections
            for ranges in section_ranges(path, section):
                check_ranges(ranges, k.at(path))
    for f in dataclasses.fields(cfg):
        getattr(cfg, f.name).check(k.at(f.name))
    for rule in RULES:
        rule(k)

