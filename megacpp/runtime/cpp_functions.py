"""Function bodies in C++ text, found with a brace-matching heuristic (no parser).

1. Blank out what is not code, keeping every offset: comments (``//`` to the end of the line, ``/* */``),
   string and character literals (escapes, prefixes such as ``u8``, raw strings ``R"d( ... )d"``) and
   preprocessor lines (``#`` first on a line, with ``\\`` continuations). A ``'`` inside a number is a
   digit separator (``1'000``), not a character literal.
2. Match braces in what is left. A file whose braces do not balance (typically ``#if`` branches that each
   open a brace) has no functions: its matching would be wrong.
3. A ``{`` opens a function body when it is not inside another function body and the code before it ends
   with ``)``, optionally followed by ``const``, ``volatile``, ``noexcept``/``noexcept(...)``,
   ``override``, ``final``, ``&`` or ``&&``, and the ``)`` closes a ``(`` that follows a name which is no
   keyword (``if``, ``while``, ``switch``...). Constructors with a member initializer list qualify (the
   name is the last member's); lambdas, ``= {`` initializers, classes, namespaces, ``extern "C"`` blocks
   and functions with a trailing return type (``-> T {``) do not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

NOT_FUNCTION_NAMES = frozenset({
    "if", "for", "while", "switch", "catch", "return", "sizeof", "alignof", "alignas", "decltype", "noexcept",
    "static_assert", "throw", "new", "delete", "else", "do", "case", "using", "typedef", "requires",
    "co_return", "co_await", "co_yield", "defined", "__attribute__", "__declspec", "typeid",
})
_TRAILING_QUALIFIER = re.compile(r"(?:\b(?:const|volatile|noexcept|override|final)|&&|&)$")
_IDENTIFIER_END = re.compile(r"(?:operator\s*(?:\(\)|[^\s(]+)|~?[A-Za-z_]\w*)$")
_RAW_STRING = re.compile(r'(?:u8|[uUL])?R"([^()\\\s]{0,16})\(')


@dataclass(frozen=True)
class FunctionBody:
    name: str
    open: int  # offset of the body's "{"
    close: int  # offset of its matching "}"


def _is_identifier_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _number_continues(text: str, quote: int) -> bool:
    """Whether the ' at `quote` separates digits: the token it ends starts with a digit."""
    i = quote
    while i > 0 and (_is_identifier_char(text[i - 1]) or text[i - 1] in ".'"):
        i -= 1
    return i < quote and text[i].isdigit()


def _end_of_literal(text: str, start: int, quote: str) -> int:
    """Offset past the string or character literal whose opening quote is at `start` (or the line's end
    for an unterminated one)."""
    i = start + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == quote:
            return i + 1
        if ch == "\n":
            return i
        i += 1
    return len(text)


def _end_of_line(text: str, start: int, continued: bool) -> int:
    """Offset of the newline ending the line at `start`; with `continued`, backslash-newlines join lines."""
    i = start
    while True:
        end = text.find("\n", i)
        if end == -1:
            return len(text)
        if continued and text[i:end].rstrip("\r").endswith("\\"):
            i = end + 1
            continue
        return end


def code_only(text: str) -> str:
    """`text` with comments, literals and preprocessor lines replaced by blanks (newlines kept), so that
    every offset still points at the same character of `text`."""
    out = list(text)

    def blank(lo: int, hi: int) -> None:
        for j in range(lo, hi):
            if out[j] != "\n":
                out[j] = " "

    i, line_start = 0, True
    while i < len(text):
        ch = text[i]
        if ch == "\n":
            i, line_start = i + 1, True
            continue
        if ch in " \t\r\f\v":
            i += 1
            continue
        if line_start and ch == "#":
            end = _end_of_line(text, i, continued=True)
        elif text.startswith("//", i):
            end = _end_of_line(text, i, continued=True)
        elif text.startswith("/*", i):
            close = text.find("*/", i + 2)
            end = len(text) if close == -1 else close + 2
        elif ch in "uULR" and (i == 0 or not _is_identifier_char(text[i - 1])) and (raw := _RAW_STRING.match(text, i)):
            close = text.find(f"){raw.group(1)}\"", raw.end())
            end = len(text) if close == -1 else close + len(raw.group(1)) + 2
        elif ch == '"' or (ch == "'" and not _number_continues(text, i)):
            end = _end_of_literal(text, i, ch)
        else:
            i, line_start = i + 1, False
            continue
        blank(i, end)
        i, line_start = end, False
    return "".join(out)


def _matching_braces(code: str) -> dict[int, int] | None:
    """open offset -> close offset of every brace pair; None when the braces do not balance."""
    pairs, stack = {}, []
    for i, ch in enumerate(code):
        if ch == "{":
            stack.append(i)
        elif ch == "}":
            if not stack:
                return None
            pairs[stack.pop()] = i
    return pairs if not stack else None


def _strip_qualifiers(code: str, end: int) -> int:
    """Offset just past the code before `end` once trailing function qualifiers are removed."""
    while True:
        stripped = code[:end].rstrip()
        end = len(stripped)
        qualifier = _TRAILING_QUALIFIER.search(stripped)
        if qualifier is not None:
            end = qualifier.start()
            continue
        if stripped.endswith(")"):  # noexcept(...): the group after "noexcept"
            open_paren = _matching_open_paren(code, end - 1)
            if open_paren is not None and re.search(r"\bnoexcept\s*$", code[:open_paren]):
                end = code[:open_paren].rstrip().rfind("noexcept")
                continue
        return end


def _matching_open_paren(code: str, close: int) -> int | None:
    depth = 0
    for i in range(close, -1, -1):
        if code[i] == ")":
            depth += 1
        elif code[i] == "(":
            depth -= 1
            if depth == 0:
                return i
        elif code[i] in "{};":
            return None
    return None


def _function_name(code: str, brace: int) -> str | None:
    """The name whose parameter list ends right before the "{" at `brace` (qualifiers aside), or None."""
    end = _strip_qualifiers(code, brace)
    if end == 0 or code[end - 1] != ")":
        return None
    open_paren = _matching_open_paren(code, end - 1)
    if open_paren is None:
        return None
    match = _IDENTIFIER_END.search(code[max(0, open_paren - 200):open_paren].rstrip())
    if match is None or match.group(0) in NOT_FUNCTION_NAMES:
        return None
    return match.group(0)


def find_functions(text: str) -> list[FunctionBody]:
    """The outermost function bodies of C++ `text` (one inside another is part of it), in order."""
    code = code_only(text)
    pairs = _matching_braces(code)
    if pairs is None:
        return []
    found: list[FunctionBody] = []
    inside_until = -1  # the close of the function body we are in
    for open_brace in sorted(pairs):
        if open_brace < inside_until:
            continue
        name = _function_name(code, open_brace)
        if name is not None:
            found.append(FunctionBody(name, open_brace, pairs[open_brace]))
            inside_until = pairs[open_brace]
    return found


def body_end(completion: str) -> int | None:
    """Offset just past the "}" that closes a body whose "{" comes right before `completion`, or None
    while it is still open. Braces in comments and literals do not count."""
    depth = 0
    for i, ch in enumerate(code_only(completion)):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return i + 1
    return None
