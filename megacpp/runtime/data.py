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
from megacpp.errors import MegacppError, UsageError
from megacpp.fs import atomic_write_bytes


@dataclass
class DataBundle:
    tokenizer: CodeTokenizer
    shards: ShardSet
    loader: PackedLoader
    batch_size: int
    seq_len: int
    device: torch.device
    baselines: Baselines
    # Rows this rank evaluates per validation batch. Training gives its rows of an optimizer step, so that a
    # validation batch is the step's rows in every layout that keeps them (GPUs x batch x accum).
    val_batch_size: int
    rank: int = 0
    world_size: int = 1

    @property
    def tokenizer_hash(self) -> str:
        return self.tokenizer.hash

    def tokenizer_json(self) -> bytes:
        return Path(self.tokenizer.path).read_bytes()

    def val_batches(self, max_batches: int = 0) -> Iterator[ValBatch]:
        """The same fixed validation batches on every call: this rank's rows of `max_batches` global
        batches of `world_size` x `val_batch_size` rows (the same number of batches on every rank); 0: every
        row of the split."""
        return iter(self._val_loader(max_batches))

    def covers_whole_val_split(self, max_batches: int) -> bool:
        """Whether `val_batches(max_batches)` reads every row of the split."""
        loader = self._val_loader(max_batches)
        return loader.num_rows == loader.rows_per_epoch

    def _val_loader(self, max_batches: int) -> ValLoader:
        return ValLoader(self.shards, self.val_batch_size, self.seq_len,
                         num_batches=max_batches or None, rank=self.rank, world_size=self.world_size,
                         device=self.device, pin_memory=self.device.type == "cuda")


def build_data(cfg: DataConfig, seed: int, batch_size: int, device: torch.device | str,
               log: Callable[[str], None] = print, progress: bool = True,
               rank: int = 0, world_size: int = 1, val_batch_size: int | None = None) -> DataBundle:
    """Discover, tokenize (cached) and wrap the corpus in loaders for this rank; each validation batch
    holds `val_batch_size` rows per rank (None: `batch_size`)."""
    prepared = prepare_data(cfg, progress=progress, log=log)
    device = torch.device(device)
    try:
        # Pinned host batches copy without a sync: from pageable memory each of a batch's three copies
        # waited for the previous step's optimizer to finish, and the GPU then idled while the host
        # queued the next forward (4.3 ms per `small` step on an H200).
        loader = PackedLoader(prepared.shards, batch_size, cfg.seq_len, rank=rank, world_size=world_size,
                              seed=seed + cfg.shuffle_seed, device=device, pin_memory=device.type == "cuda")
        ValLoader(prepared.shards, batch_size, cfg.seq_len, num_batches=1, rank=rank, world_size=world_size)
    except ValueError as exc:  # before any training: not at the first evaluation
        raise CorpusError(f"{exc} (corpus: {prepared.corpus.summary().splitlines()[0]})") from exc
    return DataBundle(prepared.tokenizer, prepared.shards, loader, batch_size, cfg.seq_len, device,
                      prepared.baselines, val_batch_size or batch_size, rank, world_size)


def _tokenizer_out(out: Path) -> Path:
    """The file `tokenizer train --out` names: ``<out>/tokenizer.json`` for a directory (made if
    missing), else ``out`` itself when it ends in .json; checked before any training."""
    expected = "expected a directory or a .json file path"
    if out.is_dir():
        target = out / "tokenizer.json"
    elif out.suffix == ".json":
        target = out
    elif out.exists() or out.is_symlink():
        raise UsageError(f"--out {out}: an existing file that is not .json; {expected}")
    else:
        target = out / "tokenizer.json"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create directory {target.parent} "
                         f"({exc.strerror or exc}); {expected}") from exc
    if target.is_dir():
        raise UsageError(f"--out {out}: {target} is a directory; {expected}")
    return target


def _copy_tokenizer(out: Path, target: Path, tok: CodeTokenizer) -> str:
    """Copy tokenizer.json to `target`; an existing file there is kept unless it is byte-identical."""
    data = Path(tok.path).read_bytes()
    if target.exists() or target.is_symlink():
        try:
            same = target.read_bytes() == data
        except OSError:
            same = False
        if same:
            return f"{target} (already up to date)"
        raise UsageError(f"--out {out}: {target} already exists and is not this tokenizer; not overwriting it "
                         f"(remove it, or choose another --out; the trained tokenizer is at {tok.path})")
    try:
        atomic_write_bytes(target, data)
    except OSError as exc:
        raise MegacppError(f"--out {out}: cannot write {target} ({exc.strerror or exc})") from exc
    return str(target)


def train_tokenizer_cli(cfg: DataConfig, out: Path | None) -> str:
    """`megacpp tokenizer train`: train (or find cached) and optionally copy tokenizer.json to ``out``
    (a directory, or a .json file path); a different existing file there is never replaced."""
    target = _tokenizer_out(out) if out is not None else None
    tok = load_or_train_tokenizer(cfg, discover_corpus(cfg))
    where = _copy_tokenizer(out, target, tok) if target is not None else tok.path
    return f"tokenizer {tok.hash[:12]}: vocab {tok.vocab_size}, {where}"
