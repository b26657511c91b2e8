"""The ``tk`` command line and the features only it uses: run listing (``tk runs``), config
docs (``tk info``), plugin commands, the ``tk new-task`` scaffold.

``tk.core.cli:main`` is the console-script entry point; the commands live in ``main``.
"""

from tk.core.cli.main import cli, main

__all__ = ["cli", "main"]
