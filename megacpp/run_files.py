"""What megacpp writes in a run directory (`train.out_dir`), by name.

The trainer (megacpp.train.rundir) writes and moves these; the corpus walk (megacpp.data.corpus) leaves
them out, so that a run directory inside a corpus never feeds the run's own files back in as training
data. Standard library only: the data path reads it without importing the trainer.
"""
from __future__ import annotations

import fnmatch

# Created by every run before it writes anything else, and left behind (emptied) when it ends: the mark
# of a run directory.
LOCK_NAME = ".megacpp.lock"
PREVIOUS_PREFIX = "previous-"  # previous-<time>/: an earlier run's files, moved aside
RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "config.toml", "loss.png", "sample.txt", "logs", "tensorboard",
               "profile")
RUN_PATTERNS = ("position_curve-*.json",)


def is_run_entry(name: str) -> bool:
    """Whether `name`, in a run directory, is megacpp's (a run's file, its lock, or an earlier run's
    files moved aside) rather than the user's."""
    return (name in RUN_ENTRIES or name == LOCK_NAME or name.startswith(PREVIOUS_PREFIX)
            or any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_PATTERNS))
