"""Repository-level documents (data.documents = directory | repository) on generated trees.

Expected orders and groupings are written out by hand from the rules in megacpp/data/repository.py's
docstring; the include edges each test relies on are planted in the files it writes.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from megacpp.data.config import DataConfig
from megacpp.data.corpus import content_hash, discover_corpus, is_val
from megacpp.data.repository import FILE_HEADER, IncludeResolver, include_order, join_parts
from megacpp.data.shards import build_shards
from megacpp.data.tokenizer import train_tokenizer


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def cfg(root: Path, documents: str = "repository", **kw) -> DataConfig:
    return DataConfig(corpus=[str(root)], min_bytes=1, val_fraction=0.0, documents=documents, **kw)


def headers(text: str) -> list[str]:
    """The paths named by a joined document's header lines, in order."""
    prefix = FILE_HEADER.split("{")[0]
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def joined_text(files: list[tuple[str, str]]) -> str:
    """A joined document by the documented format: header line, text, a newline if it had none."""
    return "".join(f"// file: {path}\n{text if text.endswith(chr(10)) else text + chr(10)}" for path, text in files)


# A repository (.git) whose include graph is known: util/base.h <- util/list.h <- core/a.h <- main.cpp,
# with core/b.h including nothing and a.cpp (sorted before everything) including core/a.h.
GRAPH = {
    "proj/.git/HEAD": "ref: refs/heads/main\n",
    "proj/a.cpp": '#include "core/a.h"\nint main_a() { return a(); }\n',
    "proj/core/a.h": '#pragma once\n#include "../util/list.h"\n#include <vector>\nint a();\n',
    "proj/core/b.h": "#pragma once\nint b();\n",
    "proj/main.cpp": '#include "core/a.h"\n#include "core/b.h"\nint main() { return a() + b(); }\n',
    "proj/util/base.h": "#pragma once\nstruct Base {};\n",
    "proj/util/list.h": '#pragma once\n#include "base.h"\nstruct List : Base {};\n',
}


def test_tier1_headers_come_before_their_includers_with_ties_in_path_order(tmp_path):
    write(tmp_path / "corpus", GRAPH)
    corpus = discover_corpus(cfg(tmp_path / "corpus"))
    [doc] = corpus.docs
    # Ready first: core/b.h and util/base.h (no includes); base.h opens the chain base -> list -> a.h,
    # and each time the smallest ready path goes next.
    assert headers(doc.text) == ["core/b.h", "util/base.h", "util/list.h", "core/a.h", "a.cpp", "main.cpp"]
    planted = [("core/a.h", "util/list.h"), ("util/list.h", "util/base.h"), ("a.cpp", "core/a.h"),
               ("main.cpp", "core/a.h"), ("main.cpp", "core/b.h")]
    order = headers(doc.text)
    assert all(order.index(header) < order.index(includer) for includer, header in planted)
    assert doc.source == "corpus/proj"
    expected = joined_text([(rel, GRAPH[f"proj/{rel}"]) for rel in order])
    assert doc.text == expected
    assert doc.hash == content_hash(expected.encode()) and doc.nbytes == len(expected.encode())


def test_tier1_each_file_of_a_joined_document_points_back_to_its_text_on_disk(tmp_path):
    write(tmp_path / "corpus", {**GRAPH, "proj/no_newline.h": "int z;"})
    [doc] = discover_corpus(cfg(tmp_path / "corpus")).docs
    assert len(doc.files) == 7 and doc.root == tmp_path / "corpus" / "proj"
    for f in doc.files:
        assert doc.text[f.start:f.end] == f.path.read_text()
        assert doc.text[:f.start].endswith(f"// file: {f.path.relative_to(doc.root).as_posix()}\n")


def test_tier1_an_include_cycle_is_placed_together_in_path_order(tmp_path):
    files = {
        "CMakeLists.txt": "project(x)\n",
        "x.h": '#include "c2.h"\n',  # includes the cycle: after it
        "c2.h": '#include "c1.h"\nint c2;\n',
        "c1.h": '#include "c3.h"\nint c1;\n',
        "c3.h": '#include "c2.h"\n#include "a.h"\nint c3;\n',  # the cycle c1 -> c3 -> c2 -> c1 includes a.h
        "a.h": "int a;\n",
        "b.h": "int b;\n",
    }
    write(tmp_path / "corpus", files)
    [doc] = discover_corpus(cfg(tmp_path / "corpus")).docs  # CMakeLists.txt is a .txt file: joined too
    # b.h and a.h are ready; after a.h the cycle {c1, c2, c3} is (its smallest path c1.h < b.h), then x.h.
    assert headers(doc.text) == ["CMakeLists.txt", "a.h", "b.h", "c1.h", "c2.h", "c3.h", "x.h"]


def test_tier1_same_named_headers_in_two_directories_resolve_to_the_right_one():
    files = ["libA/util.h", "libA/a.cpp", "libB/util.h", "libB/b.cpp",
             "libA/include/common.h", "libB/include/common.h", "libB/src/deep/x.cpp", "include/common.h",
             "tools/t.cpp"]
    resolver = IncludeResolver(files)
    assert resolver.resolve("libA/a.cpp", "util.h", quoted=True) == "libA/util.h"
    assert resolver.resolve("libB/b.cpp", "util.h", quoted=True) == "libB/util.h"
    # include roots on the includer's own path win, nearest first; then the others in path order.
    assert resolver.resolve("libB/src/deep/x.cpp", "common.h", quoted=True) == "libB/include/common.h"
    assert resolver.resolve("libA/a.cpp", "common.h", quoted=False) == "libA/include/common.h"
    assert resolver.resolve("tools/t.cpp", "common.h", quoted=True) == "include/common.h"
    # An angle include does not search the includer's directory; the top directory is searched last.
    assert resolver.resolve("libA/a.cpp", "util.h", quoted=False) is None
    assert resolver.resolve("tools/t.cpp", "libB/util.h", quoted=False) == "libB/util.h"
    assert resolver.resolve("libA/a.cpp", "../../outside.h", quoted=True) is None


def test_tier1_same_named_headers_order_each_includer_after_its_own_header(tmp_path):
    files = {
        "r/.hg/store": "x\n",
        "r/one/util.h": "int one_util;\n",
        "r/one/z_use.cpp": '#include "util.h"\nint z;\n',
        "r/two/util.h": "int two_util;\n",
        "r/two/a_use.cpp": '#include "util.h"\nint a;\n',
    }
    write(tmp_path / "corpus", files)
    [doc] = discover_corpus(cfg(tmp_path / "corpus")).docs
    # Were both includes resolved to one/util.h, two/a_use.cpp would come before two/util.h.
    assert headers(doc.text) == ["one/util.h", "one/z_use.cpp", "two/util.h", "two/a_use.cpp"]


def test_tier1_files_outside_any_repository_are_documents_alone_and_nested_repositories_join_the_outer(tmp_path):
    files = {
        "outer/CMakeLists.txt": "project(outer)\n",
        "outer/src/main.cpp": '#include "../third_party/dep/dep.h"\nint main();\n',
        "outer/third_party/dep/.git": "gitdir: ../../.git/modules/dep\n",  # a submodule: .git is a file
        "outer/third_party/dep/dep.h": "int dep();\n",
        "loose/notes.h": "int notes;\n",
        "top.h": "int top;\n",
        "other/Makefile": "all:\n",
        "other/o.cpp": "int o;\n",
    }
    write(tmp_path / "corpus", files)
    corpus = discover_corpus(cfg(tmp_path / "corpus"))
    by_source = {d.source: headers(d.text) for d in corpus.docs}
    assert by_source == {
        "corpus/loose/notes.h": ["loose/notes.h"],
        "corpus/other": ["o.cpp"],
        "corpus/outer": ["CMakeLists.txt", "third_party/dep/dep.h", "src/main.cpp"],  # a .txt file, joined too
        "corpus/top.h": ["top.h"],
    }
    assert [d.source for d in corpus.docs] == ["corpus/loose/notes.h", "corpus/other", "corpus/outer",
                                               "corpus/top.h"]  # by the first file's path


def test_tier1_a_corpus_root_without_markers_is_one_repository(tmp_path):
    write(tmp_path / "corpus", {"b/x.h": "int x;\n", "a/y.h": '#include "b/x.h"\n'})
    [doc] = discover_corpus(cfg(tmp_path / "corpus")).docs
    assert doc.source == "corpus" and headers(doc.text) == ["b/x.h", "a/y.h"]


def test_tier1_directory_documents_join_the_files_of_one_directory(tmp_path):
    write(tmp_path / "corpus", {**GRAPH, "proj/util/zz.txt": "notes\n"})
    corpus = discover_corpus(cfg(tmp_path / "corpus", documents="directory"))
    assert {d.source: headers(d.text) for d in corpus.docs} == {
        "corpus/proj": ["proj/a.cpp", "proj/main.cpp"],
        "corpus/proj/core": ["proj/core/a.h", "proj/core/b.h"],
        "corpus/proj/util": ["proj/util/base.h", "proj/util/list.h", "proj/util/zz.txt"],
    }


def test_tier2_order_is_stable_and_independent_of_directory_listing_order(tmp_path, monkeypatch):
    rng = random.Random(0)
    files = {**GRAPH}
    for i in range(30):  # a random DAG: file i includes some files j < i
        deps = rng.sample(range(i), min(i, rng.randint(0, 3)))
        files[f"proj/gen/f{(i * 7919) % 101:03d}.h"] = "".join(
            f'#include "f{(j * 7919) % 101:03d}.h"\n' for j in deps) + f"int v{i};\n"
    write(tmp_path / "corpus", files)
    first = discover_corpus(cfg(tmp_path / "corpus"))
    real_walk = os.walk

    def reversed_walk(top, *args, **kwargs):
        for dirpath, dirnames, filenames in real_walk(top, *args, **kwargs):
            dirnames.reverse()
            filenames.reverse()
            yield dirpath, dirnames, filenames

    monkeypatch.setattr(os, "walk", reversed_walk)
    second = discover_corpus(cfg(tmp_path / "corpus"))
    assert [(d.source, d.text) for d in first.docs] == [(d.source, d.text) for d in second.docs]
    assert first.hash == second.hash
    texts = {rel: text for rel, text in files.items() if rel.startswith("proj/gen/")}
    shuffled = list(texts.items())
    rng.shuffle(shuffled)
    assert include_order(dict(shuffled)) == include_order(dict(sorted(texts.items())))
    order = headers(first.docs[0].text)
    for i in range(30):  # every planted edge is respected
        name = f"gen/f{(i * 7919) % 101:03d}.h"
        for line in files[f"proj/{name}"].splitlines():
            if line.startswith("#include"):
                assert order.index("gen/" + line.split('"')[1]) < order.index(name)


def test_tier1_parts_are_cut_at_file_boundaries_under_the_cap():
    files = [(f"f{i}.h", "x" * n) for i, n in enumerate([10, 20, 5, 200, 3])]
    size = {path: len(f"// file: {path}\n") + len(text) + 1 for path, text in files}  # + the added newline
    parts = join_parts(files, max_bytes=size["f0.h"] + size["f1.h"] + size["f2.h"])
    assert [[f.path for f in p.files] for p in parts] == [["f0.h", "f1.h", "f2.h"], ["f3.h"], ["f4.h"]]
    assert "".join(p.text for p in parts) == joined_text(files)
    assert len(parts[1].text.encode()) > size["f0.h"] + size["f1.h"] + size["f2.h"]  # a longer file is alone


def test_tier1_joined_documents_are_split_deduplicated_and_limited_per_file(tmp_path):
    files = {f"r{i}/.git/HEAD": "x\n" for i in range(12)}
    for i in range(12):
        files[f"r{i}/own.h"] = f"int own{i};\n"
        files[f"r{i}/shared.h"] = "int shared;\n"  # the same bytes in every repository: kept in r0 only
    files["r0/huge.h"] = "x" * 500
    write(tmp_path / "corpus", files)
    corpus = discover_corpus(DataConfig(corpus=[str(tmp_path / "corpus")], min_bytes=1, max_bytes=400,
                                        val_fraction=0.3, documents="repository"))
    assert corpus.skipped["duplicate"] == 11 and corpus.skipped["too_large"] == 1
    assert headers(corpus.docs[0].text) == ["own.h", "shared.h"]
    assert all(headers(d.text) == ["own.h"] for d in corpus.docs[1:])
    for doc in corpus.docs:  # the split is by the joined text's own hash
        assert doc.hash == content_hash(doc.text.encode())
        assert doc.split == ("val" if is_val(doc.hash, 0.3) else "train")
    assert {d.split for d in corpus.docs} == {"train", "val"}


def test_tier1_default_file_mode_has_no_headers_and_one_file_per_document(tmp_path):
    write(tmp_path / "corpus", GRAPH)
    corpus = discover_corpus(cfg(tmp_path / "corpus", documents="file"))
    assert [d.text for d in corpus.docs] == [GRAPH[f"proj/{d.source.split('/proj/')[1]}"] for d in corpus.docs]
    assert all(len(d.files) == 1 and (d.files[0].start, d.files[0].end) == (0, len(d.text)) for d in corpus.docs)


@pytest.mark.parametrize("documents", ["file", "repository"])
def test_tier1_shard_summary_gives_document_lengths_in_tokens(tmp_path, documents):
    files = {f"p{i}/.git/HEAD": "x\n" for i in range(5)}
    for i in range(5):
        for j in range(i + 1):
            files[f"p{i}/h{j}.h"] = f"int v{i}_{j} = {i * j};\n" * (j + 1)
    write(tmp_path / "corpus", files)
    corpus = discover_corpus(cfg(tmp_path / "corpus", documents=documents))
    tok = train_tokenizer(corpus, 300, 1_000_000, tmp_path / "tok.json")
    shards = build_shards(corpus, tok, tmp_path / "shards", progress=False)
    lengths = sorted(len(tok.encode(d.text)) for d in corpus.docs)  # BOS excluded
    n = len(lengths)
    median, p90 = lengths[(n - 1) // 2], lengths[int(np.floor(0.9 * (n - 1)))]  # "lower" percentiles
    assert (f"{n} documents of median {median:,} tokens, 90th percentile {p90:,}, longest {lengths[-1]:,}"
            in shards.summary())
    assert n == (5 if documents == "repository" else 15)
