"""Source-level rules of the compile contract, checked on the AST of every module under megacpp/."""
from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import megacpp

ROOT = Path(megacpp.__file__).parent


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _where(match: Callable[[ast.AST], bool]) -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if match(node):
                found.append(f"{path.relative_to(ROOT.parent).as_posix()}:{node.lineno}")
    return found


def _reads_torch_version(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "__version__":
        return _dotted(node.value) in ("torch", "torch.version")
    if isinstance(node, ast.ImportFrom) and node.module == "torch":
        return any(alias.name == "__version__" for alias in node.names)
    return False


def _calls_reset(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _dotted(node.func).endswith(("_dynamo.reset", "compiler.reset"))


def _sets_suppress_errors(node: ast.AST) -> bool:
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Attribute) and t.attr == "suppress_errors" for t in targets)
    if isinstance(node, ast.Call):
        literal = [a.value for a in node.args if isinstance(a, ast.Constant)]
        return "suppress_errors" in literal or any(k.arg == "suppress_errors" for k in node.keywords)
    return False


def _uses_disable(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and _dotted(node).endswith(("compiler.disable", "_dynamo.disable"))


def test_torch_version_is_read_only_in_versions_py():
    outside = [h for h in _where(_reads_torch_version) if not h.startswith("megacpp/versions.py:")]
    assert not outside, (
        "torch version read outside the version-gate table; use megacpp.versions.torch_version() "
        f"(and GATES for branches): {outside}"
    )


def test_dynamo_reset_is_called_in_exactly_one_place():
    hits = _where(_calls_reset)
    assert len(hits) == 1 and hits[0].startswith("megacpp/compile/report.py:"), hits


def test_suppress_errors_is_never_set():
    assert not _where(_sets_suppress_errors), "suppress_errors set on a megacpp path"


def test_compiler_disable_is_never_used():
    hits = _where(_uses_disable)
    assert not hits, f"torch.compiler.disable is a graph break on a megacpp path: {hits}"


def test_rules_catch_what_they_claim():
    planted = ast.parse(
        "import torch\n"
        "v = torch.__version__\n"
        "torch._dynamo.reset()\n"
        "torch._dynamo.config.suppress_errors = True\n"
        "f = torch.compiler.disable(print)\n"
    )
    nodes = list(ast.walk(planted))
    for rule in (_reads_torch_version, _calls_reset, _sets_suppress_errors, _uses_disable):
        assert any(rule(n) for n in nodes), rule.__name__
