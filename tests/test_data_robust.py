"""Data path under a faulty environment: special files, huge JSONL, unreadable paths, a split too
small to train on, and cached shards or tokenizers damaged after they were written."""
from __future__ import annotations

import json
import os
import threading
import tracemalloc
from pathlib import Path

import pytest

from megacpp.cli import main
from megacpp.data import CorpusError, DataConfig, ShardError, discover_corpus, load_shards, prepare_data
from tests.helpers import tiny_train_args


def code(i: int) -> str:
    return f"// file {i}\nint f{i}(int x) {{\n    return x + {i};\n}}\n"


def write_files(root: Path, n: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"f{i:02d}.cpp").write_text(code(i))
    return root


def cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(corpus=[str(root)], min_bytes=1, val_fraction=0.0, **kw)


def discover_within(config: DataConfig, seconds: float = 30.0):
    """discover_corpus in a daemon thread: a blocking open fails the test instead of hanging it."""
    result: dict = {}

    def run() -> None:
        try:
            result["corpus"] = discover_corpus(config)
        except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "corpus discovery blocked"
    if "error" in result:
        raise result["error"]
    return result["corpus"]


# ---------------------------------------------------------------- discovery


def test_fifo_is_skipped_and_counted_never_opened(tmp_path):
    root = write_files(tmp_path / "src", 3)
    os.mkfifo(root / "pipe.cpp")
    os.mkfifo(root / "records.jsonl")
    corpus = discover_within(cfg(root))
    assert len(corpus.docs) == 3
    assert corpus.skipped["special_file"] == 2
    assert "2 special_file" in corpus.summary()
    # A FIFO named directly as the corpus is refused the same way, without blocking.
    with pytest.raises(CorpusError, match="special_file"):
        discover_within(cfg(root / "pipe.cpp"))


def test_large_jsonl_is_streamed_with_bounded_memory(tmp_path, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    huge = "x" * 20_000_000  # one 20 MB record: far over max_bytes, must never be held whole
    with open(root / "data.jsonl", "w") as f:
        f.write(json.dumps({"text": code(1)}) + "\n")
        f.write(json.dumps({"text": huge}) + "\n")
        f.write(json.dumps({"text": code(2)}) + "\n")
    del huge

    def no_whole_reads(self, *a, **k):
        raise AssertionError(f"{self} read whole")

    monkeypatch.setattr(Path, "read_bytes", no_whole_reads)
    monkeypatch.setattr(Path, "read_text", no_whole_reads)
    tracemalloc.start()
    try:
        corpus = discover_corpus(cfg(root, max_bytes=10_000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [d.source.rsplit(":", 1)[1] for d in corpus.docs] == ["1", "3"]  # line numbers kept
    assert corpus.skipped["too_large"] == 1
    assert peak < 5_000_000, f"peak {peak} bytes: the 20 MB line was held in memory"


def test_unreadable_directory_and_file_are_counted(tmp_path, monkeypatch):
    """Tests run as root, which ignores permission bits: the denial is simulated at the system call."""
    root = write_files(tmp_path / "src", 3)
    write_files(root / "locked", 2)
    real_scandir, real_open = os.scandir, os.open

    def scandir(path="."):
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    def open_(path, flags, *args, **kw):
        if Path(path).name == "f01.cpp":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "open", open_)
    corpus = discover_corpus(cfg(root))
    assert sorted(Path(d.source).name for d in corpus.docs) == ["f00.cpp", "f02.cpp"]
    assert corpus.skipped["unreadable_dir"] == 1 and corpus.skipped["unreadable"] == 1
    assert "1 unreadable, 1 unreadable_dir" in corpus.summary()


# ---------------------------------------------------------------- a split too small to train on


def test_train_split_too_small_is_one_line_before_training(tmp_path, small_corpus, capsys):
    args = tiny_train_args(tmp_path, small_corpus, **{"train.batch_size": "4096"})
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "train split has" in err and "tokens" in err and "4096 x data.seq_len 32 + 1 = 131,073 tokens" in err
    for setting in ("data.seq_len", "train.batch_size", "data.val_fraction", "corpus"):
        assert setting in err
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------- damaged caches


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def prepared_cfg(tmp_path) -> DataConfig:
    root = write_files(tmp_path / "src", 40)
    return DataConfig(corpus=[str(root)], min_bytes=1, val_fraction=0.1, vocab_size=300,
                      cache_dir=str(tmp_path / "cache"))


def test_flipped_byte_in_a_cached_shard_is_detected_and_rebuilt(prepared_cfg):
    first = prepare_data(prepared_cfg, progress=False, log=None)
    path = first.shards.dir / "train.bin"
    good = path.read_bytes()
    # The last token of the last document: sizes and BOS positions stay valid, only the hash notices.
    flip_byte(path, len(good) - 1)
    with pytest.raises(ShardError, match="sha256 differs"):
        load_shards(first.shards.dir, first.corpus.hash, first.tokenizer.hash)
    notices: list[str] = []
    again = prepare_data(prepared_cfg, progress=False, log=notices.append)
    assert not again.shards.from_cache
    assert [n for n in notices if n.startswith("rebuilding shards:")] == [
        f"rebuilding shards: {path}: content changed since it was written (sha256 differs from the manifest)"]
    assert path.read_bytes() == good
    assert prepare_data(prepared_cfg, progress=False, log=None).shards.from_cache


def test_flipped_byte_in_a_cached_tokenizer_is_detected_and_retrained(prepared_cfg):
    first = prepare_data(prepared_cfg, progress=False, log=None)
    path = Path(first.tokenizer.path)
    good = path.read_bytes()
    flip_byte(path, good.index(b'"vocab"') + 20)  # inside the vocabulary: still parses as JSON
    notices: list[str] = []
    again = prepare_data(prepared_cfg, progress=False, log=notices.append)
    assert any(n.startswith(f"tokenizer cache {path}: hash ") and "retraining" in n for n in notices)
    assert path.read_bytes() == good and again.tokenizer.hash == first.tokenizer.hash
    assert again.shards.from_cache  # the same tokenizer again: its shards are still valid


def test_given_tokenizer_that_is_not_one_is_a_one_line_error(tmp_path, small_corpus, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    args = ["data", "prepare", "--preset", "tiny", f"--data.corpus=[\"{small_corpus}\"]",
            "--data.cache_dir", str(tmp_path / "cache"), "--data.tokenizer_path", str(bad)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert f"{bad}: not a valid tokenizer.json" in err
    assert bad.read_text() == '{"not": "a tokenizer"}'
