"""The package's import graph, read from the source (AST, imports inside functions included): no circle, the
run-config schema on the lowest floors (it imports only leaves, so a config is checked before anything loads), the
run's I/O (llds_jax.runtime) a leaf package, the pod tools (llds_jax.aot) on top of the library, and few modules left
at the top level of the package."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "llds_jax"


def _modules() -> dict[str, str]:
    """Module name -> file of every module of the package."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = path
    return modules


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package's modules that `module` imports anywhere in its file (a package stands for its __init__)."""
    is_package = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_reader_finds_a_circle_and_each_kind_of_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    modules = {"llds_jax", "llds_jax.rl", "llds_jax.rl.terms", "llds_jax.rl.llds", "llds_jax.config"}
    path = os.path.join(ROOT, "llds_jax", "rl", "llds.py")
    found = _imports("llds_jax.rl.llds", path, dict.fromkeys(modules, path))
    assert "llds_jax.rl.terms" in found  # llds registers itself as a loss term


def test_no_import_circle_in_the_package(graph):
    assert _circles(graph) == []


def _floor(graph: dict[str, set[str]], module: str) -> int:
    """0 for a leaf (it imports nothing of the package), else 1 + the highest floor it imports (no circle: above)."""
    return 1 + max((_floor(graph, m) for m in graph[module]), default=-1)


def test_config_is_on_the_lowest_floors(graph):
    """llds_jax.config sits on the fourth floor at most: the leaf llds_jax.errors (the error types), llds_jax.bounds
    and the topology catalogue above it alone, the reward's rules (llds_jax.data.rewards) above bounds, the
    declarations (llds_jax.config.sections) above those, so that a config is checked before anything heavy
    loads."""
    assert _floor(graph, "llds_jax.errors") == 0
    assert graph["llds_jax.topologies"] == graph["llds_jax.bounds"] == {"llds_jax.errors"}
    assert _floor(graph, "llds_jax.config.sections") <= 3
    assert _floor(graph, "llds_jax.config") <= 4, {m: _floor(graph, m) for m in graph["llds_jax.config"]}


def _package(module: str) -> str:
    """The node of `module` in the package-level graph: its package of llds_jax, or itself at the top level."""
    return ".".join(module.split(".")[:2])


def test_no_package_imports_upward(graph):
    """Read with each package of llds_jax (rollout, data, sft, aot, runtime, ...) and each top-level module as one
    node, the graph has no circle either: no module imports a package that imports, directly or not, its own package
    (the shared leaves, protocol.py, programs.py, topologies.py and bounds.py, sit at the top level)."""
    packages = {_package(m): set() for m in graph}
    for module, imports in graph.items():
        packages[_package(module)] |= {_package(i) for i in imports} - {_package(module)}
    assert _circles(packages) == []


def test_the_runs_io_is_a_leaf_package(graph):
    """llds_jax.runtime (storage, lease, output folders, gs://, redaction, multi-host start-up) imports nothing of
    llds_jax but the error types and its own modules, so the config schema and every layer above may use it."""
    runtime = {m for m in graph if _package(m) == "llds_jax.runtime"}
    assert "llds_jax.runtime.storage" in runtime and "llds_jax.runtime.redaction" in runtime
    outside = {m: graph[m] - runtime - {"llds_jax.errors"} for m in runtime}
    assert {m: i for m, i in outside.items() if i} == {}


def test_the_pod_tools_sit_on_top_of_the_library(graph):
    """llds_jax.aot (--mode=compile, the roofline and the step estimate) is reached only through the launcher: no
    module of the library imports it, and it imports neither the launcher nor an application."""
    aot = {m for m in graph if _package(m) == "llds_jax.aot"}
    assert "llds_jax.aot.compile_check" in aot and "llds_jax.aot.roofline" in aot
    importers = {m for m in graph if m not in aot and graph[m] & aot}
    assert importers == {"llds_jax.launch"}
    assert {i for m in aot for i in graph[m] if i == "llds_jax.launch" or _package(i) == "llds_jax.apps"} == set()


def test_few_modules_at_the_top_level():
    """The top of llds_jax/ holds the entry point, the config and the leaves several packages share, at most 12
    modules; a subsystem of several modules is a package (docs/architecture.md lists them all)."""
    top = [name for name in os.listdir(os.path.join(ROOT, PACKAGE)) if name.endswith(".py") and name != "__init__.py"]
    assert len(top) <= 12, sorted(top)
