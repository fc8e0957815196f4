"""The data flow is the import direction (memkit/ARCHITECTURE.md, "Layers"): every memkit module
belongs to one layer of base < spec < plan < estimate < {planner, emit} < measure < train <
calibrate < cli, and imports only from its own layer or the layers below, at module level or
inside a function; planner/ and emit/ share a rank and import neither each other. So no layer
imports upward and no two layers import each other in a circle. The pure core - spec/, plan/,
estimate/, planner/, emit/ - never reaches train/, measure/ or cli/, directly or
through another memkit module. Checked on the source with ast (nothing is imported), following
every `memkit.*` import."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "memkit"
# The layers, lowest first; a module is in the layer of its longest matching prefix
# (memkit/ARCHITECTURE.md says what each holds and why a module sits where it does).
LAYERS = (
    ("base", ("memkit", "memkit.errors", "memkit.units", "memkit.fileio", "memkit.presets_dir")),
    ("spec", ("memkit.spec",)),
    ("plan", ("memkit.plan",)),  # the plan/ package: TrainingPlan, split / technique rules, limits, schema
    ("estimate", ("memkit.estimate", "memkit.profile")),
    ("planner", ("memkit.planner",)),
    ("emit", ("memkit.emit",)),
    ("measure", ("memkit.measure",)),
    ("train", ("memkit.train",)),
    ("calibrate", ("memkit.calibrate",)),
    # the faces: the commands, the Python API, the HF callback, the runner's command line
    # (train/main.py: finetune's parser and main, over the loop), flag checks and tools
    ("cli", ("memkit.cli", "memkit.api", "memkit.callback", "memkit.finetune", "memkit.validate", "memkit.plot",
             "memkit.presets_gen", "memkit.train.main")),
)
SAME_RANK = {"planner": "emit", "emit": "planner"}  # {planner, emit}: side by side
CORE = ("memkit.spec", "memkit.plan", "memkit.estimate", "memkit.planner", "memkit.emit")
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


def all_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def layer_of(name: str) -> str:
    matches = [(len(prefix), layer) for layer, prefixes in LAYERS for prefix in prefixes
               if name == prefix or name.startswith(prefix + ".")]
    return max(matches)[1]


RANK = {layer: i for i, (layer, _) in enumerate(LAYERS)}
RANK["emit"] = RANK["planner"]


def test_every_module_has_a_layer():
    # the root package itself is base; every other module matches a longer prefix than 'memkit'
    unplaced = [n for n in all_modules() if n != "memkit" and layer_of(n) == "base"
                and n not in dict(LAYERS)["base"]]
    assert unplaced == []
    assert [layer_of(n) for n in ("memkit.errors", "memkit.spec.hf", "memkit.plan.limits", "memkit.profile",
                                  "memkit.emit.plan_doc", "memkit.train.loop", "memkit.train.main",
                                  "memkit.calibrate.cpu_step", "memkit.api")] == \
        ["base", "spec", "plan", "estimate", "emit", "train", "cli", "calibrate", "cli"]


@pytest.mark.parametrize("name", all_modules())
def test_no_upward_import(name):
    layer = layer_of(name)
    for dep in sorted(imports_of(name)):
        other = layer_of(dep)
        assert RANK[other] <= RANK[layer], f"{name} ({layer}) imports {dep} ({other}), a higher layer"
        assert other != SAME_RANK.get(layer), f"{name} ({layer}) imports {dep} ({other}): side by side, neither imports the other"


def test_the_layers_have_no_circle():
    edges = {(layer_of(n), layer_of(d)) for n in all_modules() for d in imports_of(n) if layer_of(n) != layer_of(d)}
    circles = sorted((a, b) for a, b in edges if (b, a) in edges)
    assert circles == []


def test_the_layers_rank_as_documented():
    # the walk finds the imports the rules are about (cli/ above estimate/, the loop on its signals)
    assert RANK[layer_of("memkit.cli.main")] > RANK[layer_of("memkit.estimate.memory")]
    assert "memkit.estimate.memory" in imports_of("memkit.cli.suggest")
    assert "memkit.train.supervise" in imports_of("memkit.train.loop")


def test_the_core_is_found():
    names = core_modules()
    for expected in ("memkit.plan.parallel", "memkit.plan.plan", "memkit.plan", "memkit.spec.resolve", "memkit.emit.plan_doc",
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
    assert "memkit.plan.parallel" in imports_of("memkit.planner.space")
