"""Plugin commands (`tk.commands` entry points): listed from metadata, imported only when
run, a broken one fails with one line, one that takes a built-in name is an error."""

import importlib.metadata as md
import sys
import textwrap

import click
import pytest
from click.testing import CliRunner

from tests.core.distributions import write_distribution
from tk.core.cli import cli
from tk.core.errors import TkError
from tk.core.registry import discover_commands, load_command

GREET_PLUGIN = textwrap.dedent('''
    import click

    @click.command()
    @click.argument("who")
    @click.option("--loud", is_flag=True)
    def greet(who, loud):
        """Say hello (a test plugin command)."""
        text = f"hello {who}"
        click.echo(text.upper() if loud else text)

    not_a_command = 42
''')


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def command_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    write_distribution(site, "tk-greet", "tk_greet_plugin", GREET_PLUGIN,
                       {"tk.commands": {"greet": "tk_greet_plugin:greet", "bad": "tk_greet_plugin:not_a_command"}},
                       summary="Greetings for tk")
    write_distribution(site, "tk-broken-cmd", "tk_broken_cmd", "raise ImportError('boom: no such dep')\n",
                       {"tk.commands": {"explode": "tk_broken_cmd:cli"}})
    write_distribution(site, "tk-clash", "tk_clash_cmd", "raise AssertionError('must never be imported')\n",
                       {"tk.commands": {"run": "tk_clash_cmd:run"}})
    monkeypatch.syspath_prepend(str(site))
    for name in ("tk_greet_plugin", "tk_broken_cmd", "tk_clash_cmd"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return site


def test_help_lists_plugin_commands_without_importing_them(command_site):
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    assert "tk_greet_plugin" not in sys.modules and "tk_broken_cmd" not in sys.modules
    plugin_part = result.output.split("Plugin commands:")[1]
    flat = " ".join(plugin_part.split())
    assert "greet [tk-greet 0.1] Greetings for tk" in flat
    assert "explode [tk-broken-cmd 0.1] (run tk explode --help)" in flat
    assert "run ERROR: clashes with the built-in `tk run` (tk-clash 0.1); rename it there" in flat
    assert "tk_clash_cmd" not in sys.modules


def test_plugin_command_runs_when_invoked(command_site):
    result = invoke("greet", "world", "--loud")
    assert result.exit_code == 0, result.output
    assert result.output == "HELLO WORLD\n"
    assert "Say hello" in invoke("greet", "--help").output


def test_broken_or_wrong_plugin_command_is_one_line_error(command_site):
    broken = invoke("explode")
    assert broken.exit_code == 2
    assert broken.stderr == ("error: command 'explode' (entry point 'tk_broken_cmd:cli' of tk-broken-cmd) "
                             "failed to import: ImportError: boom: no such dep\n")
    wrong = invoke("bad")
    assert wrong.exit_code == 2 and "points to 42, which is not a click command" in wrong.stderr
    assert invoke("greet", "x").exit_code == 0  # a broken plugin does not break the others


def test_clash_with_a_builtin_names_the_distribution_and_builtin_still_runs(command_site):
    entry = discover_commands()["run"]
    with pytest.raises(TkError, match=r"command 'run' of distribution 'tk-clash' \(tk_clash_cmd:run\) clashes "
                                      r"with the built-in `tk run`"):
        load_command(entry, builtin=cli.commands)
    listing = invoke("list")
    assert listing.exit_code == 0
    line = next(line for line in listing.output.splitlines() if line.strip().startswith("run "))
    assert "ERROR" in line and "tk-clash" in line
    assert "Train a recipe" in invoke("run", "--help").output  # tk's own command keeps the name
    assert "tk_clash_cmd" not in sys.modules


def test_info_on_a_plugin_command(command_site):
    result = invoke("info", "greet")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["tk greet: Say hello (a test plugin command).",
                                          "  from tk-greet 0.1 (tk_greet_plugin:greet)"]


def test_two_distributions_claiming_one_command_name():
    eps = [md.EntryPoint("go", "a_pkg:go", "tk.commands"), md.EntryPoint("go", "b_pkg:go", "tk.commands")]
    with pytest.raises(TkError, match="command name 'go' is claimed by .*a_pkg:go.* and .*b_pkg:go"):
        load_command(discover_commands(eps)["go"])


def test_load_command_returns_the_click_object():
    eps = [md.EntryPoint("lst", "tk.core.cli.main:list_cmd", "tk.commands")]
    assert isinstance(load_command(discover_commands(eps)["lst"]), click.Command)
