"""Corpus discovery: files -> deduplicated UTF-8 documents with a hash-based train/val split."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import stat
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from megacpp.data.config import DataConfig
from megacpp.data.repository import group_files, include_order, join_parts, repository_dirs
from megacpp.data.system_corpus import SourceTree, default_corpus_root, system_trees
from megacpp.errors import MegacppError
from megacpp.run_files import LOCK_NAME, is_run_entry

IGNORED_SHOWN = 6  # extensions the summary names of the files it did not read

# The tokenizer's pre-tokens (megacpp.data.tokenizer.SPLIT_PATTERN) end at a line end, except a run of
# blank space across lines, and BPE training on one pre-token takes time quadratic in its length (a word
# of 16 KiB 0.14 s, 64 KiB 1.5 s, 1 MiB over 2 minutes; a 200 MB line aborted the tokenizer library at
# 8.9 GB). A document with a longer line or blank run is skipped, counted as `long_line`. Code lines are
# far shorter: torch/include's longest is 1.8 KB.
MAX_LINE_BYTES = 65536
_LONG_BLANK_RUN = re.compile(rb"(?<!\s)\s{%d}" % (MAX_LINE_BYTES + 1))  # from a run's start: one scan per run


class CorpusError(MegacppError, ValueError):
    """Bad corpus input: a missing path, a bad JSONL line, or nothing left after filtering."""


def content_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def is_val(doc_hash: str, val_fraction: float) -> bool:
    """Hash-based split: a document's side depends on its bytes only, never on file order."""
    return int(doc_hash[:16], 16) < val_fraction * 2**64


@dataclass(frozen=True)
class DocumentFile:
    """A file a document was read from, and where its text lies in the document's (character offsets)."""

    path: Path
    start: int
    end: int


@dataclass(frozen=True)
class Document:
    source: str  # "root/rel/path", "root/file.jsonl:LINE", or a joined unit "root/dir" (+ "#part")
    text: str
    hash: str
    nbytes: int
    split: str  # "train" | "val"
    files: tuple[DocumentFile, ...] = ()  # none for a JSONL record
    root: Path | None = None  # where its files' include paths start: the repository, else the corpus root


@dataclass(frozen=True)
class SourceStats:
    """What one tree of a multi-tree corpus contributed."""

    name: str
    files: int  # files with a corpus name found in it
    docs: int  # documents kept from it (after filters and dedup against earlier trees)
    nbytes: int  # their bytes


@dataclass
class Corpus:
    docs: list[Document]
    roots: list[Path]
    files_seen: int
    skipped: Counter  # reason -> count
    hash: str  # identifies the kept documents, their order and split
    sources: list[SourceStats] = field(default_factory=list)  # per tree, for data.corpus = "system"
    unreadable_trees: list[str] = field(default_factory=list)  # trees that exist but cannot be listed
    documents: str = "file"  # data.documents: what one document is
    ignored: Counter = field(default_factory=Counter)  # extension -> files not read for it
    left_out: list[str] = field(default_factory=list)  # megacpp's own directories found in it (_OwnDirs)

    def split(self, name: str) -> list[Document]:
        return [d for d in self.docs if d.split == name]

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.docs)

    def summary(self) -> str:
        n_val = sum(d.split == "val" for d in self.docs)
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        mode = f" joined per {self.documents}" if self.documents != "file" else ""
        line = (
            f"corpus {self.hash[:12]}: {self.files_seen} files, {len(self.docs)} docs{mode} "
            f"(train {len(self.docs) - n_val} / val {n_val}), {self.nbytes / 1e6:.1f} MB; "
            f"skipped {sum(self.skipped.values())}: {skipped}"
        )
        if self.ignored:  # what a user's tree holds besides the corpus's extensions, in case some of it is C++
            ranked = sorted(self.ignored.items(), key=lambda item: (-item[1], item[0]))[:IGNORED_SHOWN]
            top = ", ".join(f"{ext} {n}" for ext, n in ranked)
            more = ", ..." if len(self.ignored) > IGNORED_SHOWN else ""
            line += (f"; not read, by extension: {sum(self.ignored.values())} ({top}{more}; "
                     "data.extensions adds one)")
        if self.left_out:
            line += f"; left out, as megacpp's own: {', '.join(map(_printable, self.left_out))}"
        if n_val == 1:
            line += ("\nwarning: the validation split is one document: its bits/byte says little; raise "
                     "data.val_fraction")
        if not self.sources and not self.unreadable_trees:
            return line
        trees = "; ".join(f"{_printable(s.name)} {s.files} files -> {s.docs} docs {s.nbytes / 1e6:.1f} MB"
                          for s in self.sources)
        unreadable = f" ({', '.join(map(_printable, self.unreadable_trees))})" if self.unreadable_trees else ""
        return f"{line}\nsources: {trees}; {len(self.unreadable_trees)} unreadable trees{unreadable}"


def _printable(name: str) -> str:
    """A tree's name as a printable line: a byte of a non-UTF-8 directory name (a lone surrogate after
    os.fsdecode, which a strict UTF-8 stdout refuses to print) is shown escaped, e.g. ``p\\xe9kg``."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


@dataclass
class _Filter:
    """Size limits, UTF-8 check and dedup, shared by every input format."""

    cfg: DataConfig
    skipped: Counter = field(default_factory=Counter)
    seen: set[str] = field(default_factory=set)
    docs: list[Document] = field(default_factory=list)

    def size_ok(self, nbytes: int) -> bool:
        if nbytes < self.cfg.min_bytes:
            self.skipped["too_small"] += 1
        elif nbytes > self.cfg.max_bytes:
            self.skipped["too_large"] += 1
        else:
            return True
        return False

    def accept(self, data: bytes) -> tuple[str, str] | None:
        """(text, content hash) of a file or record within the size limits, UTF-8, without a line the
        tokenizer cannot take (MAX_LINE_BYTES) and not seen before."""
        if not self.size_ok(len(data)):
            return None
        if len(data) > MAX_LINE_BYTES and (max(map(len, data.split(b"\n"))) > MAX_LINE_BYTES
                                           or _LONG_BLANK_RUN.search(data)):
            self.skipped["long_line"] += 1
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            self.skipped["undecodable"] += 1
            return None
        h = content_hash(data)
        if h in self.seen:
            self.skipped["duplicate"] += 1
            return None
        self.seen.add(h)
        return text, h

    def add(self, source: str, data: bytes, path: Path | None = None, root: Path | None = None) -> None:
        """One file (at `path`, under corpus root `root`) or JSONL record as one document."""
        accepted = self.accept(data)
        if accepted is not None:
            text, h = accepted
            files = (DocumentFile(path, 0, len(text)),) if path is not None else ()
            self.docs.append(Document(source, text, h, len(data), self._split(h), files, root))

    def add_joined(self, source: str, text: str, files: tuple[DocumentFile, ...], root: Path) -> None:
        """A joined document: its files passed `accept` one by one; an identical joined text is a duplicate."""
        data = text.encode("utf-8")
        h = content_hash(data)
        if h in self.seen:
            self.skipped["duplicate"] += 1
            return
        self.seen.add(h)
        self.docs.append(Document(source, text, h, len(data), self._split(h), files, root))

    def _split(self, doc_hash: str) -> str:
        return "val" if is_val(doc_hash, self.cfg.val_fraction) else "train"


@dataclass
class _OwnDirs:
    """megacpp's own directories, left out of every corpus so that its files never become training data:
    - a run directory, marked by the lock file every run creates first and leaves behind
      (megacpp.run_files): the files megacpp writes there are left out, the user's own stay in (a run
      may write into the corpus root itself, ``--train.out_dir .``);
    - the caches this process uses, by path: ``data.cache_dir`` and the compile cache megacpp exports as
      TORCHINDUCTOR_CACHE_DIR (Inductor writes generated C++ there).
    What was left out is listed in `found` as ``<label>/<path> (<what>)``."""

    caches: dict[str, str]  # real path -> what it is
    found: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: DataConfig) -> _OwnDirs:
        caches = {cfg.resolved_cache_dir(): "the data cache"}
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            caches[Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])] = "the compile cache"
        # realpath, as the walk's roots are resolved; unlike Path.resolve it never raises on a link loop
        return cls({os.path.realpath(path.expanduser()): what for path, what in caches.items()})

    def leave_out(self, label: str, rel: str, dirpath: str, dirnames: list[str], filenames: list[str]) -> None:
        """Drop megacpp's own entries from one step of an ``os.walk`` (in place), noting each."""
        where = f"{label}/{rel}" if rel != "." else label
        if LOCK_NAME in filenames:
            self.found.append(f"{where} (a run directory's files)")
            filenames[:] = [name for name in filenames if not is_run_entry(name)]
            dirnames[:] = [name for name in dirnames if not is_run_entry(name)]
        for name in list(dirnames):
            what = self.caches.get(os.path.join(dirpath, name))
            if what is not None:
                self.found.append(f"{where}/{name} ({what})")
                dirnames.remove(name)


def _list_files(
    root: Path, suffixes: set[str], skipped: Counter, label: str | None = None,
    skip_dirs: frozenset[Path] = frozenset(), extensionless: bool = False, ignored: Counter | None = None,
    own: _OwnDirs | None = None,
) -> list[tuple[str, Path]]:
    """(label, path) of matching names under root, sorted by relative path; a directory that cannot
    be listed is counted as `unreadable_dir` instead of ending discovery. Labels start with `label`
    (default: the root's name); directories in `skip_dirs` are not entered, nor megacpp's `own`. Files of
    other extensions are counted in `ignored` by extension ("(none)" for a name without one; hidden files
    not at all)."""
    label = label or root.name
    if not root.is_dir():  # a file named directly (or a special file, rejected when it is read)
        return [(label, root)]

    def count_unlistable(_exc: OSError) -> None:
        skipped["unreadable_dir"] += 1

    def wanted(name: str) -> bool:
        ext = os.path.splitext(name)[1].lower()
        return ext in suffixes or (extensionless and not ext and not name.startswith("."))

    found = []
    # os.walk does not follow directory symlinks, so a link cycle cannot loop forever.
    for dirpath, dirnames, filenames in os.walk(root, onerror=count_unlistable):
        if skip_dirs:
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) not in skip_dirs]
        if own is not None:
            own.leave_out(label, os.path.relpath(dirpath, root), dirpath, dirnames, filenames)
        for name in filenames:
            if wanted(name):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
            elif ignored is not None and not name.startswith("."):
                ignored[os.path.splitext(name)[1].lower() or "(none)"] += 1
    found.sort(key=lambda item: item[0])
    return [(f"{label}/{rel}", path) for rel, path in found]


def _open_regular(path: Path) -> BinaryIO | None:
    """The file opened for reading, or None for a FIFO, device or socket (counted as `special_file`).

    Special files are recognised by stat and never opened: opening a FIFO waits for a writer forever.
    O_NONBLOCK still covers one swapped in between the stat and the open.
    """
    if not stat.S_ISREG(path.stat().st_mode):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        return None
    return f


def _jsonl_record_limit(max_bytes: int) -> int:
    """Longest JSONL line worth parsing: JSON escapes spell a byte as at most 6 characters (\\u00XX),
    plus 64 KiB for the record's other fields. Longer lines are skipped unread, as `too_large`."""
    return 6 * max_bytes + 65536


def _bounded_lines(f: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The lines of `f`, never holding more than `limit + 1` bytes of one; None stands for a longer
    line, whose rest is read and dropped in bounded pieces."""
    while line := f.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(limit + 1)
        yield None


def _read_jsonl(label: str, f: BinaryIO, cfg: DataConfig, flt: _Filter) -> None:
    """One document per line, streamed: memory is bounded by the longest accepted record."""
    for lineno, line in enumerate(_bounded_lines(f, _jsonl_record_limit(cfg.max_bytes)), start=1):
        if line is None:
            flt.skipped["too_large"] += 1
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record[cfg.jsonl_field]
            if not isinstance(text, str):
                raise TypeError(f"field {cfg.jsonl_field!r} is {type(text).__name__}, not a string")
            data = text.encode("utf-8")  # UnicodeEncodeError (a ValueError) on lone surrogates
        except (ValueError, KeyError, TypeError) as e:
            why = f"missing field {cfg.jsonl_field!r}" if isinstance(e, KeyError) else str(e)
            if cfg.jsonl_errors == "raise":
                raise CorpusError(f"{label}:{lineno}: bad JSONL record: {why}") from e
            flt.skipped["bad_jsonl_line"] += 1
            continue
        flt.add(f"{label}:{lineno}", data)


def _read_file(label: str, path: Path, is_jsonl: bool, cfg: DataConfig, flt: _Filter, root: Path) -> None:
    """Add the documents of one file (under corpus root `root`); unreadable and special files are counted,
    not raised."""
    if not is_jsonl:
        data = _read_source(path, cfg, flt)
        if data is not None:
            flt.add(label, data, path, root)
        return
    try:
        f = _open_regular(path)
        if f is None:
            flt.skipped["special_file"] += 1
            return
        with f:
            _read_jsonl(label, f, cfg, flt)
    except OSError:
        flt.skipped["unreadable"] += 1


def _read_source(path: Path, cfg: DataConfig, flt: _Filter) -> bytes | None:
    """The bytes of one source file, or None when it is special, unreadable or too large (counted)."""
    try:
        f = _open_regular(path)
        if f is None:
            flt.skipped["special_file"] += 1
            return None
        with f:
            # fstat first so a huge file is rejected unread; the read is bounded too, for a file that
            # grows after the fstat.
            if flt.size_ok(os.fstat(f.fileno()).st_size):
                return f.read(cfg.max_bytes + 1)
    except OSError:
        flt.skipped["unreadable"] += 1
    return None


def _read_units(root: Path, label: str, files: list[tuple[str, Path]], jsonl_ext: set[str], cfg: DataConfig,
                flt: _Filter) -> None:
    """data.documents = directory | repository: the files under one corpus root, each through the usual
    filters, joined per unit (megacpp.data.repository) and cut into parts of data.max_document_bytes.
    JSONL records stay documents of their own."""
    top = root if root.is_dir() else root.parent
    texts: dict[str, str] = {}
    for file_label, path in files:
        if path.suffix.lower() in jsonl_ext:
            _read_file(file_label, path, True, cfg, flt, top)
            continue
        data = _read_source(path, cfg, flt)
        accepted = flt.accept(data) if data is not None else None
        if accepted is not None:
            texts[path.relative_to(top).as_posix()] = accepted[0]
    repositories = repository_dirs(root) if cfg.documents == "repository" and root.is_dir() else set()
    for unit in group_files(texts, cfg.documents, repositories):
        unit_dir = top / unit.base
        text_of = {rel: texts[posixpath.join(unit.base, rel) if unit.base else rel] for rel in unit.files}
        order = include_order(text_of) if unit.joined else list(unit.files)
        parts = join_parts([(rel, text_of[rel]) for rel in order], cfg.max_document_bytes)
        name = f"{label}/{unit.name}" if unit.name else label
        for number, part in enumerate(parts, start=1):
            files_in = tuple(DocumentFile(unit_dir / f.path, f.start, f.end) for f in part.files)
            flt.add_joined(name if len(parts) == 1 else f"{name}#{number}", part.text, files_in, unit_dir)


def _corpus_hash(docs: list[Document]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for d in docs:
        h.update(f"{d.hash}:{d.split}\n".encode())
    return h.hexdigest()


def _ensure_val(docs: list[Document], val_fraction: float) -> list[Document]:
    """A tiny corpus may hash nothing into val; then move the lowest-hash doc there (order-independent)."""
    if val_fraction == 0 or len(docs) < 2 or any(d.split == "val" for d in docs):
        return docs
    pick = min(docs, key=lambda d: d.hash)
    return [dataclasses.replace(d, split="val") if d is pick else d for d in docs]


def _is_listable(path: Path) -> bool:
    try:
        with os.scandir(path):
            return True
    except OSError:
        return False


def _read_system_trees(trees: Sequence[SourceTree], cfg: DataConfig, flt: _Filter, own: _OwnDirs
                       ) -> tuple[int, list[SourceStats], list[str]]:
    """Walk each tree once (trees nested in it are skipped there: they are walked on their own) and
    account for what each contributed. Only C/C++ extensions: a system tree's .txt or .jsonl files are
    not code documents."""
    suffixes = {e.lower() for e in cfg.extensions}
    files_seen, stats, unreadable = 0, [], []
    for tree in trees:
        if not _is_listable(tree.path):
            unreadable.append(tree.name)
            continue
        nested = frozenset(t.path for t in trees if t.path != tree.path and t.path.is_relative_to(tree.path))
        first_doc = len(flt.docs)
        files = _list_files(tree.path, suffixes, flt.skipped, tree.name, nested, tree.extensionless, own=own)
        if cfg.documents == "file":
            for label, path in files:
                _read_file(label, path, False, cfg, flt, tree.path)
        else:
            _read_units(tree.path, tree.name, files, set(), cfg, flt)
        kept = flt.docs[first_doc:]
        stats.append(SourceStats(tree.name, len(files), len(kept), sum(d.nbytes for d in kept)))
        files_seen += len(files)
    return files_seen, stats, unreadable


def _resolved_root(path: str) -> Path:
    """A corpus root as an absolute path; a symbolic-link loop is one line, not a traceback."""
    try:
        return Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # Python < 3.13 raises RuntimeError("Symlink loop ...")
        raise CorpusError(f"corpus path {path}: cannot be resolved ({exc}): a symbolic link that points back "
                          "into itself; expected a directory or file") from None


def discover_corpus(cfg: DataConfig, system: Sequence[SourceTree] | None = None) -> Corpus:
    """Read, filter, dedup and split the corpus named by `cfg.corpus` (None = torch/include;
    "system" = the trees of `system`, by default this machine's: `megacpp.data.system_corpus`)."""
    flt = _Filter(cfg)
    sources: list[SourceStats] = []
    unreadable: list[str] = []
    ignored: Counter = Counter()  # a user's own trees only: a system tree is mostly not code
    own = _OwnDirs.of(cfg)
    if cfg.corpus == "system":
        trees = list(system) if system is not None else system_trees()
        roots = [t.path for t in trees]
        files_seen, sources, unreadable = _read_system_trees(trees, cfg, flt, own)
        exts = sorted(cfg.extensions)
    else:
        # Resolved, so "." still has a name to prefix document sources with.
        roots = [_resolved_root(p) for p in cfg.corpus] if cfg.corpus else [default_corpus_root()]
        for root in roots:
            if not root.exists():
                raise CorpusError(f"corpus path does not exist: {root}")
        source_ext = {e.lower() for e in cfg.extensions}
        text_ext = {e.lower() for e in cfg.text_extensions}
        jsonl_ext = {e.lower() for e in cfg.jsonl_extensions}
        files_seen = 0
        for root in roots:
            files = _list_files(root, source_ext | text_ext | jsonl_ext, flt.skipped, ignored=ignored, own=own)
            files_seen += len(files)
            if cfg.documents == "file":
                top = root if root.is_dir() else root.parent
                for label, path in files:
                    _read_file(label, path, path.suffix.lower() in jsonl_ext, cfg, flt, top)
            else:
                _read_units(root, root.name, files, jsonl_ext, cfg, flt)
        exts = sorted(source_ext | text_ext | jsonl_ext)
    docs = _ensure_val(flt.docs, cfg.val_fraction)
    corpus = Corpus(docs, roots, files_seen, flt.skipped, _corpus_hash(docs), sources, unreadable, cfg.documents,
                    ignored, own.found)
    if files_seen == 0:
        raise CorpusError(f"no corpus files with extensions {exts} under {[str(r) for r in roots]}")
    if not any(d.split == "train" for d in docs):
        raise CorpusError(
            f"corpus is empty after filtering (no training documents): {corpus.summary()} "
            f"[limits: {cfg.min_bytes}..{cfg.max_bytes} bytes, val_fraction {cfg.val_fraction}]"
        )
    return corpus
