"""README's first two commands are the promise to a fresh machine: keep them true and in step with CI."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _first_code_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_train_then_test_command():
    train, test = _first_code_block()[:2]
    assert train.endswith("megacpp train") and "pip install" in train
    assert "pytest" in test and '".[test]"' in test


def test_ci_runs_exactly_the_readme_test_command():
    test = _first_code_block()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci_lines, f"{test!r} is not a line of .ci/run"
