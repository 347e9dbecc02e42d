"""Shard cache: layout, cache hits, invalidation on corpus/tokenizer change, half-written shards."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from megacpp.data.config import DataConfig
from megacpp.data.corpus import discover_corpus
from megacpp.data.shards import MANIFEST, ShardError, build_shards, load_shards, token_dtype
from megacpp.data.tokenizer import train_tokenizer


def make_corpus(root: Path, n: int = 24, tag: str = ""):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        body = "".join(f"    int v{i}_{j} = {j} * {i};{tag}\n" for j in range(1 + i % 4))
        (root / f"f{i:02d}.cpp").write_text(f"void f{i}() {{\n{body}}}\n")
    return discover_corpus(DataConfig(corpus=[str(root)], val_fraction=0.2))


@pytest.fixture
def setup(tmp_path):
    corpus = make_corpus(tmp_path / "src")
    tok = train_tokenizer(corpus, 400, 1_000_000, tmp_path / "tok" / "tokenizer.json")
    return corpus, tok, tmp_path / "shards"


def test_manifest_offsets_match_documents(setup):
    corpus, tok, out = setup
    shards = build_shards(corpus, tok, out, progress=False)
    assert not shards.from_cache
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["corpus_hash"] == corpus.hash and manifest["tokenizer_hash"] == tok.hash
    assert manifest["dtype"] == "uint16"
    for name in ("train", "val"):
        split, docs = shards.splits[name], corpus.split(name)
        assert split.tokens.dtype == np.uint16 and len(docs) == split.num_docs > 0
        for i, doc in enumerate(docs):
            ids = split.tokens[split.offsets[i] : split.offsets[i + 1]]
            assert ids[0] == tok.bos_id
            assert tok.decode(ids[1:].tolist()) == doc.text
            assert split.doc_bytes[i] == doc.nbytes and split.sources[i] == doc.source
        assert split.num_bytes == sum(d.nbytes for d in docs)
        text_tokens = split.num_tokens - split.num_docs
        assert split.bytes_per_token() == pytest.approx(split.num_bytes / text_tokens)


def test_cache_hit_does_not_retokenize(setup, monkeypatch):
    corpus, tok, out = setup
    build_shards(corpus, tok, out, progress=False)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def boom(texts):
        raise AssertionError("re-tokenized on a cache hit")

    monkeypatch.setattr(tok, "encode_batch", boom)
    again = build_shards(corpus, tok, out, progress=False)
    assert again.from_cache
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


def test_rebuild_when_a_corpus_file_changes(setup, tmp_path):
    corpus, tok, out = setup
    old = build_shards(corpus, tok, out, progress=False)
    old_tokens = np.array(old.splits["train"].tokens)
    changed = make_corpus(tmp_path / "src", tag=" // edited")
    assert changed.hash != corpus.hash
    new = build_shards(changed, tok, out, progress=False)
    assert not new.from_cache and new.corpus_hash == changed.hash
    assert not np.array_equal(np.array(new.splits["train"].tokens), old_tokens)
    with pytest.raises(ShardError, match="stale shards .*corpus_hash"):
        load_shards(out, corpus.hash, tok.hash)


def test_rebuild_when_the_tokenizer_changes(setup, tmp_path):
    corpus, tok, out = setup
    build_shards(corpus, tok, out, progress=False)
    tok2 = train_tokenizer(corpus, 270, 1_000_000, tmp_path / "tok2" / "tokenizer.json")
    assert tok2.hash != tok.hash
    new = build_shards(corpus, tok2, out, progress=False)
    assert not new.from_cache and new.tokenizer_hash == tok2.hash
    doc = corpus.split("train")[0]
    split = new.splits["train"]
    assert split.tokens[1 : split.offsets[1]].tolist() == tok2.encode(doc.text)


def reference(corpus, tok, out: Path) -> np.ndarray:
    return np.array(build_shards(corpus, tok, out, progress=False).splits["train"].tokens)


def test_half_written_temp_file_and_no_manifest_is_rebuilt(setup, tmp_path):
    corpus, tok, out = setup
    out.mkdir()
    (out / "train.bin.tmp-999").write_bytes(b"\x01" * 100)  # a crashed writer's leftover
    (out / "train.bin").write_bytes(b"\x02" * 10)  # renamed but never committed by a manifest
    shards = build_shards(corpus, tok, out, progress=False)
    assert not shards.from_cache
    assert not list(out.glob("*.tmp-*"))
    assert np.array_equal(np.array(shards.splits["train"].tokens), reference(corpus, tok, tmp_path / "ref"))


@pytest.mark.parametrize("damage", ["truncate_train", "truncate_val", "truncate_manifest", "drop_manifest"])
def test_damaged_shards_are_ignored_and_rebuilt(setup, tmp_path, damage):
    corpus, tok, out = setup
    build_shards(corpus, tok, out, progress=False)
    if damage.startswith("truncate_") and damage != "truncate_manifest":
        path = out / f"{damage.removeprefix('truncate_')}.bin"
        os.truncate(path, path.stat().st_size - 2)
    elif damage == "truncate_manifest":
        text = (out / MANIFEST).read_text()
        (out / MANIFEST).write_text(text[: len(text) // 2])
    else:
        (out / MANIFEST).unlink()
    with pytest.raises(ShardError):
        load_shards(out, corpus.hash, tok.hash)
    shards = build_shards(corpus, tok, out, progress=False)
    assert not shards.from_cache
    assert np.array_equal(np.array(shards.splits["train"].tokens), reference(corpus, tok, tmp_path / "ref"))
    assert build_shards(corpus, tok, out, progress=False).from_cache


def test_wrong_content_of_right_size_is_detected(setup):
    corpus, tok, out = setup
    build_shards(corpus, tok, out, progress=False)
    path = out / "train.bin"
    # Same size, so only the content checks can notice: the recorded sha256 comes first.
    np.full(path.stat().st_size // 2, tok.vocab_size - 1, dtype=np.uint16).tofile(path)
    with pytest.raises(ShardError, match="sha256 differs from the manifest"):
        load_shards(out, corpus.hash, tok.hash)


def test_token_dtype_by_vocab_size():
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
