"""Every function in numesh/ and cli/ fits on a screen: at most 60 lines.

A function's length is counted from its `def` line to its last line, decorators and
docstring not counted (so documenting a function never pushes it over), with `ast` on the
source. A longer function is split into named steps; the only exceptions are declarative
tables (data written as code, not logic), each listed in ALLOWED with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60
# "path::qualified name" -> why it may be longer (declarative tables only)
ALLOWED: dict[str, str] = {}


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def function_lengths(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function and method in `path`."""
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1 - _docstring_lines(child)))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "")
    return out


def sources() -> list[Path]:
    return sorted([*(ROOT / "numesh").rglob("*.py"), *(ROOT / "cli").rglob("*.py")])


def test_the_walk_finds_the_functions() -> None:
    found = {name for path in sources() for name, _, _ in function_lengths(path)}
    assert {"train", "Trainer.train_step", "diagnose", "_Diagnosis.collective_waits"} <= found


def test_every_function_is_at_most_60_lines() -> None:
    too_long = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        for name, line, n in function_lengths(path):
            if n > MAX_LINES and f"{rel}::{name}" not in ALLOWED:
                too_long.append(f"{rel}:{line} {name}: {n} lines")
    assert not too_long, (f"functions longer than {MAX_LINES} lines (docstrings not counted): split them into "
                          f"named steps, or list a declarative table in ALLOWED with why:\n" + "\n".join(too_long))


def test_the_allowlist_names_only_long_functions_that_exist() -> None:
    """An entry whose function was split or renamed goes, so the list stays short and true."""
    lengths = {f"{path.relative_to(ROOT).as_posix()}::{name}": n
               for path in sources() for name, _, n in function_lengths(path)}
    stale = [key for key in ALLOWED if lengths.get(key, 0) <= MAX_LINES]
    assert not stale, f"ALLOWED entries that are not functions over {MAX_LINES} lines: {stale}"
