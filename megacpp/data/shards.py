"""Tokenized shard cache: one memory-mapped token file per split plus a JSON manifest.

Layout of a shard directory:
  train.bin, val.bin   every document as [BOS, tokens...], concatenated (uint16 or uint32)
  manifest.json        hashes, dtype, per-document offsets / bytes / sources; written last
The manifest is the commit point: token files are written to temp names and renamed first, so a
directory without a valid manifest (or whose files disagree with it) is rebuilt, never read. The
manifest records each token file's sha256 as written; loading checks it, so a byte flipped on disk
later is caught too (about 12 ms per 20 MB, once per load).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock
from tqdm import tqdm

from megacpp.data.corpus import Corpus, Document
from megacpp.data.tokenizer import CodeTokenizer
from megacpp.errors import MegacppError
from megacpp.fs import atomic_path, atomic_write_text, remove_stale_temporaries

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: each split records the sha256 of its token file
SPLITS = ("train", "val")
_ENCODE_CHUNK = 256  # documents per encode_batch call: enough for the Rust thread pool


class ShardError(MegacppError, RuntimeError):
    """A shard directory that does not match its manifest or the requested corpus/tokenizer."""


@dataclass
class ShardSplit:
    name: str
    tokens: np.ndarray  # memmap (read-only) of all documents, each starting with BOS
    offsets: np.ndarray  # int64 (n_docs + 1,): document i is tokens[offsets[i]:offsets[i + 1]]
    doc_bytes: np.ndarray  # int64 (n_docs,): UTF-8 bytes of each document's text
    sources: list[str]

    @property
    def num_docs(self) -> int:
        return len(self.sources)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_bytes(self) -> int:
        return int(self.doc_bytes.sum())

    def bytes_per_token(self) -> float:
        """Text bytes per text token (BOS excluded): converts nats/token into bits/byte."""
        text_tokens = self.num_tokens - self.num_docs
        return self.num_bytes / text_tokens if text_tokens else 0.0


@dataclass
class ShardSet:
    dir: Path
    corpus_hash: str
    tokenizer_hash: str
    bos_id: int
    vocab_size: int
    token_bytes: np.ndarray  # int32 (vocab,): UTF-8 bytes per token id, 0 for specials
    splits: dict[str, ShardSplit]
    from_cache: bool  # False when this call tokenized the corpus

    @property
    def key(self) -> str:
        """Identifies the token stream; a loader state is only valid for the same key."""
        return f"{self.corpus_hash}-{self.tokenizer_hash}"

    def document_tokens(self) -> np.ndarray:
        """int64 text tokens (BOS excluded) of every document, both splits."""
        return np.concatenate([np.diff(s.offsets) - 1 for s in self.splits.values()])

    def summary(self) -> str:
        parts = [
            f"{s.name} {s.num_docs} docs {s.num_tokens:,} tokens ({s.bytes_per_token():.2f} B/token)"
            for s in self.splits.values()
        ]
        how = "cached" if self.from_cache else "built"
        lengths = self.document_tokens()
        if len(lengths):  # the tokens of the documents themselves: what a long context can read at once
            median, p90 = np.percentile(lengths, [50, 90], method="lower")
            parts.append(f"{len(lengths)} documents of median {median:,} tokens, 90th percentile {p90:,}, "
                         f"longest {lengths.max():,}")
        return f"shards {how} at {self.dir}: " + "; ".join(parts)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def shard_dir_name(corpus_hash: str, tokenizer_hash: str) -> str:
    return f"{corpus_hash[:16]}-{tokenizer_hash[:16]}"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _map_tokens(path: Path, dtype: np.dtype, count: int, sha256: str) -> np.ndarray:
    expected = count * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise ShardError(f"{path}: {actual} bytes, manifest says {expected}")
    if _sha256_file(path) != sha256:
        raise ShardError(f"{path}: content changed since it was written (sha256 differs from the manifest)")
    if count == 0:  # mmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def load_shards(out_dir: str | Path, corpus_hash: str, tokenizer_hash: str) -> ShardSet:
    """Open a built shard directory; ShardError when anything is missing, stale or inconsistent."""
    out_dir = Path(out_dir)
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ShardError(f"{out_dir / MANIFEST}: unreadable manifest ({e})") from e
    if manifest.get("version") != FORMAT_VERSION:
        raise ShardError(f"{out_dir}: manifest version {manifest.get('version')} != {FORMAT_VERSION}")
    for what, want in (("corpus_hash", corpus_hash), ("tokenizer_hash", tokenizer_hash)):
        if manifest.get(what) != want:
            raise ShardError(f"{out_dir}: stale shards ({what} {manifest.get(what)} != {want})")
    try:
        dtype = np.dtype(manifest["dtype"])
        bos = manifest["bos_id"]
        splits = {}
        for name in SPLITS:
            m = manifest["splits"][name]
            offsets = np.asarray(m["offsets"], dtype=np.int64)
            tokens = _map_tokens(out_dir / m["file"], dtype, int(offsets[-1]), m["sha256"])
            if len(offsets) != len(m["sources"]) + 1 or len(m["doc_bytes"]) != len(m["sources"]):
                raise ShardError(f"{out_dir}: {name} offsets/doc_bytes/sources lengths disagree")
            if len(tokens) and not np.all(tokens[offsets[:-1]] == bos):
                raise ShardError(f"{out_dir}: {name} documents do not start with BOS")
            doc_bytes = np.asarray(m["doc_bytes"], dtype=np.int64)
            splits[name] = ShardSplit(name, tokens, offsets, doc_bytes, list(m["sources"]))
        token_bytes = np.asarray(manifest["token_bytes"], dtype=np.int32)
        vocab_size = int(manifest["vocab_size"])
    except (KeyError, TypeError, ValueError, IndexError, OSError) as e:
        raise ShardError(f"{out_dir}: malformed shards ({type(e).__name__}: {e})") from e
    return ShardSet(out_dir, corpus_hash, tokenizer_hash, bos, vocab_size, token_bytes, splits, True)


def _encoded(docs: list[Document], tok: CodeTokenizer, bar: tqdm) -> Iterator[list[int]]:
    for start in range(0, len(docs), _ENCODE_CHUNK):
        chunk = docs[start : start + _ENCODE_CHUNK]
        yield from tok.encode_batch([d.text for d in chunk])
        bar.update(sum(d.nbytes for d in chunk))


def _write_split(
    docs: list[Document], tok: CodeTokenizer, path: Path, dtype: np.dtype, bar: tqdm
) -> dict:
    lengths = []
    digest = hashlib.sha256()  # of the bytes as written, for the check at every load
    with atomic_path(path, fsync=True) as tmp, open(tmp, "wb") as f:
        for ids in _encoded(docs, tok, bar):
            data = np.array([tok.bos_id, *ids], dtype=dtype).tobytes()
            f.write(data)
            digest.update(data)
            lengths.append(len(ids) + 1)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return {
        "file": path.name,
        "sha256": digest.hexdigest(),
        "num_tokens": int(offsets[-1]),
        "num_bytes": sum(d.nbytes for d in docs),
        "offsets": offsets.tolist(),
        "doc_bytes": [d.nbytes for d in docs],
        "sources": [d.source for d in docs],
    }


def _tokenize_into(out_dir: Path, corpus: Corpus, tok: CodeTokenizer, progress: bool) -> None:
    (out_dir / MANIFEST).unlink(missing_ok=True)  # uncommit first: old manifest + new files never mix
    remove_stale_temporaries(out_dir)
    dtype = token_dtype(tok.vocab_size)
    split_docs = {name: corpus.split(name) for name in SPLITS}
    total = sum(d.nbytes for docs in split_docs.values() for d in docs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        splits = {
            name: _write_split(docs, tok, out_dir / f"{name}.bin", dtype, bar)
            for name, docs in split_docs.items()
        }
    manifest = {
        "version": FORMAT_VERSION,
        "corpus_hash": corpus.hash,
        "tokenizer_hash": tok.hash,
        "dtype": dtype.name,
        "bos_id": tok.bos_id,
        "vocab_size": tok.vocab_size,
        "token_bytes": tok.token_bytes().tolist(),
        "splits": splits,
    }
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest), fsync=True)


def build_shards(
    corpus: Corpus, tok: CodeTokenizer, out_dir: str | Path, progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> ShardSet:
    """Load the shards in `out_dir` if they match corpus and tokenizer, else (re)build them.

    A file lock makes concurrent callers (e.g. all ranks of a torchrun job) build once. A committed
    directory that fails its checks (damaged, stale, older format) is rebuilt with a notice to `log`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir / ".lock")):
        try:
            return load_shards(out_dir, corpus.hash, tok.hash)
        except ShardError as e:
            if log and (out_dir / MANIFEST).exists():
                log(f"rebuilding shards: {e}")
        _tokenize_into(out_dir, corpus, tok, progress)
        shards = load_shards(out_dir, corpus.hash, tok.hash)
    shards.from_cache = False
    return shards
