"""Data-path throughput: BPE training, corpus tokenization, packed-loader batches.

    python benchmarks/tools/bench_data.py                      # torch/include, default DataConfig
    python benchmarks/tools/bench_data.py --tokenize-mb 8 --batches 8x256,16x2048

Everything is written to a temporary cache directory; the user cache is not touched.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from megacpp.data.config import DataConfig
from megacpp.data.corpus import Corpus, discover_corpus
from megacpp.data.loader import PackedLoader, ValLoader
from megacpp.data.shards import build_shards
from megacpp.data.tokenizer import sample_documents, train_tokenizer


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def loader_rate(make, seconds: float) -> float:
    """Tokens per second over repeated passes; the first batch (stream setup) is excluded."""
    it = iter(make())
    batch = next(it)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(make())
            continue
        n += batch[0].numel()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", nargs="*", default=None, help="corpus paths (default: torch/include)")
    ap.add_argument("--vocab-size", type=int, default=DataConfig.vocab_size)
    ap.add_argument("--sample-mb", type=float, default=DataConfig.tokenizer_sample_bytes / 1e6)
    ap.add_argument("--tokenize-mb", type=float, default=0, help="tokenize a sample of this size (0: all)")
    ap.add_argument("--batches", default="8x256,32x256,16x2048", help="loader shapes, BxT comma-separated")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per loader measurement")
    args = ap.parse_args()

    rows: list[tuple[str, str]] = [("cpu cores visible", str(os.cpu_count()))]
    cfg = DataConfig(corpus=args.corpus, vocab_size=args.vocab_size)
    corpus, dt = timed(lambda: discover_corpus(cfg))
    print(corpus.summary())
    rows.append(("discovery", f"{corpus.nbytes / 1e6:.1f} MB in {dt:.2f} s = {corpus.nbytes / 1e6 / dt:.1f} MB/s"))

    with tempfile.TemporaryDirectory() as tmp:
        budget = int(args.sample_mb * 1e6)
        sampled = sum(d.nbytes for d in sample_documents(corpus.split("train"), budget))
        tok, dt = timed(lambda: train_tokenizer(corpus, args.vocab_size, budget, Path(tmp) / "tokenizer.json"))
        rows.append((
            f"tokenizer training (vocab {tok.vocab_size})",
            f"{sampled / 1e6:.1f} MB in {dt:.1f} s = {sampled / 1e6 / dt:.2f} MB/s",
        ))

        part = corpus
        if args.tokenize_mb:
            docs = sample_documents(corpus.docs, int(args.tokenize_mb * 1e6))
            part = Corpus(docs, corpus.roots, len(docs), corpus.skipped, f"sample-{corpus.hash}")
        shards, dt = timed(lambda: build_shards(part, tok, Path(tmp) / "shards", progress=False))
        n_tok = sum(s.num_tokens for s in shards.splits.values())
        rows.append((
            "tokenize + write shards",
            f"{part.nbytes / 1e6:.1f} MB in {dt:.1f} s = {part.nbytes / 1e6 / dt:.2f} MB/s "
            f"({n_tok / dt / 1e6:.2f} M tok/s)",
        ))
        rows.append(("bytes/token (val split)", f"{shards.splits['val'].bytes_per_token():.3f}"))

        for shape in args.batches.split(","):
            b, t = (int(v) for v in shape.lower().split("x"))
            rate = loader_rate(lambda b=b, t=t: PackedLoader(shards, b, t), args.seconds)
            rows.append((f"train loader {b}x{t}", f"{rate / 1e6:.1f} M tok/s"))
        b, t = (int(v) for v in args.batches.split(",")[0].lower().split("x"))
        rate = loader_rate(lambda: ValLoader(shards, b, t), args.seconds)
        rows.append((f"val loader {b}x{t} (+target_bytes)", f"{rate / 1e6:.1f} M tok/s"))

    width = max(len(k) for k, _ in rows)
    print(f"\n{'measure':<{width}}  result")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
