"""The language configuration sections state their rules in, and the checks that run them.

Every section dataclass (ModelConfig and one per block kind, OptimConfig, DataConfig, TrainConfig, ...)
is a `ConfigSection`: ``ranges()`` gives each numeric field its `Interval` and ``check(keys)`` holds the
rules between fields, each with a docstring saying why it exists. Two callers run the same code: the
gate (megacpp.validate) on a whole Config, quoting where every value came from, and a block's
constructor on its own config (`check_alone`), so the two cannot disagree.

A rule reads and names fields through `Keys`, a view of one section that knows each field's dotted key
("model.mamba.head_dim") and its source ("run.toml:4"); values from outside the section that a rule
needs (the model's d_model for a block) are handed to the view by name.

Only the standard library, megacpp.errors and megacpp.section are imported here: the lowest packages
define their sections on this module.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megacpp.errors import ConfigError, MegacppError
from megacpp.section import Section


class Provenance:
    """Where each configuration value came from, so an error can point at the line to change.

    Merges record every key they set ("run.toml:4", "command line --model.depth"); a key no merge set
    reports `base`, the config's starting point ("preset 'tiny'", "built-in default", a checkpoint's
    meta.json). It lives beside the Config, not in it, so a Config stays plain data.
    """

    def __init__(self, base: str) -> None:
        self.base = base
        self._keys: dict[str, str] = {}

    def record(self, key: str, source: str) -> None:
        self._keys[key] = source

    def source(self, key: str) -> str:
        return self._keys.get(key, self.base)

    def is_set(self, key: str) -> bool:
        """Whether a merge set ``key`` (rather than the starting point)."""
        return key in self._keys


# ---------------------------------------------------------------- types


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints widen to floats, nothing else converts."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: expected {_describe(tp)}, got {value!r}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list of {_describe(item_tp)}, got {value!r}")
        return [coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{where}: expected {tp.__name__}, got bool {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's fields and their annotations, resolved."""
    return typing.get_type_hints(cls)


def check_types(obj: Any, label: Callable[[str], str], prefix: str = "") -> None:
    """Check every field of the dataclass tree ``obj`` against its annotation, as a merge does.

    For configs built or changed in Python, which never went through a merge; ``label(dotted)``
    starts each error (e.g. "run.toml:4: model.depth").
    """
    for key, tp in field_types(type(obj)).items():
        dotted, value = f"{prefix}{key}", getattr(obj, key)
        if dataclasses.is_dataclass(value):
            check_types(value, label, f"{dotted}.")
        else:
            coerce(value, tp, label(dotted))


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


AT_LEAST_1 = Interval(1)  # sizes, counts and intervals in steps
NON_NEGATIVE = Interval(0)
POSITIVE = Interval(0, low_open=True)
UNIT = Interval(0, 1)
BELOW_1 = Interval(0, 1, high_open=True)  # decay rates and betas: 1 would never forget
ABOVE_0_UNIT = Interval(0, 1, low_open=True)
SEED_MAX = 2**64 - 1  # torch's manual_seed and Generator.manual_seed take an unsigned 64-bit seed
SEED = Interval(0, SEED_MAX)


# ---------------------------------------------------------------- keys


class Keys:
    """The fields of one config section by name, as the dotted keys errors quote, with their sources.

    ``section`` is the dataclass and ``path`` its dotted key ("model.mamba"; "" for a whole Config, whose
    rules then name fields as "data.seq_len"). ``outer`` maps a name the section's rules read but do not
    own to its (dotted key, value): a block's rules read the model's width as "d_model".
    """

    def __init__(self, section: Any, path: str, sources: Provenance | None = None,
                 outer: Mapping[str, tuple[str, Any]] | None = None) -> None:
        self.section, self.path, self.sources = section, path, sources
        self.outer = dict(outer or {})

    def key(self, name: str) -> str:
        if name in self.outer:
            return self.outer[name][0]
        return f"{self.path}.{name}" if self.path else name

    def value(self, name: str) -> Any:
        if name in self.outer:
            return self.outer[name][1]
        obj = self.section
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    def at(self, name: str, **outer: str) -> Keys:
        """The view of the sub-section ``name``; each keyword hands it a field of this view under a name
        of its own (``at("mamba", d_model="d_model")``)."""
        return Keys(self.value(name), self.key(name), self.sources,
                    {alias: (self.key(field), self.value(field)) for alias, field in outer.items()})

    def label(self, name: str) -> str:
        """``source: key``, as the merge's own errors start; just the key when no source is known."""
        key = self.key(name)
        return f"{self.sources.source(key)}: {key}" if self.sources else key

    def ref(self, name: str) -> str:
        """``key = value (source)``: how a rule quotes a field other than the one it leads with."""
        source = f" ({self.sources.source(self.key(name))})" if self.sources else ""
        return f"{self.key(name)} = {self.value(name)!r}{source}"

    def error(self, name: str, why: str, kind: type[MegacppError] = ConfigError) -> MegacppError:
        """``source: key = value why``, for a rule about one field."""
        return kind(f"{self.label(name)} = {self.value(name)!r} {why}")

    def error_among(self, names: Sequence[str], problem: str, kind: type[MegacppError] = ConfigError
                    ) -> MegacppError:
        """An error about several fields, led by the first one a merge set: the user most likely just
        changed it, and its file:line is where to look. The others follow with values and sources."""
        lead = next((name for name in names if self.sources and self.sources.is_set(self.key(name))), names[0])
        others = ", ".join(self.ref(name) for name in names if name != lead)
        return kind(f"{self.label(lead)} = {self.value(lead)!r}: {problem}; {others}")


# ---------------------------------------------------------------- sections


class ConfigSection(Section):
    """The base of every configuration section dataclass: its ranges and its rules (and, from
    megacpp.section, that it freezes once the gate has passed it).

    ``ranges()`` maps each numeric field to its `Interval` (tests/test_config_rules.py fails for a
    numeric field without one); None passes every range (optional keys: "derive it", checked where
    derived). ``check(keys)`` raises at the first broken rule between fields; sub-sections are
    checked by the section that holds them, which knows when their rules apply.
    """

    @classmethod
    def ranges(cls) -> Mapping[str, Interval]:
        return {}

    def check(self, k: Keys) -> None:
        """No rules between fields."""


def check_ranges(ranges: Mapping[str, Interval], k: Keys) -> None:
    """Raise at the first field of ``k``'s section outside its interval; NaN and infinities are outside
    every interval."""
    for name, interval in ranges.items():
        value = k.value(name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise k.error(name, f"must be a finite number {interval.describe()}")
        if not interval.contains(value):
            raise k.error(name, f"must be {interval.describe()}")


def check_ordered(k: Keys, low: str, high: str) -> None:
    """Fields ``low`` <= ``high`` of ``k``'s section, which bound an init range (torch refuses a reversed one)."""
    if k.value(low) > k.value(high):
        raise k.error_among((low, high), f"{low} must be <= {high}: they bound an init range")


def sections(section: Any, path: str = "") -> Iterator[tuple[str, ConfigSection]]:
    """(path relative to ``section``, section) for ``section`` and every section nested in it,
    depth-first in field order: the order the gate checks ranges in."""
    yield path, section
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from sections(value, f"{path}.{f.name}" if path else f.name)


def check_alone(section: ConfigSection, **outer: Any) -> None:
    """Types, ranges and rules of one section outside any Config, with no sources: what a block's
    constructor runs on its config. Errors name its fields ``<Class>.<field>``; ``outer`` gives the
    values from outside the section its rules read (``d_model=128``), named as given."""
    k = Keys(section, type(section).__name__, None, {name: (name, value) for name, value in outer.items()})
    check_types(section, k.label)
    for path, sub in sections(section):
        check_ranges(sub.ranges(), k.at(path) if path else k)
    section.check(k)
