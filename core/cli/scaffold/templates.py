"""The files every kind shares: pyproject.toml, the package ``__init__``, README, test.

Placeholders (replaced verbatim): ``__NAME__`` the task name, ``__CLASS__`` its Task class,
``__PKG__`` the import package, ``__DIST__`` the distribution, ``__RECIPE__`` the recipe
name, ``__KIND__`` the kind.
"""

from __future__ import annotations


def recipe_name(name: str) -> str:
    """The recipe a new task ships: ``<name>_demo``."""
    return f"{name}_demo"


def names(name: str, kind: str) -> dict[str, str]:
    """Placeholder -> value for task ``name``."""
    return {
        "__NAME__": name,
        "__CLASS__": "".join(part.capitalize() for part in name.split("_") if part) + "Task",
        "__PKG__": f"tk_{name}",
        "__DIST__": f"tk-{name.replace('_', '-')}",
        "__RECIPE__": recipe_name(name),
        "__KIND__": kind,
    }


PYPROJECT = '''\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "__DIST__"
version = "0.1.0"
description = "The __NAME__ task for tk (__KIND__)"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["tk"]

[project.optional-dependencies]
test = ["pytest"]

# `task: __NAME__` in a recipe loads this class
[project.entry-points."tk.tasks"]
__NAME__ = "__PKG__:__CLASS__"

# `tk run __RECIPE__` finds __PKG__/recipes/__RECIPE__.yaml
[project.entry-points."tk.recipes"]
__RECIPE__ = "__PKG__.recipes:__RECIPE__"

[tool.setuptools]
packages = ["__PKG__"]

[tool.setuptools.package-data]
__PKG__ = ["recipes/*.yaml"]

[tool.ruff]
line-length = 120
'''

INIT = '''\
"""The __NAME__ task plugin for tk (registered in pyproject.toml)."""

from __PKG__.task import __CLASS__

__all__ = ["__CLASS__"]
'''

README = '''\
# __DIST__

The `__NAME__` task plugin for tk (kind: __KIND__), written by
`tk new-task __NAME__ --kind __KIND__`. It trains on generated data as it is; replace
`make_examples` in `__PKG__/task.py` with your data and adapt the model.

```bash
pip install -e .          # registers task `__NAME__` and recipe `__RECIPE__` (see `tk list`)
tk run __RECIPE__         # train the demo recipe (runs/__RECIPE__)
python -m pytest tests    # the plugin's tests
```

`tk info __NAME__` lists the recipe keys with their docs (the comments of the config
dataclasses); `tk eval runs/__RECIPE__` evaluates the best checkpoint.

Files:

- `pyproject.toml`: the package; its entry points register the task (`tk.tasks`) and
  the recipe (`tk.recipes`).
- `__PKG__/task.py`: the config sections (`data:`, `model:`), the generated data, the
  model (a `tk.core` backbone plus a head), the summed loss and the metrics.
- `__PKG__/recipes/__RECIPE__.yaml`: the demo recipe.
- `tests/test___NAME__.py`: the recipe validates, one batch goes through the loss, and
  `tk run` trains two steps.
'''

TEST = '''\
"""Tests of the __NAME__ task (run after `pip install -e .`)."""

from pathlib import Path

import torch
from click.testing import CliRunner
from tk.core.cli import cli
from tk.core.recipe import load_config

from __PKG__ import __CLASS__
from __PKG__.task import make_examples

RECIPE = Path(__file__).resolve().parents[1] / "__PKG__" / "recipes" / "__RECIPE__.yaml"
FAST = ["train.max_steps=2", "train.eval_every=2", "train.batch_size=8", "train.progress=false",
        "train.device=cpu", "data.num_train=32", "data.num_val=16"]


def test_recipe_names_the_installed_task():
    cfg, task_cls = load_config(str(RECIPE))
    assert task_cls is __CLASS__ and cfg.task == "__NAME__"


def test_one_batch_through_the_loss():
    cfg, _ = load_config(str(RECIPE), FAST)
    task = __CLASS__(cfg)
    task.setup()
    dataset = task.build_dataset("train")
    batch = task.collate([dataset[i] for i in range(4)])
    out = task.loss(task.build_model(), batch)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert int(out.num_items) > 0


def test_tk_run_trains_two_steps(tmp_path):
    result = CliRunner().invoke(cli, ["run", "__RECIPE__", f"output_dir={tmp_path / 'run'}", *FAST])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()
'''
