"""The size limits a newcomer can rely on (docs/testing.md): no module over 500 lines, no function
over 60, no class over 25 methods, in the package and in bench/. A unit that outgrows one is split
along a seam of its own (one job per module or class), not trimmed to pass."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_METHODS = 500, 60, 25


def over_limits(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if methods > MAX_METHODS:
                    found.append(f"{name}:{node.lineno} {node.name}: {methods} methods")
    return found


@pytest.mark.parametrize("folder", ["src/onlinespec", "bench"])
def test_no_module_function_or_class_past_its_limit(folder):
    assert over_limits(ROOT / folder) == []
