"""Compile log classifier: the lines of Dynamo's and Inductor's logs that always alert, and graph breaks
counted against their bound.

Dynamo and Inductor print a lot; `CompileHealth` feeds the classifier every warning of both loggers
and acts on alerts only: recompile cap hits (that frame runs eagerly from then on, or the run stops),
graph breaks above the bound, an autotune candidate that failed (Inductor drops it with "Ignoring this
choice": in seed 000 that was a benchmark subprocess running out of GPU memory, which left the slower
choices and later took the run down) and Triton running out of shared memory or registers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class LogKind(str, Enum):
    COUNT = "count"  # counted against a bound (graph breaks within it)
    ALERT = "alert"  # always a regression: surface it
    OTHER = "other"  # not one of the rules: pass through unchanged


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    why: str


def _rule(name: str, pattern: str, why: str) -> Rule:
    return Rule(name, re.compile(pattern), why)


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
    _rule(
        "autotune_choice_failed",
        r"Ignoring this choice",
        "an autotune candidate failed to benchmark (often out of GPU memory) and was dropped",
    ),
    _rule(
        "triton_out_of_resources",
        r"OutOfResources|out of resource: (?:shared memory|registers)",
        "a Triton kernel asked for more shared memory or registers than the GPU has",
    ),
)
BREAK_RULE = _rule(
    "graph_break",
    r"Graph break(?: \([^)]*\))? in user code at (?P<where>\S+)",
    "one graph break (TORCH_LOGS=graph_breaks header line)",
)
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

    def classify(self, line: str) -> Verdict:
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
        return Verdict(LogKind.OTHER, "", "")
