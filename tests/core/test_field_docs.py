"""Field docs read from dataclass source: trailing comments, metadata docs, inherited and
nested fields; and every option of every built-in section has one."""

import dataclasses
from dataclasses import dataclass, field

import pytest

from tk.core.cli.docs import field_docs, section_keys, type_label
from tk.core.config import core_schema
from tk.core.registry import available_tasks, load_task


@dataclass
class Inner:
    """A nested section."""

    width: int = 8  # inner width


@dataclass
class Base:
    lr: float = 1e-3  # learning rate  # (second hash kept)
    spread: tuple[int, int] = (
        1,
        2,
    )  # a field written over several lines
    plain: int = 0


@dataclass
class Child(Base):
    depth: int = 2  # number of blocks
    tagged: str = field(default="x", metadata={"doc": "from metadata"})  # comment loses to metadata
    inner: Inner = field(default_factory=lambda: Inner(width=16))  # the nested options
    maybe: Inner | None = None  # optional nested options
    plain: int = 1  # re-declared: the subclass's comment


def test_comments_metadata_and_inheritance():
    docs = field_docs(Child)
    assert list(docs) == ["lr", "spread", "plain", "depth", "tagged", "inner", "maybe"]  # dataclass field order
    assert docs["lr"] == "learning rate  # (second hash kept)"  # from Base, where it is defined
    assert docs["spread"] == "a field written over several lines"
    assert docs["depth"] == "number of blocks"
    assert docs["tagged"] == "from metadata"
    assert docs["plain"] == "re-declared: the subclass's comment"
    assert field_docs(Base)["plain"] == ""


def test_nested_keys_flatten_with_the_factory_defaults():
    keys = {k.key: k for k in section_keys(Child)}
    assert keys["inner"].doc == "the nested options" and keys["inner"].type == "Inner mapping"
    assert keys["inner.width"].default == 16  # the default_factory's value, not Inner's own 8
    assert keys["inner.width"].doc == "inner width" and keys["inner.width"].type == "int"
    assert keys["maybe.width"].default == 8
    assert keys["lr"].default == 1e-3 and keys["lr"].type == "float"


def test_type_labels():
    from typing import Literal

    assert type_label(int | None) == "int | None"
    assert type_label(Literal["pad", "rrc"]) == "'pad' | 'rrc'"
    assert type_label(list[float]) == "list[float]"


def _builtin_sections():
    sections = [(f"core {name}", cls) for name, cls in core_schema().items()]
    for task in available_tasks():
        task_cls = load_task(task)
        sections += [(f"{task} {name}", cls) for name, cls in task_cls.config_sections().items()]
    return sections


@pytest.mark.parametrize("where,cls", _builtin_sections(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_builtin_option_has_a_doc(where, cls):
    """Every key of core's sections and of every installed task's sections (nested
    dataclasses included) has a one-line doc, so `tk info` documents every option."""
    assert dataclasses.is_dataclass(cls)
    missing = [k.key for k in section_keys(cls) if not k.doc.strip()]
    assert not missing, f"{where} ({cls.__module__}.{cls.__qualname__}): keys without a doc: {missing}"
