"""Compile log classifier: a known-noise allowlist and an always-alert list.

Dynamo and Inductor print a lot; a few lines matter. Noise: Triton specialization warnings during
warmup, and autotune "Ignoring this choice" unless the step time jumped at the same time (then the
autotune subprocess most likely ran out of memory and its pick is suspect). Always alert: recompile
cap hits (that frame runs eagerly from then on, or the run stops) and graph breaks above the bound.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from enum import Enum


class LogKind(str, Enum):
    NOISE = "noise"  # known and harmless: drop
    COUNT = "count"  # counted against a bound (graph breaks within it)
    ALERT = "alert"  # always a regression: surface it
    OTHER = "other"  # not recognised: pass through unchanged


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    why: str


def _rule(name: str, pattern: str, why: str) -> Rule:
    return Rule(name, re.compile(pattern), why)


NOISE_RULES: tuple[Rule, ...] = (
    _rule("triton_specialization", r"native_specialize_impl", "Triton specialization during warmup, not a break"),
    _rule(
        "autotune_choice_skipped",
        r"[Ii]gnoring this choice",
        "an autotune candidate failed to run; harmless unless the step time jumped",
    ),
)
ALERT_RULES: tuple[Rule, ...] = (
    _rule(
        "recompile_limit_hit",
        r"hit config\.(?:accumulated_)?(?:recompile_limit|cache_size_limit)",
        "a frame hit the recompile cap: it now runs eagerly (or the run stops with fail_on_recompile_limit_hit)",
    ),
    _rule(
        "recompile_limit_failure",
        r"FailOnRecompileLimitHit",
        "hard failure at the recompile cap",
    ),
)
BREAK_RULE = _rule(
    "graph_break",
    r"Graph break(?: \([^)]*\))? in user code at (?P<where>\S+)",
    "one graph break (TORCH_LOGS=graph_breaks header line)",
)
AUTOTUNE_OOM = "autotune_oom"
BREAKS_ABOVE_BOUND = "graph_breaks_above_bound"


@dataclass(frozen=True)
class Verdict:
    kind: LogKind
    rule: str  # rule name, "" for OTHER
    why: str


class LogClassifier:
    """Classify compile log lines; counts graph-break lines and alerts once they exceed `break_bound`."""

    def __init__(self, break_bound: int = 0) -> None:
        self.break_bound = break_bound
        self.breaks = 0
        self.counts: Counter[str] = Counter()

    def classify(self, line: str, *, step_time_jumped: bool = False) -> Verdict:
        """Classify one line. `step_time_jumped`: the step time rose sharply around this line."""
        verdict = self._classify(line, step_time_jumped)
        if verdict.rule:
            self.counts[verdict.rule] += 1
        return verdict

    def _classify(self, line: str, step_time_jumped: bool) -> Verdict:
        for rule in ALERT_RULES:
            if rule.pattern.search(line):
                return Verdict(LogKind.ALERT, rule.name, rule.why)
        match = BREAK_RULE.pattern.search(line)
        if match:
            self.breaks += 1
            if self.breaks > self.break_bound:
                why = f"graph break #{self.breaks} at {match['where']} exceeds the bound of {self.break_bound}"
                return Verdict(LogKind.ALERT, BREAKS_ABOVE_BOUND, why)
            return Verdict(LogKind.COUNT, BREAK_RULE.name, BREAK_RULE.why)
        for rule in NOISE_RULES:
            if rule.pattern.search(line):
                if rule.name == "autotune_choice_skipped" and step_time_jumped:
                    return Verdict(LogKind.ALERT, AUTOTUNE_OOM, "autotune choice failed as step time jumped: OOM?")
                return Verdict(LogKind.NOISE, rule.name, rule.why)
        return Verdict(LogKind.OTHER, "", "")
