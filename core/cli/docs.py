"""Config documentation read from the code: each dataclass field's one-line doc, type and
default, for ``tk info`` and the test that every built-in option is documented.

A field's doc is its ``field(metadata={"doc": ...})`` entry or, as STYLE.md asks for every
field, the trailing ``# comment`` on its line in the class that defines it (so inherited
fields keep the comment of their base class).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["KeyDoc", "field_docs", "format_default", "section_keys", "type_label"]


@dataclass
class KeyDoc:
    """One recipe key of a section, as ``tk info`` shows it."""

    key: str  # dotted path inside the section, e.g. "transformer.dim" for a nested dataclass
    type: str  # the annotation, readable: "int | None", "'pad' | 'rrc'"
    default: Any  # the default value (plain data); MISSING_DEFAULT when the key is required
    doc: str  # one-line description ("" when the field has none)

    def to_dict(self) -> dict[str, Any]:
        default = None if self.default is MISSING_DEFAULT else _plain(self.default)
        return {"key": self.key, "type": self.type, "default": default,
                "required": self.default is MISSING_DEFAULT, "doc": self.doc}


MISSING_DEFAULT = dataclasses.MISSING


@functools.cache
def _own_comments(cls: type) -> dict[str, str]:
    """Trailing ``# comments`` of the fields ``cls`` itself annotates (not inherited ones)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # defined in a REPL or exec'd string: no source to read
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    class_def = ast.parse(source).body[0]
    out: dict[str, str] = {}
    for node in getattr(class_def, "body", []):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            # a field spread over several lines carries its comment on the last (or first) one
            doc = comments.get(node.end_lineno) or comments.get(node.lineno) or ""
            out[node.target.id] = doc
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> one-line doc for a dataclass, inherited fields included.

    Args:
        cls: a dataclass type.

    Returns:
        Every field of ``cls``, mapped to its ``metadata["doc"]`` or its trailing comment in
        the class that defines it (a subclass that re-declares a field wins); ``""`` if none.
    """
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update({k: v for k, v in _own_comments(klass).items() if v})
    return {f.name: str(f.metadata.get("doc") or comments.get(f.name, "")) for f in dataclasses.fields(cls)}


def type_label(tp: Any) -> str:
    """A readable annotation: ``int | None``, ``'pad' | 'rrc'``, ``list[float]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_label(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_label(a) for a in args)}]" if args else name
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _plain(value: Any) -> Any:
    """A default as plain data (for JSON and display)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def format_default(value: Any) -> str:
    """A default as it would be written in a recipe: ``null``, ``true``, ``"pad"``, ``0.0001``."""
    if value is MISSING_DEFAULT:
        return "(required)"
    try:
        return json.dumps(_plain(value))
    except (TypeError, ValueError):
        return repr(value)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING_DEFAULT


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass a field holds (``Config`` or ``Config | None``), else None."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return _dataclass_in(inner[0])
    return None


def section_keys(cls: type, prefix: str = "", defaults: Any = None) -> list[KeyDoc]:
    """Every recipe key of a section dataclass, nested dataclasses flattened to dotted keys.

    Args:
        cls: the section's dataclass.
        prefix: key prefix for nested sections (``"transformer."``).
        defaults: an instance whose values are the defaults (a nested field's
            ``default_factory`` may set other values than the nested class's own defaults).

    Returns:
        One :class:`KeyDoc` per leaf key, in field order; a nested dataclass field adds a
        row for itself (its doc) followed by its own keys.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[KeyDoc] = []
    unused = set(getattr(cls, "unused_keys", ()))  # e.g. encoder-decoder keys of a one-stack model
    for f in dataclasses.fields(cls):
        if not f.init or f.name in unused:
            continue
        default = getattr(defaults, f.name) if defaults is not None else _default_of(f)
        nested = _dataclass_in(hints[f.name])
        key = prefix + f.name
        if nested is not None:
            out.append(KeyDoc(key, f"{nested.__name__} mapping", default, docs[f.name]))
            instance = default if dataclasses.is_dataclass(default) else None
            out += section_keys(nested, key + ".", instance)
        else:
            out.append(KeyDoc(key, type_label(hints[f.name]), default, docs[f.name]))
    return out


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0].strip() if lines else ""


def task_info(task_cls: type, core_sections: dict[str, type], entry: Any = None) -> dict[str, Any]:
    """Everything ``tk info TASK`` shows, as plain data (what ``--json`` prints).

    Args:
        task_cls: the Task class.
        core_sections: core's sections, name -> dataclass (``tk.core.config.core_schema()``).
        entry: the task's :class:`tk.core.registry.PluginEntry` (None for a local plugin).

    Returns:
        ``{"task", "description", "entry_point", "distribution", "version", "sections": {name:
        {"owner": "task" | "core", "class", "doc", "keys": [KeyDoc.to_dict(), ...]}}}``.
    """
    sections: dict[str, Any] = {}
    owned = [(n, c, "task") for n, c in task_cls.config_sections().items()]
    for name, cls, owner in owned + [(n, c, "core") for n, c in core_sections.items()]:
        sections[name] = {"owner": owner, "class": cls.__name__, "doc": _first_line(cls.__doc__),
                          "keys": [k.to_dict() for k in section_keys(cls)]}
    return {
        "task": task_cls.name or getattr(entry, "name", ""),
        "description": task_cls.describe(),
        "entry_point": getattr(entry, "value", f"{task_cls.__module__}:{task_cls.__qualname__}"),
        "distribution": getattr(entry, "distribution", None),
        "version": getattr(entry, "version", None),
        "sections": sections,
    }


def format_task_info(info: dict[str, Any], width: int = 44) -> str:
    """``task_info`` as text: a header, then each section's keys as
    ``key: type = default   # doc`` lines (the dataclass source's own layout)."""
    dist = info["distribution"] or "a local plugin"
    provider = f"{dist} {info['version']}" if info["version"] else dist
    lines = [f"{info['task']}: {info['description']}", f"  from {provider} ({info['entry_point']})"]
    for name, section in info["sections"].items():
        about = section["doc"].replace("``", "`")
        lines += ["", f"{name}:  # {section['class']} ({section['owner']} section) {about}".rstrip()]
        if not section["keys"]:
            lines.append("  (no keys)")
        for key in section["keys"]:
            default = "{...}" if key["type"].endswith(" mapping") else (
                "(required)" if key["required"] else format_default(key["default"]))
            head = f"  {key['key']}: {key['type']} = {default}"
            lines.append(f"{head:<{width}}  # {key['doc']}" if key["doc"] else head)
    return "\n".join(lines)
