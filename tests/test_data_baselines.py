"""Baselines on the validation split: unigram entropy and xz -9e, alone and given the training split."""
from __future__ import annotations

import lzma
import math
from collections import Counter

import pytest

import megacpp.data.baselines as baselines_module
from megacpp.data.baselines import BASELINES_FILE
from megacpp.data.config import DataConfig
from megacpp.data.prepare import prepare_data
from tests.helpers import write_corpus


@pytest.fixture
def corpus_dir(tmp_path):
    root = tmp_path / "corpus"
    write_corpus(root, n_files=80)
    return root


def config(root, tmp_path, cap: int | None) -> DataConfig:
    return DataConfig(corpus=[str(root)], val_fraction=0.2, vocab_size=300, cache_dir=str(tmp_path / "cache"),
                      baseline_context_bytes=cap)


def xz(data: bytes) -> int:
    return len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))  # the .xz format, as `xz -9e` writes


@pytest.mark.parametrize("cap", [3000, None])
def test_tier1_xz_figures_equal_a_direct_lzma_computation(corpus_dir, tmp_path, cap):
    """xz alone: 8 x compressed bytes / text bytes of the validation documents in corpus order. Given
    train: the extra compressed bytes the same text costs after the training documents in content-hash
    order (cut at the cap); the cap is actually below the training split here, so the cut is exercised."""
    data = prepare_data(config(corpus_dir, tmp_path, cap), progress=False, log=None)
    val = b"".join(d.text.encode() for d in data.corpus.docs if d.split == "val")
    train_docs = sorted((d for d in data.corpus.docs if d.split == "train"), key=lambda d: d.hash)
    context = b"".join(d.text.encode() for d in train_docs)
    assert cap is None or len(context) > cap
    context = context[:cap] if cap else context
    got = data.baselines
    assert got.val_bytes == len(val) and got.context_bytes == len(context)
    assert got.xz_bpb == 8 * xz(val) / len(val)
    assert got.xz_given_train_bpb == 8 * (xz(context + val) - xz(context)) / len(val)
    assert got.xz_given_train_bpb < got.xz_bpb  # the training text helps: the corpus repeats snippets


def test_tier3_unigram_entropy_of_the_validation_tokens(corpus_dir, tmp_path):
    """Entropy of the validation split's token frequencies (the tokenizer run here on each document's
    text), times its token count, per text byte. Tolerance 1e-12 relative: both sides sum < 300 float64
    terms in different orders (rounding ~300 x 1.1e-16)."""
    data = prepare_data(config(corpus_dir, tmp_path, None), progress=False, log=None)
    val = [d for d in data.corpus.docs if d.split == "val"]
    counts = Counter(t for d in val for t in data.tokenizer.encode(d.text))
    n = sum(counts.values())
    bits = -sum(c * math.log2(c / n) for c in counts.values())
    expected = bits / sum(d.nbytes for d in val)
    assert abs(data.baselines.unigram_bpb - expected) <= 1e-12 * expected


def test_cached_with_the_shards_and_recomputed_when_the_recipe_changes(corpus_dir, tmp_path, monkeypatch):
    cfg = config(corpus_dir, tmp_path, 3000)
    first = prepare_data(cfg, progress=False, log=None)
    assert (first.shards.dir / BASELINES_FILE).is_file()

    def refuse(*_args):
        raise AssertionError("recomputed although cached")

    real = baselines_module.compute_baselines
    monkeypatch.setattr(baselines_module, "compute_baselines", refuse)
    assert prepare_data(cfg, progress=False, log=None).baselines == first.baselines
    # Another cap is another recipe; a damaged file is recomputed, never trusted.
    monkeypatch.setattr(baselines_module, "compute_baselines", real)
    wider = prepare_data(config(corpus_dir, tmp_path, 6000), progress=False, log=None).baselines
    assert wider.context_bytes == 6000 and wider != first.baselines
    (first.shards.dir / BASELINES_FILE).write_text("{not json")
    assert prepare_data(cfg, progress=False, log=None).baselines == first.baselines


def test_summary_names_every_figure_and_the_training_sample(corpus_dir, tmp_path):
    b = prepare_data(config(corpus_dir, tmp_path, 3000), progress=False, log=None).baselines
    line = b.summary()
    for value in (b.unigram_bpb, b.xz_bpb, b.xz_given_train_bpb):
        assert f"{value:.3f}" in line
    assert f"after the first 2.9 KiB of the {b.train_bytes / 1024:.1f} KiB training split" in line
    assert "content-hash order" in line
