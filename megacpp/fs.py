"""Atomic file writes: a reader sees the old content or the new, never half of the new.

Every write goes to a temporary name in the destination's own directory (a rename is atomic only
within one filesystem) and is renamed over the destination once complete; on any error the temporary
is removed and the destination is left as it was. Temporary names are ``.<name>.tmp-<pid>-<random>``:
hidden, and recognisable (`is_temporary`) so that directory scans skip them and a crashed writer's
leftovers can be swept (`remove_stale_temporaries`).

``fsync=True`` flushes the file's data to disk before the rename, for files whose loss after a power
failure would cost more than rewriting them (token shards and their manifest). Directories are not
fsynced: a lost rename leaves the old file, which the callers' checks already handle.
"""
from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TEMP_MARKER = ".tmp-"


def temporary_sibling(path: str | Path) -> Path:
    """A fresh temporary name beside `path` (same directory, so a rename onto `path` is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")


def is_temporary(name: str) -> bool:
    """Whether a file or directory name is a temporary of an atomic write (ours, or a crashed one's)."""
    return TEMP_MARKER in name


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_path(path: str | Path, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path` for a writer that wants a file name; when the block ends
    without an error, the file written there replaces `path`. On an error it is removed."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        if fsync:
            _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def atomic_write_bytes(path: str | Path, data: bytes, *, fsync: bool = False) -> None:
    """Replace `path` with `data` atomically."""
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = False, encoding: str = "utf-8") -> None:
    """Replace `path` with `text` atomically."""
    atomic_write_bytes(path, text.encode(encoding), fsync=fsync)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished directory `src` to `dst`, removing an existing `dst` first (a directory
    cannot be renamed over a non-empty one). Only that removal and the rename are not one step."""
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(src, dst)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `path`; when the block ends without an error it
    replaces `path` (see `replace_dir`). On an error it is removed and `path` is left as it was."""
    path = Path(path)
    tmp = temporary_sibling(path)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


@contextmanager
def scratch_dir(parent: str | Path, name: str) -> Iterator[Path]:
    """Yield a temporary directory ``<parent>/.<name>.tmp-...``, removed when the block ends whatever
    happens: a staging area whose content the block moves out file by file."""
    tmp = temporary_sibling(Path(parent) / name)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    finally:
        _remove(tmp)


def remove_stale_temporaries(directory: str | Path) -> int:
    """Remove the temporaries that crashed writers left in `directory` (not recursive); how many."""
    stale = [p for p in Path(directory).iterdir() if is_temporary(p.name)]
    for path in stale:
        _remove(path)
    return len(stale)
