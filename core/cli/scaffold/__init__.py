"""``tk new-task``: write a pip-installable task plugin package to start from.

``new_task(name, parent, kind)`` writes ``<parent>/tk-<name>/`` (distribution ``tk-<name>``,
import package ``tk_<name>``): a ``pyproject.toml`` registering the task in ``tk.tasks`` and
its recipe in ``tk.recipes``, the task module (config sections, generated data, a core
backbone + head, a summed loss, metrics), the recipe, a pytest file and a README. The
three kinds differ in the example they start from: one label per sequence
(``classification``), one tag per token (``tokens``) or an output sequence (``seq2seq``).
"""

from tk.core.cli.scaffold.generate import KINDS, check_name, new_task, render

__all__ = ["KINDS", "check_name", "new_task", "render"]
