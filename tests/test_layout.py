"""The folder layout is the data flow: each stage imports only the stages below it, and no module
imports itself back through others (function-level imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tuner"

# Lowest first. A module may import its own stage and the stages before it, never one after.
STAGES = ["errors", "limits", "paths", "model", "engine", "machine", "profile", "search", "report", "cli"]
# Modules outside the stages: the package's front door and the public test helpers sit on top.
TOP = {"tuner", "tuner.__main__", "tuner.testing"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{a.name}" for a in node.names] + [stem]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            # the longest known module that the target names
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("tuner"):
                found.add(target)
    return found


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if module in TOP or len(parts) < 2:
        return None
    return STAGES.index(parts[1])


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_belongs_to_a_stage():
    for name in _modules():
        if name not in TOP and name != "tuner":
            assert name.split(".")[1] in STAGES, f"{name}: add its stage to STAGES, in data-flow order"


def test_nothing_imports_upward():
    bad = []
    for name, targets in _graph().items():
        mine = _stage(name)
        if mine is None:
            continue
        for target in targets:
            theirs = _stage(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{name} imports {target}")
    assert bad == []


def test_no_import_circle():
    graph = _graph()
    # package __init__ files re-export what is below them: they are not part of any circle's logic
    graph = {k: {t for t in v if not graph.get(t) or t.count(".") > 1 or t == "tuner"} for k, v in graph.items()}
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == "tuner" or nxt in TOP:
                continue
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert circles == []
