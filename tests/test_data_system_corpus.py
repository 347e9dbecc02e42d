"""data.corpus = "system": the machine's C/C++ trees, gathered from a fake machine laid out in tmp_path."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from megacpp.config import ConfigError
from megacpp.data.config import DataConfig
from megacpp.data.corpus import discover_corpus
from megacpp.data.system_corpus import SourceTree, compiler_include_dirs, system_trees
from megacpp.run_config import load_config


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def code(name: str) -> str:
    return f"// {name}\nint {name.replace('.', '_').replace('/', '_')}(int x) {{ return x; }}\n"


@pytest.fixture
def machine(tmp_path):
    """torch's headers, a C++ standard library inside /usr/include, the compiler's own dir, two
    packages' include dirs; a copy of a torch header under /usr/include; a FIFO, a .txt file and an
    extensionless README that are not code; a dangling link where an include tree should be."""
    m = tmp_path / "machine"
    torch_inc = m / "torch/include"
    write(torch_inc / "ATen/core.h", code("core"))
    write(torch_inc / "c10/util.hpp", code("util"))
    usr = m / "usr/include"
    write(usr / "stdio.h", code("stdio"))
    write(usr / "copy_of_core.h", code("core"))  # the same bytes as torch's ATen/core.h
    write(usr / "notes.txt", "not code, but long enough to pass the size filter\n")
    write(usr / "README", "an extensionless file outside a C++ library\n")
    os.mkfifo(usr / "pipe.h")
    cxx = usr / "c++/12"
    write(cxx / "vector", code("vector"))  # a standard header has no extension
    write(cxx / "bits/stl_vector.h", code("stl_vector"))
    write(cxx / "backward/hash_map", code("hash_map"))
    gcc = m / "usr/lib/gcc/12/include"
    write(gcc / "stddef.h", code("stddef"))
    site = m / "site"
    write(site / "numpy/_core/include/numpy/arrayobject.h", code("arrayobject"))
    write(site / "pkg/include/pkg.h", code("pkg"))
    os.symlink(m / "gone", m / "broken_include")
    return {"m": m, "torch": torch_inc, "usr": usr, "cxx": cxx, "gcc": gcc, "site": site}


def trees_of(machine) -> list[SourceTree]:
    m = machine["m"]
    return system_trees(
        torch_include=machine["torch"],
        compiler_dirs=[machine["cxx"], machine["cxx"] / "backward", machine["gcc"], machine["usr"]],
        include_dirs=[m / "usr/local/include", machine["usr"], m / "broken_include"],
        site_dirs=[machine["site"]],
    )


def test_trees_in_keeping_order_without_absent_nested_or_repeated_ones(machine):
    m, usr = machine["m"], machine["usr"]
    trees = trees_of(machine)
    assert [t.name for t in trees] == [
        "torch/include", str(machine["cxx"]), str(machine["gcc"]), str(usr), str(m / "broken_include"),
        "site-packages/pkg/include", "site-packages/numpy/_core/include",  # site-packages/*/include first
    ]  # no backward/ (inside c++/12), no /usr/local/include (absent), /usr/include once
    assert [t.extensionless for t in trees] == [False, True, False, False, False, False, False]


def test_sources_named_duplicates_dropped_and_unreadable_trees_counted(machine, monkeypatch):
    """Every tree is named with its counts; the copy of a torch header under /usr/include is a
    duplicate; /usr/include's walk leaves the C++ library (its own tree) alone; the dangling link and
    a tree that refuses listing are unreadable trees; the FIFO is skipped unopened; .txt and README
    are not read. Tests run as root, which ignores permission bits: the refusal is simulated."""
    real_scandir = os.scandir
    locked = machine["site"] / "pkg/include"

    def scandir(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    corpus = discover_corpus(DataConfig(corpus="system", min_bytes=1, val_fraction=0.0), system=trees_of(machine))
    by_source = {d.source for d in corpus.docs}
    cxx, usr = str(machine["cxx"]), str(machine["usr"])
    assert by_source == {
        "torch/include/ATen/core.h", "torch/include/c10/util.hpp",
        f"{cxx}/vector", f"{cxx}/bits/stl_vector.h", f"{cxx}/backward/hash_map",
        f"{machine['gcc']}/stddef.h", f"{usr}/stdio.h",
        "site-packages/numpy/_core/include/numpy/arrayobject.h",
    }
    assert corpus.skipped["duplicate"] == 1 and corpus.skipped["special_file"] == 1
    stats = {s.name: s for s in corpus.sources}
    assert (stats["torch/include"].files, stats["torch/include"].docs) == (2, 2)
    assert (stats[cxx].files, stats[cxx].docs) == (3, 3)
    # stdio.h, copy_of_core.h and pipe.h: not the C++ library's files, not .txt, not README
    assert (stats[usr].files, stats[usr].docs) == (3, 1)
    assert stats[usr].nbytes == len(code("stdio").encode())
    assert corpus.unreadable_trees == [str(machine["m"] / "broken_include"), "site-packages/pkg/include"]
    summary = corpus.summary().splitlines()
    assert len(summary) == 2 and summary[1].startswith("sources: torch/include 2 files -> 2 docs")
    assert f"{usr} 3 files -> 1 docs 0.0 MB" in summary[1]
    assert summary[1].endswith("2 unreadable trees (" + ", ".join(corpus.unreadable_trees) + ")")


def test_compiler_search_path_is_parsed_from_the_compiler(tmp_path):
    """A stand-in compiler that prints what `c++ -xc++ -E -v -` prints (on stderr); the first compiler
    that is missing or says nothing useful is passed over."""
    fake = write(tmp_path / "fake-c++", "#!/bin/sh\ncat >/dev/null\n"
                 "printf '%s\\n' 'ignored' '#include \"...\" search starts here:' "
                 "'#include <...> search starts here:' ' /opt/c++/13' ' /opt/inc' "
                 "' /Library/Frameworks (framework directory)' 'End of search list.' >&2\n")
    fake.chmod(0o755)
    silent = write(tmp_path / "silent-c++", "#!/bin/sh\nexit 1\n")
    silent.chmod(0o755)
    dirs = compiler_include_dirs([str(tmp_path / "missing"), str(silent), str(fake)])
    assert dirs == [Path("/opt/c++/13"), Path("/opt/inc")]
    assert compiler_include_dirs([str(tmp_path / "missing")]) == []


def test_system_is_a_config_value_and_typos_are_errors():
    cfg, _ = load_config("tiny", None, [("data.corpus", "system")])
    assert cfg.data.corpus == "system"
    cfg, _ = load_config("tiny", None, [("data.corpus", '["a", "b"]')])
    assert cfg.data.corpus == ["a", "b"]
    with pytest.raises(ConfigError, match="data.corpus"):
        load_config("tiny", None, [("data.corpus", "systen")])


def test_tier1_summary_prints_a_tree_name_that_is_not_utf8(machine):
    """A package directory whose name is not UTF-8 (os.fsdecode keeps its byte as a lone surrogate)
    must not make the summary unprintable on a strict UTF-8 stdout: the byte is shown escaped."""
    site = machine["site"]
    write(site / os.fsdecode(b"p\xe9kg") / "include/weird.h", code("weird"))
    corpus = discover_corpus(DataConfig(corpus="system", min_bytes=1, val_fraction=0.0), system=trees_of(machine))
    summary = corpus.summary()
    assert summary.encode("utf-8").decode("utf-8") == summary  # no lone surrogate left in it
    assert "site-packages/p\\xe9kg/include 1 files -> 1 docs" in summary
