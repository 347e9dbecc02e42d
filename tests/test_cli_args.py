"""`megacpp sample` and `megacpp eval` arguments: each mistake is one line on stderr, a non-zero exit
status, no traceback, and nothing on disk changes; the sample ends at the end of a document."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megacpp.cli import main
from megacpp.config import Config
from megacpp.data.config import DataConfig
from megacpp.data.corpus import discover_corpus
from megacpp.data.tokenizer import train_tokenizer
from megacpp.infer.session import Session, load_session
from megacpp.train.loop import Trainer
from tests.helpers import tiny_train_config, write_corpus

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A two-step tiny run whose attention context is 64 tokens, so a long prompt exceeds it."""
    tmp = tmp_path_factory.mktemp("cli-args")
    write_corpus(tmp / "corpus")
    cfg = tiny_train_config(tmp, tmp / "corpus", **{"train.steps": "2", "train.ckpt_every": "2",
                                                    "model.attention.max_seq_len": "64"})
    Trainer(cfg, log=lambda _msg: None, progress=False).run()
    return tmp / "run"


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fails(args: list[str], capsys, code: int) -> str:
    """Run the CLI, assert the exit code and a one-line, traceback-free stderr; return that line."""
    assert main(args) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(("args", "message"), [
    (["sample", "--tokens", "0"], "--tokens 0: must be >= 1"),
    (["sample", "--tokens", "-5"], "--tokens -5: must be >= 1"),
    (["sample", "--temperature", "-0.1"], "--temperature -0.1: must be a finite number >= 0"),
    (["sample", "--temperature", "nan"], "--temperature nan: must be a finite number >= 0"),
    (["sample", "--temperature", "inf"], "--temperature inf: must be a finite number >= 0"),
    (["sample", "--top-k", "-1"], "--top-k -1: must be >= 0"),
    (["sample", "--prompt", "int \udcff x"], "--prompt is not valid UTF-8 text: character 4"),
    (["eval", "--batches", "-1"], "--batches -1: must be >= 0 (0 = the whole validation split)"),
])
def test_out_of_range_arguments_fail_before_loading(run_dir, capsys, args, message):
    before = snapshot(run_dir)
    err = fails([*args, "--checkpoint", str(run_dir)], capsys, 2)
    assert message in err
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("seed", [str(2**64), "-1"])
def test_tier1_sample_seed_out_of_64_bit_range_is_one_line(run_dir, capsys, seed):
    """torch.Generator.manual_seed overflowed on a seed >= 2**64 ("Overflow when unpacking long long")."""
    err = fails(["sample", "--checkpoint", str(run_dir), "--tokens", "2", "--seed", seed], capsys, 2)
    assert f"--seed {seed}: must be in [0, 18446744073709551615]" in err


def test_invalid_prompt_bytes_from_a_real_command_line(tmp_path):
    """Bytes that are not UTF-8 reach sys.argv as lone surrogates (surrogateescape)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "megacpp.cli", "sample", "--checkpoint", str(tmp_path),
                           "--prompt", b"int \xff x"], capture_output=True, env=env, timeout=300)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "--prompt is not valid UTF-8 text: character 4" in err


def _sample_process(run_dir: Path, *args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "megacpp.cli", "sample", "--checkpoint", str(run_dir), "--seed", "1",
               "--train.device", "cpu", *args]
    return subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **popen)


def test_tier1_sample_to_an_ascii_stdout_escapes_what_it_cannot_encode(run_dir):
    """PYTHONIOENCODING=ascii (or a C locale) ended the sample with a UnicodeEncodeError traceback."""
    proc = _sample_process(run_dir, "--prompt", "// é ", "--tokens", "3", env={"PYTHONIOENCODING": "ascii"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert out.startswith(b"// \\xe9 ") and err == b""


def test_tier1_sample_whose_reader_closes_the_pipe_stops_quietly(run_dir):
    """`megacpp sample | head -c 1` printed "error: Broken pipe" and exited 1; now it ends as a tool that
    SIGPIPE stops does: exit status 141, nothing on stderr. The reader here is gone before the first
    write, so the outcome does not depend on timing."""
    read, write = os.pipe()
    os.close(read)
    proc = _sample_process(run_dir, "--prompt", "int ", "--tokens", "20", stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and err == b"", err.decode()


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_missing_or_wrong_checkpoint_path_is_named(tmp_path, capsys, command):
    missing = tmp_path / "no-such-run"
    assert f"{missing}: no such checkpoint or run directory" in fails(
        [command, "--checkpoint", str(missing)], capsys, 1)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a checkpoint")
    assert f"{a_file}: not a checkpoint or run directory" in fails([command, "--checkpoint", str(a_file)], capsys, 1)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty}: no valid checkpoint" in fails([command, "--checkpoint", str(empty)], capsys, 1)
    assert a_file.read_text() == "not a checkpoint" and not list(empty.iterdir())


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_tier1_settings_a_checkpoint_command_would_ignore_are_refused(run_dir, capsys, command):
    """eval and sample rebuild model, data and tokenizer from the checkpoint: an override of those (here
    --data.corpus, which eval used to drop silently) is one line naming it; the device still applies."""
    before = snapshot(run_dir)
    err = fails([command, "--checkpoint", str(run_dir), "--data.corpus", "system"], capsys, 2)
    assert f"{command}: --data.corpus is not used" in err and "--train.out_dir, --train.device apply" in err
    assert "--optim.muon_lr is not used" in fails([command, "--checkpoint", str(run_dir), "--optim.muon_lr", "0.01"],
                                                capsys, 2)
    assert snapshot(run_dir) == before


def test_tier2_a_prompt_and_tokens_past_the_rope_tables_sample(run_dir, capsys):
    """The model's RoPE tables have 64 rows (max_seq_len); the decode cache grows its own, so a longer prompt
    (it refused it before issue 36) or more tokens sample, the same text twice, and nothing on disk changes."""
    before = snapshot(run_dir)
    prompt = "int x; " * 40
    outputs = []
    for _ in range(2):
        assert main(["sample", "--checkpoint", str(run_dir), "--prompt", prompt, "--tokens", "30", "--seed", "2",
                     "--train.device", "cpu"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith(prompt)
    session = load_session(run_dir, Config())
    assert session.config.model.attention.max_seq_len == 64 and len(session.prompt_ids(prompt)) > 64
    assert snapshot(run_dir) == before


def test_tier1_a_run_directorys_checkpoints_folder_names_the_run(run_dir, capsys):
    """`--checkpoint RUN/checkpoints` (what tab completion gives) looked in RUN/checkpoints/checkpoints and
    found nothing; it means RUN: the newest checkpoint, the same sample as `--checkpoint RUN`."""
    outputs = []
    for path in (run_dir, run_dir / "checkpoints"):
        assert main(["sample", "--checkpoint", str(path), "--prompt", "int ", "--tokens", "5",
                     "--temperature", "0", "--train.device", "cpu"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("int ")


def test_valid_arguments_still_sample(run_dir, capsys):
    assert main(["sample", "--checkpoint", str(run_dir), "--prompt", "int ", "--tokens", "5",
                 "--temperature", "0", "--top-k", "0", "--train.device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("int ") and "<|" not in out


# ---------------------------------------------------------------- end of document


class ScriptedModel(torch.nn.Module):
    """Greedy decoding follows `next_of`: after input token t the most likely next token is next_of[t]."""

    def __init__(self, vocab_size: int, next_of: dict[int, int]) -> None:
        super().__init__()
        self.tok_embed = torch.nn.Embedding(vocab_size, 1)
        self.vocab_size, self.next_of = vocab_size, next_of

    def init_cache(self, batch_size: int, max_len: int) -> None:
        return None

    def forward_step(self, x: torch.Tensor, cache: None) -> torch.Tensor:
        logits = torch.zeros(1, 1, self.vocab_size)
        logits[0, 0, self.next_of.get(int(x), 0)] = 1.0
        return logits

    def prefill(self, tokens: torch.Tensor, cache: None) -> torch.Tensor:
        return self.forward_step(tokens[:, -1:], cache)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    write_corpus(tmp / "corpus")
    corpus = discover_corpus(DataConfig(corpus=[str(tmp / "corpus")], val_fraction=0.1))
    return train_tokenizer(corpus, 300, 1_000_000, tmp / "tokenizer.json")


@pytest.mark.parametrize("end", ["bos", "eos"])
def test_sample_stops_at_the_end_of_a_document_and_prints_no_special_token(tokenizer, end):
    tok = tokenizer
    (last,) = tok.encode("int")[-1:]
    a, b, c = (tok.encode(ch)[0] for ch in "abc")
    end_id = tok.bos_id if end == "bos" else tok.eos_id
    # int -> a -> PAD -> b -> end of document -> c: the PAD is not printed and c is never reached.
    model = ScriptedModel(tok.vocab_size, {last: a, a: tok.pad_id, tok.pad_id: b, b: end_id, end_id: c})
    session = Session(model, tok, Config(), Path("ckpt"), torch.device("cpu"))
    assert "".join(session.stream("int", 20, 0.0, 0, 0)) == "intab"
