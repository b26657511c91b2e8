"""The layers of tk.core, checked by walking every module's imports (module-level and the
lazy ones inside functions): the contract, config, model parts, data and text never reach
into the engine or the command line, core has no import cycle, and plugins use the engine
only through the finished-run API (``tk.core.engine.inference``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "core"
PLUGINS = REPO / "plugins"
MAX_LINES = 400
PLUGIN_ENGINE_API = {"tk.core.engine.inference"}  # load_run, evaluate_run, predict_run


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = [*package.split("."), *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    return {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
            and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
            for stmt in block.body for node in ast.walk(stmt)}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The ``tk.*`` modules ``path`` imports, anywhere in the file but under ``if TYPE_CHECKING:``
    (``from a import b`` counts as ``a.b`` when that is a module)."""
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tk."):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tk."))
    return found


def _core_graph() -> dict[str, set[str]]:
    modules = {_module_name(p, CORE, "tk.core"): p for p in CORE.rglob("*.py")}
    return {m: {d for d in _imports(p, set(modules)) if d in modules and d != m} for m, p in modules.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in ("engine", "cli") else "base"


def test_below_the_engine_nothing_imports_the_engine_or_the_cli():
    graph = _core_graph()
    assert "tk.core.task" in graph and "tk.core.nn.attention" in graph  # the walk found the tree
    wrong = {m: sorted(d for d in deps if _layer(d) in ("engine", "cli"))
             for m, deps in graph.items() if _layer(m) == "base"}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_the_engine_does_not_import_the_cli():
    graph = _core_graph()
    wrong = {m: sorted(d for d in deps if _layer(d) == "cli") for m, deps in graph.items() if _layer(m) == "engine"}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_core_has_no_import_cycle():
    graph, state, cycles = _core_graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_plugins_use_the_engine_only_to_load_finished_runs():
    modules = {_module_name(p, PLUGINS, "tk.plugins") for p in PLUGINS.rglob("*.py")}
    wrong = {}
    for path in PLUGINS.rglob("*.py"):
        engine = {d for d in _imports(path, modules) if d.startswith("tk.core.engine")} - PLUGIN_ENGINE_API
        if engine:
            wrong[str(path.relative_to(REPO))] = sorted(engine)
    assert wrong == {}


@pytest.mark.parametrize("root", [CORE, PLUGINS], ids=["core", "plugins"])
def test_no_module_over_the_line_limit(root):
    long = {str(p.relative_to(REPO)): n for p in root.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules (limit {MAX_LINES} lines)"
