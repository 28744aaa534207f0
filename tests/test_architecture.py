"""The package's import graph, built from the source (ast, every import statement, function-level ones included):
no cycles between modules, and each layer imports only the layers below it (docs/architecture.md).

Every violation is listed with its file and line; those in engine/, kernels/ or server/ are marked engine-side."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "evalpipe"

# Layer -> the layers it may import. "shared" are the few modules every layer uses (the version, the one
# redaction rule, the volatile-field list, the console).
SHARED = {"evalpipe", "evalpipe.redact", "evalpipe.volatile", "evalpipe.console", "evalpipe.digest"}
ALLOWED = {
    "shared": {"shared"},
    "kernels": {"kernels"},  # nothing else from the project
    "engine": {"engine", "kernels", "shared"},
    "server": {"server", "engine", "kernels", "shared"},
    "skills": {"skills"},
    "lanes": {"lanes", "skills", "shared"},
    "harness": {"harness", "lanes", "skills", "shared"},
    "compare": {"compare", "harness", "lanes", "shared"},
    "launchers": {"launchers", "harness", "engine", "shared"},  # the native launcher checks flags by the engine's rules
    "ab": {"ab", "compare", "harness", "lanes", "launchers", "shared"},
    "qualify": {"qualify", "harness", "lanes", "skills", "shared"},  # gates against an endpoint, through the harness
    "commands": {
        "commands",
        "ab",
        "compare",
        "qualify",
        "harness",
        "lanes",
        "launchers",
        "server",
        "engine",
        "skills",
        "shared",
    },
    "cli": {"shared"},  # it finds the commands by name (importlib), so nothing imports evalpipe.commands
}
ENGINE_SIDE = {"engine", "kernels", "server"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    if module in SHARED:
        return "shared"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "shared"


def import_graph() -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported project module, line)], for every import statement in its source."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, list[tuple[str, int]]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = graph.setdefault(name, [])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package, up level - 1
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            edges += [(t, node.lineno) for t in targets if t in files and t != name]
    return graph


def where(module: str, line: int) -> str:
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    return f"{path.relative_to(PACKAGE.parent)}:{line}"


def side(module: str) -> str:
    return "engine-side" if layer(module) in ENGINE_SIDE else "harness-side"


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_it_must():
    """The checks below are only as good as the graph: it holds function-level and relative imports."""
    graph = import_graph()
    assert any(t == "evalpipe.harness.client" for t, _ in graph["evalpipe.harness.lane_run"])
    assert any(t == "evalpipe.harness.records" for t, _ in graph["evalpipe.commands.audit"])  # inside the function
    assert any(t == "evalpipe.engine.spec.settings" for t, _ in graph["evalpipe.launchers.rules"])  # inside a method
    assert {layer(m) for m in graph} >= {"engine", "kernels", "server", "harness", "lanes", "compare", "ab", "commands"}


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": [("b", 1)], "b": [("c", 2)], "c": [("a", 3)], "d": [("a", 4)], "e": []}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    problems = []
    for component in cycles(graph):
        members = set(component)
        edges = [f"{m} -> {t} ({where(m, line)})" for m in component for t, line in graph[m] if t in members]
        problems.append(f"{side(component[0])} cycle {component}:\n    " + "\n    ".join(edges))
    assert not problems, "\n".join(problems)


def test_each_layer_imports_only_the_layers_below_it():
    """engine, kernels and server import nothing from the harness; kernels nothing else from the project; nothing
    imports evalpipe.commands; the harness never imports compare, ab or the commands, compare never ab."""
    graph = import_graph()
    problems = sorted(
        f"{side(m)}: {m} ({layer(m)}) imports {t} ({layer(t)}) at {where(m, line)}"
        for m, edges in graph.items()
        for t, line in edges
        if layer(t) not in ALLOWED.get(layer(m), set())
    )
    assert not problems, "layer violations:\n  " + "\n  ".join(problems)


def test_every_module_belongs_to_a_layer():
    graph = import_graph()
    assert not [m for m in graph if layer(m) not in ALLOWED], "add new packages to ALLOWED"


TESTS = PACKAGE.parent / "tests"


def test_tests_mirror_the_packages_and_helpers_sit_in_support():
    """docs/architecture.md: test files live in a folder named after what they test (a package of evalpipe, or
    benchmarks, training, interop); only this file sits at the top; every module that is not a test is in
    tests/support (conftest.py files aside)."""
    flat = sorted(p.name for p in TESTS.glob("test_*.py") if p.name != "test_architecture.py")
    assert not flat, f"test files at the top of tests/: {flat}"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in ("support", "__pycache__")}
    assert folders <= packages | {"shared", "benchmarks", "training", "interop"}, folders - packages
    helpers = sorted(
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("*.py")
        if not p.name.startswith("test_") and p.name != "conftest.py" and p.parent.name != "support"
    )
    assert not helpers, f"helpers outside tests/support: {helpers}"
    testless = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if "def test_" not in p.read_text())
    assert not testless, f"test files that hold no test: {testless}"
