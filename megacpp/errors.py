"""The base class of every error megacpp explains to its user.

The CLI prints a ``MegacppError`` as one line instead of a traceback, so a subclass promises that its
message says what is wrong and where. This module imports nothing but the standard library: every
module that defines such an error can import it without pulling in the trainer (or torch).
"""
from __future__ import annotations


class MegacppError(Exception):
    """A problem with the user's input or environment, explained by its message."""


class ConfigError(MegacppError, ValueError):
    """A configuration value, key or file that cannot be used."""


class UsageError(MegacppError):
    """A command-line argument outside its range or form; the CLI exits with status 2, like argparse."""


class Interrupted(MegacppError):
    """A run was stopped by Ctrl-C (SIGINT) or SIGTERM and saved what it had: the CLI exits with
    ``exit_code`` (130 for SIGINT, 143 for SIGTERM, as the signal itself would have).
    ``complete``: the run had already trained all its steps (the signal cut its final evaluation or
    sample short), so there is nothing to resume and the CLI says so instead of how to resume."""

    def __init__(self, message: str, *, complete: bool = False, exit_code: int = 130) -> None:
        super().__init__(message)
        self.complete = complete
        self.exit_code = exit_code
