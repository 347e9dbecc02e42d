"""Per-rank log files: only rank 0 talks to the terminal, every rank writes its own file.

Under torchrun each rank's messages (and its error, if it fails) go to ``<run>/logs/rank<R>.log``, so
a failure on any rank is visible after the job ends, whichever rank torchrun reported first.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


class RankLog:
    def __init__(self, out_dir: str | Path, rank: int, echo: Callable[[str], None] | None) -> None:
        self.path = Path(out_dir) / "logs" / f"rank{rank}.log"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.echo = echo

    def __call__(self, message: str) -> None:
        self.record(message)
        if self.echo is not None:
            self.echo(message)

    def record(self, message: str) -> None:
        """Into the file only (e.g. a failure's traceback: the terminal gets the one-line error)."""
        with self.path.open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
