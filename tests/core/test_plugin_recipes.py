"""Recipes shipped by plugins (entry-point group ``tk.recipes``): found by name without
importing the plugin, listed with their distribution, name clashes name both claimants."""

import pytest
from click.testing import CliRunner

from tests.core.distributions import write_distribution
from tk.core.cli import cli
from tk.core.errors import TkError
from tk.core.recipe import find_recipe, list_recipes

RECIPE = "# Toy blobs from a plugin's recipe.\ntask: toy\ntrain: {max_steps: 2, batch_size: 8, progress: false}\n"
NEVER = "raise ImportError('a recipe lookup must not import the plugin')\n"


def _recipe_dist(site, dist, package, name, stem="toy_plugin_recipe"):
    write_distribution(site, dist, package, NEVER, {"tk.recipes": {name: f"{package}.recipes:{stem}"}})
    (site / package / "recipes").mkdir(exist_ok=True)
    (site / package / "recipes" / f"{stem}.yaml").write_text(RECIPE)
    return site / package / "recipes" / f"{stem}.yaml"


def test_plugin_recipe_is_found_by_name_without_importing(tmp_path, monkeypatch):
    path = _recipe_dist(tmp_path, "tk-recipes-a", "tk_recipes_a", "toy_plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert find_recipe("toy_plugin") == path
    listed = {r.name: r for r in list_recipes()}
    assert listed["toy_plugin"].provider == "tk-recipes-a 0.1" and listed["toy_plugin"].problem is None
    assert listed["quickstart"].provider.startswith("tk ")


def test_tk_run_and_tk_list_use_a_plugin_recipe(toy_site, tmp_path, monkeypatch):
    _recipe_dist(tmp_path / "site2", "tk-recipes-a", "tk_recipes_a", "toy_plugin")
    monkeypatch.syspath_prepend(str(tmp_path / "site2"))
    line = next(ln for ln in CliRunner().invoke(cli, ["list"]).output.splitlines() if "toy_plugin" in ln)
    assert "[tk-recipes-a 0.1]" in line and "Toy blobs from a plugin's recipe." in line
    run = CliRunner().invoke(cli, ["run", "toy_plugin", f"output_dir={tmp_path / 'run'}"])
    assert run.exit_code == 0, run.output + run.stderr
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_one_name_from_two_plugins_is_an_error_naming_both(tmp_path, monkeypatch):
    _recipe_dist(tmp_path, "tk-recipes-a", "tk_recipes_a", "shared")
    _recipe_dist(tmp_path, "tk-recipes-b", "tk_recipes_b", "shared")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TkError, match="recipe name 'shared' is claimed by distribution ") as e:
        find_recipe("shared")
    assert "'tk-recipes-a' (tk_recipes_a.recipes:" in str(e.value) and "'tk-recipes-b' (tk_recipes_b" in str(e.value)
    result = CliRunner().invoke(cli, ["run", "shared"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "tk-recipes-b" in result.stderr
    line = next(ln for ln in CliRunner().invoke(cli, ["list"]).output.splitlines() if ln.strip().startswith("shared"))
    assert "ERROR" in line and "tk-recipes-a" in line and "tk-recipes-b" in line


def test_a_plugin_recipe_may_not_take_a_builtin_name(tmp_path, monkeypatch):
    _recipe_dist(tmp_path, "tk-recipes-a", "tk_recipes_a", "quickstart")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TkError, match="'quickstart' is claimed by tk's built-in recipe .* and by distribution "
                                      "'tk-recipes-a'"):
        find_recipe("quickstart")


def test_missing_file_and_bad_value_name_the_distribution(tmp_path, monkeypatch):
    write_distribution(tmp_path, "tk-recipes-c", "tk_recipes_c", NEVER,
                       {"tk.recipes": {"gone": "tk_recipes_c.recipes:gone", "odd": "not a value"}})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TkError, match=r"recipe 'gone' .*tk-recipes-c.*gone\.yaml does not exist"):
        find_recipe("gone")
    with pytest.raises(TkError, match=r"recipe 'odd' .*tk-recipes-c.*must be `package.folder:stem`"):
        find_recipe("odd")


def test_unknown_name_suggests_plugin_recipes_too(tmp_path, monkeypatch):
    _recipe_dist(tmp_path, "tk-recipes-a", "tk_recipes_a", "toy_plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TkError, match="did you mean 'toy_plugin'"):
        find_recipe("toy_plugn")
