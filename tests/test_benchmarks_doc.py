"""BENCHMARKS.md holds the newest figure of each target: one table per section, and every row names its date,
device and torch, and the command that measured it, listed under its table (`- ID: ...`)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_WHEN = re.compile(r"\b20\d\d-\d\d-\d\d · [^|]+ · torch [^|]+")
_COMMAND = re.compile(r"^- ([A-Z]\d+): `", re.M)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def row_problems(text: str) -> list[str]:
    """Each problem with a section or a table row of a BENCHMARKS.md text, one line each."""
    problems = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title, body = section.split("\n", 1)
        rows = [line for line in body.splitlines() if line.startswith("|")]
        if not rows:
            problems.append(f"{title}: no table")
        defined = set(_COMMAND.findall(body))
        for line in rows[2:] if rows else []:  # past each table's header and separator
            if set(line) <= set("|-: ") or line == rows[0]:
                continue
            cells = _cells(line)
            if cells[0] in ("what", "row", "run", "sublayer", "check", "comparison"):
                continue
            if not any(_WHEN.search(cell) for cell in cells):
                problems.append(f"{title}: {cells[0]!r} names no date · device · torch")
            command = cells[-1]
            if command.startswith("not recorded"):
                continue
            named = re.findall(r"\b[A-Z]\d+\b", command)
            if not named or not set(named) <= defined:
                problems.append(f"{title}: {cells[0]!r} names no command listed under its table ({command!r})")
    return problems


def test_every_row_of_benchmarks_md_names_when_where_and_its_command():
    assert row_problems((ROOT / "BENCHMARKS.md").read_text()) == []


def test_the_row_check_finds_a_row_without_date_or_command():
    text = ("# B\n\n## One\n\n| what | figure | date | command |\n|---|---|---|---|\n"
            "| a | 1 ms | 2026-11-25 · H200 · torch 2.11 | T1 |\n| b | 2 ms | yesterday | T1 |\n"
            "| c | 3 ms | 2026-11-25 · H200 · torch 2.11 | T9 |\n\n- T1: `python x.py`\n\n## Two\n\nNo table.\n")
    assert row_problems(text) == ["One: 'b' names no date · device · torch",
                                  "One: 'c' names no command listed under its table ('T9')", "Two: no table"]


def test_the_archive_keeps_the_history_and_benchmarks_md_links_it():
    archive = (ROOT / "docs" / "benchmarks_archive.md").read_text()
    assert "## GPU: sublayers, forward + backward (issue 2)" in archive  # the oldest section
    assert "## From the code's comments" in archive
    assert "(docs/benchmarks_archive.md)" in (ROOT / "BENCHMARKS.md").read_text()
