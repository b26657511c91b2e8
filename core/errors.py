"""The error type for bad user input (recipes, data, registry, CLI arguments)."""


class TkError(ValueError):
    """A user-facing error: the CLI prints only its message and exits with code 2.

    The message says what was wrong, quotes the value and says how to fix it.
    """
