"""Byte-level BPE tokenizer: round trip, specials, stable hash, code-friendly pre-tokenization."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megacpp.data.config import DataConfig
from megacpp.data.corpus import discover_corpus
from megacpp.data.tokenizer import CodeTokenizer, sample_documents, train_tokenizer

SNIPPET = """\
namespace demo {{
template <typename T>
struct Box{i} {{
    T value;
    explicit Box{i}(T v) : value(v) {{}}
    T get() const {{
        if (value > {i}) {{
            return value * {i};  // scale
        }}
        return value;
    }}
}};
}}  // namespace demo
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    for i in range(60):
        (root / f"box{i}.hpp").write_text(SNIPPET.format(i=i))
    return discover_corpus(DataConfig(corpus=[str(root)], val_fraction=0.05))


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory) -> CodeTokenizer:
    return train_tokenizer(corpus, 512, 1_000_000, tmp_path_factory.mktemp("tok") / "tokenizer.json")


CODE = "int main() {\n    for (auto& x : v) {\n\t\tstd::cout << x << \"\\n\";  // é 漢字 🙂\n    }\n}\n"


def test_roundtrip_code_with_indentation_and_unicode(tok):
    for text in [CODE, SNIPPET.format(i=7), "  \n\n    \t x", "", "\r\n\r\n", "\x00\x7f"]:
        assert tok.decode(tok.encode(text)) == text
    assert [tok.decode(ids) for ids in tok.encode_batch([CODE, "a b"])] == [CODE, "a b"]


def test_specials_present_and_never_produced_by_text(tok):
    ids = {tok.bos_id, tok.eos_id, tok.pad_id}
    assert len(ids) == 3 and max(ids) < tok.vocab_size
    text = "a <|bos|> b <|eos|><|pad|>"
    encoded = tok.encode(text)
    assert not ids & set(encoded)
    assert tok.decode(encoded) == text
    assert tok.decode([tok.bos_id]) == "<|bos|>"


def test_saved_as_tokenizer_json_and_reloads(tok):
    assert tok.path.name == "tokenizer.json" and tok.path.is_file()
    again = CodeTokenizer.from_file(tok.path)
    assert again.hash == tok.hash and again.encode(CODE) == tok.encode(CODE)


def test_tier2_tokenizer_hash_stable(corpus, tok, tmp_path):
    other = train_tokenizer(corpus, 512, 1_000_000, tmp_path / "tokenizer.json")
    assert other.hash == tok.hash
    assert other.path.read_bytes() == tok.path.read_bytes()
    different = train_tokenizer(corpus, 300, 1_000_000, tmp_path / "t300.json")
    assert different.hash != tok.hash


def test_whitespace_and_punctuation_runs_become_few_tokens(tok):
    # Indentation after a newline is one pre-token, so BPE learns it as one or two tokens.
    assert len(tok.encode("\n        ")) <= 2
    assert len(tok.encode("\n    ")) == 1
    assert len(tok.encode("}}")) <= 2
    # Pieces never straddle an identifier and punctuation: "value;" splits after "value".
    pieces = [tok.decode([i]) for i in tok.encode("    T value;\n")]
    assert "".join(pieces) == "    T value;\n"
    assert not any(p.rstrip(";") != p and p.strip(";").strip() for p in pieces)


def test_token_bytes_sum_to_utf8_length(tok):
    tb = tok.token_bytes()
    assert tb.shape == (tok.vocab_size,)
    assert tb[tok.bos_id] == tb[tok.eos_id] == tb[tok.pad_id] == 0
    for text in [CODE, SNIPPET.format(i=3)]:
        assert int(tb[np.array(tok.encode(text))].sum()) == len(text.encode("utf-8"))


def test_sample_is_deterministic_and_bounded(corpus):
    docs = corpus.split("train")
    sample = sample_documents(docs, 3000)
    assert sample == sample_documents(list(reversed(docs)), 3000)
    assert sum(d.nbytes for d in sample[:-1]) < 3000 <= sum(d.nbytes for d in sample)


def test_errors(corpus, tmp_path):
    with pytest.raises(ValueError, match="vocab_size 100"):
        train_tokenizer(corpus, 100, 1000, tmp_path / "t.json")
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        CodeTokenizer.from_file(Path(tmp_path / "none.json"))


# ---------------------------------------------------------------- `megacpp tokenizer train --out`


def _train_cli(tmp: Path, out: Path) -> list[str]:
    corpus = tmp / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i in range(60):
            (corpus / f"box{i}.hpp").write_text(SNIPPET.format(i=i))
    return ["tokenizer", "train", "--preset", "tiny", "--out", str(out), "--data.corpus", f'["{corpus}"]',
            "--data.cache_dir", str(tmp / "cache"), "--data.vocab_size", "300"]


def _one_line_error(capsys, args: list[str], code: int = 2) -> str:
    from megacpp.cli import main

    assert main(args) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("name", ["", "my.json"])
def test_tier1_tokenizer_train_out_never_replaces_a_users_file(tmp_path, capsys, name):
    """`--out DIR` (its tokenizer.json) or `--out FILE.json`: an existing different file is kept, one line
    names it; a byte-identical one (a repeated command) is left as it is and the command succeeds."""
    from megacpp.cli import main

    out_dir = tmp_path / "tokout"
    out_dir.mkdir()
    target = out_dir / (name or "tokenizer.json")
    target.write_text("MY OWN FILE\n")
    out = out_dir / name if name else out_dir
    err = _one_line_error(capsys, _train_cli(tmp_path, out))
    assert f"--out {out}: {target} already exists" in err and "choose another --out" in err
    assert target.read_text() == "MY OWN FILE\n"
    target.unlink()
    assert main(_train_cli(tmp_path, out)) == 0
    written = target.read_bytes()
    assert main(_train_cli(tmp_path, out)) == 0 and target.read_bytes() == written
    assert "already up to date" in capsys.readouterr().out


def test_tier1_tokenizer_train_out_of_the_wrong_kind_is_one_line_naming_out(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    for out in (afile, afile / "x.json", tmp_path / "f.json" / "sub"):
        (tmp_path / "f.json").write_text("{}")
        err = _one_line_error(capsys, _train_cli(tmp_path, out))
        assert f"--out {out}:" in err and "expected a directory or a .json file path" in err, err
        assert ".tmp-" not in err
    assert afile.read_text() == "keep me\n" and (tmp_path / "f.json").read_text() == "{}"
