"""The files every kind shares: pyproject.toml, the package ``__init__``, README, the tests, and
the end of each kind's ``data.py`` (``DATA_HELPERS``).

Placeholders (replaced verbatim): ``__NAME__`` the task name, ``__CLASS__`` its Task class,
``__PKG__`` the import package, ``__DIST__`` the distribution, ``__RECIPE__`` the recipe
name, ``__KIND__`` the kind; in ``TEST``, ``__TEST_HEAD__`` is the kind's ``TEST_HEAD`` (its
imports, ``INPUTS`` for ``tk predict`` and the ``BACKBONE`` prefix).
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

[tool.pytest.ini_options]
markers = ["slow: a longer test (graph export, two processes); deselect with -m 'not slow'"]

[tool.ruff]
line-length = 120
'''

INIT = '''\
"""The __NAME__ task plugin for tk (registered in pyproject.toml)."""

from __PKG__.task import __CLASS__

__all__ = ["__CLASS__"]
'''

# the end of every kind's data.py: the vocabulary, the task files, reading a file, padding a batch
DATA_HELPERS = '''

def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file; TkError naming the file where it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TkError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e}); check data.train_file "
                      f"and data.val_file") from None


def build_vocab(sentences: Iterable[list[str]], specials: list[str]) -> list[str]:
    """``specials``, then every word of ``sentences``, most frequent first: a word's id is its index."""
    counts = Counter(word for words in sentences for word in words)
    return [*specials, *sorted(counts.keys() - set(specials), key=lambda w: (-counts[w], w))]


def task_file(files: TaskFiles, name: str, build: Callable[[], Any], resume: bool) -> Any:
    """Task file ``name`` (JSON) where the run has it, else ``build()`` saved there.

    Resume, eval and predict (``resume``) always read it back: it is never rebuilt from data that may
    have changed. A fresh run started from ``model.pretrained_from`` finds the source's copy.
    """
    if files.exists(name) or resume:
        return json.loads(files.read_text(name))
    value = build()
    if files.dir is not None:  # tk summary has no run dir
        files.write_text(name, json.dumps(value, indent=0))
    return value


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    """Rows of ids -> a (B, T) tensor, padded with ``value`` to the longest row."""
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True, padding_value=value)
'''

README = '''\
# __DIST__

The `__NAME__` task plugin for tk (kind: __KIND__), written by
`tk new-task __NAME__ --kind __KIND__`. It trains on generated data as it is; point it at
your files with `data.source=files` (format below), or replace `generate` in
`__PKG__/data.py`, and adapt the model in `__PKG__/task.py`.

```bash
pip install -e .          # registers task `__NAME__` and recipe `__RECIPE__` (see `tk list`)
tk run __RECIPE__         # train the demo recipe (runs/__RECIPE__)
python -m pytest tests    # the plugin's tests (-m "not slow": without graph export, two processes)
```

A trained run goes the whole way:

```bash
tk eval runs/__RECIPE__                                 # the best checkpoint on the val split
tk predict runs/__RECIPE__ "INPUT" ...                  # one JSON row per input (below)
tk export runs/__RECIPE__ --format torch-export         # also safetensors, onnx
tk run __RECIPE__ model.pretrained_from=runs/__RECIPE__ output_dir=runs/next  # start from its backbone
```

`tk info __NAME__` lists the recipe keys with their docs (the comments of the config
dataclasses).

Files:

- `pyproject.toml`: the package; its entry points register the task (`tk.tasks`) and
  the recipe (`tk.recipes`).
- `__PKG__/data.py`: the `data:` section, the generated data, the file reader, the
  vocabulary and the task files (`<run>/artifacts/vocab.json` and the label names: what
  `tk predict` needs besides the weights).
- `__PKG__/task.py`: the `model:` section, the model (a `tk.core` backbone plus a head),
  the summed loss, the metrics, `predict`, `example_inputs` (graph export) and
  `pretrained_backbone` (`model.pretrained_from`).
- `__PKG__/recipes/__RECIPE__.yaml`: the demo recipe.
- `tests/test___NAME__.py`: one training step, exact resume, `tk predict`, `tk export`,
  `model.pretrained_from` (all through `tk.core.testing`), the data and the file reader by hand.
'''

TEST = '''\
"""Tests of the __NAME__ task (run after `pip install -e .`): the engine's promises for this task
(tk.core.testing: one step, exact resume, tk predict, tk export, two processes), model.pretrained_from,
and the data by hand. The tiny overrides keep each test to seconds on a CPU."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tk.core import TkError, testing
from tk.core.engine.inference import load_run
from tk.core.recipe import load_config

from __PKG__ import __CLASS__
__TEST_HEAD__
RECIPE = Path(__file__).resolve().parents[1] / "__PKG__" / "recipes" / "__RECIPE__.yaml"
TINY = ["data.num_train=32", "data.num_val=8", "model.dim=16", "model.depth=1", "train.batch_size=8",
        "train.max_steps=4", "train.eval_every=2", "train.device=cpu", "train.curves=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained run: the uninterrupted one of check_resume, which proves that a run stopped half-way
    and resumed ends with the same metrics and weights, bit for bit."""
    return testing.check_resume(RECIPE, tmp_path_factory.mktemp("resume"), TINY, steps=4)["reference"]


def test_recipe_names_the_installed_task():
    cfg, task_cls = load_config(str(RECIPE))
    assert task_cls is __CLASS__ and cfg.task == "__NAME__"


def test_one_step_gives_a_finite_loss_and_gradients(tmp_path):
    testing.check_step(RECIPE, TINY, tmp_path)


def test_export_writes_the_weights_and_refuses_hf_in_one_line(run, tmp_path):
    report = testing.check_export(run, tmp_path, formats=("safetensors", "hf", "timm"))
    assert report["safetensors"] == "written"
    assert report["hf"].startswith("refused")  # no transformers class maps this model (define export_hf)


@pytest.mark.slow  # tracing the model takes seconds
def test_graph_exports_give_the_models_outputs(run, tmp_path):
    report = testing.check_export(run, tmp_path, formats=("torch-export", "onnx"))  # traced on example_inputs
    assert report["torch-export"] == "written"
    assert report["onnx"] == "written" or report["onnx"].startswith("skipped")  # skipped: no onnx package


def test_pretrained_from_starts_from_the_source_backbone_and_vocabulary(run, tmp_path):
    start = testing.train_run(RECIPE, tmp_path / "start", [*TINY, f"model.pretrained_from={run}",
                                                           "train.max_steps=0"])  # 0: saves the starting model
    source = load_run(run, "best", ["train.device=cpu"])[1].state_dict()  # the checkpoint a source gives
    started = load_file(start / "model.safetensors")
    backbone = [name for name in source if name.startswith(BACKBONE)]
    assert backbone and all(torch.equal(started[name], source[name]) for name in backbone)
    assert (start / "artifacts" / "vocab.json").read_text() == (run / "artifacts" / "vocab.json").read_text()


@pytest.mark.slow  # two fresh processes (torchrun)
def test_two_processes_train_as_one(tmp_path):
    # sgd: Adam would scale the float noise of gradients that are zero in exact arithmetic (attention key
    # biases) up to the learning rate, and the weights would differ by more than the float noise
    testing.check_two_processes(RECIPE, tmp_path, [*TINY, "optim.name=sgd"])
'''
