"""Data configuration: corpus discovery, tokenizer training, shard cache and packing."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

SOURCE_EXTENSIONS = [
    ".h", ".hpp", ".hh", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".ipp", ".inl",
]

JsonlErrors = Literal["skip", "raise"]  # skip: count bad lines in the summary | raise: error naming file:line

# Special tokens; a byte-level vocabulary needs 256 byte tokens besides these.
MIN_VOCAB_SIZE = 256 + 3


def default_cache_dir() -> Path:
    """`$MEGACPP_CACHE_DIR/data`, else `~/.cache/megacpp/data`."""
    root = os.environ.get("MEGACPP_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "megacpp") / "data"


@dataclass
class DataConfig:
    # Directories and/or files; None = the C++ headers shipped inside torch (torch/include).
    corpus: list[str] | None = None
    extensions: list[str] = field(default_factory=lambda: list(SOURCE_EXTENSIONS))
    text_extensions: list[str] = field(default_factory=lambda: [".txt"])
    jsonl_extensions: list[str] = field(default_factory=lambda: [".jsonl"])
    jsonl_field: str = "text"
    jsonl_errors: JsonlErrors = "skip"
    # Per-document UTF-8 size limits; the default cap drops a few multi-MB generated headers.
    min_bytes: int = 16
    max_bytes: int = 1_000_000
    val_fraction: float = 0.01  # by content hash, so independent of file order
    vocab_size: int = 4096
    # Training-split bytes the BPE trainer sees (~4 s on 2 cores; the whole 34 MB split compresses
    # only 0.2% better at 2.5x the time).
    tokenizer_sample_bytes: int = 16_000_000
    tokenizer_path: str | None = None  # an existing tokenizer.json; None = train (cached)
    cache_dir: str | None = None  # None = default_cache_dir()
    seq_len: int = 256
    shuffle_seed: int = 0

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    def validate(self) -> None:
        """Raise ValueError naming the first field with an invalid value."""
        checks = [
            ("jsonl_errors", self.jsonl_errors in get_args(JsonlErrors), "must be 'skip' or 'raise'"),
            ("min_bytes", 0 <= self.min_bytes <= self.max_bytes, "must satisfy 0 <= min_bytes <= max_bytes"),
            ("val_fraction", 0.0 <= self.val_fraction < 1.0, "must be in [0, 1)"),
            ("vocab_size", self.vocab_size >= MIN_VOCAB_SIZE, f"must be >= {MIN_VOCAB_SIZE}"),
            ("tokenizer_sample_bytes", self.tokenizer_sample_bytes > 0, "must be > 0"),
            ("seq_len", self.seq_len > 0, "must be > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"data.{name} = {getattr(self, name)!r} {why}")
        for name in ("extensions", "text_extensions", "jsonl_extensions"):
            bad = [e for e in getattr(self, name) if not e.startswith(".")]
            if bad:
                raise ValueError(f"data.{name}: extensions must start with '.', got {bad}")
