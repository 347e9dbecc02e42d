"""Configuration sections that freeze: the base class of every configuration dataclass.

A run's configuration is merged (preset < file < command line), checked once by the gate, and then
frozen (`freeze`): nothing may change it afterwards, so the values the gate accepted are the values
every layer reads, and what a run derives from them (the tokenizer's vocabulary, the micro-batch, the
global batch) lives in values of its own (megacpp.train.plan) instead of being written back.

The sections stay ordinary mutable dataclasses until frozen, because presets and merges build them
field by field; `freeze` returns a frozen deep copy and leaves its argument as it was.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, TypeVar

from megacpp.errors import MegacppError

_FROZEN = "_section_frozen"  # instance flag set by freeze(); not a dataclass field

T = TypeVar("T", bound="Section")


class FrozenSectionError(MegacppError, AttributeError):
    """An attempt to change a configuration after the gate accepted it."""


class Section:
    """Base of the configuration dataclasses: assignment raises once the instance is frozen."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get(_FROZEN):
            raise FrozenSectionError(
                f"{type(self).__name__}.{name}: the configuration is frozen after the gate; build a changed "
                "copy with dataclasses.replace, or keep a derived value beside it")
        object.__setattr__(self, name, value)


def is_frozen(section: Section) -> bool:
    return bool(section.__dict__.get(_FROZEN))


def freeze(section: T) -> T:
    """A frozen deep copy of ``section`` and of every section nested in its fields."""
    frozen = copy.deepcopy(section)
    _freeze_in_place(frozen)
    return frozen


def _freeze_in_place(section: Section) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, Section):
            _freeze_in_place(value)
    object.__setattr__(section, _FROZEN, True)
