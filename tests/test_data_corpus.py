"""Corpus discovery: extensions, dedup, filtering, hash split, JSONL/text inputs, errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megacpp.data.config import DataConfig
from megacpp.data.corpus import CorpusError, discover_corpus


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    return path


def code(i: int) -> str:
    return f"// file {i}\nint f{i}(int x) {{\n    return x + {i};\n}}\n"


def cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(corpus=[str(root)], min_bytes=1, val_fraction=0.0, **kw)


def test_extensions_and_sorted_order(tmp_path):
    for name in ["z.cpp", "a/b.h", "a/c.CU", "m.hpp", "notes.txt", "script.py", "img.png", "q.inl"]:
        write(tmp_path / name, code(len(name)) + name)
    corpus = discover_corpus(cfg(tmp_path))
    root = tmp_path.name
    want = ["a/b.h", "a/c.CU", "m.hpp", "notes.txt", "q.inl", "z.cpp"]
    assert [d.source for d in corpus.docs] == [f"{root}/{w}" for w in want]
    assert corpus.files_seen == len(want)
    only_py = discover_corpus(cfg(tmp_path, extensions=[".py"], text_extensions=[]))
    assert [d.source for d in only_py.docs] == [f"{root}/script.py"]


def test_dedup_by_content(tmp_path):
    write(tmp_path / "a.h", code(1))
    write(tmp_path / "copy/a.h", code(1))
    write(tmp_path / "b.h", code(2))
    corpus = discover_corpus(cfg(tmp_path))
    assert len(corpus.docs) == 2
    assert corpus.skipped["duplicate"] == 1
    assert corpus.docs[0].source.endswith("/a.h")  # first in sorted order is the one kept


def test_undecodable_and_unreadable_skipped_and_counted(tmp_path):
    write(tmp_path / "good.cpp", code(1))
    write(tmp_path / "latin1.cpp", "// caf\xe9\n".encode("latin-1"))
    os.symlink(tmp_path / "missing.h", tmp_path / "dangling.h")
    corpus = discover_corpus(cfg(tmp_path))
    assert [Path(d.source).name for d in corpus.docs] == ["good.cpp"]
    assert corpus.skipped["undecodable"] == 1
    assert corpus.skipped["unreadable"] == 1


def test_size_limits(tmp_path):
    write(tmp_path / "tiny.h", "int x;")
    write(tmp_path / "mid.h", code(1))
    write(tmp_path / "big.h", "x" * 5000)
    corpus = discover_corpus(DataConfig(corpus=[str(tmp_path)], min_bytes=10, max_bytes=1000))
    assert [Path(d.source).name for d in corpus.docs] == ["mid.h"]
    assert corpus.skipped["too_small"] == 1 and corpus.skipped["too_large"] == 1


def test_tier2_split_deterministic_and_independent_of_file_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    n = 300
    for i in range(n):
        write(a / f"f{i:03d}.cpp", code(i))
        write(b / f"g{(i * 7919) % n:03d}.cpp", code(i))  # same contents, different names/order
    c1 = discover_corpus(DataConfig(corpus=[str(a)], val_fraction=0.1))
    c2 = discover_corpus(DataConfig(corpus=[str(a)], val_fraction=0.1))
    c3 = discover_corpus(DataConfig(corpus=[str(b)], val_fraction=0.1))
    assert [(d.hash, d.split) for d in c1.docs] == [(d.hash, d.split) for d in c2.docs]
    assert c1.hash == c2.hash
    val1 = {d.hash for d in c1.docs if d.split == "val"}
    assert val1 == {d.hash for d in c3.docs if d.split == "val"}
    assert 0.04 * n < len(val1) < 0.2 * n


def test_tiny_corpus_gets_one_val_document(tmp_path):
    for i in range(3):
        write(tmp_path / f"{i}.h", code(i))
    corpus = discover_corpus(DataConfig(corpus=[str(tmp_path)], val_fraction=0.01))
    val = corpus.split("val")
    assert len(val) == 1 and val[0].hash == min(d.hash for d in corpus.docs)


def test_summary_line(tmp_path):
    write(tmp_path / "a.h", code(1))
    write(tmp_path / "b.h", code(1))
    write(tmp_path / "c.h", b"\xff\xfe\x00junk")
    summary = discover_corpus(cfg(tmp_path)).summary()
    assert "\n" not in summary
    for part in ["3 files", "1 docs", "skipped 2", "1 duplicate", "1 undecodable"]:
        assert part in summary, (part, summary)


def test_jsonl_and_plain_text(tmp_path):
    lines = [
        json.dumps({"text": "int main() { return 0; }"}),
        "",
        json.dumps({"content": "no text field"}),
        "{not json",
        json.dumps({"text": "void g() {}\n"}),
        '{"text": "lone surrogate \\ud800"}',  # valid JSON, not encodable as UTF-8
    ]
    write(tmp_path / "data.jsonl", "\n".join(lines) + "\n")
    write(tmp_path / "readme.txt", "plain text document\n")
    corpus = discover_corpus(cfg(tmp_path))
    root = tmp_path.name
    assert [d.source for d in corpus.docs] == [f"{root}/data.jsonl:1", f"{root}/data.jsonl:5", f"{root}/readme.txt"]
    assert corpus.docs[0].text == "int main() { return 0; }"
    assert corpus.skipped["bad_jsonl_line"] == 3
    other_field = discover_corpus(cfg(tmp_path, jsonl_field="content"))
    assert "no text field" in [d.text for d in other_field.docs]


def test_bad_jsonl_line_error_names_file_and_line(tmp_path):
    write(tmp_path / "data.jsonl", '{"text": "ok"}\n{"text": "ok2"}\n{broken\n')
    with pytest.raises(CorpusError, match=r"data\.jsonl:3: bad JSONL record"):
        discover_corpus(cfg(tmp_path, jsonl_errors="raise"))


def test_missing_path_error(tmp_path):
    with pytest.raises(CorpusError, match="corpus path does not exist: .*nope"):
        discover_corpus(DataConfig(corpus=[str(tmp_path / "nope")]))


def test_empty_after_filtering_says_why(tmp_path):
    write(tmp_path / "a.h", "x")
    write(tmp_path / "b.h", "y")
    with pytest.raises(CorpusError, match="empty after filtering.*2 too_small"):
        discover_corpus(DataConfig(corpus=[str(tmp_path)], min_bytes=16))
    write(tmp_path / "empty/readme.md", "not a source file")
    with pytest.raises(CorpusError, match="no corpus files"):
        discover_corpus(DataConfig(corpus=[str(tmp_path / "empty")]))


def test_default_corpus_is_torch_include_headers():
    import torch

    corpus = discover_corpus(DataConfig())
    assert corpus.roots == [Path(torch.__file__).parent / "include"]
    assert len(corpus.docs) > 1000 and corpus.nbytes > 10e6
    assert corpus.split("val") and corpus.split("train")


def test_the_summary_counts_files_of_other_extensions_and_reads_cpp_template_and_module_files(tmp_path):
    root = tmp_path / "tree"
    root.mkdir()
    for name in ("a.cpp", "b.tcc", "c.tpp", "d.ixx", "e.cppm", "f.inc"):
        (root / name).write_text(f"// {name}\nint f_{name[0]}() {{ return {ord(name[0])}; }}\n")
    for name in ("setup.py", "tool.py", "README.md", "Makefile", ".hidden"):
        (root / name).write_text("not c++\n")
    corpus = discover_corpus(cfg(root))
    assert corpus.files_seen == 6 and len(corpus.docs) == 6
    assert dict(corpus.ignored) == {".py": 2, ".md": 1, "(none)": 1}
    assert "not read, by extension: 4 (.py 2, (none) 1, .md 1; data.extensions adds one)" in corpus.summary()


def test_a_validation_split_of_one_document_is_warned_about(tmp_path):
    root = tmp_path / "tree"
    root.mkdir()
    for i in range(3):
        (root / f"f{i}.hpp").write_text(f"// file {i}\nint g{i}() {{ return {i}; }}\n")
    summary = discover_corpus(DataConfig(corpus=[str(root)], min_bytes=1, val_fraction=0.001)).summary()
    assert "warning: the validation split is one document" in summary and "data.val_fraction" in summary
