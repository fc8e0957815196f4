"""No function in memkit/estimate/ or memkit/planner/ is over 80 lines (memkit/ARCHITECTURE.md, "Small pieces"):
checked on the source with ast, docstrings and comments included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ESTIMATE = Path(__file__).resolve().parents[2] / "memkit" / "estimate"
PLANNER = ESTIMATE.parent / "planner"
MAX_LINES = 80


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("path", sorted([*ESTIMATE.glob("*.py"), *PLANNER.glob("*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_function_over_80_lines(path):
    long = [(name, n) for name, n in functions(path) if n > MAX_LINES]
    assert long == []


def test_the_walk_counts_lines():
    sizes = dict(functions(ESTIMATE / "memory.py"))
    assert 20 < sizes["_stage"] <= MAX_LINES and "_PhaseWalk" not in sizes  # a class is not a function
