"""Plugin commands on the ``tk`` command line: the ``tk.commands`` entry-point group.

A distribution adds ``tk NAME`` by declaring ``NAME = package.module:command_object`` (a
click command) in its ``[tk.commands]`` entry points. Names come from the metadata alone:
``tk --help`` lists them without importing anything; a command is imported only when it
is run (or asked for its own ``--help``). A broken one fails with one line when used; one
that takes a built-in name is never loaded and is reported as an error.
"""

from __future__ import annotations

import click

from tk.core.registry import PluginEntry, discover_commands, load_command


class PluginCommands(click.Group):
    """A click group that also offers the installed ``tk.commands`` plugin commands, lazily."""

    def plugin_entries(self) -> dict[str, PluginEntry]:
        """The plugin commands' metadata, by name (read on each call: nothing is cached or imported)."""
        return discover_commands()

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.plugin_entries()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        builtin = super().get_command(ctx, cmd_name)
        if builtin is not None:
            return builtin
        entry = self.plugin_entries().get(cmd_name)
        return None if entry is None else load_command(entry, builtin=self.commands)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Built-in commands as click lists them; plugin commands from metadata only."""
        limit = formatter.width - 6 - max(len(n) for n in self.list_commands(ctx))
        rows = [(name, cmd.get_short_help_str(limit)) for name, cmd in sorted(self.commands.items())
                if not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
        plugins = [(name, describe_command(entry, self.commands)) for name, entry in self.plugin_entries().items()]
        if plugins:
            with formatter.section("Plugin commands"):
                formatter.write_dl(plugins)


def describe_command(entry: PluginEntry, builtin) -> str:
    """One line about a plugin command from its metadata: provider and summary, or the clash."""
    if entry.name in builtin:
        return f"ERROR: clashes with the built-in `tk {entry.name}` ({entry.provider}); rename it there"
    if entry.conflicts:
        return f"ERROR: claimed by {entry.claimants}"
    # tk's own summary describes the toolkit, not the command: point at the command's help instead
    own = entry.distribution == "tk"
    about = f"(run tk {entry.name} --help)" if own or not entry.summary else entry.summary
    return f"[{entry.provider}] {about}"
