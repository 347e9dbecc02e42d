"""The C++ syntax check (`megacpp eval --cpp-syntax N`): the function finder on odd inputs, planted
completions that do and do not compile (g++ must be installed: CI has it, so a missing g++ fails here),
and a tiny model end to end. Expected functions are written out by hand from the finder's documented rules."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megacpp.cli import main
from megacpp.config import Config
from megacpp.data.config import DataConfig
from megacpp.data.corpus import Document, DocumentFile, discover_corpus
from megacpp.infer.session import load_session
from megacpp.runtime.cpp_functions import body_end, code_only, find_functions
from megacpp.runtime.cpp_syntax import Case, CppSyntaxError, cases_of, find_compiler, include_dirs
from megacpp.train.loop import Trainer
from tests.helpers import tiny_train_config

ODD = r'''#include <cstdio>
#define OPEN {
#define LONG_MACRO(x) \
    if (x) { \
    }
namespace ns {
// a brace in a comment: {
/* and in a block comment: } { */
struct Widget {
  Widget(int n) : n_(n), m_(0) { puts("}"); }
  int size() const noexcept(true) { return n_; }
  bool operator()(int x) && { return x > '}'; }
  int n_, m_;
};
int body(int x) {
  auto lambda = [](int y) { return y; };
  const char* raw = R"tag(}}{)tag";
  const char* s = "\"{";
  int big = 1'000'000;
  if (x) { return lambda(big); }
  return raw[0] + s[0];
}
auto trailing() -> int { return 0; }
int table[] = {1, 2, 3};
}  // namespace ns
extern "C" { int c_function(void) { return 1; } }
'''


def test_tier1_function_finder_on_strings_comments_literals_and_preprocessor_lines():
    found = find_functions(ODD)
    assert [f.name for f in found] == ["m_", "size", "operator()", "body", "c_function"]
    bodies = [ODD[f.open:f.close + 1] for f in found]
    assert bodies[0] == '{ puts("}"); }' and bodies[2] == "{ return x > '}'; }"
    assert bodies[3].startswith("{\n  auto lambda") and bodies[3].endswith("return raw[0] + s[0];\n}")
    assert bodies[4] == "{ return 1; }"


def test_tier1_code_only_blanks_what_is_not_code_and_keeps_offsets():
    text = 'int a = 1\'000; // x { y\nchar c = \'{\'; const char* r = R"d(})d"; /* } */ int z;\n#if X {\n'
    code = code_only(text)
    assert len(code) == len(text) and code.count("\n") == text.count("\n")
    assert "{" not in code and "}" not in code
    assert code.startswith("int a = 1'000;") and "int z;" in code  # a digit separator is no literal


def test_tier1_unbalanced_braces_give_no_functions():
    """#if branches that each open a brace: brace matching would pair the wrong braces, so nothing is found."""
    assert find_functions("#if A\nvoid f() {\n#else\nvoid f(int) {\n#endif\n}\n") == []
    assert find_functions("void f() {\n  if (a) {\n}\n") == []
    assert find_functions("void f() { }\n}\n") == []


def test_tier1_body_end_ignores_braces_in_literals_and_comments():
    assert body_end(" return '}'; } int next;") == len(" return '}'; }")
    assert body_end(' s = "}"; // }\n if (a) { b(); }\n}\nint x;') == len(' s = "}"; // }\n if (a) { b(); }\n}')
    assert body_end(" if (a) { b(); }") is None


# ---------------------------------------------------------------- the compiler


def test_gxx_is_installed_and_found_first():
    assert subprocess.run(["g++", "--version"], capture_output=True).returncode == 0
    compiler = find_compiler(env={})
    assert compiler.command == ("g++",) and compiler.version.startswith("g++")


def test_missing_compiler_is_one_clear_error(monkeypatch, tmp_path):
    with pytest.raises(CppSyntaxError, match=r"\$CXX='no-such-cxx' is not an executable on PATH"):
        find_compiler(env={"CXX": "no-such-cxx"})
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no compiler on PATH
    with pytest.raises(CppSyntaxError, match="none of g\\+\\+, clang\\+\\+, c\\+\\+ is on PATH"):
        find_compiler(env={})


def planted_case(root: Path) -> Case:
    """src/use.cpp includes a header beside it ("helper.h") and one through an include root (<proj/api.h>)."""
    (root / "include/proj").mkdir(parents=True)
    (root / "src").mkdir()
    (root / "include/proj/api.h").write_text("#pragma once\nint api(int);\n")
    (root / "src/helper.h").write_text("#pragma once\ninline int helper(int x) { return x; }\n")
    text = '#include "helper.h"\n#include <proj/api.h>\nint use(int x) {\n  return helper(x) + api(x);\n}\n'
    (root / "src/use.cpp").write_text(text)
    doc = Document("t", text, "h", len(text), "val", (DocumentFile(root / "src/use.cpp", 0, len(text)),), root)
    [case] = cases_of([doc])
    return case


@pytest.mark.parametrize(("completion", "verdict"), [
    ("\n  return helper(x) * api(x);\n}", "pass"),
    ("\n  int y = x; // }\n  return y;\n}", "pass"),
    ("\n  return helper(x) +;\n}", "fail"),  # a syntax error
    ("\n  return helper(x);\n", "fail"),  # no closing brace: the budget ran out
    ("\n  return undeclared(x);\n}", "fail"),  # -fsyntax-only still resolves names
])
def test_planted_completions_compile_or_not(tmp_path, completion, verdict):
    case = planted_case(tmp_path)
    assert case.prompt.endswith("int use(int x) {") and case.with_body("\n  return helper(x) + api(x);\n}") \
        == case.file_text
    compiler = find_compiler(env={})
    dirs = include_dirs(case.root)
    assert dirs == (tmp_path / "include", tmp_path)
    assert compiler.check(case.file_text, "use.cpp", case.path.parent, dirs, 60) == "pass"
    assert compiler.check(case.file_text, "use.cpp", tmp_path, dirs, 60) == "fail"  # helper.h not found
    assert compiler.check(case.with_body(completion), "use.cpp", case.path.parent, dirs, 60) == verdict


def test_a_compiler_call_past_its_timeout_is_a_timeout(tmp_path):
    case = planted_case(tmp_path)
    compiler = find_compiler(env={})
    assert compiler.check(case.file_text, "use.cpp", case.path.parent, include_dirs(case.root), 1e-4) == "timeout"


# ---------------------------------------------------------------- a tiny model end to end


def write_cpp_repository(root: Path, n_files: int = 24) -> set[str]:
    """Valid C++ files (each a few functions over a shared header), and every fourth one calling an
    undeclared function, so its original fails the check. Returns the names of the broken ones."""
    (root / "include").mkdir(parents=True)
    (root / "CMakeLists.txt").write_text("project(p)\n")
    (root / "include/common.h").write_text("#pragma once\ninline int scale(int x) { return 3 * x; }\n")
    broken = set()
    for i in range(n_files):
        calls = f"missing_{i}(x)" if i % 4 == 3 else "scale(x)"
        if i % 4 == 3:
            broken.add(f"f{i:02d}.cpp")
        functions = "".join(f"int f{i}_{j}(int x) {{\n  int y = {calls} + {j};\n  return y * {i + 1};\n}}\n"
                            for j in range(3))
        (root / f"f{i:02d}.cpp").write_text(f'#include "common.h"\n{functions}')
    return broken


@pytest.fixture(scope="module")
def cpp_run(tmp_path_factory) -> tuple[Path, set[str]]:
    tmp = tmp_path_factory.mktemp("cpp-syntax")
    broken = write_cpp_repository(tmp / "corpus")
    cfg = tiny_train_config(tmp, tmp / "corpus", **{"train.steps": "2", "train.ckpt_every": "2",
                                                    "data.val_fraction": "0.5", "data.seq_len": "64"})
    Trainer(cfg, log=lambda _msg: None, progress=False).run()
    return tmp / "run", broken


def test_tiny_model_end_to_end_counts_add_up(cpp_run):
    run, broken = cpp_run
    session = load_session(run, Config())
    val_files = [f.path.name for d in discover_corpus(session.config.data).split("val") for f in d.files
                 if f.path.suffix in (".cpp", ".h")]  # every one holds a function; CMakeLists.txt none
    n = 5
    # The reference: files in order, broken ones skipped, until n are checked.
    looked_at, checked = [], 0
    for name in val_files:
        if checked == n:
            break
        looked_at.append(name)
        checked += name not in broken
    report = session.cpp_syntax(n, find_compiler(env={}), max_new_tokens=16, context=48, timeout_s=60)
    assert report.cases == checked == n and report.passed + report.failed + report.timed_out == report.cases
    assert report.functions == len(looked_at) and report.skipped == sum(name in broken for name in looked_at)
    assert report.skipped >= 1, "the fixture must plant a broken file among those looked at"
    assert 0.0 <= report.pass_rate <= 1.0


def test_cli_eval_reports_the_pass_rate_beside_bits_per_byte(cpp_run, capsys):
    run, _ = cpp_run
    assert main(["eval", "--checkpoint", str(run), "--batches", "1", "--cpp-syntax", "2", "--cpp-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "validation bits per byte:" in out
    [line] = [line for line in out.splitlines() if line.startswith("C++ syntax pass rate: ")]
    assert " of 2 completed functions compile (" in line and "-fsyntax-only" in line


def test_cli_eval_without_a_compiler_is_one_line(cpp_run, capsys, monkeypatch, tmp_path):
    run, _ = cpp_run
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["eval", "--checkpoint", str(run), "--cpp-syntax", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cpp-syntax needs a C++ compiler" in err and "Traceback" not in err


@pytest.mark.parametrize(("args", "message"), [
    (["--cpp-syntax", "-1"], "--cpp-syntax -1: must be >= 0"),
    (["--cpp-syntax", "1", "--cpp-tokens", "0"], "--cpp-tokens 0: must be >= 1"),
    (["--cpp-syntax", "1", "--cpp-tokens", "64"], "--cpp-tokens 64: must be below the checkpoint's data.seq_len 64"),
    (["--cpp-syntax", "1", "--cpp-timeout", "0"], "--cpp-timeout 0.0: must be a finite number of seconds > 0"),
    (["--cpp-syntax", "1", "--cpp-context", "0"], "--cpp-context 0: must be >= 1"),
])
def test_out_of_range_syntax_check_arguments_are_one_line(cpp_run, capsys, args, message):
    run, _ = cpp_run
    assert main(["eval", "--checkpoint", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cases_come_from_each_file_of_a_repository_document(tmp_path):
    """Joined documents: one case per file, the prompt running from the document's start (earlier files
    included) to the body's brace, the file's own text rebuilt from its span."""
    broken = write_cpp_repository(tmp_path / "corpus", n_files=4)
    corpus = discover_corpus(DataConfig(corpus=[str(tmp_path / "corpus")], documents="repository", val_fraction=0))
    [doc] = corpus.docs
    cases = list(cases_of([doc]))
    assert [c.path.name for c in cases] == ["common.h", "f00.cpp", "f01.cpp", "f02.cpp", "f03.cpp"]
    assert all(c.root == tmp_path / "corpus" for c in cases) and "f03.cpp" in broken
    last = cases[-1]
    assert last.file_text == (tmp_path / "corpus/f03.cpp").read_text()
    # CMakeLists.txt (11 bytes) is below data.min_bytes, so the document starts with the header.
    assert last.prompt.startswith("// file: include/common.h\n") and last.prompt.endswith("int f3_2(int x) {")
