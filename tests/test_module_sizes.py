"""Modules stay under 500 lines and functions under 100, or say why in the allowlist.

A long module usually holds two concepts and a long function several steps that could
be named (STYLE.md). `size_allowlist.toml` lists the exceptions, each with a reason; an
entry that is no longer over its limit fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("adaptipe", "models", "controllers", "envs")
MODULE_LINES = 500
FUNCTION_LINES = 100
ALLOWLIST = Path(__file__).with_name("size_allowlist.toml")


def _files() -> Iterator[tuple[str, str]]:
    """``(path from the repository root, source)`` of every module."""
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """``(qualified name, lines from def to end)`` of every function and method, nested
    ones included (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """Lines of every module, and of every function as ``path:qualified name``."""
    modules: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path, source in _files():
        modules[path] = len(source.splitlines())
        for name, lines in _functions(ast.parse(source, filename=path)):
            functions[f"{path}:{name}"] = lines
    return modules, functions


def _allowlist() -> dict[str, dict[str, str]]:
    with ALLOWLIST.open("rb") as f:
        data = tomllib.load(f)
    assert set(data) <= {"modules", "functions"}, f"{ALLOWLIST.name}: unknown tables {set(data)}"
    return {kind: data.get(kind, {}) for kind in ("modules", "functions")}


def _over(sizes: dict[str, int], limit: int, allowed: dict[str, str]) -> list[str]:
    return [f"{k}: {n} lines" for k, n in sorted(sizes.items()) if n > limit and k not in allowed]


def test_no_module_is_over_500_lines_unless_allowlisted() -> None:
    modules, _ = _sizes()
    over = _over(modules, MODULE_LINES, _allowlist()["modules"])
    assert not over, f"modules over {MODULE_LINES} lines (split by concept):\n" + "\n".join(over)


def test_no_function_is_over_100_lines_unless_allowlisted() -> None:
    _, functions = _sizes()
    over = _over(functions, FUNCTION_LINES, _allowlist()["functions"])
    assert not over, f"functions over {FUNCTION_LINES} lines (name their steps):\n" + "\n".join(
        over
    )


def test_every_allowlisted_entry_is_still_over_its_limit_and_says_why() -> None:
    modules, functions = _sizes()
    allow = _allowlist()
    problems: list[str] = []
    for kind, sizes, limit in (
        ("modules", modules, MODULE_LINES),
        ("functions", functions, FUNCTION_LINES),
    ):
        for key, reason in sorted(allow[kind].items()):
            if key not in sizes:
                problems.append(f"[{kind}] {key}: no such {kind[:-1]}")
            elif sizes[key] <= limit:
                problems.append(f"[{kind}] {key}: {sizes[key]} lines, within {limit}")
            if not isinstance(reason, str) or not reason.strip() or "\n" in reason:
                problems.append(f"[{kind}] {key}: the reason must be one non-empty line")
    assert not problems, f"stale or bad entries in {ALLOWLIST.name}:\n" + "\n".join(problems)
