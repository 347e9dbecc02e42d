"""Bits per byte by position in the document: the curve that shows whether a model uses long context.

A target's position is the number of tokens of its document the model has read when it predicts it:
1 for the token after BOS (or after the first token of a row that continues a document), up to
data.seq_len. Positions restart at every document, as the attention mask, RoPE and the recurrent resets
do; a window that continues a document starts it again at 1, since nothing outside the row is visible.
Buckets are doubling ranges: 1-64, 65-128, 129-256, ... up to the row length. A model that uses its
context has lower bits/byte in later buckets; a flat curve past some position says it reads no further.

Each bucket sums nats and UTF-8 bytes in float64 over the same validation batches as `evaluate_bpb`
(special-token targets excluded from both), so the buckets add back up to its figure.

A rising curve can be the text rather than the model: a repository document's later files differ from
its first ones, and only the longest documents reach the last buckets. So a curve can be taken with the
context cut (``context_window``): the model reads each document in windows of W tokens, each window a
document of its own (mask, RoPE and resets restart), while targets stay bucketed by their position in
the document. The same text scored both ways, the difference past W is what the context beyond W tokens
is worth to the model.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.fs import atomic_write_text
from megacpp.model.segments import document_segments
from megacpp.ops import kernel_prewarm
from megacpp.runtime.data import DataBundle
from megacpp.runtime.device import autocast_context

FIRST_BUCKET = 64  # tokens in the first bucket; each later one doubles the range


def bucket_bounds(seq_len: int) -> list[tuple[int, int]]:
    """[(1, 64), (65, 128), (129, 256), ...], the last ending at seq_len."""
    bounds, first, last = [], 1, FIRST_BUCKET
    while first <= seq_len:
        bounds.append((first, min(last, seq_len)))
        first, last = last + 1, 2 * last
    return bounds


def context_positions(doc_ids: Tensor) -> Tensor:
    """(b, t) int64: tokens of its document the model has read when it predicts each target (from 1)."""
    return document_segments(doc_ids).positions + 1


def window_doc_ids(doc_ids: Tensor, window: int) -> Tensor:
    """doc_ids (b, t) with every document cut into windows of `window` tokens, each numbered as a document
    of its own (numbers rise along the row, as the loader's do)."""
    if window < 1:
        raise ValueError(f"context window {window}: must be >= 1 token")
    starts = document_segments(doc_ids).positions % window == 0  # a document's start is position 0
    return starts.cumsum(dim=1).to(doc_ids.dtype)


@dataclass(frozen=True)
class Bucket:
    first: int  # positions first..last
    last: int
    tokens: int  # targets counted (special-token targets excluded)
    bytes: int
    nats: float

    @property
    def bits_per_byte(self) -> float | None:
        return self.nats / math.log(2) / self.bytes if self.bytes else None


@dataclass(frozen=True)
class PositionCurve:
    seq_len: int
    batches: int
    buckets: list[Bucket]
    context_window: int | None = None  # the model read documents in windows of this many tokens

    @property
    def bits_per_byte(self) -> float:
        """Over every bucket: evaluate_bpb's figure on the same batches."""
        nats = math.fsum(b.nats for b in self.buckets)
        return nats / math.log(2) / max(sum(b.bytes for b in self.buckets), 1)

    def table(self) -> str:
        cut = f", context cut to windows of {self.context_window} tokens" if self.context_window else ""
        rows = [f"bits/byte by position in the document ({self.batches} validation batches of rows of "
                f"{self.seq_len} tokens{cut})",
                f"  {'positions':>13}  {'tokens':>10}  {'bytes':>11}  bits/byte"]
        for b in self.buckets:
            bpb = f"{b.bits_per_byte:.4f}" if b.bits_per_byte is not None else "-"
            rows.append(f"  {f'{b.first}-{b.last}':>13}  {b.tokens:>10,}  {b.bytes:>11,}  {bpb}")
        tokens, nbytes = sum(b.tokens for b in self.buckets), sum(b.bytes for b in self.buckets)
        rows.append(f"  {'all':>13}  {tokens:>10,}  {nbytes:>11,}  {self.bits_per_byte:.4f}")
        return "\n".join(rows)

    def to_json(self) -> str:
        buckets = [{**asdict(b), "bits_per_byte": b.bits_per_byte} for b in self.buckets]
        return json.dumps({"seq_len": self.seq_len, "batches": self.batches, "context_window": self.context_window,
                           "bits_per_byte": self.bits_per_byte, "buckets": buckets}, indent=1) + "\n"

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.to_json())


@torch.no_grad()
@kernel_prewarm.no_backward_follows()
def position_curve(model: nn.Module, data: DataBundle, device: torch.device, max_batches: int,
                   micro_batch: int | None = None, context_window: int | None = None) -> PositionCurve:
    """The curve over `max_batches` validation batches (the batches `evaluate_bpb` reads), on one process;
    with `context_window`, the model reads each document in windows of that many tokens."""
    bounds = bucket_bounds(data.seq_len)
    edges = torch.tensor([last for _, last in bounds], device=device)
    nats = torch.zeros(len(bounds), dtype=torch.float64, device=device)
    nbytes = torch.zeros(len(bounds), dtype=torch.int64, device=device)
    tokens = torch.zeros(len(bounds), dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    batches = 0
    with torch.compiler.set_stance("force_eager"), autocast_context(device):
        for batch in data.val_batches(max_batches):
            batches += 1
            rows = micro_batch or len(batch.inputs)
            for start in range(0, len(batch.inputs), rows):
                part = slice(start, start + rows)
                doc_ids = batch.doc_ids[part]
                read = doc_ids if context_window is None else window_doc_ids(doc_ids, context_window)
                logits = model(batch.inputs[part], doc_ids=read)
                nll = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets[part].flatten(), reduction="none")
                counted = batch.target_bytes[part].flatten() > 0
                bucket = torch.bucketize(context_positions(doc_ids).flatten(), edges)[counted]
                nats.index_add_(0, bucket, nll[counted].double())
                nbytes.index_add_(0, bucket, batch.target_bytes[part].flatten()[counted].long())
                tokens.index_add_(0, bucket, torch.ones_like(bucket))
    model.train(was_training)
    buckets = [Bucket(first, last, int(t), int(b), float(n))
               for (first, last), t, b, n in zip(bounds, tokens.tolist(), nbytes.tolist(), nats.tolist(), strict=True)]
    return PositionCurve(data.seq_len, batches, buckets, context_window)


def default_curve_path(checkpoint: Path, context_window: int | None = None) -> Path:
    """Next to the checkpoint's run: RUN/position_curve-step_NNNNNNNN.json (beside RUN/checkpoints/), with
    ``-window<W>`` before the suffix for a curve with the context cut."""
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    window = f"-window{context_window}" if context_window else ""
    return run / f"position_curve-{checkpoint.name}{window}.json"
