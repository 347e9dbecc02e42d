"""Inductor cache hygiene: a chosen, reported cache directory, and warm-cache export/import between hosts.

The cache directory is set explicitly at entry: an explicit root, else $MEGACPP_CACHE_DIR, else a
user-set $TORCHINDUCTOR_CACHE_DIR (not torch's /tmp default, which importing torch._dynamo writes into
that variable), else ~/.cache/megacpp; ``<root>/inductor`` must be writable (checked
by writing a probe file, not by permission bits: root ignores them), otherwise a private per-user
temporary directory (`fallback_cache_dir`) is used and the status says why. FX graph and AOTAutograd
caches are switched on, with their keys tied to the source of megacpp's custom ops (`ops_source_digest`).
Triton kernels land under the same directory (Inductor's default ``<cache>/triton``).

Export copies the cache directory (plus PyTorch's Mega-Cache artifact bytes where the version gate
allows) into a target directory with a manifest holding a content digest of the copied files; export
and import skip when digests match, refuse unwritable targets and hold file locks, so two processes
syncing at once cannot interleave. Import checks every file against the manifest's per-file sha256
before copying anything, then copies into a staging directory and renames into place. Mega-Cache
bytes are unpickled on import: import only caches you trust. They hold only what this process
compiled; a fresh CLI process exports the directory alone.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from megacpp.compile.config import CompileConfig
from megacpp.errors import MegacppError
from megacpp.fs import atomic_dir, atomic_path, atomic_write_bytes, is_temporary, scratch_dir
from megacpp.versions import supports, torch_version

MANIFEST = "MANIFEST.json"
FILES_DIR = "inductor"
ARTIFACTS = "mega_cache.bin"
LOCK = ".megacpp-cache.lock"
IMPORTED = ".megacpp-imported"  # digest of the last import, inside the local cache dir
EXPORT_MARK = ".megacpp-export"  # beside FILES_DIR in an export: megacpp wrote that folder
_SKIP_NAMES = {LOCK, IMPORTED}
_SKIP_DIRS = {"locks"}  # Inductor's own lock files


class CacheError(MegacppError, RuntimeError):
    """A cache directory cannot be used (not writable, not an export, ...)."""


class CacheBusy(CacheError):
    """Another process holds the cache lock longer than the timeout."""


@dataclass(frozen=True)
class CacheStatus:
    path: Path
    source: str  # argument | MEGACPP_CACHE_DIR | TORCHINDUCTOR_CACHE_DIR | default | fallback
    fallback_reason: str | None = None

    def format(self) -> str:
        text = f"inductor cache: {self.path} ({self.source})"
        if self.fallback_reason:
            text += f"\n  WARNING: cache root unusable ({self.fallback_reason}); using a private temp dir"
        return text


@dataclass(frozen=True)
class SyncResult:
    action: str  # exported | imported | skipped
    path: Path
    digest: str
    files: int
    artifacts: bool  # Mega-Cache bytes written (export) or loaded (import)

    def format(self) -> str:
        extra = " + mega-cache artifacts" if self.artifacts else ""
        return f"cache {self.action}: {self.files} files{extra} at {self.path} (digest {self.digest[:12]})"


def writable_reason(path: Path) -> str | None:
    """None if `path` (created if needed) accepts a new file, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return None


def default_cache_root() -> Path:
    """$MEGACPP_CACHE_DIR, else ~/.cache/megacpp."""
    return Path(os.environ.get("MEGACPP_CACHE_DIR") or Path.home() / ".cache" / "megacpp")


def _user_inductor_dir() -> bool:
    """Whether $TORCHINDUCTOR_CACHE_DIR holds a user's choice: importing torch._dynamo writes torch's
    default (/tmp/torchinductor_<user>) there, which is not one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return bool(value) and os.path.abspath(value) != os.path.abspath(default_cache_dir())


def _choose(root: str | Path | None) -> tuple[Path, str, str | None]:
    """(path, source, why unusable or None) by the precedence in the module docstring."""
    if root:
        path, source = Path(root) / "inductor", "argument"
    elif os.environ.get("MEGACPP_CACHE_DIR"):
        path, source = default_cache_root() / "inductor", "MEGACPP_CACHE_DIR"
    elif _user_inductor_dir():
        path, source = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]), "TORCHINDUCTOR_CACHE_DIR"
    else:
        path, source = default_cache_root() / "inductor", "default"
    return path, source, writable_reason(path)


OPS_CACHE_KEY = "torch.ops.megacpp"  # the entry of Inductor's unsafe_marked_cacheable_functions we own


_PACKAGE = Path(__file__).resolve().parent.parent  # megacpp/


def ops_source_digest(ops_dir: Path | None = None) -> str:
    """16 hex digits of sha256 over the names and bytes of the custom ops' sources, megacpp/ops/*.py
    (or ops_dir's)."""
    root = ops_dir or _PACKAGE / "ops"
    return _source_digest(root, sorted(root.glob("*.py")))


@functools.cache  # the installed source does not change under a running process; each read is ~200 files
def package_source_digest() -> str:
    """16 hex digits of sha256 over the names and bytes of every megacpp/**/*.py."""
    return _source_digest(_PACKAGE, sorted(_PACKAGE.rglob("*.py")))


def _source_digest(root: Path, paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def setup_inductor_cache(root: str | Path | None = None) -> CacheStatus:
    """Choose and export TORCHINDUCTOR_CACHE_DIR, switch FX graph and AOTAutograd caches on.

    Call at the start of the entry point, before the first compile.
    """
    path, source, reason = _choose(root)
    if reason is not None:
        path, source = fallback_cache_dir(), "fallback"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.resolve())
    # env for subprocesses (compile workers, autotune); config for this process, whose config
    # modules may already have read the environment at import.
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    # A cached graph holds each custom op's call and what its Python autograd formula saves for the
    # backward, but neither cache hashes that Python: after an upgrade that changed an op's outputs, a
    # warm cache handed back graphs built for the old ones (an IndexError at the first step). Entries
    # of this Inductor setting enter both caches' keys, so the ops' source digest there turns such an
    # upgrade into a cache miss.
    marked = torch._inductor.config.unsafe_marked_cacheable_functions
    torch._inductor.config.unsafe_marked_cacheable_functions = {**marked, OPS_CACHE_KEY: ops_source_digest()}
    return CacheStatus(path.resolve(), source, reason)


def fallback_cache_dir() -> Path:
    """Where a run compiles when its cache root is unusable: one directory per user under the system's
    temporary directory, private to the user (0700) and reused by the next run (a directory per process
    left one more behind every run), or a fresh private one when that cannot be had."""
    shared = Path(tempfile.gettempdir()) / f"megacpp-inductor-{os.getuid()}"
    try:
        shared.mkdir(mode=0o700, exist_ok=True)
        info = shared.stat()
        if info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700 and writable_reason(shared) is None:
            return shared
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix=f"megacpp-inductor-{os.getpid()}-"))


def describe_cache_dirs(cfg: CompileConfig) -> list[str]:
    """Lines for `doctor`: where the compile caches of a run with `cfg` would live (sets nothing)."""
    path, source, reason = _choose(cfg.cache_dir or None)
    lines = [f"inductor: {path.resolve()} ({source})"]
    if reason is not None:
        lines[0] += f" -- not writable ({reason}): a run would use a private temp dir"
    triton = os.environ.get("TRITON_CACHE_DIR")
    lines.append(f"triton: {triton} (TRITON_CACHE_DIR)" if triton else f"triton: {path.resolve() / 'triton'}")
    return lines


def current_cache_dir() -> Path:
    """The Inductor cache directory this process uses now."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _files(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Temporaries of atomic writes and staging directories are never cache content.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not is_temporary(d))
        for name in sorted(filenames):
            ours = name in _SKIP_NAMES or name.startswith(".probe-") or is_temporary(name)
            if not ours and not name.endswith(".lock"):
                found.append(Path(dirpath, name).relative_to(root))
    return found


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every cache file under `root`, by relative POSIX path, in walk order."""
    return {rel.as_posix(): _sha256(root / rel) for rel in _files(root)}


def _digest(hashes: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for rel, file_digest in hashes.items():
        digest.update(rel.encode() + b"\0")
        digest.update(bytes.fromhex(file_digest))
    return digest.hexdigest()


def _copy_tree(src: Path, dst: Path, files: list[Path]) -> None:
    for rel in files:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:  # readers never see a half-written file
            shutil.copyfile(src / rel, tmp)


def _move_tree(src: Path, dst: Path, files: list[Path]) -> None:
    """Rename staged files into place: on one filesystem, no copy that could fail half-way."""
    for rel in files:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(src / rel, dst / rel)


def _locks(paths: list[Path], timeout: float) -> ExitStack:
    stack = ExitStack()
    try:
        for path in sorted(set(paths)):  # one global order: exporters and importers never deadlock
            stack.enter_context(FileLock(str(path / LOCK), timeout=timeout))
    except Timeout as exc:
        stack.close()
        raise CacheBusy(f"cache lock {exc.lock_file} held by another process for > {timeout}s") from exc
    return stack


def _require_writable(path: Path, what: str) -> None:
    reason = writable_reason(path)
    if reason is not None:
        raise CacheError(f"refusing to {what}: target not writable ({reason})")


def export_cache(dest: str | Path, cache_dir: str | Path | None = None, *, lock_timeout: float = 600.0) -> SyncResult:
    """Copy the local Inductor cache (default: the current one) into `dest`; skip if `dest` holds it.

    Raises `CacheError` if `dest` is not writable, `CacheBusy` if its lock is held past `lock_timeout`.
    """
    dest, src = Path(dest), Path(cache_dir) if cache_dir else current_cache_dir()
    _refuse_overlap(dest, src)
    _require_writable(dest, f"export the compile cache into {dest}")
    if (dest / FILES_DIR).exists() and not (dest / EXPORT_MARK).is_file():
        raise CacheError(f"refusing to export the compile cache into {dest}: it has an {FILES_DIR}/ folder that no "
                         f"megacpp export wrote, which an export would replace; choose a new or empty directory")
    with _locks([dest, src], lock_timeout):
        hashes = file_hashes(src)
        digest, count = _digest(hashes), len(hashes)
        manifest = dest / MANIFEST
        if manifest.is_file() and json.loads(manifest.read_text()).get("digest") == digest:
            return SyncResult("skipped", dest, digest, count, (dest / ARTIFACTS).is_file())
        manifest.unlink(missing_ok=True)  # an interrupted export leaves no manifest: never a skip
        (dest / EXPORT_MARK).write_text("an export of megacpp's compile cache: `megacpp cache export` replaces "
                                        f"{FILES_DIR}/ here\n")
        with atomic_dir(dest / FILES_DIR) as staging:
            _copy_tree(src, staging, _files(src))
        artifacts = torch.compiler.save_cache_artifacts() if supports("cache_artifacts") else None
        if artifacts:
            atomic_write_bytes(dest / ARTIFACTS, artifacts[0])
        else:
            (dest / ARTIFACTS).unlink(missing_ok=True)
        info = {"digest": digest, "files": count, "torch": str(torch_version()), "artifacts": bool(artifacts),
                "sha256": hashes}
        if artifacts:
            info["artifacts_sha256"] = hashlib.sha256(artifacts[0]).hexdigest()
        atomic_write_bytes(manifest, json.dumps(info, indent=1).encode())
    return SyncResult("exported", dest, digest, count, bool(artifacts))


def _refuse_overlap(dest: Path, cache: Path) -> None:
    """An export written into the live cache (or the cache inside the export) would copy the cache onto
    itself while holding its lock: it waited on that lock for the whole timeout."""
    dest, cache = dest.resolve(), cache.resolve()
    if dest == cache or cache in dest.parents or dest in cache.parents:
        raise CacheError(f"refusing to export the compile cache into {dest}: the live cache directory {cache} is "
                         "there; export into a directory outside it")


def _read_export_manifest(src: Path) -> dict:
    """The export's manifest, checked for the fields import relies on; CacheError naming it if not."""
    path = src / MANIFEST
    if not path.is_file():
        raise CacheError(f"{src} is not a megacpp cache export (no {MANIFEST})")
    try:
        info = json.loads(path.read_text())
        if not (isinstance(info["digest"], str) and isinstance(info["files"], int)
                and isinstance(info.get("sha256", {}), dict)):  # absent in exports before per-file hashes
            raise TypeError("digest, files or sha256 has the wrong type")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CacheError(f"{path}: corrupt cache export manifest ({type(exc).__name__}: {exc}); nothing imported"
                         ) from exc
    return info


def _verify_export(src: Path, info: dict) -> list[Path]:
    """Every exported file against the manifest, before anything is copied; the files to import.

    Exports from before per-file hashes are checked by their overall digest alone.
    """
    def corrupt(what: str) -> CacheError:
        return CacheError(f"{src}: corrupt cache export: {what}; nothing imported")

    hashes = file_hashes(src / FILES_DIR)
    recorded = info.get("sha256")
    if recorded is not None:
        missing = sorted(recorded.keys() - hashes.keys())
        if missing:
            raise corrupt(f"{FILES_DIR}/{missing[0]} is missing")
        for rel, digest in hashes.items():
            if recorded.get(rel) != digest:
                raise corrupt(f"{FILES_DIR}/{rel} does not match its sha256 in {MANIFEST}")
    if (_digest(hashes), len(hashes)) != (info["digest"], info["files"]):
        raise corrupt(f"the files do not match the digest in {MANIFEST}")
    artifacts = src / ARTIFACTS
    if "artifacts_sha256" in info and (not artifacts.is_file() or _sha256(artifacts) != info["artifacts_sha256"]):
        raise corrupt(f"{ARTIFACTS} does not match its sha256 in {MANIFEST}")
    return [Path(rel) for rel in hashes]


def _same_torch(src: Path, info: dict) -> None:
    """Inductor's cache keys hold torch's version: another version's entries would never be used."""
    made_by, here = info.get("torch"), str(torch_version())
    if made_by is not None and made_by != here:
        raise CacheError(f"{src} was exported by torch {made_by}; this is torch {here}, whose compiles would never "
                         "use its entries: nothing imported")


def import_cache(src: str | Path, cache_dir: str | Path | None = None, *, lock_timeout: float = 600.0) -> SyncResult:
    """Copy an export made by `export_cache` into the local Inductor cache; skip if already imported.

    The export is verified file by file before anything is copied; the files are copied into a staging
    directory beside the cache and renamed into place only when all copies succeeded, so a corrupt
    export or a full disk leaves the cache as it was. Loads the Mega-Cache bytes when present and
    supported. Raises `CacheError` if `src` is not an intact export or the local cache directory is not
    writable, `CacheBusy` on a held lock.
    """
    src, dest = Path(src), Path(cache_dir) if cache_dir else current_cache_dir()
    _same_torch(src, _read_export_manifest(src))
    _require_writable(dest, f"import the compile cache into {dest}")
    with _locks([src, dest], lock_timeout):
        info = _read_export_manifest(src)  # again under the lock: an export may have finished since
        marker = dest / IMPORTED
        if marker.is_file() and marker.read_text().strip() == info["digest"]:
            return SyncResult("skipped", dest, info["digest"], info["files"], False)
        files = _verify_export(src, info)
        with scratch_dir(dest, "import") as staging:
            _copy_tree(src / FILES_DIR, staging, files)
            _move_tree(staging, dest, files)
        loaded = False
        if (src / ARTIFACTS).is_file() and supports("cache_artifacts"):
            loaded = torch.compiler.load_cache_artifacts((src / ARTIFACTS).read_bytes()) is not None
        atomic_write_bytes(marker, info["digest"].encode())
    return SyncResult("imported", dest, info["digest"], len(files), loaded)
