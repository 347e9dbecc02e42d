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
    """The user stopped a run with Ctrl-C (SIGINT) and it saved what it had: the CLI exits 130.
    ``complete``: the run had already trained all its steps (Ctrl-C cut its final evaluation or sample
    short), so there is nothing to resume and the CLI says so instead of how to resume."""

    def __init__(self, message: str, *, complete: bool = False) -> None:
        super().__init__(message)
        self.complete = complete
