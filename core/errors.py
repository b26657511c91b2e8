"""The error types for bad user input (recipes, data, registry, CLI arguments) and for
failures that stop a run after training has started."""


class TkError(ValueError):
    """A user-facing error: the CLI prints only its message and exits with ``exit_code``
    (2: a usage or config problem, found before anything was changed).

    The message says what was wrong, quotes the value and says how to fix it.
    """

    exit_code = 2


class RunError(TkError):
    """A problem found after training started (e.g. a corrupt image mid-epoch, a full
    disk): the CLI prints one line and exits with code 1."""

    exit_code = 1
