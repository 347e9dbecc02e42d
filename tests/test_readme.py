"""README's commands are the promise to a new user: its first two lines to a fresh machine (kept in step
with CI), and the "Train on your own repository" block, run here as written on a generated C++ tree."""
import os
import shlex
from pathlib import Path

from megacpp.cli import main
from tests.helpers import write_corpus

ROOT = Path(__file__).resolve().parent.parent
# What a README command gets appended here so that the tiny preset's run takes seconds: few steps, and
# the evaluation, checkpoint and sample of each run still happen.
FAST = {"train": ["--no-progress", "--train.steps", "2", "--train.eval_every", "2", "--train.ckpt_every", "2",
                  "--train.sample_tokens", "4", "--train.tensorboard", "false"],
        "sample": ["--tokens", "8"]}


def _first_code_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _section_commands(title: str) -> list[list[str]]:
    """The command lines of the first bash block under `## title`, split as a shell would (comments dropped)."""
    section = (ROOT / "README.md").read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_readme_opens_with_train_then_test_command():
    train, test = _first_code_block()[:2]
    assert train.endswith("megacpp train") and "pip install" in train
    assert "pytest" in test and '".[test]"' in test


def test_ci_runs_exactly_the_readme_test_command():
    test = _first_code_block()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci_lines, f"{test!r} is not a line of .ci/run"


def test_the_own_repository_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """Each command of the block exits 0 on a tree of 200 generated headers (plus two files it must not
    read) in a fresh HOME, after a `runs/tiny` trained on another tree stands in for the first run."""
    commands = _section_commands("Train on your own repository")
    assert len(commands) >= 5 and all(cmd[0] == "megacpp" for cmd in commands)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    project = tmp_path / "src" / "myproject"
    write_corpus(project, n_files=200, seed=1)
    (project / "README.md").write_text("# not C++\n")
    (project / "setup.py").write_text("print('not C++')\n")
    write_corpus(tmp_path / "other", n_files=200, seed=2)
    assert main(["train", "--data.corpus", "./other", "--data.val_fraction", "0.1", "--train.out_dir", "runs/tiny",
                 *FAST["train"]]) == 0
    capsys.readouterr()
    outputs = []
    for command in commands:
        args = [os.path.expanduser(arg) for arg in command[1:]] + FAST.get(command[1], [])
        assert main(args) == 0, f"`{shlex.join(command)}` failed: {capsys.readouterr().err}"
        outputs.append(capsys.readouterr().out)
    assert "not read, by extension: 2 (.md 1, .py 1" in outputs[0]
    assert any("fine-tuning from" in out and "runs/tiny/checkpoints" in out for out in outputs)
    evals = [out for cmd, out in zip(commands, outputs, strict=True) if cmd[1] == "eval"]
    assert evals and all("(the whole validation split)" in out for out in evals)
