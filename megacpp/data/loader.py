"""Packed loaders over a shard split: fixed-length rows with BOS-delimited documents and doc ids.

Windows. An epoch's token stream is the split's documents ([BOS, tokens...] each) concatenated in
the epoch's document order. Window k is stream[k*T : k*T + T + 1] (consecutive windows overlap by
one token, so every token is an input once and a target once); inputs = window[:-1], targets =
window[1:]. Short documents therefore share a window with their neighbours in the epoch order, and
a document longer than what is left of a window continues in the next windows; no token is padding.
Targets are never masked: the target of a document's last token is the next document's BOS, i.e.
the model learns to predict end-of-document.

Rows. Training does not read the windows in stream order: a second permutation of the epoch, drawn
right after the document order, deals them out, so the rows of one batch come from unrelated places
of the split (one long generated header no longer fills a whole batch). Doc ids count documents
within a row from 0 and step at each BOS in the inputs; a window that continues a document starts
it as id 0, and nothing outside the row is visible to the model.

Sharding. Global batch g takes dealt rows [g*W*B, (g+1)*W*B); rank r gets the B rows at offset r*B,
so ranks are disjoint, cover the epoch together, and all have the same number of steps. The rows
left over at an epoch's end (fewer than W*B, a different random set each epoch) are dropped, and so
are the last < T tokens of the stream. The deal depends on the global batch W*B only, not on W: a run
resumed on another number of ranks with the same global batch reads the same rows.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from megacpp.data.shards import ShardSet, ShardSplit
from megacpp.errors import MegacppError

STATE_VERSION = 3  # 2: records the global batch instead of the world size; 3: rows are dealt in a shuffled order


class SplitTooSmallError(MegacppError, ValueError):
    """A split that cannot fill one global batch: training would have nothing to read."""


class LoaderStateError(MegacppError, ValueError):
    """A saved loader position that this loader cannot continue exactly (another stream or format)."""


class Batch(NamedTuple):
    inputs: torch.Tensor  # (b, t) int64
    targets: torch.Tensor  # (b, t) int64, inputs shifted left by one
    doc_ids: torch.Tensor  # (b, t) int32, from 0 in each row


class ValBatch(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor
    target_bytes: torch.Tensor  # (b, t) int32: UTF-8 bytes of each target token (0 for BOS)


class _Stream:
    """A split's documents concatenated in a given order, read lazily from the memmap."""

    def __init__(self, split: ShardSplit, order: np.ndarray) -> None:
        self.tokens = split.tokens
        self.src_start = split.offsets[:-1][order]  # where each document lives in the memmap
        self.pos = np.zeros(len(order) + 1, dtype=np.int64)  # where it lives in the stream
        np.cumsum(np.diff(split.offsets)[order], out=self.pos[1:])

    def read(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.pos, start, side="right")) - 1
        last = int(np.searchsorted(self.pos, stop - 1, side="right")) - 1
        # One contiguous memmap slice per document touched (a handful per batch), no per-token work.
        pieces = []
        for d in range(first, last + 1):
            lo = max(start, int(self.pos[d])) - int(self.pos[d]) + int(self.src_start[d])
            hi = min(stop, int(self.pos[d + 1])) - int(self.pos[d]) + int(self.src_start[d])
            pieces.append(self.tokens[lo:hi])
        return np.concatenate(pieces)

    def rows(self, first_row: int, n_rows: int, seq_len: int) -> np.ndarray:
        """(n_rows, seq_len + 1) int64 consecutive windows, window k = stream[k*T : k*T + T + 1]."""
        seg = self.read(first_row * seq_len, (first_row + n_rows) * seq_len + 1).astype(np.int64)
        return sliding_window_view(seg, seq_len + 1)[::seq_len]

    def windows(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
        """(len(indices), seq_len + 1) int64: the windows with these numbers, in this order."""
        return np.stack([self.read(k * seq_len, k * seq_len + seq_len + 1) for k in indices.tolist()]
                        ).astype(np.int64)


class _Packer:
    """Shared geometry and tensor conversion of the train and validation loaders."""

    def __init__(
        self, shards: ShardSet, split: str, batch_size: int, seq_len: int,
        rank: int, world_size: int, device: str | torch.device, pin_memory: bool,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size {batch_size} and seq_len {seq_len} must be >= 1")
        self.shards = shards
        self.split = shards.splits[split]
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.rows_per_epoch = max(self.split.num_tokens - 1, 0) // seq_len
        self.global_batch = world_size * batch_size  # rows per step over all ranks
        self.steps_per_epoch = self.rows_per_epoch // self.global_batch

    def _first_row(self, step: int) -> int:
        """Where this rank's rows of global batch `step` start in the epoch's row order."""
        return (step * self.world_size + self.rank) * self.batch_size

    def _doc_ids(self, inputs: np.ndarray) -> np.ndarray:
        ids = np.cumsum(inputs == self.shards.bos_id, axis=1, dtype=np.int32)
        return ids - ids[:, :1]

    def _tensors(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        out = []
        for a in arrays:
            t = torch.from_numpy(np.require(a, requirements=["C", "W"]))  # copies strided/read-only views
            if self.pin_memory:
                t = t.pin_memory()
            out.append(t.to(self.device, non_blocking=self.pin_memory))
        return out

    def _too_small(self) -> SplitTooSmallError:
        need = self.global_batch * self.seq_len + 1
        world = f"world_size {self.world_size} x " if self.world_size > 1 else ""
        return SplitTooSmallError(
            f"{self.split.name} split has {self.split.num_tokens:,} tokens ({self.split.num_docs} docs), "
            f"too few for one training batch: {world}train.batch_size {self.batch_size} x data.seq_len "
            f"{self.seq_len} + 1 = {need:,} tokens; lower data.seq_len or train.batch_size, lower "
            f"data.val_fraction, or add corpus files"
        )


class _Epoch(NamedTuple):
    number: int
    stream: _Stream  # the documents in this epoch's order
    row_order: np.ndarray  # the stream's window numbers in the order they are read


class PackedLoader(_Packer):
    """Infinite iterator of training batches, reshuffled every epoch, resumable via state_dict."""

    def __init__(
        self, shards: ShardSet, batch_size: int, seq_len: int, *, split: str = "train",
        rank: int = 0, world_size: int = 1, seed: int = 0,
        device: str | torch.device = "cpu", pin_memory: bool = False,
    ) -> None:
        super().__init__(shards, split, batch_size, seq_len, rank, world_size, device, pin_memory)
        if self.steps_per_epoch == 0:
            raise self._too_small()
        self.seed = seed
        self.epoch = 0
        self.step = 0  # batches already taken in this epoch
        self._epoch_cache: _Epoch | None = None

    def _current_epoch(self) -> _Epoch:
        if self._epoch_cache is None or self._epoch_cache.number != self.epoch:
            # Both permutations come from one generator seeded by (seed, epoch), documents first:
            # randomness is consumed in a fixed order, and a resumed run rebuilds it from (seed, epoch).
            rng = np.random.default_rng([self.seed, self.epoch])
            stream = _Stream(self.split, rng.permutation(self.split.num_docs))
            self._epoch_cache = _Epoch(self.epoch, stream, rng.permutation(self.rows_per_epoch))
        return self._epoch_cache

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        epoch = self._current_epoch()
        first = self._first_row(self.step)
        rows = epoch.stream.windows(epoch.row_order[first : first + self.batch_size], self.seq_len)
        self.step += 1
        inputs, targets = rows[:, :-1], rows[:, 1:]
        return Batch(*self._tensors(inputs, targets, self._doc_ids(inputs)))

    def state_dict(self) -> dict[str, Any]:
        """The same on every rank: what shapes the stream, and the position in it."""
        return {
            "version": STATE_VERSION, "data_key": self.shards.key, "split": self.split.name,
            "seq_len": self.seq_len, "global_batch": self.global_batch,
            "seed": self.seed, "epoch": self.epoch, "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any], allow_global_batch_change: bool = False) -> None:
        """Resume exactly; everything that shapes the token stream must match.

        Another global batch reads another stream; with ``allow_global_batch_change`` the loader goes
        on from the same number of rows consumed in the epoch (rounded down to a whole step).
        """
        mine = self.state_dict()
        if state.get("version") != mine["version"]:
            raise LoaderStateError(
                f"loader state version {state.get('version')!r} != {mine['version']}: it was saved by a megacpp "
                f"that read other rows for the same position; continuing would not be exact (start a new run)")
        for k in ("data_key", "split", "seq_len", "seed"):
            if state.get(k) != mine[k]:
                raise LoaderStateError(
                    f"loader state mismatch: {k} is {state.get(k)!r}, this loader has {mine[k]!r}"
                )
        step = int(state["step"])
        if state["global_batch"] != self.global_batch:
            if not allow_global_batch_change:
                raise LoaderStateError(
                    f"loader state mismatch: global batch (ranks x batch_size) was {state['global_batch']} "
                    f"rows, now {self.global_batch}: the run would read another token stream"
                )
            step = step * int(state["global_batch"]) // self.global_batch
        if not 0 <= step <= self.steps_per_epoch:
            raise LoaderStateError(f"loader state step {step} outside [0, {self.steps_per_epoch}]")
        self.epoch, self.step = int(state["epoch"]), step


class ValLoader(_Packer):
    """The validation split in manifest order, a fixed set of rows, the same every pass.

    The rows evaluated are the split's first ``num_batches * world_size * batch_size`` rows (all rows
    with None), or every row when the split holds fewer, so a small validation split is evaluated
    whole instead of failing. Every rank yields the same number of batches of `batch_size` rows (a
    sharded forward is collective); rows past the end are padding whose targets count for nothing
    (``target_bytes`` 0).
    """

    def __init__(
        self, shards: ShardSet, batch_size: int, seq_len: int, *, num_batches: int | None = None,
        split: str = "val", rank: int = 0, world_size: int = 1,
        device: str | torch.device = "cpu", pin_memory: bool = False,
    ) -> None:
        super().__init__(shards, split, batch_size, seq_len, rank, world_size, device, pin_memory)
        if self.rows_per_epoch == 0:
            raise ValueError(f"{self.split.name} split has {self.split.num_tokens} tokens: one row needs "
                             f"seq_len+1 = {seq_len + 1}; lower data.seq_len or raise data.val_fraction")
        wanted = self.rows_per_epoch if num_batches is None else num_batches * self.global_batch
        self.num_rows = min(wanted, self.rows_per_epoch)  # identical on every rank
        self.num_batches = -(-self.num_rows // self.global_batch)
        self._stream = _Stream(self.split, np.arange(self.split.num_docs))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[ValBatch]:
        for step in range(self.num_batches):
            first = self._first_row(step)
            real = max(0, min(self.batch_size, self.num_rows - first))
            rows = self._stream.rows(first if real else 0, max(real, 1), self.seq_len)
            # Padding repeats a real row so shapes stay fixed; its targets stand for no bytes.
            # (A rank past the split's end reads one row to repeat: it pads batch_size - 1 more.)
            rows = np.concatenate([rows, np.repeat(rows[:1], self.batch_size - len(rows), axis=0)]) \
                if len(rows) < self.batch_size else rows
            inputs, targets = rows[:, :-1], rows[:, 1:]
            target_bytes = self.shards.token_bytes[targets]
            target_bytes[real:] = 0
            yield ValBatch(*self._tensors(inputs, targets, self._doc_ids(inputs), target_bytes))
