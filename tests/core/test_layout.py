"""The layers of tk.core, checked by walking every module's imports (module-level, the lazy
ones inside functions and those under ``if TYPE_CHECKING:``). From the bottom up:

    base      the contract, config, model parts (nn/), data/, text/, errors, metrics, ...
    run       the run folder: marker, checkpoints, RNG states, shards, logs, curves
    exchange  models in and out: pretrained sources, export formats, weight mappings
    training  the parts of the loop: assembly, batches, update, precision, EMA, parallel, ...
    engine    runs from start to use: the Trainer, launch, the finished-run API, predict, export
    cli       the ``tk`` command
    testing   checks for plugins' own tests (``tk.core.testing``): runs through every layer, cli included

A module imports only its own layer and those below it (``exchange`` and ``training``
are side by side: neither imports the other); core has no import cycle; plugins use core's
base layers, ``exchange`` and, of the engine, only the finished-run API
(``tk.core.engine.inference``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "core"
PLUGINS = REPO / "plugins"
MAX_LINES = 400
MAX_MODULES = 15  # per folder, __init__.py not counted
PLUGIN_ENGINE_API = {"tk.core.engine.inference"}  # load_run, evaluate_run, predict_run, pretrained sources
# what each layer may import (every layer also imports itself)
MAY_IMPORT = {
    "base": set(),
    "run": {"base"},
    "exchange": {"base", "run"},
    "training": {"base", "run"},
    "engine": {"base", "run", "exchange", "training"},
    "cli": {"base", "run", "exchange", "training", "engine"},
    "testing": {"base", "run", "exchange", "training", "engine", "cli"},  # core/testing.py, a module
}
PLUGINS_MAY_IMPORT = {"base", "exchange"}  # plus PLUGIN_ENGINE_API


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = [*package.split("."), *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The ``tk.*`` modules ``path`` imports, anywhere in the file (``from a import b``
    counts as ``a.b`` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
    return parts[2] if len(parts) > 2 and parts[2] in MAY_IMPORT else "base"


def _upward_arrows(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module's imports of a layer it may not import."""
    wrong = {m: sorted(d for d in deps if _layer(d) != _layer(m) and _layer(d) not in MAY_IMPORT[_layer(m)])
             for m, deps in graph.items()}
    return {m: d for m, d in wrong.items() if d}


def test_the_layers_are_the_subpackages_the_docstring_names():
    graph = _core_graph()
    assert "tk.core.task" in graph and "tk.core.nn.attention" in graph  # the walk found the tree
    layers = {_layer(m) for m in graph}
    assert layers == set(MAY_IMPORT)
    for name in set(MAY_IMPORT) - {"base", "cli", "testing"}:  # each says what it holds and what it may import
        doc = ast.get_docstring(ast.parse((CORE / name / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "May import" in doc, name


def test_no_import_runs_back_up_a_layer():
    assert _upward_arrows(_core_graph()) == {}


def test_the_layer_check_catches_an_arrow_back_up():
    graph = {"tk.core.run.checkpoint": {"tk.core.training.rng", "tk.core.errors"},
             "tk.core.exchange.export": {"tk.core.training.parallel", "tk.core.run.atomic"},
             "tk.core.training.build": {"tk.core.exchange.export"},
             "tk.core.nn.vit": {"tk.core.cli.main"},
             "tk.core.engine.train": {"tk.core.training.update", "tk.core.exchange.export", "tk.core.run.shards"}}
    assert _upward_arrows(graph) == {"tk.core.run.checkpoint": ["tk.core.training.rng"],
                                     "tk.core.exchange.export": ["tk.core.training.parallel"],
                                     "tk.core.training.build": ["tk.core.exchange.export"],
                                     "tk.core.nn.vit": ["tk.core.cli.main"]}


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
        core = {d for d in _imports(path, modules) if d.startswith("tk.core.")}
        bad = {d for d in core - PLUGIN_ENGINE_API if _layer(d) not in PLUGINS_MAY_IMPORT}
        if bad:
            wrong[str(path.relative_to(REPO))] = sorted(bad)
    assert wrong == {}


def test_no_folder_in_core_holds_more_than_fifteen_modules():
    crowded = {str(d.relative_to(REPO)): n for d in [CORE, *CORE.rglob("*")] if d.is_dir()
               and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES}
    assert crowded == {}


@pytest.mark.parametrize("root", [CORE, PLUGINS], ids=["core", "plugins"])
def test_no_module_over_the_line_limit(root):
    long = {str(p.relative_to(REPO)): n for p in root.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules (limit {MAX_LINES} lines)"
