"""Data configuration: corpus discovery, tokenizer training, shard cache and packing."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megacpp.rules import AT_LEAST_1, BELOW_1, NON_NEGATIVE, SEED, ConfigSection, Interval, Keys

# C and C++ sources and headers, CUDA, and the names C++ libraries give template implementations (.tcc,
# .tpp, .ipp, .inl, .inc) and modules (.ixx, .cppm).
SOURCE_EXTENSIONS = [
    ".h", ".hpp", ".hh", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".ipp", ".inl", ".tcc", ".tpp",
    ".inc", ".ixx", ".cppm",
]

JsonlErrors = Literal["skip", "raise"]  # skip: count bad lines in the summary | raise: error naming file:line
# What one document is: a file, the files of one directory, or the files of one repository, joined in
# include order (megacpp.data.repository).
DocumentMode = Literal["file", "directory", "repository"]

# Special tokens; a byte-level vocabulary needs 256 byte tokens besides these.
MIN_VOCAB_SIZE = 256 + 3


def default_cache_dir() -> Path:
    """`$MEGACPP_CACHE_DIR/data`, else `~/.cache/megacpp/data`."""
    root = os.environ.get("MEGACPP_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "megacpp") / "data"


@dataclass
class DataConfig(ConfigSection):
    # Directories and/or files; None = the C++ headers shipped inside torch (torch/include); "system" =
    # every C/C++ include tree on the machine (megacpp.data.system_corpus).
    corpus: list[str] | Literal["system"] | None = None
    extensions: list[str] = field(default_factory=lambda: list(SOURCE_EXTENSIONS))
    text_extensions: list[str] = field(default_factory=lambda: [".txt"])
    jsonl_extensions: list[str] = field(default_factory=lambda: [".jsonl"])
    jsonl_field: str = "text"
    jsonl_errors: JsonlErrors = "skip"
    # Per-document UTF-8 size limits; the default cap drops a few multi-MB generated headers.
    min_bytes: int = 16
    max_bytes: int = 1_000_000
    documents: DocumentMode = "file"
    # A joined document is cut at file boundaries into parts of at most this many bytes (a longer file is a
    # part alone). Split, dedup and shuffle work per part: whole, torch's headers (one tree, 34.8 MB) would
    # be one document, all train or all val. 256 KiB is ~77K tokens at 3.4 bytes/token, more than a row
    # of 65,536, and cuts torch's headers into 137 parts.
    max_document_bytes: int = 262_144
    val_fraction: float = 0.01  # by content hash, so independent of file order
    vocab_size: int = 4096
    # Training-split bytes the BPE trainer sees (~4 s on 2 cores; the whole 34 MB split compresses
    # only 0.2% better at 2.5x the time).
    tokenizer_sample_bytes: int = 16_000_000
    tokenizer_path: str | None = None  # an existing tokenizer.json; None = train (cached)
    cache_dir: str | None = None  # None = default_cache_dir()
    seq_len: int = 256
    shuffle_seed: int = 0
    # Training bytes the "xz given train" baseline may use as context (xz -9e runs at ~2 MB/s on one
    # core, twice over this sample, once per shard cache); None = the whole training split.
    baseline_context_bytes: int | None = 8 * 2**20

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {
            "min_bytes": NON_NEGATIVE,
            "max_bytes": NON_NEGATIVE,
            "max_document_bytes": AT_LEAST_1,
            "val_fraction": BELOW_1,  # 1 would leave nothing to train on
            "vocab_size": Interval(MIN_VOCAB_SIZE),  # 256 byte tokens and the special tokens
            "tokenizer_sample_bytes": AT_LEAST_1,
            "seq_len": AT_LEAST_1,
            "baseline_context_bytes": AT_LEAST_1,
            "shuffle_seed": SEED,  # the loader's generator takes train.seed + shuffle_seed (megacpp.validate)
        }

    def check(self, k: Keys) -> None:
        for rule in (_byte_limits, _extensions_dotted, _corpus_names_a_path):
            rule(self, k)


def _byte_limits(cfg: DataConfig, k: Keys) -> None:
    """A document must be able to pass both size limits."""
    if cfg.min_bytes > cfg.max_bytes:
        raise k.error_among(("min_bytes", "max_bytes"), "min_bytes must be <= max_bytes")


def _extensions_dotted(cfg: DataConfig, k: Keys) -> None:
    """Extensions are compared with Path.suffix, which starts with a dot: 'cpp' would match nothing."""
    for name in ("extensions", "text_extensions", "jsonl_extensions"):
        bad = [e for e in getattr(cfg, name) if not e.startswith(".")]
        if bad:
            raise k.error(name, f"has extensions {bad} without the leading '.'")


def _corpus_names_a_path(cfg: DataConfig, k: Keys) -> None:
    """An empty corpus list would reach the data step and find nothing to train on; unset means the
    default corpus, so the empty list is never what was meant."""
    if isinstance(cfg.corpus, list) and not [p for p in cfg.corpus if p.strip()]:
        raise k.error("corpus", "names no path; expected one or more files or directories, \"system\" "
                      "(every C/C++ include tree on the machine), or no value for the default corpus")

