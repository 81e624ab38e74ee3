"""The house's layering, read from the source: no import cycle among xpress modules (imports inside
functions and under ``TYPE_CHECKING`` count: they are cycles all the same), and the model modules (drafter,
heads, jacobi) never reach the engine (decoding), the target's callers, training or the studies."""
from __future__ import annotations

import ast
from pathlib import Path

from xpress import paths

PACKAGE = paths.REPO_ROOT / "xpress"
MODELS = ("xpress.drafter", "xpress.heads", "xpress.jacobi")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(paths.REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every xpress module -> the xpress modules it imports anywhere in its source (``from . import x`` names
    the module ``x`` where it is one, else the package)."""
    files = {module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_no_import_cycle():
    graph = import_graph()
    assert {"xpress.drafter", "xpress.targets", "xpress.rehearsal", "xpress.studies.latency"} <= set(graph)
    assert cycles(graph) == []


def test_models_do_not_reach_the_engine_the_targets_callers_training_or_the_studies():
    graph = import_graph()
    callers = {m for m, imported in graph.items() if "xpress.targets" in imported}
    above = {m for m in graph if m.startswith(("xpress.train", "xpress.studies"))}
    forbidden = {"xpress.decoding"} | callers | above
    assert {"xpress.decoding", "xpress.rehearsal", "xpress.methods"} <= forbidden  # the rule has teeth
    for model in MODELS:
        assert not reach(graph, model) & forbidden, (model, sorted(reach(graph, model) & forbidden))


def test_the_checks_catch_a_cycle_and_a_function_level_import(tmp_path, monkeypatch):
    """The graph sees an import inside a function and a relative ``from . import``; a circle is found."""
    pkg = tmp_path / "xpress"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text("from . import a\n\ndef g():\n    return a\n")
    (pkg / "c.py").write_text("import xpress.a\n")
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path)
    graph = import_graph(pkg)
    assert graph["xpress.a"] == {"xpress.b"} and graph["xpress.b"] == {"xpress.a"} and graph["xpress.c"] == {"xpress.a"}
    assert cycles(graph) == [["xpress.a", "xpress.b"]]
