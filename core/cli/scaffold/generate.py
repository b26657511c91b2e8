"""Validate a new task's name and write its package (all files or none)."""

from __future__ import annotations

import keyword
import shutil
import tempfile
from pathlib import Path

from tk.core.cli.scaffold import templates, templates_classification, templates_seq2seq, templates_tokens
from tk.core.errors import TkError
from tk.core.registry import discover, discover_recipes

KINDS = {
    "classification": templates_classification,
    "tokens": templates_tokens,
    "seq2seq": templates_seq2seq,
}


def check_name(name: str) -> None:
    """Reject a name that is not a lowercase Python identifier or that an installed task
    (or recipe of the generated name) already has.

    Raises:
        TkError: naming the value, the reason and the fix.
    """
    if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
        raise TkError(f"task name {name!r} is not a valid Python identifier (letters, digits, '_', not starting "
                      f"with a digit or '_', not a keyword); e.g. `tk new-task my_tagger`")
    if name != name.lower():
        raise TkError(f"task name {name!r} must be lowercase (it is the recipe's `task:` value and a package "
                      f"name); e.g. {name.lower()!r}")
    tasks = discover()
    if name in tasks:
        raise TkError(f"task name {name!r} is already taken by the installed task of {tasks[name].provider} "
                      f"({tasks[name].value}); choose another name (see `tk list`)")
    recipe = templates.recipe_name(name)
    recipes = discover_recipes()
    if recipe in recipes:
        raise TkError(f"task name {name!r}: its recipe name {recipe!r} is already taken by "
                      f"{recipes[recipe].provider}; choose another name (see `tk list`)")


def render(name: str, kind: str) -> dict[str, str]:
    """The package's files, relative path -> text, for task ``name`` of ``kind``.

    Raises:
        TkError: an unknown kind.
    """
    if kind not in KINDS:
        raise TkError(f"--kind {kind!r} is not one of {', '.join(KINDS)}")
    module = KINDS[kind]
    names = templates.names(name, kind)
    pkg = names["__PKG__"]
    files = {
        "pyproject.toml": templates.PYPROJECT,
        "README.md": templates.README + module.README_EXTRA,
        f"{pkg}/__init__.py": templates.INIT,
        f"{pkg}/data.py": module.DATA,
        f"{pkg}/task.py": module.TASK,
        f"{pkg}/recipes/{names['__RECIPE__']}.yaml": module.RECIPE,
        f"tests/test_{name}.py": templates.TEST.replace("__TEST_HEAD__", module.TEST_HEAD) + module.TEST_EXTRA,
    }
    out = {}
    for path, text in files.items():
        for key, value in names.items():
            text = text.replace(key, value)
        out[path] = text
    return out


def new_task(name: str, parent: str | Path = ".", kind: str = "classification") -> Path:
    """Write the package of a new task into ``<parent>/tk-<name>`` and return that folder.

    Everything is checked before anything is written, and the files are written to a
    temporary folder first and moved into place at the end: an error leaves no files.

    Raises:
        TkError: a bad or taken name, an unknown kind, or an existing target folder.
    """
    check_name(name)
    files = render(name, kind)
    parent = Path(parent).expanduser()
    if parent.exists() and not parent.is_dir():
        raise TkError(f"--dir {parent}: not a folder; pass the folder in which to create the package")
    target = parent / templates.names(name, kind)["__DIST__"]
    if target.exists():
        raise TkError(f"{target} already exists; tk new-task never overwrites: remove it or pass another --dir")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for rel, text in files.items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
