"""docs/plugins.md's complete plugin: its `# file:` blocks are written out, installed (a
dist-info from the guide's pyproject.toml on sys.path), listed, trained through the
guide's recipe, and its command run on the trained run."""

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.plugin_dist import install_metadata
from tk.core.cli import cli

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def guide_files() -> dict[str, str]:
    """Every fenced block of the guide whose first line is `# file: PATH`, by path."""
    blocks = re.findall(r"^```[a-z]*\n# file: (\S+)\n(.*?)^```", GUIDE.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE)
    return {path: f"# file: {path}\n{body}" for path, body in blocks}


def install_guide_plugin(tmp_path, monkeypatch):
    """The guide's plugin written to ``tmp_path/tk-repeats`` and importable, its entry points found."""
    project = tmp_path / "tk-repeats"
    for rel, text in guide_files().items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text, encoding="utf-8")
    install_metadata(project, tmp_path / "site")
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return project


def test_the_guide_has_one_complete_plugin():
    assert set(guide_files()) == {"tk_repeats/__init__.py", "tk_repeats/recipes/repeats_demo.yaml",
                                  "pyproject.toml", "tk_repeats/cli.py"}


@pytest.mark.slow
def test_the_guides_plugin_installs_trains_and_its_command_runs(tmp_path, monkeypatch):
    install_guide_plugin(tmp_path, monkeypatch)
    runner = CliRunner()

    listing = runner.invoke(cli, ["list"]).output.splitlines()
    assert "[tk-repeats 0.1.0]" in next(line for line in listing if line.strip().startswith("repeats "))
    assert "[tk-repeats 0.1.0]" in next(line for line in listing if line.strip().startswith("repeats_demo "))
    info = runner.invoke(cli, ["info", "repeats"]).output
    assert "generated sequences in the train split" in info  # the field comment is the key's doc

    run_dir = tmp_path / "run"
    run = runner.invoke(cli, ["run", "repeats_demo", f"output_dir={run_dir}", "train.max_steps=150",
                              "train.eval_every=150", "train.progress=false", "train.device=cpu"])
    assert run.exit_code == 0, run.output + run.stderr
    top1 = float(re.search(r"val/top1=([0-9.]+)", run.output).group(1))
    assert top1 > 0.9, run.output  # tagging every token "new" (0) scores about 0.57 (length 12, 9 tokens)

    check = runner.invoke(cli, ["repeats-check", str(run_dir), "3", "5", "3", "7", "5"])
    assert check.exit_code == 0, check.output + check.stderr
    assert check.output.strip() == "[0, 0, 1, 0, 1]"
