"""One call from config to ready data: discover the corpus, load or train the tokenizer, build shards,
and the validation split's baselines (cached beside the shards)."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from megacpp.data.baselines import Baselines, load_or_compute_baselines
from megacpp.data.config import DataConfig
from megacpp.data.corpus import Corpus, discover_corpus
from megacpp.data.shards import ShardSet, build_shards, shard_dir_name
from megacpp.data.tokenizer import SPLIT_PATTERN, CodeTokenizer, file_hash, train_tokenizer
from megacpp.fs import atomic_write_text


@dataclass
class PreparedData:
    corpus: Corpus
    tokenizer: CodeTokenizer
    shards: ShardSet
    baselines: Baselines


def tokenizer_cache_path(cfg: DataConfig, corpus: Corpus) -> Path:
    """Cache slot for the tokenizer that `cfg` would train on `corpus`."""
    recipe = f"{corpus.hash}|{cfg.vocab_size}|{cfg.tokenizer_sample_bytes}|{SPLIT_PATTERN}"
    key = hashlib.blake2b(recipe.encode(), digest_size=8).hexdigest()
    return cfg.resolved_cache_dir() / "tokenizers" / key / "tokenizer.json"


def recorded_hash_path(path: Path) -> Path:
    """Where the cache keeps the hash a cached tokenizer.json had when it was trained."""
    return path.with_name(path.name + ".blake2b")


def _load_cached_tokenizer(path: Path, log: Callable[[str], None] | None) -> CodeTokenizer | None:
    """The cached tokenizer if its bytes still hash to what was recorded at training, else None (with a
    notice): a damaged cache entry is retrained, never used."""
    if not path.is_file():
        return None
    recorded = recorded_hash_path(path)
    want = recorded.read_text().strip() if recorded.is_file() else None
    have = file_hash(path)
    if have == want:
        return CodeTokenizer.from_file(path)
    if log:
        why = f"hash {have[:12]} != recorded {want[:12]}" if want else "no recorded hash"
        log(f"tokenizer cache {path}: {why} (damaged or from an older megacpp); retraining")
    return None


def _record_hash(path: Path, digest: str) -> None:
    atomic_write_text(recorded_hash_path(path), digest + "\n")


def load_or_train_tokenizer(
    cfg: DataConfig, corpus: Corpus, log: Callable[[str], None] | None = print
) -> CodeTokenizer:
    """`cfg.tokenizer_path` if set, else the cached tokenizer for this corpus/recipe, trained once.

    Training records the file's hash beside it; a cached file is used only while it still matches.
    """
    if cfg.tokenizer_path:
        return CodeTokenizer.from_file(Path(cfg.tokenizer_path).expanduser())
    path = tokenizer_cache_path(cfg, corpus)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / ".lock")):
        cached = _load_cached_tokenizer(path, log)
        if cached is not None:
            return cached
        t0 = time.perf_counter()
        tok = train_tokenizer(corpus, cfg.vocab_size, cfg.tokenizer_sample_bytes, path)
        _record_hash(path, tok.hash)
    if log:
        log(f"tokenizer {tok.hash[:12]}: trained vocab {tok.vocab_size} in "
            f"{time.perf_counter() - t0:.1f}s -> {path}")
    return tok


def prepare_data(
    cfg: DataConfig, progress: bool = True, log: Callable[[str], None] | None = print
) -> PreparedData:
    """Discover, tokenize, cache and measure the baselines; safe to call from every rank at once
    (file locks)."""
    corpus = discover_corpus(cfg)
    if log:
        log(corpus.summary())
    tok = load_or_train_tokenizer(cfg, corpus, log)
    out_dir = cfg.resolved_cache_dir() / "shards" / shard_dir_name(corpus.hash, tok.hash)
    shards = build_shards(corpus, tok, out_dir, progress=progress, log=log)
    if log:
        log(shards.summary())
    baselines = load_or_compute_baselines(corpus, shards, cfg.baseline_context_bytes, log)
    return PreparedData(corpus, tok, shards, baselines)
