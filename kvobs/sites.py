"""Where an exception was raised, as the release's own source says: file, function, line, expression.

Pure (no vLLM import): the glue hands it the traceback and the installed package's directory
(kvobs/vllm/boundary.py). The source is read with :mod:`linecache`, the text Python itself shows in
tracebacks, and parsed with :mod:`ast` to take a statement that spans lines whole (an ``assert``'s
test, a call over several lines); nothing is evaluated. Bounded: at most ``MAX_SOURCE_BYTES`` of a
file are parsed and ``MAX_EXPRESSION`` characters kept.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
from dataclasses import dataclass
from types import TracebackType

MAX_EXPRESSION = 500
"""Characters of an expression a site keeps (a report and a span carry it)."""
MAX_SOURCE_BYTES = 4 * 2**20
"""Larger files are not parsed: the site keeps the one line."""
MAX_LABEL = 64
"""A site's label fits a short label of the wire (``kvobs.wire.format.MAX_SHORT_LABEL``)."""


@dataclass(frozen=True, slots=True)
class Site:
    """One frame of a traceback, as its source has it."""

    file: str
    """Relative to the package's directory (posix separators) for a site inside it, else the file's name."""
    function: str
    line: int
    expression: str
    """An ``assert``'s test, else the whole statement that was running ("" when the source is unavailable)."""
    statement: str
    """``assert`` for an assert statement, else the statement's kind (``Expr``, ``Return``, ``Assign``, ...)."""

    def to_json(self) -> dict[str, object]:
        return {"file": self.file, "function": self.function, "line": self.line,
                "expression": self.expression, "statement": self.statement}

    def label(self, room: int = MAX_LABEL) -> str:
        """``file:function`` in at most ``room`` characters: the file's leading directories go first
        (``offloading/scheduler.py:_build_store_jobs``), then the file name's head; the function stays whole
        unless it alone is longer."""
        parts = self.file.split("/")
        while len(parts) > 1 and len("/".join(parts)) + 1 + len(self.function) > room:
            parts = parts[1:]
        file = "/".join(parts)
        keep = max(0, room - 1 - len(self.function))  # a long name keeps its function whole, its file's tail
        return f"{file[max(0, len(file) - keep):] if keep else ''}:{self.function}"[:room]


def frames(tb: TracebackType | None) -> list[tuple[str, str, int]]:
    """(file, function, line) of each frame of ``tb``, outermost first."""
    out = []
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append((code.co_filename, code.co_name, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _inside(path: str, root: str) -> bool:
    return bool(root) and os.path.normcase(os.path.abspath(path)).startswith(os.path.normcase(root) + os.sep)


def sites_of(exc: BaseException, root: str) -> tuple[Site | None, Site | None]:
    """(the innermost frame inside ``root``, the innermost frame of all where that is another one).

    ``root``: the package's directory (vLLM's). The first is the report's site; the second says where the
    exception was raised when that was outside the package (kvobs's code, a plugin, a test's injection)."""
    stack = frames(exc.__traceback__)
    inner = next((f for f in reversed(stack) if _inside(f[0], root)), None)
    site = None if inner is None else site_at(*inner, root=root)
    raised = None
    if stack and stack[-1] != inner:
        raised = site_at(*stack[-1], root=root)
    return site, raised


def site_at(path: str, function: str, line: int, root: str = "") -> Site:
    """The site of one frame; never raises for a file it cannot read (expression "")."""
    name = os.path.relpath(path, root).replace(os.sep, "/") if _inside(path, root) else os.path.basename(path)
    try:
        statement, expression = _statement(path, line)
    except Exception:  # noqa: BLE001 - any source kvobs cannot read or parse: the line alone, never a fault
        statement, expression = "", linecache.getline(path, line).strip()
    return Site(name, function, line, expression[:MAX_EXPRESSION], statement)


def _statement(path: str, line: int) -> tuple[str, str]:
    """(kind, text) of the innermost statement at ``line``: an assert's test, a simple statement whole,
    a compound statement's header line only."""
    lines = linecache.getlines(path)
    if not lines:
        return "", ""
    source = "".join(lines)
    tree = _parse(path, source) if len(source) <= MAX_SOURCE_BYTES else None
    if tree is None:
        return "", lines[line - 1].strip() if 0 < line <= len(lines) else ""
    best: ast.stmt | None = None
    for node in ast.walk(tree):
        if (isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno)
                and (best is None or (node.lineno, -(node.end_lineno or 0)) > (best.lineno, -(best.end_lineno or 0)))):
            best = node
    if best is None:
        return "", lines[line - 1].strip() if 0 < line <= len(lines) else ""
    if isinstance(best, ast.Assert):
        return "assert", ast.get_source_segment(source, best.test) or ""
    if hasattr(best, "body"):  # compound: its header, not its body
        return type(best).__name__, lines[line - 1].strip() if 0 < line <= len(lines) else ""
    text = ast.get_source_segment(source, best) or ""
    return type(best).__name__, " ".join(part.strip() for part in text.splitlines())


@functools.lru_cache(maxsize=8)
def _parse_cached(path: str, source: str) -> ast.Module | None:
    try:
        return ast.parse(source, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _parse(path: str, source: str) -> ast.Module | None:
    return _parse_cached(path, source)
