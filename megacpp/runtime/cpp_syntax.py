"""`megacpp eval --cpp-syntax N`: do a model's completions of held-out C++ functions compile?

For each file of the validation split's documents (in corpus order), the last function body that
`megacpp.runtime.cpp_functions` finds with at least one statement and at most `MAX_BODY_CHARS` characters
is a case: the document's text up to and including the body's ``{`` is the prompt (its last `context`
tokens, BOS first when that reaches the document's start; `megacpp eval` gives it the rest of the training
row, or ``--cpp-context``), the model completes it greedily until the braces balance (or the token budget,
or the end of the document), and the file with the completion in place of the body is checked by the
machine's C++ compiler in syntax-only mode. A case
whose original file fails that check (a missing dependency, a header written for another compiler) is
skipped and counted: only completions can fail. Cases are taken until N have been checked.

The compiler is ``$CXX`` when set, else the first of g++, clang++, c++ on PATH; it runs as
``<cxx> -fsyntax-only -x c++ -std=c++17 -w -iquote <the file's directory> -I <include roots>`` on a copy of
the file, where the include roots are the directories named ``include`` under the document's root (its
repository, else its corpus root) and that root itself: the include paths the corpus came with.
"""
from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from megacpp.data.corpus import Document
from megacpp.data.repository import INCLUDE_DIR_NAME
from megacpp.data.tokenizer import CodeTokenizer
from megacpp.errors import MegacppError
from megacpp.model.hybrid import HybridLM
from megacpp.runtime.cpp_functions import body_end, code_only, find_functions
from megacpp.runtime.generate import generate_tokens, stream_text

COMPILERS = ("g++", "clang++", "c++")
STANDARD = "c++17"  # torch's headers need it; older code still parses
MAX_BODY_CHARS = 1500  # ~440 tokens at 3.4 bytes/token: a body the default budget can rewrite whole
DEFAULT_TOKENS = 512  # the completion budget `megacpp eval` caps at half of data.seq_len

Verdict = Literal["pass", "fail", "timeout"]


class CppSyntaxError(MegacppError):
    """No usable C++ compiler for the syntax check."""


@dataclass(frozen=True)
class Compiler:
    command: tuple[str, ...]
    version: str  # the first line of --version

    def check(self, text: str, name: str, quote_dir: Path, include_dirs: Sequence[Path], timeout_s: float
              ) -> Verdict:
        """Whether `text`, as the file `name` of directory `quote_dir`, passes -fsyntax-only."""
        with tempfile.TemporaryDirectory(prefix="megacpp-syntax-") as tmp:
            source = Path(tmp, name)
            source.write_text(text, encoding="utf-8")
            args = [*self.command, "-fsyntax-only", "-x", "c++", f"-std={STANDARD}", "-w", "-iquote", str(quote_dir),
                    *(arg for d in include_dirs for arg in ("-I", str(d))), str(source)]
            try:
                done = subprocess.run(args, capture_output=True, timeout=timeout_s, cwd=tmp)
            except subprocess.TimeoutExpired:
                return "timeout"
        return "pass" if done.returncode == 0 else "fail"


def find_compiler(env: Mapping[str, str] = os.environ) -> Compiler:
    """$CXX, else the first of g++, clang++, c++ on PATH; CppSyntaxError in one line when there is none."""
    if env.get("CXX"):
        command = shlex.split(env["CXX"])
        if not command or shutil.which(command[0]) is None:
            raise CppSyntaxError(f"--cpp-syntax: $CXX={env['CXX']!r} is not an executable on PATH")
    else:
        found = next((exe for exe in COMPILERS if shutil.which(exe)), None)
        if found is None:
            raise CppSyntaxError(f"--cpp-syntax needs a C++ compiler: none of {', '.join(COMPILERS)} is on PATH "
                                 "and $CXX is not set (install g++ or clang++, or set CXX)")
        command = [found]
    try:
        probe = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CppSyntaxError(f"--cpp-syntax: {shlex.join(command)} --version failed ({exc})") from exc
    if probe.returncode != 0:
        raise CppSyntaxError(f"--cpp-syntax: {shlex.join(command)} --version exited {probe.returncode}")
    return Compiler(tuple(command), (probe.stdout.splitlines() or ["?"])[0].strip())


@functools.lru_cache(maxsize=64)
def include_dirs(root: Path) -> tuple[Path, ...]:
    """The directories named `include` under `root` (sorted), then `root` itself."""
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        dirnames.sort()
        found += [Path(dirpath, d) for d in dirnames if d == INCLUDE_DIR_NAME]
    return (*sorted(found), root)


@dataclass(frozen=True)
class Case:
    """One held-out function: the file it is in, the body's place in that file, and the prompt."""

    path: Path  # the file on disk (its name and directory; the text comes from the document)
    file_text: str
    open: int  # offsets of the body's braces in file_text
    close: int
    prompt: str  # the document's text up to and including the "{"
    root: Path  # where the include roots are looked for

    def with_body(self, completion: str) -> str:
        """The file with `completion` (the body and its closing brace) in place of the original's."""
        return self.file_text[: self.open + 1] + completion + self.file_text[self.close + 1:]


def _wanted(body: str) -> bool:
    return len(body) <= MAX_BODY_CHARS and ";" in code_only(body)


def cases_of(docs: Sequence[Document]) -> Iterator[Case]:
    """Per file of each document, its last function with a statement and a body of at most MAX_BODY_CHARS."""
    for doc in docs:
        for file in doc.files:
            text = doc.text[file.start:file.end]
            functions = [f for f in find_functions(text) if _wanted(text[f.open + 1:f.close])]
            if functions and doc.root is not None:
                f = functions[-1]
                yield Case(file.path, text, f.open, f.close, doc.text[: file.start + f.open + 1], doc.root)


def complete_body(model: HybridLM, tokenizer: CodeTokenizer, prompt: list[int], max_new_tokens: int) -> str:
    """The greedy completion of an open body, cut just after the brace that closes it (or whatever came
    before the budget or the end of the document ran out)."""
    tokens = generate_tokens(model, prompt, max_new_tokens, temperature=0.0, top_k=0,
                             stop_id={tokenizer.bos_id, tokenizer.eos_id})
    text = ""
    for piece in stream_text(tokenizer, tokens):
        text += piece
        end = body_end(text)
        if end is not None:
            return text[:end]
    return text


def prompt_ids(tokenizer: CodeTokenizer, case: Case, context: int) -> list[int]:
    """The prompt's last `context` tokens, led by BOS when that reaches the document's start."""
    ids = tokenizer.encode(case.prompt)
    return [tokenizer.bos_id, *ids] if len(ids) < context else ids[-context:]


@dataclass
class SyntaxReport:
    compiler: str
    requested: int
    functions: int = 0  # functions looked at: cases + skipped
    skipped: int = 0  # their original file fails the check (or times out)
    passed: int = 0
    failed: int = 0
    timed_out: int = 0  # completions whose check ran past the timeout (not passed)

    @property
    def cases(self) -> int:
        return self.passed + self.failed + self.timed_out

    @property
    def pass_rate(self) -> float | None:
        return self.passed / self.cases if self.cases else None

    def summary(self) -> str:
        rate = f"{self.pass_rate:.1%}" if self.pass_rate is not None else "n/a"
        short = f" (asked for {self.requested}: the validation split has no more)" \
            if self.cases < self.requested else ""
        return (f"C++ syntax pass rate: {rate}, {self.passed} of {self.cases} completed functions compile "
                f"({self.failed} fail, {self.timed_out} time out){short}; {self.skipped} more skipped because "
                f"their original file fails the check; {self.compiler}, -fsyntax-only -std={STANDARD}")


@torch.no_grad()
def check_completions(model: HybridLM, tokenizer: CodeTokenizer, docs: Sequence[Document], n: int,
                      compiler: Compiler, context: int, max_new_tokens: int, timeout_s: float) -> SyntaxReport:
    """Check up to `n` completed functions from `docs` (see the module doc)."""
    report = SyntaxReport(compiler.version, n)
    original_ok: dict[Path, bool] = {}
    was_training = model.training
    model.eval()
    for case in cases_of(docs):
        if report.cases == n:
            break
        report.functions += 1
        dirs = include_dirs(case.root)
        if case.path not in original_ok:
            verdict = compiler.check(case.file_text, case.path.name, case.path.parent, dirs, timeout_s)
            original_ok[case.path] = verdict == "pass"
        if not original_ok[case.path]:
            report.skipped += 1
            continue
        completion = complete_body(model, tokenizer, prompt_ids(tokenizer, case, context), max_new_tokens)
        verdict = compiler.check(case.with_body(completion), case.path.name, case.path.parent, dirs, timeout_s)
        if verdict == "pass":
            report.passed += 1
        elif verdict == "fail":
            report.failed += 1
        else:
            report.timed_out += 1
    model.train(was_training)
    return report
