"""The README's promises: its first two commands are what CI runs, and every
`tk <command>` it shows exists."""

import re
from pathlib import Path

import click

from tk.core.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def first_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_first_two_commands_install_run_and_test():
    install, tests = first_commands()[:2]
    assert 'pip install -e ".[test]"' in install and install.endswith("tk run quickstart")
    assert tests == "python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[test]"' in ci and "tk run quickstart" in ci and "python -m pytest -q" in ci


def test_every_tk_command_shown_exists():
    text = (ROOT / "README.md").read_text()
    shown = set(re.findall(r"^tk ([a-z][a-z-]*)", text, re.M))
    existing = set(cli.list_commands(click.Context(cli)))  # built-in and plugin commands (tk.commands)
    missing = sorted(c for c in shown if c not in existing)
    assert not missing, f"README shows tk commands that do not exist: {missing}"


def test_the_python_lines_that_use_a_run_work(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from PIL import Image

    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(from tk.core import load_run\n.*?)```", text, re.S).group(1)
    tiny = ["data.num_train=8", "data.num_val=4", "model.dim=16", "model.depth=1", "model.num_heads=2",
            "train.max_steps=1", "train.batch_size=4", "train.eval_batch_size=4", "train.progress=false"]
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(cli, ["run", "quickstart", *tiny]).exit_code == 0
    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "cat.png")
    printed = []
    exec(block, {"print": printed.append})
    assert printed[0][0]["input"] == "cat.png" and len(printed[0][0]["top_k"]) >= 1
