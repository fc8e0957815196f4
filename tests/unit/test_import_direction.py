"""The data flow is the import direction (STYLE.md): the pure core - spec/, plan.py, parallel.py,
estimate/, planner/, emit/ - never imports train/, measure/ or cli/, directly or through another
memkit module, at module level or inside a function. Checked on the source with ast (nothing is
imported), following every `memkit.*` import transitively within the package."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "memkit"
CORE = ("memkit.spec", "memkit.plan", "memkit.parallel", "memkit.estimate", "memkit.planner", "memkit.emit")
FORBIDDEN = ("memkit.train", "memkit.measure", "memkit.cli")


def module_file(name: str) -> Path | None:
    rel = Path(*name.split("."))
    for candidate in (PACKAGE.parent / rel.with_suffix(".py"), PACKAGE.parent / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of(name: str) -> set[str]:
    """memkit modules `name` imports anywhere in its source (`from memkit.x import y` counts
    memkit.x, and memkit.x.y when that is a module)."""
    path = module_file(name)
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "memkit")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.split(".")[0] != "memkit":
                continue
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names if module_file(f"{target}.{a.name}"))
    return {m for m in out if module_file(m)}


def core_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name.startswith(CORE):
            names.append(name)
    return names


def test_the_core_is_found():
    names = core_modules()
    for expected in ("memkit.parallel", "memkit.plan", "memkit.spec.resolve", "memkit.emit.plan_doc",
                     "memkit.planner.search", "memkit.estimate.memory"):
        assert expected in names


@pytest.mark.parametrize("start", core_modules())
def test_core_never_reaches_train_measure_or_cli(start):
    seen, chain, todo = {start}, {start: [start]}, [start]
    while todo:
        current = todo.pop()
        for dep in imports_of(current):
            if dep.startswith(FORBIDDEN):
                pytest.fail(" -> ".join(chain[current] + [dep]))
            if dep not in seen:
                seen.add(dep)
                chain[dep] = chain[current] + [dep]
                todo.append(dep)


def test_the_walk_sees_function_level_imports():
    # memkit.train.config imports memkit.emit.plan_doc inside read_plan_file only.
    assert "memkit.emit.plan_doc" in imports_of("memkit.train.config")
    assert "memkit.parallel" in imports_of("memkit.planner.space")
