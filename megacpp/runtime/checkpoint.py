"""Checkpoints: one directory per step, written atomically, verified on load, the last K usable kept.

Layout of ``<out_dir>/checkpoints/step_00000100/``:
- ``model.safetensors``  model weights, whole (safetensors: no pickle, cheap to inspect); on several
                         ranks gathered and written by rank 0, so eval, sample and tests read one format
- ``optim/``             optimizer moments by parameter name, a torch.distributed.checkpoint directory
                         (one file per writing rank + ``.metadata``): it loads on any number of ranks
- ``state.pt``           schedule, loader, RNG states, step, losses (torch.save, weights_only-loadable)
- extra files            e.g. ``tokenizer.json``, so the directory alone can be sampled from
- ``meta.json``          config, tokenizer hash, determinism mode, versions, world size and global
                         batch, and the size and digest of each file above (``sha256_blocks``: the sha256
                         of the sha256 digests of the file's consecutive ``hash_block_bytes`` blocks, so
                         one large file hashes on every core). Written last: a directory without it is
                         incomplete. Its own field ``meta_sha256`` covers the canonical JSON of the rest,
                         so an edited or damaged meta.json is detected too.

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
# 4: files hashed by blocks (sha256_blocks); 3: meta.json carries its own checksum; 2: optimizer moments by name
FORMAT_VERSION = 4
READABLE_FORMATS = (2, 3, 4)  # 3 and 2 hash each file whole (sha256); 2 has no meta_sha256
# nam52's 27 GB of weights in one file took one thread ~15 s to hash (sha256 runs at ~1.8 GB/s a thread); in
# blocks of 256 MiB, ~100 of them, the host's cores hash it side by side.
HASH_BLOCK_BYTES = 1 << 28
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
    """`_sha256` of each path (formats 2 and 3 hash each file whole), the files hashed side by side."""
    if len(paths) <= 1:
        return [_sha256(path) for path in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def _block_sha256(path: Path, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        while length > 0:
            chunk = f.read(min(1 << 20, length))
            if not chunk:  # the file shrank meanwhile: its digest will not match
                break
            h.update(chunk)
            length -= len(chunk)
    return h.digest()


def block_digests(paths: list[Path], block_bytes: int = HASH_BLOCK_BYTES) -> list[str]:
    """Each file's ``sha256_blocks``: the sha256 of the raw sha256 digests of its consecutive `block_bytes`
    blocks, the last one short (an empty file: of no digests). Every block of every file is hashed side by
    side, as hashlib and file reads release the GIL."""
    sizes = [path.stat().st_size for path in paths]
    jobs = [(index, offset, min(block_bytes, size - offset))
            for index, size in enumerate(sizes) for offset in range(0, size, block_bytes)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1, 32))) as pool:
        digests = list(pool.map(lambda job: _block_sha256(paths[job[0]], job[1], job[2]), jobs))
    per_file = [hashlib.sha256() for _ in paths]
    for (index, _, _), digest in zip(jobs, digests, strict=True):
        per_file[index].update(digest)
    return [h.hexdigest() for h in per_file]


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
    digests = block_digests([tmp / name for name in names], HASH_BLOCK_BYTES)
    files = {name: {"bytes": (tmp / name).stat().st_size, "sha256_blocks": digest}
             for name, digest in zip(names, digests, strict=True)}
    full_meta = {"format": FORMAT_VERSION, "step": step, **meta, "hash_block_bytes": HASH_BLOCK_BYTES,
                 "files": files}
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


def saved_step_rows(meta: dict[str, Any], default_global_batch: int) -> int:
    """Rows of an optimizer step of the run that wrote `meta`: its global batch (ranks x batch_size) x its
    grad_accum; `default_global_batch` for a checkpoint older than the global batch's record."""
    accum = meta.get("config", {}).get("train", {}).get("grad_accum", 1)
    return meta.get("global_batch", default_global_batch) * accum


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
    key = _digest_key(meta)
    if key == "sha256_blocks" and not (type(meta.get("hash_block_bytes")) is int and meta["hash_block_bytes"] > 0):
        return f"'hash_block_bytes' is {meta.get('hash_block_bytes')!r}, expected a positive integer"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and type(entry.get("bytes")) is int
                and isinstance(entry.get(key), str)):
            return f"files[{name!r}] is {entry!r}, expected {{\"bytes\": <int>, \"{key}\": <str>}}"
    if not isinstance(meta.get("config"), dict):
        return f"'config' is {meta.get('config')!r}, expected an object"
    return None


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file's size and digest against meta.json; return the metadata."""
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
    key = _digest_key(meta)
    paths = [path / name for name in names]
    digests = block_digests(paths, meta["hash_block_bytes"]) if key == "sha256_blocks" else _sha256_each(paths)
    for name, digest in zip(names, digests, strict=True):
        if digest != meta["files"][name][key]:
            raise CheckpointError(f"{path / name}: corrupt ({key} does not match meta.json)")
    return meta


def _digest_key(meta: dict[str, Any]) -> str:
    """The file entries' digest field: formats before 4 hash each file whole."""
    return "sha256_blocks" if meta["format"] >= 4 else "sha256"


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
