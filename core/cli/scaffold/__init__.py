"""``tk new-task``: write a pip-installable task plugin package to start from.

``new_task(name, parent, kind)`` writes ``<parent>/tk-<name>/`` (distribution ``tk-<name>``,
import package ``tk_<name>``): a ``pyproject.toml`` registering the task in ``tk.tasks`` and
its recipe in ``tk.recipes``; ``data.py`` (the ``data:`` section, generated data, a reader of
a simple file format, the vocabulary and label names kept as task files) and ``task.py`` (a
core backbone + head, a summed loss, metrics, ``predict``, ``example_inputs`` for graph export,
``pretrained_backbone`` for ``model.pretrained_from``); the recipe, a pytest file calling
``tk.core.testing`` and a README. The three kinds differ in the example they start from: one
label per text (``classification``), one tag per word (``tokens``) or an output sequence
(``seq2seq``).
"""

from tk.core.cli.scaffold.generate import KINDS, check_name, new_task, render

__all__ = ["KINDS", "check_name", "new_task", "render"]
