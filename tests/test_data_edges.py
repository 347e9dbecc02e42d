"""The corpus's edges (issue 39): megacpp's own files never become training data (a run directory or cache
inside the corpus is left out and the summary says so; a run kept inside its own corpus resumes with the
same tokenizer), and no line longer than the tokenizer can take reaches it."""
from __future__ import annotations

import json
from pathlib import Path

from megacpp.cli import main
from megacpp.data.config import DataConfig
from megacpp.data.corpus import MAX_LINE_BYTES, discover_corpus
from megacpp.run_files import LOCK_NAME
from tests.helpers import tiny_train_args, write_corpus


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_run_directories_and_caches_inside_the_corpus_are_left_out_and_named(tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    _write(root / "a.cpp", "int a() { return 1; }\n")
    run = root / "runs" / "x"
    _write(run / LOCK_NAME, "")
    _write(run / "sample.txt", "int sampled_by_the_model;\n")
    _write(run / "previous-20260101-000000" / "sample.txt", "int an_earlier_sample;\n")
    _write(run / "mine.hpp", "struct UsersOwnFileBesideTheRun {};\n")  # the user's, not megacpp's
    _write(root / "cache" / "tokenizers" / "k" / "vocab.txt", "a b c\n")
    _write(root / "inductor" / "ab" / "kernel.cpp", "extern \"C\" void kernel() {}\n")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    corpus = discover_corpus(DataConfig(corpus=[str(root)], min_bytes=1, val_fraction=0.0,
                                        cache_dir=str(root / "cache")))
    assert sorted(d.source for d in corpus.docs) == ["corpus/a.cpp", "corpus/runs/x/mine.hpp"]
    assert corpus.left_out == ["corpus/cache (the data cache)", "corpus/inductor (the compile cache)",
                               "corpus/runs/x (a run directory's files)"]
    assert ("; left out, as megacpp's own: corpus/cache (the data cache), corpus/inductor (the compile cache), "
            "corpus/runs/x (a run directory's files)") in corpus.summary()


def test_a_run_inside_its_own_corpus_resumes_with_the_same_tokenizer(tmp_path, capsys):
    """Before, the first run's sample.txt and metrics.jsonl joined the corpus of the resume, whose
    tokenizer then differed from the checkpoint's and the resume was refused."""
    root = tmp_path / "corpus"
    write_corpus(root)
    args = tiny_train_args(tmp_path, root, **{"train.out_dir": str(root / "runs" / "x"), "train.ckpt_every": "2",
                                              "train.eval_every": "2", "data.cache_dir": str(root / "cache")})
    assert main([*args, "--train.steps", "2"]) == 0
    first = capsys.readouterr().out
    assert main([*args, "--train.steps", "4", "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "resumed from" in out
    summaries = [next(line for line in text.splitlines() if line.startswith("corpus ")) for text in (first, out)]
    assert summaries[0].split("; left out")[0] == summaries[1].split("; left out")[0]  # same hash, files, docs
    assert summaries[1].endswith("; left out, as megacpp's own: corpus/cache (the data cache), "
                                 "corpus/runs/x (a run directory's files)")


def test_a_line_or_blank_run_longer_than_the_bound_keeps_its_document_from_the_tokenizer(tmp_path):
    root = tmp_path / "corpus"
    _write(root / "at_bound.hpp", "int x;\n" + "a" * MAX_LINE_BYTES + "\n")
    _write(root / "over_bound.hpp", "int y;\n" + "b" * (MAX_LINE_BYTES + 1) + "\n")
    _write(root / "blank_run.hpp", "int z;" + " \n" * (MAX_LINE_BYTES // 2 + 1) + "int w;\n")
    _write(root / "record.jsonl", json.dumps({"text": "c" * (MAX_LINE_BYTES + 1)}) + "\n")
    corpus = discover_corpus(DataConfig(corpus=[str(root)], min_bytes=1, val_fraction=0.0, cache_dir=str(tmp_path)))
    assert [d.source for d in corpus.docs] == ["corpus/at_bound.hpp"]
    assert corpus.skipped == {"long_line": 3}
    assert "skipped 3: 3 long_line" in corpus.summary()


def test_a_corpus_of_over_long_lines_alone_is_one_line_naming_the_reason(tmp_path, capsys):
    """Before, a 200 MB line let in by a raised data.max_bytes aborted inside the tokenizer library."""
    root = tmp_path / "corpus"
    _write(root / "generated.cpp", "int v[] = {" + "1" * (MAX_LINE_BYTES + 1) + "};\n")
    before = (root / "generated.cpp").read_bytes()
    assert main(tiny_train_args(tmp_path, root, **{"data.max_bytes": "10000000"})) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("megacpp: error: corpus is empty after filtering (no training documents): ")
    assert "skipped 1: 1 long_line" in lines[0]
    assert (root / "generated.cpp").read_bytes() == before
