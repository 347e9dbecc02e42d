"""Errors that explain themselves: the CLI prints these as one line instead of a traceback."""
from __future__ import annotations

from megacpp.config import ConfigError
from megacpp.data.corpus import CorpusError
from megacpp.model.pattern import PatternError
from megacpp.train.checkpoint import CheckpointError
from megacpp.train.loop import NonFiniteLossError

USER_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    CorpusError,
    PatternError,
    CheckpointError,
    NonFiniteLossError,
    FileNotFoundError,
)
