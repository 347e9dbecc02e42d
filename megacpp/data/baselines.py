"""Reference bits per byte on the validation split: what a model must beat to have learned anything.

- unigram: the entropy of the validation split's own token frequencies, per byte (a model that
  ignores context entirely cannot do better on that split);
- xz: ``xz -9e`` (LZMA preset 9 | PRESET_EXTREME, .xz container) of the split's text alone;
- xz given train: the extra compressed bytes the split costs after a sample of the training split,
  ``size(train_sample + val) - size(train_sample)``: a compressor that may use the training data as
  context, the fair bar for a model trained on it.

They are computed once per shard directory (corpus x tokenizer) and cached beside the shards in
``baselines.json``, which records what they were computed from; anything else recomputes them.
"""
from __future__ import annotations

import json
import lzma
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from megacpp.data.corpus import Corpus, Document
from megacpp.data.shards import ShardSet

BASELINES_FILE = "baselines.json"
RECIPE_VERSION = 1  # bump when a figure's definition changes: cached files of another recipe recompute
LZMA_PRESET = 9 | lzma.PRESET_EXTREME  # what `xz -9e` uses


@dataclass(frozen=True)
class Baselines:
    unigram_bpb: float
    xz_bpb: float
    xz_given_train_bpb: float
    val_bytes: int  # UTF-8 bytes of the validation split (the denominator of every figure)
    context_bytes: int  # bytes of the training sample the conditioned figure may use
    train_bytes: int  # bytes of the whole training split

    def summary(self) -> str:
        """One line: the three figures and what the conditioned one was allowed to see."""
        sample = ("the whole training split" if self.context_bytes >= self.train_bytes else
                  f"the first {_size(self.context_bytes)} of the {_size(self.train_bytes)} training split "
                  "(documents in content-hash order)")
        return (f"baselines on the validation split ({_size(self.val_bytes)}): unigram entropy "
                f"{self.unigram_bpb:.3f}, xz -9e alone {self.xz_bpb:.3f}, xz -9e after {sample} "
                f"{self.xz_given_train_bpb:.3f} bits/byte")

    def short(self) -> str:
        """The figures alone, for lines that already say what they compare."""
        return (f"unigram {self.unigram_bpb:.3f}, xz {self.xz_bpb:.3f}, "
                f"xz given train {self.xz_given_train_bpb:.3f}")

    def record(self) -> dict[str, float | int]:
        """The figures as a metrics.jsonl record (kind "baselines")."""
        return asdict(self)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def xz_size(data: bytes) -> int:
    """Bytes of ``data`` compressed as `xz -9e` writes it (container included)."""
    return len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=LZMA_PRESET))


def split_text(docs: list[Document]) -> bytes:
    """A split's documents' UTF-8 bytes, concatenated in the given order."""
    return b"".join(d.text.encode("utf-8") for d in docs)


def training_context(docs: list[Document], cap_bytes: int | None) -> bytes:
    """The training documents in content-hash order (independent of file order, a spread over the
    whole corpus), cut at ``cap_bytes`` (None: all of them)."""
    data = split_text(sorted(docs, key=lambda d: d.hash))
    return data if cap_bytes is None else data[:cap_bytes]


def unigram_bits_per_byte(shards: ShardSet, split: str = "val") -> float:
    """Entropy of the split's token frequencies, per byte of its text. Special tokens (document
    starts) stand for no bytes and are left out, as in the model's bits per byte."""
    s = shards.splits[split]
    counts = np.bincount(np.asarray(s.tokens), minlength=shards.vocab_size).astype(np.float64)
    counts[shards.token_bytes == 0] = 0
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum()) * total / max(s.num_bytes, 1)


def compute_baselines(corpus: Corpus, shards: ShardSet, context_cap: int | None) -> Baselines:
    val = split_text(corpus.split("val"))
    train_docs = corpus.split("train")
    context = training_context(train_docs, context_cap)
    n = max(len(val), 1)
    # lzma releases the GIL: the two long compressions run side by side (preset 9 may use 674 MiB each).
    with ThreadPoolExecutor(max_workers=2) as pool:
        alone, before, after = pool.map(xz_size, [val, context, context + val])
    return Baselines(
        unigram_bpb=unigram_bits_per_byte(shards, "val"),
        xz_bpb=8 * alone / n,
        xz_given_train_bpb=8 * (after - before) / n,
        val_bytes=len(val),
        context_bytes=len(context),
        train_bytes=sum(d.nbytes for d in train_docs),
    )


def _recipe(shards: ShardSet, context_cap: int | None) -> dict:
    return {"version": RECIPE_VERSION, "corpus_hash": shards.corpus_hash, "tokenizer_hash": shards.tokenizer_hash,
            "lzma_preset": LZMA_PRESET, "context_cap": context_cap}


def _read_cached(path: Path, recipe: dict) -> Baselines | None:
    try:
        stored = json.loads(path.read_text())
        if stored.get("recipe") != recipe:
            return None
        return Baselines(**stored["baselines"])
    except (OSError, ValueError, TypeError, KeyError):
        return None  # missing, damaged or of another shape: recompute


def load_or_compute_baselines(
    corpus: Corpus, shards: ShardSet, context_cap: int | None, log: Callable[[str], None] | None = None
) -> Baselines:
    """The cached figures of this shard directory if they were computed by the same recipe from the
    same corpus, tokenizer and cap; else compute them (a few seconds per MiB of context) and cache them.
    A file lock makes concurrent callers (every rank of a torchrun job) compute once."""
    path = shards.dir / BASELINES_FILE
    recipe = _recipe(shards, context_cap)
    with FileLock(str(shards.dir / ".baselines.lock")):
        cached = _read_cached(path, recipe)
        if cached is not None:
            return cached
        t0 = time.perf_counter()
        baselines = compute_baselines(corpus, shards, context_cap)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"recipe": recipe, "baselines": baselines.record()}, indent=1))
        os.replace(tmp, path)
    if log:
        log(f"baselines computed in {time.perf_counter() - t0:.1f}s -> {path}")
    return baselines
