"""The root click group of ``tk``: one-line errors with exit codes (2 usage/config, 1 during a
run, tracebacks with ``--debug`` or ``TK_DEBUG=1``), plus the plugin commands of ``tk.commands``."""

from __future__ import annotations

import errno
import os
import sys
import traceback

import click

from tk.core.cli.plugin_commands import PluginCommands
from tk.core.errors import TkError

DEBUG_ENV = "TK_DEBUG"


def debug_requested(ctx: click.Context) -> bool:
    return bool(ctx.meta.get("tk.debug")) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _set_debug(ctx: click.Context, _param, value: bool) -> bool:
    if value:
        ctx.meta["tk.debug"] = True
    return value


debug_option = click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
                            help="Show full tracebacks (also: TK_DEBUG=1).")


class TkGroup(click.Group):
    """A click group that turns exceptions into one-line errors and exit codes: click's
    own usage errors and TkError exit 2 (a RunError, found during a run, exits 1)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            sys.stdout.flush()
        except BrokenPipeError:  # `tk predict ... | head`: the reader has what it wanted, a normal end
            _close_stdout()
            sys.exit(0)
        except click.UsageError as e:
            where = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            click.echo(f"error: {_one_line(e.format_message())}{where}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:  # the reader of our output closed it (`| head`): not an error
            _close_stdout()
            ctx.exit(0)
        except TkError as e:
            if debug_requested(ctx):
                traceback.print_exc()
            _error_line(f"error: {_one_line(str(e))}")
            ctx.exit(e.exit_code)
        except OSError as e:  # a file a command reads or writes: the file and what the system said
            if debug_requested(ctx):
                traceback.print_exc()
            _error_line(f"error: {_os_error(e)}", printed=debug_requested(ctx))
            ctx.exit(1 if e.errno == errno.ENOSPC or e.errno not in _OS_FIXES else 2)  # 2: a path the user gave
        except Exception as e:  # a failure during a run
            if debug_requested(ctx):
                traceback.print_exc()
            _error_line(f"error: {type(e).__name__}: {_one_line(str(e))} (run with --debug for the full traceback)",
                        printed=debug_requested(ctx))
            ctx.exit(1)


_OS_FIXES = {errno.ENOSPC: "free disk space and run the command again",
             errno.EACCES: "choose a path you may write, or change its permissions",
             errno.EPERM: "choose a path you may write, or change its permissions",
             errno.EROFS: "choose a path on a writable disk",
             errno.ENOENT: "check the path"}


def _close_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _os_error(e: OSError) -> str:
    """``PATH: what the system said; the fix`` for an OSError no command turned into a TkError."""
    where = f"{e.filename}: " if e.filename else ""
    fix = _OS_FIXES.get(e.errno, "run with --debug for the full traceback")
    return f"{where}{e.strerror or _one_line(str(e))}; {fix}"


def _error_line(line: str, printed: bool = False) -> None:
    """Print the error line; a worker of tk's launcher hands it to the launcher instead, which
    prints the first failing rank's once (``tk.core.engine.agent``)."""
    if os.environ.get("TK_LAUNCHED"):
        from tk.core.engine.agent import report_to_launcher

        if report_to_launcher(line):
            return
    if not printed:
        click.echo(line, err=True)


def _one_line(message: str) -> str:
    return " ".join(message.split())


class CliGroup(PluginCommands, TkGroup):
    """tk's root group: built-in commands, plus plugin commands from ``tk.commands``."""
