"""Data path under a faulty environment: special files, huge JSONL, unreadable paths, a split too
small to train on, and cached shards or tokenizers damaged after they were written."""
from __future__ import annotations

import json
import os
import shutil
import threading
import tracemalloc
from pathlib import Path

import pytest

from megacpp.cli import main
from megacpp.compile.cache import CacheError, export_cache, import_cache
from megacpp.data.config import DataConfig
from megacpp.data.corpus import CorpusError, discover_corpus
from megacpp.data.prepare import prepare_data
from megacpp.data.shards import ShardError, load_shards
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


# ---------------------------------------------------------------- compile cache import


@pytest.fixture
def inductor_env(monkeypatch):
    """`cache_cli` sets Inductor's environment and config: restore both after the test."""
    import torch._functorch.config
    import torch._inductor.config

    for key in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                "MEGACPP_CACHE_DIR"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield monkeypatch


def fake_cache(root: Path) -> Path:
    for rel, text in {"fxgraph/ab/entry": "graph", "aotautograd/cd/entry": "aot", "q6/kernel.cpp": "cpp"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file's bytes, except the (empty) lock file that import takes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


@pytest.fixture
def export_and_local(tmp_path) -> tuple[Path, Path]:
    export_cache(tmp_path / "shared", fake_cache(tmp_path / "host-a"))
    local = tmp_path / "host-b"
    (local / "fxgraph" / "zz").mkdir(parents=True)
    (local / "fxgraph" / "zz" / "mine").write_text("a local entry that must survive")
    return tmp_path / "shared", local


def test_corrupt_export_is_refused_by_the_cli_and_the_cache_is_unchanged(export_and_local, inductor_env, capsys):
    shared, local = export_and_local
    flip_byte(shared / "inductor" / "q6" / "kernel.cpp", 1)
    inductor_env.setenv("TORCHINDUCTOR_CACHE_DIR", str(local))
    before = snapshot(local)
    assert main(["cache", "import", str(shared)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "corrupt cache export: inductor/q6/kernel.cpp does not match its sha256" in err
    assert "nothing imported" in err
    assert snapshot(local) == before and not list(local.glob(".import.tmp-*"))


@pytest.mark.parametrize("damage", ["manifest_not_json", "file_missing", "file_added", "digest_edited"])
def test_damaged_exports_are_refused_before_copying(export_and_local, damage):
    shared, local = export_and_local
    manifest = shared / "MANIFEST.json"
    if damage == "manifest_not_json":
        manifest.write_text(manifest.read_text()[:20])
    elif damage == "file_missing":
        (shared / "inductor" / "fxgraph" / "ab" / "entry").unlink()
    elif damage == "file_added":
        (shared / "inductor" / "extra").write_text("planted")
    else:
        info = json.loads(manifest.read_text())
        info["digest"] = "0" * 64
        manifest.write_text(json.dumps(info))
    before = snapshot(local)
    with pytest.raises(CacheError, match="corrupt cache export"):
        import_cache(shared, local)
    assert snapshot(local) == before


def test_a_failing_copy_leaves_the_cache_as_it_was(export_and_local, monkeypatch):
    shared, local = export_and_local
    real_copy, calls = shutil.copyfile, []

    def copy_then_fail(src, dst, *a, **k):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(dst))
        return real_copy(src, dst, *a, **k)

    monkeypatch.setattr(shutil, "copyfile", copy_then_fail)
    before = snapshot(local)
    with pytest.raises(OSError, match="No space left"):
        import_cache(shared, local)
    assert snapshot(local) == before and not list(local.glob(".import.tmp-*"))
    monkeypatch.setattr(shutil, "copyfile", real_copy)
    assert import_cache(shared, local).action == "imported"
    assert (local / "fxgraph" / "ab" / "entry").read_text() == "graph"
    assert (local / "fxgraph" / "zz" / "mine").is_file()


def test_unwritable_destination_is_refused(export_and_local, tmp_path):
    shared, _ = export_and_local
    blocker = tmp_path / "a-file"
    blocker.write_text("nothing can be created under a file, even as root")
    with pytest.raises(CacheError, match="not writable"):
        import_cache(shared, blocker / "cache")
    assert blocker.read_text().startswith("nothing")


def test_a_corpus_root_that_is_a_symlink_loop_is_one_line(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(CorpusError, match=r"corpus path .*loop: cannot be resolved .*points back into itself"):
        discover_corpus(cfg(loop))
