"""Compile health: per-callsite graphs, breaks, recompiles, cap hits and compile time, with bounds.

A callsite is one code object: Dynamo's cache, its recompile cap and its guards are per code object,
so all blocks of one class are one callsite. Sources: `torch._dynamo.utils.get_compilation_metrics()`
(one entry per frame compile: restart reasons = graph breaks, `recompile_reason` = the failing guard,
`fail_type`), compile start/end hooks in `torch._dynamo.callback` (wall time, including lazy backward
compiles), Dynamo's graph-break reasons (each with the user stack; its innermost frame is the break
site) and the Dynamo logger (recompile-cap hits, which name the function).

The break bound counts distinct break sites (file:line) in code outside torch: one planted break in a
mixer shows up in two compiled frames (the block that inlined the mixer, then the mixer's own frame
run after the break) but is one site. Sites inside torch itself (the deliberate breaks around
``torch.optim`` steps) are reported, not bounded.
"""
from __future__ import annotations

import copy
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.callback import CallbackArgs, callback_handler
from torch._dynamo.utils import get_compilation_metrics, graph_break_reasons

from megacpp.compile.config import CompileConfig
from megacpp.compile.logs import ALERT_RULES, LogClassifier, LogKind
from megacpp.compile.regions import CompiledModel
from megacpp.errors import MegacppError

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# Loggers whose warnings the classifier reads: Dynamo's (breaks, recompile caps) and Inductor's (autotune,
# Triton compile failures surface there).
TAPPED_LOGGERS = ("torch._dynamo", "torch._inductor")
_RESUME_PREFIX = "torch_dynamo_resume_in_"
_COMPILE_ID = re.compile(r"(\d+)/(\d+)")
_LIMIT_FUNCTION = re.compile(r"function: '(?P<name>[^']+)' \((?P<file>.+):(?P<line>\d+)\)")


class CompileHealthError(MegacppError, RuntimeError):
    """A compile-health bound was exceeded (raised in tests and CI)."""


class CompileHealthWarning(UserWarning):
    """A compile-health bound was exceeded (training keeps going, loudly)."""


@dataclass(frozen=True)
class HealthBounds:
    graph_breaks: int = 0  # distinct break sites outside torch
    recompiles_after_warmup: int = 0
    cache_limit_hits: int = 0
    graphs: int | None = None  # optional cap on graphs over all callsites


def bounds_for(cfg: CompileConfig) -> HealthBounds:
    """The expected bounds for a compile configuration."""
    return HealthBounds(cfg.max_graph_breaks, cfg.max_recompiles_after_warmup)


@dataclass
class CallsiteStats:
    name: str
    upstream: bool = False  # code lives in torch: breaks reported, not bounded
    modules: int = 0  # compiled regions that run this code (blocks of one class share it)
    graphs: int = 0
    breaks: int = 0  # compiled frames of this callsite that broke
    break_reasons: list[str] = field(default_factory=list)
    recompiles: int = 0  # every compile of an already-cached frame, warmup included
    recompiles_after_warmup: int = 0
    recompile_guards: list[str] = field(default_factory=list)
    late_recompile_guards: list[str] = field(default_factory=list)  # those after warmup
    guards: int = 0  # guards over all cache entries of this callsite
    cache_limit_hits: int = 0
    compile_time_s: float = 0.0
    failures: list[str] = field(default_factory=list)


def _first_line(text: str) -> str:
    return " ".join(text.strip().splitlines()[0].split()) if text and text.strip() else ""


def _reason_text(reason: str) -> str:
    """A break reason's headline plus its explanation line (which names the culprit), one line."""
    explanation = next((line.strip()[len("Explanation:"):].strip() for line in reason.splitlines()
                        if line.strip().startswith("Explanation:")), "")
    head = _first_line(reason)
    return f"{head}: {' '.join(explanation.split())}" if explanation else head


_GUARD_LINE = re.compile(r"^\s*(?:- )?(\d+/\d+: .*)$")
_VARIANT_GUARDS = ("___check_type_id", "___check_obj_id")  # "this entry is another variant": noise


def _guard_text(reason: str) -> str:
    """The failing guards of a recompile reason or RecompileError message, without source comments.

    One line per cache entry that was tried ('0/1: self.temperature == 1.0  # src  # file:line');
    entries rejected only because they belong to another block variant are dropped when others remain.
    """
    guards = []
    for line in reason.splitlines():
        match = _GUARD_LINE.match(line)
        if match:
            expression, _, rest = match.group(1).partition(" #")
            hint = rest[rest.find("(HINT"):] if "(HINT" in rest else ""
            guards.append(" ".join(f"{expression} {hint}".split()))
    informative = [g for g in guards if not any(v in g for v in _VARIANT_GUARDS)]
    return " | ".join(informative or guards) or _first_line(reason)


def _strict_default() -> bool:
    return bool(os.environ.get("CI")) or "PYTEST_CURRENT_TEST" in os.environ


class _DynamoLogTap(logging.Handler):
    def __init__(self, health: CompileHealth) -> None:
        super().__init__(logging.WARNING)
        self.health = health

    def emit(self, record: logging.LogRecord) -> None:
        self.health._on_log(record.getMessage())


class CompileHealth:
    """Counts compile events from creation on (earlier compiles are ignored) until `close`."""

    def __init__(self, bounds: HealthBounds | None = None, report: Callable[[str], None] | None = None) -> None:
        self.bounds = bounds or HealthBounds()
        self.alerts: list[str] = []
        # Told at once of each alert and of each recompile after warmup (the run's log), not only in the
        # summary at the end of the run.
        self.report = report
        self.classifier = LogClassifier(self.bounds.graph_breaks)
        self._stats: dict[str, CallsiteStats] = {}
        self._labels: dict[tuple[str, int], str] = {}
        self._frame_labels: dict[str, str] = {}
        self._pending_time: dict[str, float] = {}
        self._started: dict[str, float] = {}
        self._seen = {self._key(e) for e in get_compilation_metrics()}
        self._reasons_seen = len(graph_break_reasons)
        self._sites: dict[str, str] = {}
        self._compiled: list[CompiledModel] = []
        self._warm = False
        self._tap = _DynamoLogTap(self)
        self.install()

    # -- wiring -------------------------------------------------------------------------------
    def install(self) -> None:
        """Install the compile hooks and log tap (idempotent). `torch._dynamo.reset()` clears hooks."""
        if self._on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._on_start)
        if self._on_end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._on_end)
        for name in TAPPED_LOGGERS:
            if self._tap not in logging.getLogger(name).handlers:
                logging.getLogger(name).addHandler(self._tap)

    def after_reset(self) -> None:
        """Re-arm after `torch._dynamo.reset()` (call `refresh` before it): ids restart, hooks were cleared."""
        self._reasons_seen = 0
        self._frame_labels.clear()
        self._started.clear()
        self.install()

    def close(self) -> None:
        self.refresh()
        if self._on_start in callback_handler.start_callbacks:
            callback_handler.remove_start_callback(self._on_start)
        if self._on_end in callback_handler.end_callbacks:
            callback_handler.remove_end_callback(self._on_end)
        for name in TAPPED_LOGGERS:
            logging.getLogger(name).removeHandler(self._tap)

    def __enter__(self) -> CompileHealth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attach(self, compiled: CompiledModel) -> None:
        """Name the callsites of a compiled model after its region classes."""
        self._compiled.append(compiled)
        for region in compiled.regions:
            code = getattr(type(region.module), region.method).__code__
            label = f"{type(region.module).__qualname__}.{region.method}"
            self._labels[(code.co_filename, code.co_firstlineno)] = label
            self._callsite(label, code.co_filename).modules += 1

    @property
    def warm(self) -> bool:
        """Whether `end_warmup` was called: from then on a recompile is a regression."""
        return self._warm

    def end_warmup(self) -> None:
        """Warmup is over: stop marking the batch axis; from now on every recompile counts against the bound."""
        self.refresh()
        for compiled in self._compiled:
            compiled.end_warmup()
        self._warm = True

    # -- event sources ------------------------------------------------------------------------
    def _on_start(self, args: CallbackArgs) -> None:
        self.refresh()  # the previous compile's metrics entry is recorded after its end hook
        self._started[str(args.compile_id)] = time.perf_counter()

    def _on_end(self, args: CallbackArgs) -> None:
        cid = str(args.compile_id)
        start = self._started.pop(cid, None)
        if start is None:
            return
        elapsed = time.perf_counter() - start
        label = self._frame_labels.get(self._frame_id(cid))
        if label is None:
            self._pending_time[cid] = self._pending_time.get(cid, 0.0) + elapsed
        else:
            self._stats[label].compile_time_s += elapsed

    def _on_log(self, message: str) -> None:
        verdict = self.classifier.classify(message)
        if verdict.kind is not LogKind.ALERT:
            return
        self.alerts.append(_first_line(message))
        if self.report is not None:
            self.report(f"compile alert ({verdict.rule}): {_first_line(message)[:300]} -- {verdict.why}")
        match = _LIMIT_FUNCTION.search(message)
        if verdict.rule == ALERT_RULES[0].name and match:
            label = self._label(match["file"], int(match["line"]), match["name"])
            self._stats[label].cache_limit_hits += 1

    # -- bookkeeping --------------------------------------------------------------------------
    @staticmethod
    def _key(entry: Any) -> tuple:
        return (str(entry.compile_id), entry.start_time_us, entry.co_name)

    @staticmethod
    def _frame_id(compile_id: str) -> str:
        match = _COMPILE_ID.search(compile_id)
        return match.group(1) if match else compile_id

    def _callsite(self, label: str, filename: str) -> CallsiteStats:
        if label not in self._stats:
            self._stats[label] = CallsiteStats(label, upstream=filename.startswith(_TORCH_DIR))
        return self._stats[label]

    def _label(self, filename: str, lineno: int, name: str) -> str:
        if name.startswith(_RESUME_PREFIX):
            # A resume function continues its parent after a break: the enclosing code in the same file.
            parents = [(line, label) for (f, line), label in self._labels.items() if f == filename and line <= lineno]
            if parents:
                return max(parents)[1]
        key = (filename, lineno)
        if key not in self._labels:
            self._labels[key] = f"{name} ({os.path.basename(filename)}:{lineno})"
        label = self._labels[key]
        self._callsite(label, filename)
        return label

    def refresh(self) -> None:
        """Take in compile events recorded since the last call (the hooks do this on every compile)."""
        for reason in graph_break_reasons[self._reasons_seen:]:
            # The site is the innermost frame outside torch (a break raised inside nn.Module.__call__
            # belongs to the user line that made the call); all-torch stacks are torch's own breaks.
            own = [f for f in reason.user_stack if not f.filename.startswith(_TORCH_DIR)]
            site = (own or reason.user_stack or [None])[-1]
            where = f"{site.filename}:{site.lineno}" if site else "<unknown>"
            self._sites.setdefault(where, _reason_text(reason.reason))
        self._reasons_seen = len(graph_break_reasons)
        for entry in get_compilation_metrics():
            key = self._key(entry)
            if key not in self._seen:
                self._seen.add(key)
                self._ingest_entry(entry)

    def _ingest_entry(self, e: Any) -> None:
        cid = str(e.compile_id)
        frame = self._frame_id(cid)
        if e.co_name:
            label = self._label(e.co_filename, e.co_firstlineno, e.co_name)
            self._frame_labels.setdefault(frame, label)
        else:  # failed compiles (RecompileError, cap hit) carry no code info; their frame id does
            label = self._frame_labels.get(frame) or f"<frame {frame}>"
            self._callsite(label, "")
        stats = self._stats[label]
        stats.compile_time_s += self._pending_time.pop(cid, 0.0)
        if e.fail_type:
            stats.failures.append(f"{e.fail_type}: {_reason_text(e.fail_reason or '')}")
        elif e.graph_op_count:
            stats.graphs += 1
        stats.guards += e.guard_count or 0
        if e.restart_reasons:
            stats.breaks += 1
            for reason in sorted(e.restart_reasons):
                if _reason_text(reason) not in stats.break_reasons:
                    stats.break_reasons.append(_reason_text(reason))
        refused = e.fail_type == "RecompileError"  # forbid_recompiles stopped it; the guard is in fail_reason
        if e.recompile_reason or refused:
            stats.recompiles += 1
            stats.recompiles_after_warmup += int(self._warm)
            guard = _guard_text(e.recompile_reason or e.fail_reason or "")
            if guard not in stats.recompile_guards:
                stats.recompile_guards.append(guard)
            if self._warm and guard not in stats.late_recompile_guards:
                stats.late_recompile_guards.append(guard)
            if self._warm and self.report is not None:
                self.report(f"recompile after warmup: {label} ({guard})")

    # -- results ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, CallsiteStats]:
        """Per-callsite counters so far (a copy)."""
        self.refresh()
        return copy.deepcopy(self._stats)

    def break_sites(self, *, upstream: bool | None = False) -> dict[str, str]:
        """Distinct graph-break sites ``file:line`` -> reason; `upstream` picks torch's own (True) or all (None)."""
        self.refresh()
        return {where: why for where, why in self._sites.items()
                if upstream is None or where.startswith(_TORCH_DIR) == upstream}

    def totals(self) -> CallsiteStats:
        """Sums over all callsites."""
        total = CallsiteStats("total")
        for s in self.snapshot().values():
            for name in ("modules", "graphs", "breaks", "recompiles", "recompiles_after_warmup", "guards",
                         "cache_limit_hits"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.compile_time_s += s.compile_time_s
            total.break_reasons += [f"{s.name}: {r}" for r in s.break_reasons]
            total.recompile_guards += [f"{s.name}: {g}" for g in s.recompile_guards]
            total.late_recompile_guards += [f"{s.name}: {g}" for g in s.late_recompile_guards]
            total.failures += [f"{s.name}: {f}" for f in s.failures]
        return total

    def slowest(self, count: int = 4) -> str:
        """The `count` callsites that took longest to compile, each with its backward graphs' lazy compile,
        as ``compile by region: NAME 33.1 s, ...``."""
        stats = sorted(self.snapshot().values(), key=lambda s: s.compile_time_s, reverse=True)
        named = ", ".join(f"{s.name} {s.compile_time_s:.1f} s" for s in stats[:count] if s.compile_time_s > 0)
        return f"compile by region: {named}" if named else "nothing compiled"

    def summary(self) -> dict[str, float]:
        """The run's compile figures, for its metrics record."""
        totals = self.totals()
        return {"graphs": totals.graphs, "graph_break_sites": len(self.break_sites()),
                "recompiles_after_warmup": totals.recompiles_after_warmup, "compile_time_s": totals.compile_time_s}

    def violations(self) -> list[str]:
        """Bound violations, each a sentence naming callsites and reasons; empty when healthy."""
        b, every, sites = self.bounds, self.totals(), self.break_sites()
        found = []
        if len(sites) > b.graph_breaks:
            found.append(f"{len(sites)} graph break site(s) > bound {b.graph_breaks}: "
                         + "; ".join(f"{where}: {why}" for where, why in sites.items()))
        if every.recompiles_after_warmup > b.recompiles_after_warmup:
            found.append(
                f"{every.recompiles_after_warmup} recompile(s) after warmup > bound "
                f"{b.recompiles_after_warmup}: " + "; ".join(every.late_recompile_guards)
            )
        if every.cache_limit_hits > b.cache_limit_hits:
            found.append(f"{every.cache_limit_hits} recompile-cap hit(s): " + "; ".join(self.alerts))
        if b.graphs is not None and every.graphs > b.graphs:
            found.append(f"{every.graphs} graphs > bound {b.graphs}")
        return found

    def check_bounds(self, strict: bool | None = None) -> list[str]:
        """Raise `CompileHealthError` (strict) or warn loudly when a bound is exceeded.

        `strict` None: strict under pytest or when ``$CI`` is set, warn otherwise (training).
        """
        found = self.violations()
        if found:
            message = "compile health bound exceeded:\n  " + "\n  ".join(found)
            if _strict_default() if strict is None else strict:
                raise CompileHealthError(message)
            log.error(message)
            warnings.warn(message, CompileHealthWarning, stacklevel=2)
        return found


@contextmanager
def forbid_recompiles() -> Iterator[None]:
    """Raise ``torch._dynamo.exc.RecompileError`` (naming the failing guard) on any recompile inside.

    Only true recompiles raise; the first compile of a frame never seen before (an eval-mode call, a
    new code path) does not — warm those up before entering.
    """
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
