"""What the trainer needs from the data path: tokenizer, train and validation loaders, the baselines."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megacpp.data.baselines import Baselines
from megacpp.data.config import DataConfig
from megacpp.data.corpus import CorpusError, discover_corpus
from megacpp.data.loader import PackedLoader, ValBatch, ValLoader
from megacpp.data.prepare import load_or_train_tokenizer, prepare_data
from megacpp.data.shards import ShardSet
from megacpp.data.tokenizer import CodeTokenizer
from megacpp.fs import atomic_write_bytes
from megacpp.validate import validate_section


@dataclass
class DataBundle:
    tokenizer: CodeTokenizer
    shards: ShardSet
    loader: PackedLoader
    batch_size: int
    seq_len: int
    device: torch.device
    baselines: Baselines
    rank: int = 0
    world_size: int = 1

    @property
    def tokenizer_hash(self) -> str:
        return self.tokenizer.hash

    def tokenizer_json(self) -> bytes:
        return Path(self.tokenizer.path).read_bytes()

    def val_batches(self, max_batches: int) -> Iterator[ValBatch]:
        """The same fixed validation batches on every call: this rank's rows of `max_batches` global
        batches (the same number of batches on every rank)."""
        return iter(ValLoader(self.shards, self.batch_size, self.seq_len, num_batches=max_batches,
                              rank=self.rank, world_size=self.world_size, device=self.device))


def build_data(cfg: DataConfig, seed: int, batch_size: int, device: torch.device | str,
               log: Callable[[str], None] = print, progress: bool = True,
               rank: int = 0, world_size: int = 1) -> DataBundle:
    """Discover, tokenize (cached) and wrap the corpus in loaders for this rank."""
    validate_section(cfg, "data")
    prepared = prepare_data(cfg, progress=progress, log=log)
    device = torch.device(device)
    try:
        loader = PackedLoader(prepared.shards, batch_size, cfg.seq_len, rank=rank, world_size=world_size,
                              seed=seed + cfg.shuffle_seed, device=device)
        ValLoader(prepared.shards, batch_size, cfg.seq_len, num_batches=1, rank=rank, world_size=world_size)
    except ValueError as exc:  # before any training: not at the first evaluation
        raise CorpusError(f"{exc} (corpus: {prepared.corpus.summary().splitlines()[0]})") from exc
    return DataBundle(prepared.tokenizer, prepared.shards, loader, batch_size, cfg.seq_len, device,
                      prepared.baselines, rank, world_size)


def train_tokenizer_cli(cfg: DataConfig, out: Path | None) -> str:
    """`megacpp tokenizer train`: train (or find cached) and optionally copy tokenizer.json to ``out``."""
    validate_section(cfg, "data")
    tok = load_or_train_tokenizer(cfg, discover_corpus(cfg))
    if out is not None:
        out = out / "tokenizer.json" if out.suffix != ".json" else out
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out, Path(tok.path).read_bytes())
    return f"tokenizer {tok.hash[:12]}: vocab {tok.vocab_size}, {out or tok.path}"
