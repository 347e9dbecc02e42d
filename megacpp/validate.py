"""The configuration gate: one pass over a merged Config, before any data or model work.

`validate_config` runs on every configuration a run is built from: at the end of `load_config`
(preset, TOML file, command line), in `from_dict` (a checkpoint's meta.json) and in the Trainer (a
Config built in Python). It checks, in this order, and raises at the first failure:

1. the type of every field, choices included (a Config built in Python never met the merge's checks);
2. per-key ranges (`RANGES`): sizes and intervals >= 1, rates finite and >= 0, fractions in their
   interval, timeouts > 0;
3. rules between keys (`RULES`), each with a docstring saying why it exists.

A block's section (model.attention for A, model.mamba for M, ...) is held to the widths the block
needs only when the pattern uses the block: the model never reads it otherwise. Ranges hold
everywhere: an out-of-range value is a mistake wherever it is.

Every error leads with the source of the key it names ("run.toml:4", "command line --model.depth",
"preset 'tiny'", ".../meta.json") and quotes each other key a rule involves with its own source.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megacpp.config import Config, ConfigError, Provenance, check_types
from megacpp.data.config import MIN_VOCAB_SIZE
from megacpp.errors import MegacppError
from megacpp.model.mamba3 import num_rope_angles
from megacpp.model.moe import grouped_dispatch_problem
from megacpp.model.pattern import PatternError, expand_pattern, validate_pattern
from megacpp.model.rope import LONG_CONTEXT_THETAS, SHORT_CONTEXT_THETA, rope_theta_for_length
from megacpp.ops.mamba3_fused import triton_size_reason
from megacpp.ops.softcap_xent import MAX_CAP
from megacpp.optim.kind_scales import parse_lr_scales
from megacpp.optim.schedule import WarmupStableDecay


class PatternConfigError(ConfigError, PatternError):
    """A model.pattern or model.depth problem found by the gate: a configuration error (the CLI's exit
    status 2, like every other) that code expecting HybridLM's PatternError still catches as one."""


# ---------------------------------------------------------------- keys, values and their sources


class _Keys:
    """Values of dotted keys under ``root`` (a Config, or one section of it named by ``prefix``), and
    the errors that quote them with their sources."""

    def __init__(self, root: Any, prefix: str, sources: Provenance | None) -> None:
        self.root, self.prefix, self.sources = root, prefix, sources

    def value(self, key: str) -> Any:
        obj = self.root
        for part in key.removeprefix(self.prefix).split("."):
            obj = getattr(obj, part)
        return obj

    def uses(self, symbol: str) -> bool:
        """Whether the model has blocks of this pattern symbol."""
        return symbol in self.value("model.pattern")

    def label(self, key: str) -> str:
        """``source: key``, as the merge's own errors start; just the key when no source is known."""
        return f"{self.sources.source(key)}: {key}" if self.sources else key

    def ref(self, key: str) -> str:
        """``key = value (source)``: how a rule quotes a key other than the one it leads with."""
        source = f" ({self.sources.source(key)})" if self.sources else ""
        return f"{key} = {self.value(key)!r}{source}"

    def error(self, key: str, why: str, kind: type[MegacppError] = ConfigError) -> MegacppError:
        """``source: key = value why``, for a rule about one key."""
        return kind(f"{self.label(key)} = {self.value(key)!r} {why}")

    def error_among(self, keys: Sequence[str], problem: str, kind: type[MegacppError] = ConfigError
                    ) -> MegacppError:
        """An error about several keys, led by the first one a merge set: the user most likely just
        changed it, and its file:line is where to look. The others follow with values and sources."""
        lead = next((key for key in keys if self.sources and self.sources.is_set(key)), keys[0])
        others = ", ".join(self.ref(key) for key in keys if key != lead)
        return kind(f"{self.label(lead)} = {self.value(lead)!r}: {problem}; {others}")


# ---------------------------------------------------------------- ranges


@dataclass(frozen=True)
class Interval:
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _number(x: float) -> str:
    """Integer bounds in full (2**64 - 1 as :g would read 1.84467e+19), others as :g."""
    return str(x) if isinstance(x, int) else f"{x:g}"


AT_LEAST_1 = Interval(1)
NON_NEGATIVE = Interval(0)
POSITIVE = Interval(0, low_open=True)
UNIT = Interval(0, 1)
BELOW_1 = Interval(0, 1, high_open=True)  # decay rates and betas: 1 would never forget
ABOVE_0_UNIT = Interval(0, 1, low_open=True)
SEED_MAX = 2**64 - 1  # torch's manual_seed and Generator.manual_seed take an unsigned 64-bit seed
SEED = Interval(0, SEED_MAX)
MAX_DEPTH = 10_000  # blocks: far beyond any model trained here (nam52 has 52), far below a hang

RANGES: dict[str, Interval] = {
    "model.vocab_size": AT_LEAST_1,
    "model.d_model": AT_LEAST_1,
    # The gate expands the pattern to depth as a Python string and the model builds one module per
    # block: a depth beyond any real model overflowed (OverflowError) or hung there instead of failing.
    "model.depth": Interval(1, MAX_DEPTH),
    "model.norm_eps": POSITIVE,
    "model.logit_softcap": NON_NEGATIVE,  # 0 = off
    "model.mtp_depth": NON_NEGATIVE,
    "model.mtp_loss_weight": NON_NEGATIVE,
    "model.attention.n_heads": AT_LEAST_1,
    "model.attention.n_kv_heads": AT_LEAST_1,
    "model.attention.head_dim": AT_LEAST_1,
    "model.attention.rope_theta": POSITIVE,
    "model.attention.max_seq_len": AT_LEAST_1,
    "model.attention.softcap": NON_NEGATIVE,  # 0 = off
    "model.attention.qk_clip_tau": POSITIVE,
    "model.mamba.d_state": AT_LEAST_1,
    "model.mamba.expand": AT_LEAST_1,
    "model.mamba.head_dim": AT_LEAST_1,
    "model.mamba.n_groups": AT_LEAST_1,
    "model.mamba.rope_fraction": ABOVE_0_UNIT,
    "model.mamba.A_floor": NON_NEGATIVE,
    "model.mamba.dt_min": POSITIVE,  # log-uniform init: log(0) is -inf
    "model.mamba.dt_max": POSITIVE,
    "model.mamba.dt_init_floor": NON_NEGATIVE,
    "model.mamba.chunk_size": AT_LEAST_1,
    "model.mamba.norm_eps": POSITIVE,
    "model.moe.n_experts": AT_LEAST_1,
    "model.moe.top_k": AT_LEAST_1,
    "model.moe.expert_hidden": AT_LEAST_1,
    "model.moe.capacity_factor": POSITIVE,
    "model.moe.bias_update_rate": NON_NEGATIVE,
    "model.rnn.n_heads": AT_LEAST_1,
    "model.rnn.key_dim": AT_LEAST_1,
    "model.rnn.value_dim": AT_LEAST_1,
    "model.rnn.dt_min": POSITIVE,  # log-uniform init
    "model.rnn.dt_max": POSITIVE,
    "model.rnn.A_init_min": POSITIVE,  # stored as log(A)
    "model.rnn.A_init_max": POSITIVE,
    "model.rnn.w_spectral_cap": NON_NEGATIVE,  # 0 = off
    "model.ffn.hidden": AT_LEAST_1,
    "model.engram.dim": AT_LEAST_1,
    "model.engram.ngram_heads": AT_LEAST_1,
    "model.engram.ngram_table_size": NON_NEGATIVE,  # 0 = next prime >= 2 * vocab
    "model.engram.ngram_dim": AT_LEAST_1,
    "optim.muon_lr": NON_NEGATIVE,
    "optim.muon_rms_lr": NON_NEGATIVE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.muon_momentum": BELOW_1,
    "optim.variance_beta2": BELOW_1,
    "optim.ns_steps": AT_LEAST_1,
    "optim.adamw_lr": NON_NEGATIVE,
    "optim.embed_lr": NON_NEGATIVE,
    "optim.head_lr": NON_NEGATIVE,
    "optim.adamw_beta1": BELOW_1,
    "optim.adamw_beta2": BELOW_1,
    "optim.adamw_eps": POSITIVE,
    "optim.adamw_weight_decay": NON_NEGATIVE,
    "optim.warmup_frac": UNIT,
    "optim.warmup_steps": NON_NEGATIVE,
    "optim.decay_frac": UNIT,
    "optim.decay_steps": NON_NEGATIVE,
    "optim.final_lr_frac": UNIT,
    "optim.grad_clip_norm": NON_NEGATIVE,  # 0 = off
    "data.min_bytes": NON_NEGATIVE,
    "data.max_bytes": NON_NEGATIVE,
    "data.max_document_bytes": AT_LEAST_1,
    "data.val_fraction": BELOW_1,  # 1 would leave nothing to train on
    "data.vocab_size": Interval(MIN_VOCAB_SIZE),  # 256 byte tokens and the special tokens
    "data.tokenizer_sample_bytes": AT_LEAST_1,
    "data.seq_len": AT_LEAST_1,
    "data.baseline_context_bytes": AT_LEAST_1,
    "data.shuffle_seed": SEED,  # the loader's generator takes train.seed + shuffle_seed: see _seeds_sum
    "train.steps": AT_LEAST_1,
    "train.seed": SEED,
    "train.time_budget_s": NON_NEGATIVE,  # 0 = no budget
    "train.batch_size": AT_LEAST_1,
    "train.grad_accum": AT_LEAST_1,
    "train.micro_batch": NON_NEGATIVE,  # 0 = the whole batch_size
    "train.oom_min_micro_batch": AT_LEAST_1,
    "train.eval_every": AT_LEAST_1,
    "train.eval_batches": AT_LEAST_1,
    "train.log_every": AT_LEAST_1,
    "train.ckpt_every": AT_LEAST_1,
    "train.keep_last": AT_LEAST_1,
    "train.sample_tokens": NON_NEGATIVE,
    "train.sample_temperature": NON_NEGATIVE,  # 0 = greedy
    "train.sample_top_k": NON_NEGATIVE,  # 0 = all tokens
    "compile.max_graph_breaks": NON_NEGATIVE,
    "compile.max_recompiles_after_warmup": NON_NEGATIVE,
    "dist.init_timeout_s": POSITIVE,
    "dist.step_timeout_s": POSITIVE,
    "dist.fingerprint_every": NON_NEGATIVE,  # 0 = only at checkpoints
}


def _check_range(k: _Keys, key: str, interval: Interval) -> None:
    value = k.value(key)
    if value is None:  # optional keys: None means "derive it", checked where derived
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise k.error(key, f"must be a finite number {interval.describe()}")
    if not interval.contains(value):
        raise k.error(key, f"must be {interval.describe()}")


# ---------------------------------------------------------------- rules between keys: model


Rule = Callable[[_Keys], None]


def _pattern_symbols(k: _Keys) -> None:
    """Unknown symbols and empty patterns: PatternError, the error HybridLM would raise."""
    try:
        validate_pattern(k.value("model.pattern"))
    except PatternError as exc:
        raise k.error("model.pattern", f"is not a valid pattern: {exc}", PatternConfigError) from None


def _depth_fills_pattern(k: _Keys) -> None:
    """Tiling to a depth shorter than the pattern would silently drop block kinds."""
    try:
        expand_pattern(k.value("model.pattern"), k.value("model.depth"))
    except PatternError as exc:
        raise k.error_among(("model.depth", "model.pattern"), str(exc), PatternConfigError) from None


def _attention_heads_group(k: _Keys) -> None:
    """Grouped-query attention: query head h reads kv head h // (n_heads / n_kv_heads)."""
    heads, kv_heads = k.value("model.attention.n_heads"), k.value("model.attention.n_kv_heads")
    if k.uses("A") and heads % kv_heads:
        raise k.error_among(("model.attention.n_heads", "model.attention.n_kv_heads"),
                            "n_heads must be a multiple of n_kv_heads (query heads share kv heads in groups)")


def _attention_head_dim_even(k: _Keys) -> None:
    """RoPE rotates pairs of dimensions."""
    if k.uses("A") and k.value("model.attention.head_dim") % 2:
        raise k.error("model.attention.head_dim", "must be even: RoPE rotates pairs of dimensions")


_MAMBA_WIDTH = ("model.mamba.head_dim", "model.mamba.expand", "model.d_model")


def _mamba_heads_fit(k: _Keys) -> None:
    """Mamba-3 splits its inner width expand * d_model into heads of head_dim."""
    inner = k.value("model.mamba.expand") * k.value("model.d_model")
    if k.uses("M") and inner % k.value("model.mamba.head_dim"):
        raise k.error_among(_MAMBA_WIDTH, f"head_dim must divide Mamba-3's inner width expand * d_model = {inner}")


def _mamba_groups_divide(k: _Keys) -> None:
    """B and C are shared by groups of heads, so the head count splits into n_groups."""
    if not k.uses("M"):
        return
    heads = k.value("model.mamba.expand") * k.value("model.d_model") // k.value("model.mamba.head_dim")
    if heads % k.value("model.mamba.n_groups"):
        raise k.error_among(("model.mamba.n_groups", *_MAMBA_WIDTH),
                            f"n_groups must divide the {heads} Mamba-3 heads (expand * d_model / head_dim)")


def _mamba_rope_angles(k: _Keys) -> None:
    """The data-dependent RoPE on B/C needs at least one rotated pair of state dimensions."""
    d_state, fraction = k.value("model.mamba.d_state"), k.value("model.mamba.rope_fraction")
    if k.uses("M") and num_rope_angles(d_state, fraction) < 1:
        raise k.error_among(("model.mamba.rope_fraction", "model.mamba.d_state"),
                            "rope_fraction * d_state must cover at least one pair of state dimensions (>= 2)")


def _mamba_triton_sizes(k: _Keys) -> None:
    """scan_kernel "triton" asks for the fused kernels, which support a range of sizes; "auto" would fall
    back to the reference silently, an explicit request should fail before the first forward instead."""
    if not k.uses("M") or k.value("model.mamba.scan_kernel") != "triton":
        return
    d_state = k.value("model.mamba.d_state")
    n_angles = num_rope_angles(d_state, k.value("model.mamba.rope_fraction"))
    reason = triton_size_reason(k.value("model.mamba.head_dim"), d_state, n_angles, k.value("model.mamba.chunk_size"))
    if reason is not None:
        raise k.error_among(("model.mamba.scan_kernel", "model.mamba.chunk_size", "model.mamba.d_state",
                             "model.mamba.head_dim"), f"the Triton scan kernels do not support this size: {reason}")


def _fused_loss_cap(k: _Keys) -> None:
    """loss_kernel "triton" asks for the fused loss, whose kernel needs a soft-cap in (0, MAX_CAP]; "auto"
    would fall back to the reference silently, an explicit request should fail before the first step."""
    cap = k.value("model.logit_softcap")
    if k.value("model.loss_kernel") == "triton" and not 0 < cap <= MAX_CAP:
        raise k.error_among(("model.loss_kernel", "model.logit_softcap"),
                            f"the fused loss kernel needs a logit_softcap in (0, {MAX_CAP:g}], got {cap:g}")


def _check_ordered(k: _Keys, low_key: str, high_key: str) -> None:
    if k.value(low_key) > k.value(high_key):
        low, high = low_key.rsplit(".", 1)[1], high_key.rsplit(".", 1)[1]
        raise k.error_among((low_key, high_key), f"{low} must be <= {high}: they bound an init range")


def _mamba_dt_range(k: _Keys) -> None:
    """dt starts log-uniform in [dt_min, dt_max]; torch refuses a reversed range at model build."""
    if k.uses("M"):
        _check_ordered(k, "model.mamba.dt_min", "model.mamba.dt_max")


def _rnn_dt_range(k: _Keys) -> None:
    """As for Mamba-3: M2RNN's dt starts log-uniform in [dt_min, dt_max]."""
    if k.uses("R"):
        _check_ordered(k, "model.rnn.dt_min", "model.rnn.dt_max")


def _rnn_decay_range(k: _Keys) -> None:
    """M2RNN's decay rate A starts uniform in [A_init_min, A_init_max]; torch refuses a reversed range."""
    if k.uses("R"):
        _check_ordered(k, "model.rnn.A_init_min", "model.rnn.A_init_max")


def _moe_top_k(k: _Keys) -> None:
    """Each token picks top_k distinct experts."""
    if k.uses("E") and k.value("model.moe.top_k") > k.value("model.moe.n_experts"):
        raise k.error_among(("model.moe.top_k", "model.moe.n_experts"),
                            "top_k must be <= n_experts: each token picks distinct experts")


def _moe_grouped_dispatch(k: _Keys) -> None:
    """dispatch = "grouped" forces the dropless grouped GEMMs: token-choice routing, a torch with
    grouped_mm and 16-byte-aligned rows, or the model cannot be built ("auto" falls back instead)."""
    if k.uses("E") and k.value("model.moe.dispatch") == "grouped":
        problem = grouped_dispatch_problem(k.value("model.d_model"), k.value("model.moe"))
        if problem:
            keys = ("model.moe.dispatch", "model.moe.routing", "model.d_model", "model.moe.expert_hidden")
            raise k.error_among(keys, problem)


def _engram_layers_in_depth(k: _Keys) -> None:
    """An Engram layer index outside [0, depth) matches no block: the branch would silently not exist."""
    depth = k.value("model.depth")
    bad = [i for i in k.value("model.engram.layers") if not 0 <= i < depth]
    if bad:
        raise k.error_among(("model.engram.layers", "model.depth"),
                            f"block indices {bad} are outside [0, depth): no block would get the branch")


def _ngram_orders(k: _Keys) -> None:
    """The n-gram hash embeds n-grams of order >= 2 (order 1 is the token embedding itself)."""
    orders = k.value("model.engram.ngram_orders")
    if k.value("model.engram.ngram_hash") and (not orders or min(orders) < 2):
        raise k.error("model.engram.ngram_orders", "needs one or more orders, each >= 2 (1 is the token embedding)")


# ---------------------------------------------------------------- rules between keys: data, train


def _byte_limits(k: _Keys) -> None:
    """A document must be able to pass both size limits."""
    if k.value("data.min_bytes") > k.value("data.max_bytes"):
        raise k.error_among(("data.min_bytes", "data.max_bytes"), "min_bytes must be <= max_bytes")


def _extensions_dotted(k: _Keys) -> None:
    """Extensions are compared with Path.suffix, which starts with a dot: 'cpp' would match nothing."""
    for key in ("data.extensions", "data.text_extensions", "data.jsonl_extensions"):
        bad = [e for e in k.value(key) if not e.startswith(".")]
        if bad:
            raise k.error(key, f"has extensions {bad} without the leading '.'")


def _corpus_names_a_path(k: _Keys) -> None:
    """An empty corpus list would reach the data step and find nothing to train on; unset means the
    default corpus, so the empty list is never what was meant."""
    corpus = k.value("data.corpus")
    if isinstance(corpus, list) and not [p for p in corpus if p.strip()]:
        raise k.error("data.corpus", "names no path; expected one or more files or directories, \"system\" "
                      "(every C/C++ include tree on the machine), or no value for the default corpus")


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _device_form(k: _Keys) -> None:
    """train.device is auto, cpu, cuda or cuda:N; whether that device exists is checked when used."""
    if not _DEVICE.fullmatch(k.value("train.device")):
        raise k.error("train.device", "must be auto, cpu, cuda or cuda:N")


def _micro_batch_divides(k: _Keys) -> None:
    """Every micro-batch of a batch has the same size: a ragged last one would weigh its tokens
    differently in the loss and compile another graph."""
    micro, batch = k.value("train.micro_batch"), k.value("train.batch_size")
    if micro and batch % micro:
        raise k.error_among(("train.micro_batch", "train.batch_size"),
                            "the micro-batch must divide train.batch_size (0 = the whole batch)")


# ---------------------------------------------------------------- rules: optim


def _lr_scales_well_formed(k: _Keys) -> None:
    """Each entry is <kind>=<factor>: a block letter and a finite factor >= 0, each kind once. The
    optimizer's own parser decides, so the gate and the optimizer cannot disagree."""
    try:
        parse_lr_scales(k.value("optim.lr_scale_by_kind"))
    except ValueError as exc:
        raise k.error("optim.lr_scale_by_kind", f"is not a list of <kind>=<factor> entries: {exc}") from None


# ---------------------------------------------------------------- rules between sections


def _seq_len_fits_rope(k: _Keys) -> None:
    """Attention's RoPE tables have max_seq_len rows; a longer training row fails in the first forward.
    The tables are a model setting, recorded in every checkpoint: the gate asks for them rather than the
    model quietly sizing itself from the data. The message names the documented long-context base period."""
    seq_len = k.value("data.seq_len")
    if k.uses("A") and seq_len > k.value("model.attention.max_seq_len"):
        theta = rope_theta_for_length(seq_len) if seq_len <= LONG_CONTEXT_THETAS[-1][0] else None
        advice = f" and, as documented for this length, --model.attention.rope_theta {theta:g}" \
            if theta is not None and theta != SHORT_CONTEXT_THETA else ""
        raise k.error_among(("data.seq_len", "model.attention.max_seq_len"),
                            "data.seq_len exceeds model.attention.max_seq_len, the length of the RoPE tables "
                            f"(raise the latter: --model.attention.max_seq_len {seq_len}{advice})")


def _mtp_within_seq_len(k: _Keys) -> None:
    """MTP head k predicts the token k ahead inside the row: with k >= seq_len it has no target and
    its loss is NaN from the first step."""
    if k.value("model.mtp_depth") >= k.value("data.seq_len"):
        raise k.error_among(("model.mtp_depth", "data.seq_len"),
                            "mtp_depth must be < seq_len: the deepest MTP head would have no target")


def _seeds_sum(k: _Keys) -> None:
    """The data loader is seeded with train.seed + data.shuffle_seed: the sum, like each seed, must be an
    unsigned 64-bit seed, the range every generator of a run takes."""
    if k.value("train.seed") + k.value("data.shuffle_seed") > SEED_MAX:
        raise k.error_among(("data.shuffle_seed", "train.seed"),
                            f"train.seed + data.shuffle_seed seeds the data loader and must be <= {SEED_MAX} "
                            "(2**64 - 1)")


def _schedule_fits_run(k: _Keys) -> None:
    """Warmup plus decay must fit in train.steps; the optimizer refuses it otherwise, but only after the
    data work. The schedule's own constructor decides, so the two cannot disagree."""
    try:
        WarmupStableDecay.from_config(k.value("optim"), k.value("train.steps"))
    except ValueError as exc:
        keys = (_phase_key(k, "warmup"), _phase_key(k, "decay"), "train.steps")
        raise k.error_among(keys, f"the learning-rate schedule does not fit the run: {exc}") from None


def _lr_scales_name_used_kinds(k: _Keys) -> None:
    """A learning-rate factor for a block kind the pattern does not use would change nothing: an option
    that does nothing is an error (issue 11)."""
    absent = [kind for kind in parse_lr_scales(k.value("optim.lr_scale_by_kind")) if not k.uses(kind)]
    if absent:
        raise k.error_among(("optim.lr_scale_by_kind", "model.pattern"),
                            f"block kind(s) {', '.join(absent)} do not occur in the pattern, so their learning-rate "
                            "factors would change nothing (drop them, or pass --optim.lr_scale_by_kind '' for none; "
                            "the `dense` preset is `small` with pattern AF and no factors)")


def _phase_key(k: _Keys, phase: str) -> str:
    """The key that sets a schedule phase's length: *_steps when given, else *_frac."""
    return f"optim.{phase}_steps" if k.value(f"optim.{phase}_steps") is not None else f"optim.{phase}_frac"


RULES: dict[str, tuple[Rule, ...]] = {
    "model": (
        _pattern_symbols,
        _depth_fills_pattern,
        _attention_heads_group,
        _attention_head_dim_even,
        _mamba_heads_fit,
        _mamba_groups_divide,
        _mamba_rope_angles,
        _mamba_triton_sizes,
        _fused_loss_cap,
        _mamba_dt_range,
        _moe_top_k,
        _moe_grouped_dispatch,
        _rnn_dt_range,
        _rnn_decay_range,
        _engram_layers_in_depth,
        _ngram_orders,
    ),
    "data": (_byte_limits, _extensions_dotted, _corpus_names_a_path),
    "train": (_device_form, _micro_batch_divides),
    "optim": (_lr_scales_well_formed,),
    "": (_seq_len_fits_rope, _mtp_within_seq_len, _seeds_sum, _schedule_fits_run,
         _lr_scales_name_used_kinds),
}


# ---------------------------------------------------------------- entry points


def _run(k: _Keys, section: str | None) -> None:
    """Types, then ranges, then rules, of one section (or of everything when ``section`` is None)."""
    check_types(k.root, k.label, k.prefix)
    for key, interval in RANGES.items():
        if key.startswith(k.prefix):
            _check_range(k, key, interval)
    for name, rules in RULES.items():
        if section is None or name == section:
            for rule in rules:
                rule(k)


def validate_config(cfg: Config, sources: Provenance | None = None) -> None:
    """Raise ConfigError (PatternConfigError for the pattern) at the first problem, naming the key and,
    when ``sources`` is given, where its value came from."""
    _run(_Keys(cfg, "", sources), None)


def validate_section(section: Any, name: str) -> None:
    """The types, ranges and rules of one section alone (e.g. a DataConfig built in Python, before
    data work); rules that need other sections are left to `validate_config`."""
    _run(_Keys(section, f"{name}.", None), name)
