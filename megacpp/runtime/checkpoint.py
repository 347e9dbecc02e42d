"""Checkpoints: one directory per step, written atomically, verified on load, the last K usable kept.

Layout of ``<out_dir>/checkpoints/step_00000100/``:
- ``model.safetensors``  model weights, whole (safetensors: no pickle, cheap to inspect); on several
                         ranks gathered and written by rank 0, so eval, sample and tests read one format
- ``optim/``             optimizer moments by parameter name, a torch.distributed.checkpoint directory
                         (one file per writing rank + ``.metadata``): it loads on any number of ranks
- ``state.pt``           schedule, loader, RNG states, step, losses (torch.save, weights_only-loadable)
- extra files            e.g. ``tokenizer.json``, so the directory alone can be sampled from
- ``meta.json``          config, tokenizer hash, determinism mode, versions, world size and global
                         batch, and the size and sha256 of each file above. Written last: a directory
                         without it is incomplete. Its own field ``meta_sha256`` covers the canonical
                         JSON of the rest, so an edited or damaged meta.json is detected too.

The directory is built under a ``.tmp`` name and renamed into place, so a crash mid-write never leaves
something that looks like a checkpoint. Writing it is `megacpp.distributed.checkpoint.save` (every rank takes
part); this module owns the format: names, hashes, verification, pruning.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megacpp.errors import MegacppError
from megacpp.fs import replace_dir

CKPT_DIR_RE = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 3  # 3: meta.json carries its own checksum; 2: optimizer moments by name in optim/
READABLE_FORMATS = (2, 3)  # format 2 is format 3 without meta_sha256
MOMENTS_DIR = "optim"


class CheckpointError(MegacppError, RuntimeError):
    """A checkpoint that is missing, corrupt, truncated or incompatible with this run."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sha256_each(paths: list[Path]) -> list[str]:
    """`_sha256` of each path, the files hashed side by side: hashlib and file reads release the GIL, and a
    sharded run's checkpoint is one file of weights plus one file of moments per rank (tens of GB for
    `nam52`), which one thread hashes at under 1.8 GB/s."""
    if len(paths) <= 1:
        return [_sha256(path) for path in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_dirs(out_dir: str | Path, step: int) -> tuple[Path, Path]:
    """(final, temporary) directory of checkpoint `step`."""
    root = checkpoint_root(out_dir)
    return root / f"step_{step:08d}", root / f"step_{step:08d}.tmp"


def write_local_files(tmp: Path, model_state: dict[str, torch.Tensor], train_state: dict[str, Any],
                      extra_files: dict[str, bytes] | None = None) -> None:
    """Write the files of one checkpoint that a single process writes (rank 0 under torchrun)."""
    save_file(_own_storages(model_state), tmp / "model.safetensors")
    torch.save(train_state, tmp / "state.pt")
    for name, blob in (extra_files or {}).items():
        (tmp / name).write_bytes(blob)


def _own_storages(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` as safetensors takes it: contiguous tensors that share no storage. Only a tensor whose storage
    an earlier one holds is copied: a sharded run's gathered weights are fresh tensors already, and copying
    them all cost rank 0 a second copy of the weights (27 GB for `nam52`)."""
    held: set[int] = set()
    own = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        own[name] = tensor.clone() if storage in held else tensor
        held.add(storage)
    return own


def write_meta(tmp: Path, step: int, meta: dict[str, Any]) -> None:
    """Hash every file under `tmp` and write meta.json last: the checkpoint is complete once it exists."""
    names = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
    digests = _sha256_each([tmp / name for name in names])
    files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": digest}
             for name, digest in zip(names, digests, strict=True)}
    full_meta = {"format": FORMAT_VERSION, "step": step, **meta, "files": files}
    full_meta["meta_sha256"] = _meta_digest(full_meta)
    (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2, sort_keys=True))


def _meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of every field but the digest itself (independent of indentation)."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def publish(tmp: Path, final: Path, keep_last: int) -> Path:
    """Rename the finished `tmp` into place and prune to the newest `keep_last` usable checkpoints."""
    replace_dir(tmp, final)
    _remember(final, usable=True)  # its hashes were just computed from these very files
    _prune(final, keep_last)
    return final


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint directories, newest first (unverified)."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and CKPT_DIR_RE.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def checkpoint_step(path: Path) -> int:
    """The step of checkpoint directory `path` (named by `checkpoint_dirs`)."""
    return int(CKPT_DIR_RE.match(path.name).group(1))


def set_aside(path: Path, reason: str) -> Path:
    """Rename checkpoint `path` to ``<name>.<reason>`` (``-2``, ``-3``... if taken), out of what resumes,
    evaluation and pruning see (they list only ``step_<8 digits>``), deleting nothing; returns the new path."""
    target, n = path.with_name(f"{path.name}.{reason}"), 2
    while target.exists():  # set aside at this step before, by an earlier run of this directory
        target, n = path.with_name(f"{path.name}.{reason}-{n}"), n + 1
    path.rename(target)
    _verdicts.pop(path, None)
    return target


def _prune(fresh: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints that verify (`fresh`, just written, counts as one without
    re-hashing) and every checkpoint newer than the oldest of those; delete only what is older. A
    resumed run whose newest checkpoints are broken thus never deletes the usable ones it started from.
    Cost: each older checkpoint is hashed once per process (`_usable`), not at every save."""
    usable = 0
    for path in list_checkpoints(fresh.parent.parent):
        if usable >= max(keep_last, 1):
            shutil.rmtree(path, ignore_errors=True)
            _verdicts.pop(path, None)
        elif path == fresh or _usable(path):
            usable += 1


# Pruning asks about the same older checkpoints at every save, and hashing them reads every byte of
# each. So a verdict is remembered for this process, with the (name, size, mtime, inode) of every file
# it judged: a file rewritten, truncated, added or removed since changes that signature and the
# checkpoint is verified again. (A same-size in-place edit within one filesystem clock tick of the
# verdict, or silent bit rot, goes unseen until the next process; `--resume` always hashes in full.)
_Signature = tuple[tuple[str, int, int, int], ...]
_verdicts: dict[Path, tuple[_Signature, bool]] = {}


def _signature(path: Path) -> _Signature | None:
    try:
        stats = [(str(f.relative_to(path)), f.stat()) for f in path.rglob("*") if f.is_file()]
    except OSError:  # a file vanished while listing: nothing to remember
        return None
    return tuple(sorted((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in stats))


def _remember(path: Path, usable: bool) -> bool:
    signature = _signature(path)
    if signature is not None:
        _verdicts[path] = (signature, usable)
    return usable


def _usable(path: Path) -> bool:
    """Whether checkpoint `path` verifies; hashed only when its files changed since the last verdict."""
    known = _verdicts.get(path)
    if known is not None and known[0] == _signature(path):
        return known[1]
    try:
        verify_checkpoint(path)
    except CheckpointError:
        return _remember(path, usable=False)
    return _remember(path, usable=True)


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no meta.json; it is written last)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path}: corrupt metadata ({exc})") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: corrupt metadata (a JSON {type(meta).__name__}, expected an object)")
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"{meta_path}: checkpoint format {meta.get('format')!r}, this megacpp reads {READABLE_FORMATS}"
        )
    if meta["format"] >= 3 and meta.get("meta_sha256") != _meta_digest(meta):
        raise CheckpointError(f"{meta_path}: edited or corrupt (its contents do not match its meta_sha256)")
    problem = _meta_shape_problem(meta)
    if problem:
        raise CheckpointError(f"{meta_path}: corrupt metadata ({problem})")
    return meta


def _meta_shape_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with the keys readers index (files and their sizes and hashes, config), or None:
    valid JSON of the wrong shape is corrupt metadata, like JSON that does not parse."""
    files = meta.get("files")
    if not isinstance(files, dict):
        return f"'files' is {files!r}, expected an object of file entries"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and type(entry.get("bytes")) is int
                and isinstance(entry.get("sha256"), str)):
            return f"files[{name!r}] is {entry!r}, expected {{\"bytes\": <int>, \"sha256\": <str>}}"
    if not isinstance(meta.get("config"), dict):
        return f"'config' is {meta.get('config')!r}, expected an object"
    return None


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file's size and sha256 against meta.json; return the metadata."""
    path = Path(path)
    meta = read_meta(path)
    for name, expected in meta["files"].items():  # sizes first: cheap, and a truncated file needs no hash
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing file of checkpoint")
        size = f.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{f}: truncated or overwritten ({size} bytes, expected {expected['bytes']})")
    names = list(meta["files"])
    for name, digest in zip(names, _sha256_each([path / name for name in names]), strict=True):
        if digest != meta["files"][name]["sha256"]:
            raise CheckpointError(f"{path / name}: corrupt (sha256 does not match meta.json)")
    return meta


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict, dict, dict]:
    """Load a checkpoint's weights and train state: (model_state, train_state, meta). The optimizer
    moments are loaded in place by `megacpp.distributed.checkpoint.load`."""
    path = Path(path)
    meta = verify_checkpoint(path)
    try:
        model_state = load_file(path / "model.safetensors", device=str(map_location))
    except (SafetensorError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from exc
    return model_state, load_train_state(path, map_location), meta


def load_train_state(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    try:
        return torch.load(path / "state.pt", map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from exc


def latest_valid_checkpoint(out_dir: str | Path, warn=print) -> Path | None:
    """The newest checkpoint that verifies; broken ones are reported and skipped, never deleted."""
    for path in list_checkpoints(out_dir):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as exc:
            warn(f"skipping checkpoint: {exc}")
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest valid one under a run directory or its `checkpoints/`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint or run directory (it is a file)")
    if CKPT_DIR_RE.match(path.name):
        return path
    # RUN/checkpoints itself (what a tab completion gives) means RUN, not RUN/checkpoints/checkpoints.
    run_dir = path.parent if checkpoint_root(path.parent) == path and not checkpoint_root(path).is_dir() else path
    found = latest_valid_checkpoint(run_dir)
    if found is None:
        raise CheckpointError(f"{path}: no valid checkpoint (looked in {checkpoint_root(run_dir)})")
    return found
