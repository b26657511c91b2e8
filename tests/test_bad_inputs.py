"""The catalogue of bad inputs (issue #11): every mistake a user can make at the `tk` CLI
answers with one line on stderr (no traceback), the documented exit code (2: usage or
config, nothing touched; 1: a failure during a run) and, where nothing should change,
leaves every file byte-identical.

Each case is (command args, exit code, a fragment of the message, whether the case
folder must stay unchanged). Placeholders in the args name files of the case folder:
``{d}`` the folder, ``{toy}`` a toy recipe, ``{faulty}`` a recipe of a task that fails on
demand, ``{run}`` a finished toy run (with checkpoints), ``{foreign}`` a folder that
holds a ``config.yaml`` of something else, ``{r:NAME}`` the recipe ``RECIPES[NAME]``.
Cases run in-process through click's CliRunner; a few run as real subprocesses.

Set ``TK_CATALOGUE_RECORD=path.jsonl`` to append every case's outcome to a file (the
table in the issue note is made from it).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner

from tk.core.cli import cli

from .conftest import TOY_PLUGIN, make_distribution

FAULTY_PLUGIN = textwrap.dedent('''
    """A task that fails on demand, for the bad-input catalogue."""
    from dataclasses import dataclass

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from tk.core.errors import TkError
    from tk.core.metrics import Accuracy
    from tk.core.task import StepOutput, Task


    @dataclass
    class FaultyData:
        fail_at: str = "none"  # "build": building a split raises; "val": building val raises; "batch": a training batch raises
        fail_batch: int = 3  # which collated batch raises (1-based)


    @dataclass
    class FaultyModel:
        hidden: int = 8  # hidden width


    class FaultyTask(Task):
        """Two-class blobs that fail on demand (test plugin)."""

        name = "faulty"
        DataConfig = FaultyData
        ModelConfig = FaultyModel

        def build_dataset(self, split):
            if self.data.fail_at == "build" or (self.data.fail_at == "val" and split == "val"):
                raise TkError(f"data.root: the {split} split folder 'x/{split}' does not exist")
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 4, generator=g)
            return TensorDataset(x, (x[:, 0] > 0).long())

        def collate(self, samples):
            self.calls = getattr(self, "calls", 0) + 1
            if self.data.fail_at == "batch" and self.calls >= self.data.fail_batch:
                raise TkError("image 'x/train/cat/7.png' cannot be read (truncated file); "
                              "fix or remove it, or set data.on_bad_image=skip")
            x, y = torch.utils.data.default_collate(samples)
            return {"x": x, "labels": y}

        def build_model(self):
            return nn.Sequential(nn.Linear(4, self.model_cfg.hidden), nn.ReLU(), nn.Linear(self.model_cfg.hidden, 2))

        def loss(self, model, batch):
            logits = model(batch["x"])
            loss = nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")
            return StepOutput(loss=loss, num_items=batch["labels"].numel(), outputs=logits)

        def build_metrics(self, split):
            return {"acc": Accuracy(topk=(1,))}


    class NotATask:
        """Not a tk Task."""
''')

TOY = "task: toy\nmodel: {hidden: 16}\noptim: {lr: 0.01}\ntrain: {max_steps: 8, batch_size: 16, eval_every: 4, progress: false}\n"
FAULTY = "task: faulty\ntrain: {max_steps: 8, batch_size: 16, eval_every: 4, progress: false}\n"

RECIPES: dict[str, str | bytes] = {
    "syntax": "task: toy\ntrain: {batch_size: [1, 2}\n",
    "empty": "# nothing here\n",
    "list": "- task: toy\n",
    "no_task": "train: {batch_size: 4}\n",
    "task_int": "task: 3\n",
    "unknown_task": "task: toyy\n",
    "top_key": "task: toy\ntrian: {batch_size: 4}\n",
    "section_key": "task: toy\noptim: {lrr: 0.1}\n",
    "section_type": "task: toy\ntrain: {batch_size: big}\n",
    "section_scalar": "task: toy\nmodel: 3\n",
    "section_null": "task: toy\nmodel: null\n",
    "dup_top": "task: toy\noptim: {lr: 0.1}\ntrain: {batch_size: 4}\noptim: {lr: 0.2}\n",
    "dup_nested": "task: toy\noptim:\n  lr: 0.1\n  weight_decay: 0.0\n  lr: 0.2\n",
    "nan": "task: toy\noptim: {lr: .nan}\n",
    "inf": "task: toy\noptim: {lr: .inf}\n",
    "three": "task: toy\ntrain: {batch_size: abc}\noptim: {lr: 0}\nmodel: {dimm: 3}\n",
    "binary": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\xff\xfe",
    "latin1": "# Recette d'\xe9t\xe9\ntask: toy\n".encode("latin-1"),
    "os_path": "task: os:path\n",
    "not_task": "task: tk_faulty_plugin:NotATask\n",
    "no_module": "task: tk_no_such_module:Task\n",
    "no_attr": "task: tk_faulty_plugin:Nope\n",
    "broken": "task: broken\n",
    "literal": "task: toy\ntrain: {best_mode: maxx}\n",
    "neg_workers": "task: toy\ntrain: {num_workers: -1}\n",
    "list_key": "task: toy\n? [1, 2]\n: 3\n",
}


@dataclass
class Case:
    args: list[str]
    code: int
    fragment: str
    fragments: list[str] = field(default_factory=list)  # further fragments
    unchanged: bool = True  # every file of the case folder byte-identical afterwards
    setup: Callable[[Path, pytest.MonkeyPatch], None] | None = None
    subprocess: bool = False


def _corrupt(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def corrupt_last(d: Path, _mp) -> None:
    _corrupt(d / "run" / "checkpoints" / "last.pt")


def corrupt_all(d: Path, _mp) -> None:
    for p in (d / "run" / "checkpoints").glob("*.pt"):
        _corrupt(p)


def read_only_dir(d: Path, _mp) -> None:
    (d / "ro").mkdir()
    (d / "ro").chmod(0o500)


def disk_full_on_second_save(_d: Path, mp: pytest.MonkeyPatch) -> None:
    import tk.core.run.checkpoint as ckpt

    real, calls = ckpt.torch.save, []

    def save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *a, **k)

    mp.setattr(ckpt.torch, "save", save)


LONG = "x" * 300
C = Case
CASES: dict[str, Case] = {
    # -- recipes ---------------------------------------------------------------------
    "recipe/missing": C(["validate", "{d}/nope.yaml"], 2, "recipe not found: "),
    "recipe/builtin typo": C(["validate", "quickstrat"], 2, "did you mean 'quickstart'"),
    "recipe/yaml syntax": C(["validate", "{r:syntax}"], 2, "syntax.yaml:2"),
    "recipe/empty": C(["validate", "{r:empty}"], 2, "the recipe is empty"),
    "recipe/a list": C(["validate", "{r:list}"], 2, "must be a mapping"),
    "recipe/no task": C(["validate", "{r:no_task}"], 2, "task: missing"),
    "recipe/task not a name": C(["validate", "{r:task_int}"], 2, "expected a task name"),
    "recipe/unknown task": C(["validate", "{r:unknown_task}"], 2, "unknown task 'toyy'; did you mean 'toy'"),
    "recipe/unknown top key": C(["validate", "{r:top_key}"], 2, "did you mean 'train'"),
    "recipe/unknown section key": C(["validate", "{r:section_key}"], 2, "optim.lrr: unknown key; did you mean 'lr'"),
    "recipe/wrong type": C(["validate", "{r:section_type}"], 2, "train.batch_size: expected int, found 'big'"),
    "recipe/section a scalar": C(["validate", "{r:section_scalar}"], 2, "model: expected a mapping"),
    "recipe/section null": C(["validate", "{r:section_null}"], 2, "remove the key"),
    "recipe/duplicate top key": C(["validate", "{r:dup_top}"], 2, "dup_top.yaml:4", ["duplicate key 'optim'"]),
    "recipe/duplicate nested key": C(["validate", "{r:dup_nested}"], 2, "dup_nested.yaml:5",
                                     ["duplicate key 'lr'"]),
    "recipe/nan": C(["validate", "{r:nan}"], 2, "optim.lr: expected a finite number"),
    "recipe/inf": C(["validate", "{r:inf}"], 2, "optim.lr: expected a finite number"),
    "recipe/every problem at once": C(["validate", "{r:three}"], 2, "3 problems",
                                      ["train.batch_size", "optim.lr", "model.dimm"]),
    "recipe/binary": C(["validate", "{r:binary}"], 2, "binary.yaml", ["not a UTF-8 text file"]),
    "recipe/latin-1": C(["validate", "{r:latin1}"], 2, "latin1.yaml", ["not a UTF-8 text file"]),
    "recipe/a folder": C(["validate", "{d}/folder.yaml"], 2, "is a folder"),
    "recipe/literal typo": C(["validate", "{r:literal}"], 2, "did you mean 'max'"),
    "recipe/a list as a key": C(["validate", "{r:list_key}"], 2, "list_key.yaml:2", ["unhashable key"]),
    "recipe/negative workers": C(["validate", "{r:neg_workers}"], 2, "train.num_workers: must be >= 0"),
    "recipe/task os:path": C(["validate", "{r:os_path}"], 2, "not a subclass of tk.core.task.Task"),
    "recipe/task not a Task": C(["validate", "{r:not_task}"], 2, "not a subclass of tk.core.task.Task"),
    "recipe/task no module": C(["validate", "{r:no_module}"], 2, "cannot import module 'tk_no_such_module'"),
    "recipe/task no attribute": C(["validate", "{r:no_attr}"], 2, "Nope"),
    "recipe/broken plugin": C(["validate", "{r:broken}"], 2, "failed to import: ImportError: boom"),
    "recipe/run checks it too": C(["run", "{r:three}", "output_dir={d}/new"], 2, "3 problems"),
    # -- overrides -------------------------------------------------------------------
    "override/no equals": C(["validate", "{toy}", "optim.lr"], 2, "is not of the form key.sub=value"),
    "override/empty key": C(["validate", "{toy}", "=3"], 2, "is not of the form key.sub=value"),
    "override/empty part": C(["validate", "{toy}", "optim..lr=3"], 2, "is not of the form key.sub=value"),
    "override/unknown key": C(["validate", "{toy}", "optim.lrr=0.1"], 2, "override 'optim.lrr=0.1'",
                              ["did you mean 'lr'"]),
    "override/unknown section": C(["validate", "{toy}", "modle.hidden=3"], 2, "did you mean 'model'"),
    "override/not a section": C(["validate", "{toy}", "train.batch_size.x=3"], 2, "is not a section"),
    "override/wrong type": C(["validate", "{toy}", "train.batch_size=abc"], 2,
                             "override 'train.batch_size=abc': expected int"),
    "override/range": C(["validate", "{toy}", "optim.lr=0"], 2, "override 'optim.lr=0': ", ["must be > 0"]),
    "override/not the file": C(["validate", "{toy}", "optim.lr=0"], 2, "override 'optim.lr=0'"),
    "override/two keys": C(["validate", "quickstart", "model.dim=30", "model.num_heads=4"], 2,
                           "override 'model.dim=30', 'model.num_heads=4': model.dim (30) must be divisible"),
    "override/second key": C(["validate", "quickstart", "model.num_heads=7"], 2,
                             "override 'model.num_heads=7': model.dim (96) must be divisible"),
    "override/float for int": C(["validate", "{toy}", "train.batch_size=1.5"], 2, "expected int, found 1.5"),
    "validate/lora targets match nothing": C(["validate", "textcls_synthetic", "data.num_train=64",
                                              "model.lora.targets=[nomatch]"], 2, "match no nn.Linear layer"),
    "validate/lora trainable matches nothing": C(["validate", "textcls_synthetic", "data.num_train=64",
                                                  "model.lora.trainable=[haed]"], 2,
                                                 "model.lora.trainable ['haed'] match no module or parameter"),
    "override/negative steps": C(["validate", "{toy}", "train.max_steps=-1"], 2, "must be >= 0"),  # 0: evaluate and save the start
    "override/broken yaml": C(["validate", "{toy}", "optim.betas=[0.9,"], 2, "override 'optim.betas=[0.9,'",
                              ["YAML"]),
    "override/section null": C(["validate", "{toy}", "model=null"], 2, "override 'model=null'",
                               ["remove the key"]),
    "override/section scalar": C(["validate", "{toy}", "train=3"], 2, "expected a mapping"),
    "override/inf": C(["validate", "{toy}", "optim.lr=.inf"], 2, "override 'optim.lr=.inf'", ["finite"]),
    "override/nan": C(["validate", "{toy}", "optim.lr=nan"], 2, "override 'optim.lr=nan'", ["finite"]),
    "override/nan elsewhere": C(["validate", "{toy}", "train.clip_grad_norm=.nan"], 2, "finite"),
    "override/every problem at once": C(["validate", "{toy}", "train.batch_size=abc", "optim.lr=0",
                                         "model.dimm=3"], 2, "3 problems",
                                        ["override 'train.batch_size=abc'", "override 'optim.lr=0'",
                                         "override 'model.dimm=3'"]),
    "override/unknown task": C(["validate", "{toy}", "task=toyy"], 2, "unknown task 'toyy'"),
    "override/task os:path": C(["validate", "{toy}", "task=os:path"], 2, "not a subclass of tk.core.task.Task"),
    "override/literal": C(["validate", "{toy}", "train.precision=fp8"], 2, "one of 'fp32', 'bf16', 'fp16'"),
    "override/timm name": C(["validate", "quickstart", "model.timm=resnet181"], 2,
                            "override 'model.timm=resnet181': 'resnet181' is not a timm model; did you mean 'resnet18'"),
    "override/lora rank": C(["validate", "quickstart", "model.lora.rank=0"], 2,
                            "override 'model.lora.rank=0': model.lora.rank (0) must be >= 1"),
    "run/lora targets match nothing": C(["run", "quickstart", "output_dir={d}/new", "model.lora.targets=[nope]"], 2,
                                        "model.lora.targets ['nope'] (patterns ['nope']) match no nn.Linear layer",
                                        ["blocks.0.attn.qkv"]),
    # -- the machine -------------------------------------------------------------------
    "machine/device tpu": C(["validate", "{toy}", "train.device=tpu"], 2, "train.device"),
    "machine/device nonsense": C(["validate", "{toy}", "train.device=gpu0"], 2, "is not a device"),
    "machine/cuda without a GPU": C(["validate", "{toy}", "train.device=cuda"], 2, "CUDA is not available"),
    "machine/fp16 on CPU": C(["validate", "{toy}", "train.device=cpu", "train.precision=fp16"], 2, "fp16"),
    "machine/run checks before the dir": C(["run", "{toy}", "output_dir={d}/new", "train.device=cuda:7"], 2,
                                           "CUDA is not available"),
    # -- run dirs --------------------------------------------------------------------
    "run dir/not empty": C(["run", "{toy}", "output_dir={run}"], 2, "is not empty (a previous run?)"),
    "run dir/overwrite foreign config.yaml": C(["run", "{toy}", "output_dir={foreign}", "--overwrite"], 2,
                                               "refusing to delete"),
    "run dir/overwrite plain folder": C(["run", "{toy}", "output_dir={d}/plain", "--overwrite"], 2,
                                        "refusing to delete"),
    "run dir/resume nothing": C(["run", "{toy}", "output_dir={d}/new", "--resume"], 2, "holds no previous run"),
    "run dir/resume auto, missing pretrained source": C(["run", "textcls_synthetic", "output_dir={d}/new", "--resume",
                                                         "auto", "model.pretrained_from={d}/nope"], 2, "nope"),
    "run dir/resume foreign": C(["run", "{toy}", "output_dir={foreign}", "--resume"], 2, "holds no tk run"),
    "run dir/resume auto foreign": C(["run", "{toy}", "output_dir={foreign}", "--resume", "auto"], 2,
                                     "holds no tk run"),
    "run dir/resume auto foreign, 2 processes": C(["run", "{toy}", "output_dir={foreign}", "--resume=auto",
                                                   "--nproc-per-node", "2"], 2, "holds no tk run"),
    "run dir/resume auto and overwrite": C(["run", "{toy}", "output_dir={run}", "--resume", "auto", "--overwrite"],
                                           2, "--resume auto excludes"),
    "run dir/resume and overwrite": C(["run", "{toy}", "output_dir={run}", "--resume", "--overwrite"], 2,
                                      "exclude each other"),
    "run dir/a file": C(["run", "{toy}", "output_dir={d}/afile"], 2, "is a file"),
    "run dir/under a file": C(["run", "{toy}", "output_dir={d}/afile/run"], 2, "output_dir"),
    "run dir/name too long": C(["run", "{toy}", f"output_dir={{d}}/{LONG}"], 2, "output_dir"),
    "run dir/read-only": C(["run", "{toy}", "output_dir={d}/ro/run"], 2, "output_dir", setup=read_only_dir),
    "run dir/not permitted": C(["run", "{toy}", "output_dir=/sys/tk-no-run-here"], 2, "output_dir"),
    "run dir/proc": C(["run", "{toy}", "output_dir=/proc/tk-no-run-here"], 2, "output_dir"),
    "run dir/overwrite, config error": C(["run", "{toy}", "output_dir={run}", "--overwrite", "optim.lr=0"], 2,
                                         "optim.lr"),
    "run dir/overwrite, data missing at set-up": C(["run", "{faulty}", "output_dir={run}", "--overwrite",
                                                    "data.fail_at=build"], 2, "does not exist"),
    "run dir/overwrite, machine problem": C(["run", "{toy}", "output_dir={run}", "--overwrite",
                                             "train.device=cuda:7"], 2, "CUDA"),
    "run dir/overwrite, failure before the first checkpoint": C(
        ["run", "{faulty}", "output_dir={run}", "--overwrite", "data.fail_at=batch"], 1, "cannot be read",
        ["previous run"]),
    # -- checkpoints -----------------------------------------------------------------
    "checkpoint/resume, last.pt damaged": C(["run", "{toy}", "output_dir={run}", "--resume"], 2,
                                            "cannot read checkpoint", ["--resume-from", "step_00000004.pt"],
                                            setup=corrupt_last),
    "checkpoint/resume, all damaged": C(["run", "{toy}", "output_dir={run}", "--resume"], 2,
                                        "no intact checkpoint", setup=corrupt_all),
    "checkpoint/resume-from missing file": C(["run", "{toy}", "output_dir={run}", "--resume-from",
                                              "{d}/nope.pt"], 2, "nope.pt"),
    "checkpoint/resume-from and overwrite": C(["run", "{toy}", "output_dir={run}", "--overwrite",
                                               "--resume-from", "{run}/checkpoints/best.pt"], 2,
                                              "exclude each other"),
    "checkpoint/resume another model": C(["run", "{toy}", "output_dir={run}", "--resume", "model.hidden=64"], 2,
                                         "does not fit"),
    "checkpoint/eval damaged last": C(["eval", "{run}", "--checkpoint", "last"], 2, "cannot read checkpoint",
                                      setup=corrupt_last),
    "checkpoint/eval missing file": C(["eval", "{run}", "--checkpoint", "{d}/nope.pt"], 2, "nope.pt"),
    "checkpoint/eval not a checkpoint": C(["eval", "{run}", "--checkpoint", "{toy}"], 2, "toy.yaml", ["not a torch.save zip file"]),
    "checkpoint/eval split banana": C(["eval", "{run}", "--split", "banana"], 2, "banana", ["val"]),
    "checkpoint/eval no run": C(["eval", "{d}/nowhere"], 2, "nowhere"),
    "checkpoint/eval foreign": C(["eval", "{foreign}"], 2, "its config.yaml was not written by `tk run`"),
    "data/unigram vocabulary below the alphabet": C(["run", "textcls_synthetic", "output_dir={d}/tc", "train.max_steps=1",
                                                     "tokenizer.kind=unigram", "tokenizer.vocab_size=20"], 2,
                                                    "tokenizer.vocab_size (20) is smaller than the unigram alphabet"),
    # -- paths say what was found and what is expected (issue #51 item 10) ------------------------------
    "paths/checkpoint name not there": C(["eval", "{run}", "--checkpoint", "nope.pt"], 2,
                                         "--checkpoint nope.pt: no such file", ["give best, last or one of"]),
    "paths/pretrained_from a missing path": C(["run", "lm_synthetic", "output_dir={d}/lm",
                                               "model.pretrained_from={d}/gone/model"], 2, "gone/model does not exist"),
    "paths/pretrained_from a file for a folder": C(["run", "translation_multi30k_marian", "output_dir={d}/tr",
                                                    "data.source=synthetic", "model.pretrained_from={toy}"], 2,
                                                   "is a file; give the folder"),
    "checkpoint/average last 0": C(["average", "{run}", "--last", "0", "-o", "{d}/avg.safetensors"], 2, "--last"),
    "checkpoint/average too many": C(["average", "{run}", "--last", "99", "-o", "{d}/avg.safetensors"], 2,
                                     "holds 2 step checkpoint(s)"),
    "checkpoint/average no output": C(["average", "{run}"], 2, "'-o'"),
    # -- what commands write outside a run (issue #34 item 1): never a run, its checkpoints, the
    # current folder or a user's file; --overwrite replaces only the command's own output ----------
    **{f"output/{name}{' --overwrite' * ow}": C([*args, *["--overwrite"] * ow], 2, fragment,
                                                 setup=(lambda d, mp: mp.chdir(d)) if "current" in name else
                                                 (lambda d, _mp: (d / "mine.pt").write_bytes(b"mine")))
       for ow in (False, True) for name, args, fragment in [
           ("export into the run", ["export", "{run}", "--format", "safetensors", "-o", "{run}"],
            "is the run being read"),
           ("export into another run", ["export", "{image_run}", "--format", "safetensors", "-o", "{run}"],
            "is a tk run dir"),
           ("export into the run's folder", ["export", "{run}", "--format", "safetensors", "-o", "{d}"],
            "is a folder that holds the run being read"),
           ("export into the current folder", ["export", "{run}", "--format", "safetensors", "-o", "."],
            "is the current folder"),
           ("export over a user's folder", ["export", "{run}", "--format", "safetensors", "-o", "{d}/plain"],
            "a folder tk did not write"),
           ("export over a user's file", ["export", "{run}", "--format", "safetensors", "-o", "{d}/afile"],
            "a file tk did not write"),
           ("average over the resume point", ["average", "{run}", "--last", "1", "-o", "{run}/checkpoints/last.pt"],
            "inside the checkpoints of the run"),
           ("average into a run's checkpoints", ["average", "{run}", "--last", "1", "-o",
                                                 "{run}/checkpoints/avg.pt"], "inside the checkpoints of the run"),
           ("average over a user's file", ["average", "{run}", "--last", "1", "-o", "{d}/mine.pt"],
            "a file tk did not write"),
           ("plot over a user's file", ["plot", "{run}", "-o", "{d}/afile"], "a file tk did not write"),
           ("plot into a run's checkpoints", ["plot", "{run}", "-o", "{run}/checkpoints/c.png"],
            "inside the checkpoints of the run"),
           ("plot over a run's checkpoint", ["plot", "{run}", "-o", "{run}/checkpoints/last.pt"],
            "inside the checkpoints of the run"),
       ]},
    # -- the CLI ---------------------------------------------------------------------
    "cli/no such command": C(["rnu", "{toy}"], 2, "No such command 'rnu'"),
    "cli/no such option": C(["run", "{toy}", "--overwirte"], 2, "No such option '--overwirte'"),
    "cli/missing argument": C(["run"], 2, "Missing argument 'RECIPE'"),
    "cli/missing option value": C(["eval", "{run}", "--checkpoint"], 2, "--checkpoint"),
    "cli/nproc 0": C(["run", "{toy}", "--nproc-per-node", "0"], 2, "--nproc-per-node"),
    "cli/validate option": C(["validate", "{toy}", "--resume"], 2, "No such option"),
    # -- failures during a run ---------------------------------------------------------
    "run/data error mid-run": C(["run", "{faulty}", "output_dir={d}/new", "data.fail_at=batch",
                                 "data.fail_batch=6"], 1, "cannot be read", unchanged=False),
    "run/disk full": C(["run", "{toy}", "output_dir={d}/new", "train.save_every=2", "train.eval_every=8"], 1,
                       "No space left on device", ["checkpoints/last.pt at step 4", "(step 2) is intact", "--resume"], unchanged=False,
                       setup=disk_full_on_second_save),
    # -- real processes ------------------------------------------------------------
    "process/no such option": C(["run", "{toy}", "--overwirte"], 2, "No such option", subprocess=True),
    "process/binary recipe": C(["validate", "{r:binary}"], 2, "not a UTF-8 text file", subprocess=True),
    "process/overwrite foreign": C(["run", "{toy}", "output_dir={foreign}", "--overwrite"], 2,
                                   "refusing to delete", subprocess=True),
}
IMAGES = ["run", "quickstart", "data.source=imagefolder", "data.root={d}/images", "data.img_size=16",
          "model.patch_size=4", "model.dim=16", "model.depth=1", "model.num_heads=2", "train.max_steps=2",
          "train.batch_size=2", "train.eval_batch_size=2", "train.eval_every=2", "output_dir={d}/new"]


def image_folder(d: Path, val_classes=("a", "b"), bad_val: bool = False) -> None:
    """``d/images/{train,val}/<class>/*.png``: 4 tiny images per class; optionally other
    val classes or one unreadable val file."""
    from PIL import Image

    for split, classes in (("train", ("a", "b")), ("val", val_classes)):
        for c in classes:
            (d / "images" / split / c).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (16, 16), (60 * i, 100 if c == "a" else 200, 0)).save(d / "images" / split / c / f"{i}.png")
    if bad_val:
        (d / "images" / "val" / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")


def predict_inputs(d: Path, _mp) -> None:
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 30, 30)).save(d / "ok.png")
    (d / "bad.png").write_bytes(b"not an image")


def label_files(d: Path, stray: str) -> None:
    """``d/tr.tsv`` with 0/1 labels and one ``stray`` label on line 8; ``d/va.tsv``."""
    rows = [f"good film {i}\t1\nbad film {i}\t0\n" for i in range(3)]
    (d / "tr.tsv").write_text("sentence\tlabel\n" + "".join(rows) + f"odd one\t{stray}\n")
    (d / "va.tsv").write_text("sentence\tlabel\ngood film\t1\nbad film\t0\n")


TEXT_FILES = ["run", "textcls_synthetic", "data.source=files", "data.train_file={d}/tr.tsv",
              "data.val_file={d}/va.tsv", "tokenizer.vocab_size=60", "train.max_steps=1", "output_dir={d}/new"]


# Issue #11 item 2: checks that must fail before the first training step (nothing run,
# nothing left on disk), and item 6: prediction errors are per input.
CASES.update({
    "before training/best_metric typo": C(["run", "{toy}", "output_dir={d}/new", "train.best_metric=val/top"], 2,
                                          "train.best_metric: 'val/top' is not an evaluation result",
                                          ["did you mean 'val/top1'?"]),
    "before training/best_metric of EMA off": C(["run", "{toy}", "output_dir={d}/new",
                                                 "train.best_metric=val_ema/top1"], 2, "'val_ema/top1'",
                                                ["results: val/loss, val/top1"]),
    "before training/val split missing": C(["run", "{faulty}", "output_dir={d}/new", "data.fail_at=val"], 2,
                                           "the val split folder 'x/val' does not exist"),
    "before training/val classes differ": C(IMAGES, 2, "every split needs the same class folders",
                                            setup=lambda d, _mp: image_folder(d, val_classes=("a", "c"))),
    "before training/unreadable val image": C(IMAGES, 2, "broken.png", ["data.on_bad_image=skip"],
                                              setup=lambda d, _mp: image_folder(d, bad_val=True)),
    # issue #35 item 3: a label that does not belong is an error naming file:line, not a new class
    "data/stray text label": C(TEXT_FILES, 2, "tr.tsv:8: label 'positive' is text while 6 rows have integer labels",
                               setup=lambda d, _mp: label_files(d, "positive")),
    "data/stray decimal label": C(TEXT_FILES, 2, "tr.tsv:8: label '1.5' is decimal",
                                  setup=lambda d, _mp: label_files(d, "1.5")),
    "data/label outside data.labels": C([*TEXT_FILES, "data.labels=[0,1]"], 2,
                                        "tr.tsv:8: label '2' is not one of data.labels [0, 1]",
                                        setup=lambda d, _mp: label_files(d, "2")),
    "data/data.labels of one class": C([*TEXT_FILES, "data.labels=[1]"], 2, "must list at least 2 distinct labels",
                                       setup=lambda d, _mp: label_files(d, "1")),
    "tokenizer/bpe vocabulary below the bytes": C(["validate", "translation_synthetic", "tokenizer.vocab_size=50"], 2,
                                                  "tokenizer.vocab_size (50) must be >= 257 for kind bpe"),
    "tokenizer/lm bpe vocabulary below the bytes": C(["validate", "lm_synthetic", "tokenizer.kind=bpe",
                                                      "tokenizer.vocab_size=100"], 2, "must be >= 257 for kind bpe"),
    "tokenizer/negative min_frequency": C(["validate", "translation_synthetic", "tokenizer.min_frequency=-1"], 2,
                                          "tokenizer.min_frequency (-1) must be >= 0"),
    "translate/batch size 0": C(["translate", "{image_run}", "-", "--batch-size", "0"], 2, "--batch-size"),
    "predict/one unreadable input": C(["predict", "{image_run}", "{d}/bad.png", "{d}/ok.png"], 1,
                                      "1 of 2 inputs failed", setup=predict_inputs),
    "predict/top_k 0": C(["predict", "{image_run}", "{d}/ok.png", "predict.top_k=0"], 2, "predict.top_k",
                         setup=predict_inputs),
    "predict/unknown option": C(["predict", "{image_run}", "{d}/ok.png", "predict.topk=3"], 2, "did you mean 'top_k'",
                                setup=predict_inputs),
    "predict/no inputs": C(["predict", "{image_run}"], 2, "no inputs"),
    "predict/task without predict": C(["predict", "{run}", "x"], 2, "does not support prediction"),
    "translate/another task's run": C(["translate", "{image_run}", "-"], 2, "tk translate needs a translation run"),
    "generate/another task's run": C(["generate", "{image_run}", "--prompt", "x"], 2,
                                     "tk generate needs a language_model run"),
})


def corrupt_best(d: Path, _mp) -> None:
    _corrupt(d / "run" / "checkpoints" / "best.pt")


def corrupt_step(d: Path, _mp) -> None:
    _corrupt(d / "run" / "checkpoints" / "step_00000008.pt")


def cut_weights(suffix: str, keep: float = 0.5) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """``d/cut<suffix>``: a weights file cut to ``keep`` of its bytes."""
    def setup(d: Path, _mp) -> None:
        from safetensors.torch import save_file

        state = {"w": torch.randn(64, 64)}
        whole = d / f"whole{suffix}"
        save_file(state, whole) if suffix == ".safetensors" else torch.save(state, whole)
        data = whole.read_bytes()
        (d / f"cut{suffix}").write_bytes(data[: int(len(data) * keep)])
        whole.unlink()
    return setup


def torch_writer_fails_on_full_disk(_d: Path, mp: pytest.MonkeyPatch) -> None:
    """torch.save on a full disk: its zip writer's RuntimeError (inline_container.cc), not an OSError."""
    import tk.core.run.atomic as atomic
    import tk.core.run.checkpoint as ckpt

    real, calls = ckpt.torch.save, []

    def save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) >= 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 564992 vs 564880")
        return real(obj, f, *a, **k)

    mp.setattr(ckpt.torch, "save", save)
    mp.setattr(atomic.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 4096))


def refuse_writes(code: int) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """Creating a file next to a command's output fails with ``code`` (EACCES as a non-root user
    would see in a folder not theirs; root ignores permissions, so the refusal is simulated)."""
    def setup(_d: Path, mp: pytest.MonkeyPatch) -> None:
        import tk.core.run.atomic as atomic

        def mkstemp(*a, **k):
            raise OSError(code, os.strerror(code))

        mp.setattr(atomic.tempfile, "mkstemp", mkstemp)
    return setup


def hub_unreachable(_d: Path, mp: pytest.MonkeyPatch) -> None:
    import tk.core.text.hub as hub

    mp.setattr(hub, "_reachable", lambda endpoint, timeout=3.0: False)


def write(name: str, data: bytes) -> Callable[[Path, pytest.MonkeyPatch], None]:
    def setup(d: Path, _mp) -> None:
        (d / name).write_bytes(data)
    return setup


def parallel(src: int, tgt: int) -> Callable[[Path, pytest.MonkeyPatch], None]:
    def setup(d: Path, _mp) -> None:
        for name, n in (("tr.en", src), ("tr.de", tgt), ("va.en", 2), ("va.de", 2)):
            (d / name).write_text("".join(f"a small house {i}\n" for i in range(n)))
    return setup


TEXTCLS_FILES = ["run", "textcls_synthetic", "data.source=files", "data.train_file={d}/tr.tsv",
                 "data.val_file={d}/va.tsv", "train.max_steps=1", "output_dir={d}/new"]
LONG_LINE = ("word " * 400 + "\n").encode()
# issue #35: text I/O (item 2), checks shared by validate and run (item 5), raw exceptions (item 6)
CASES.update({
    "damaged/eval, best.pt truncated": C(["eval", "{run}"], 2, "the file is truncated or damaged",
                                        ["intact checkpoints beside it: last.pt"], setup=corrupt_best),
    "damaged/export, best.pt truncated": C(["export", "{run}", "--format", "safetensors", "-o", "{d}/o.safetensors"],
                                          2, "best.pt': the file is truncated or damaged", ["last.pt"],
                                          setup=corrupt_best),
    "damaged/average, a step truncated": C(["average", "{run}", "--last", "2", "-o", "{d}/a.safetensors"], 2,
                                           "step_00000008.pt': the file is truncated or damaged", setup=corrupt_step),
    "damaged/pretrained safetensors truncated": C(["validate", "quickstart",
                                                   "model.pretrained_from={d}/cut.safetensors"], 2,
                                                  "model.pretrained_from: cannot read", ["truncated or damaged"],
                                                  setup=cut_weights(".safetensors")),
    "damaged/pretrained .pth truncated": C(["validate", "quickstart", "model.pretrained_from={d}/cut.pth"], 2,
                                           "model.pretrained_from: cannot read", ["truncated or damaged"],
                                           setup=cut_weights(".pth")),
    "damaged/pretrained safetensors header only": C(["validate", "quickstart",
                                                     "model.pretrained_from={d}/cut.safetensors"], 2,
                                                    "truncated or damaged", setup=cut_weights(".safetensors", 0.02)),
    "damaged/run refuses a truncated pretrained file first": C(
        ["run", "quickstart", "model.pretrained_from={d}/cut.safetensors", "output_dir={d}/new"], 2,
        "model.pretrained_from: cannot read", setup=cut_weights(".safetensors")),
    "missing/eval run": C(["eval", "{d}/nope"], 2, "nope does not exist"),
    "missing/export run": C(["export", "{d}/nope", "--format", "safetensors", "-o", "{d}/o.safetensors"], 2,
                            "nope does not exist"),
    "missing/predict run": C(["predict", "{d}/nope", "x"], 2, "nope does not exist"),
    "missing/average run": C(["average", "{d}/nope", "-o", "{d}/a.safetensors"], 2, "nope does not exist"),
    "resume/another task's checkpoint": C(["run", "{toy}", "output_dir={run}", "--resume-from",
                                           "{image_run}/checkpoints/last.pt"], 2,
                                          "is a checkpoint of task image_classification, not toy",
                                          ["its own recipe"], unchanged=False),
    "run/disk full in torch's writer": C(["run", "{toy}", "output_dir={d}/new", "train.save_every=2",
                                          "train.eval_every=8"], 1, "No space left on device",
                                         ["(step 2) is intact", "--resume"], unchanged=False,
                                         setup=torch_writer_fails_on_full_disk),
    "output/average, permission denied": C(["average", "{run}", "--last", "1", "-o", "{d}/a.safetensors"], 2,
                                           "a.safetensors: Permission denied; choose a path you may write",
                                           setup=refuse_writes(errno.EACCES)),
    "output/plot, permission denied": C(["plot", "{run}", "-o", "{d}/c.png"], 2, "c.png: Permission denied",
                                        setup=refuse_writes(errno.EACCES)),
    "output/plot, read-only disk": C(["plot", "{run}", "-o", "{d}/c.png"], 2, "Read-only file system",
                                     ["writable disk"], setup=refuse_writes(errno.EROFS)),
    "output/average, disk full": C(["average", "{run}", "--last", "1", "-o", "{d}/a.safetensors"], 1,
                                   "No space left on device", ["free disk space"], setup=refuse_writes(errno.ENOSPC)),
    "hub/text classification offline": C(["run", "textcls_synthetic", "data.source=hf", "data.hf_name=nobody/none",
                                          "output_dir={d}/new"], 2, "no network", ["(data.source: files)"],
                                         setup=hub_unreachable),
    "hub/language model offline": C(["run", "lm_synthetic", "data.source=hf", "data.hf_name=nobody/none",
                                     "output_dir={d}/new"], 2, "no network", ["(data.source: text with data.path)"],
                                    setup=hub_unreachable),
    "hub/mlm offline": C(["run", "mlm_synthetic", "data.source=hf", "data.hf_name=nobody/none",
                          "output_dir={d}/new"], 2, "no network", ["data.source: text"], setup=hub_unreachable),
    "hub/translation offline": C(["run", "translation_synthetic", "data.source=hf", "data.hf_name=nobody/none",
                                  "output_dir={d}/new"], 2, "no network", ["data.source: files"],
                                 setup=hub_unreachable),
    "validate/best_metric typo": C(["validate", "{toy}", "train.best_metric=val/top"], 2,
                                   "did you mean 'val/top1'?"),
    "validate/best_metric of EMA off": C(["validate", "{toy}", "train.best_metric=val_ema/top1"], 2,
                                         "'val_ema/top1' is not an evaluation result"),
    "validate/text teacher missing": C(["validate", "textcls_synthetic", "distill.type=soft",
                                        "distill.teacher={d}/none"], 2, "distill.teacher:", ["does not exist"]),
    "validate/image teacher not a run": C(["validate", "quickstart", "distill.type=soft", "distill.teacher={d}/plain"],
                                          2, "is not a tk run dir"),
    "validate/timm teacher file missing": C(["validate", "quickstart", "distill.type=soft",
                                             "distill.teacher=vit_tiny_patch16_224",
                                             "distill.teacher_file={d}/none.safetensors"], 2,
                                            "distill.teacher_file:", ["does not exist"]),
    "validate/text teacher of another task": C(["validate", "textcls_synthetic", "distill.type=soft",
                                                "distill.teacher={image_run}"], 2, "image_classification"),
    "translate/a line too long": C(["translate", "{translation_run}", "{d}/long.txt"], 2, "long.txt line 2: ",
                                   ["more than the 127 this model takes", "--truncate"], setup=write("long.txt", b"a small house\n" + LONG_LINE)),
    "translate/binary file": C(["translate", "{translation_run}", "{d}/x.bin"], 2, "x.bin line 1: not valid UTF-8",
                               setup=write("x.bin", b"\x89PNG\r\n\x1a\n\x00\xff\xfe")),
    "translate/latin-1 on line 3": C(["translate", "{translation_run}", "{d}/l.txt"], 2, "l.txt line 3: not valid UTF-8",
                                     setup=write("l.txt", "a house\na dog\nun \xe9t\xe9\n".encode("latin-1"))),
    "translate/batch size -1": C(["translate", "{translation_run}", "-", "--batch-size", "-1"], 2, "--batch-size"),
    "translate/beam 0": C(["translate", "{translation_run}", "-", "--beam", "0"], 2, "--beam"),
    "translate/missing input": C(["translate", "{translation_run}", "{d}/none.txt"], 2, "none.txt"),
    "predict text/empty text": C(["predict", "{textcls_run}", " "], 1, "1 of 1 inputs failed"),
    "predict text/longer than max_len": C(["predict", "{textcls_run}", "good " * 100], 1, "1 of 1 inputs failed"),
    "predict text/binary input file": C(["predict", "{textcls_run}", "--input-file", "{d}/x.bin"], 2,
                                        "x.bin line 1: not valid UTF-8",
                                        setup=write("x.bin", b"\x89PNG\r\n\x1a\n\x00\xff\xfe")),
    "predict text/option typo": C(["predict", "{textcls_run}", "good", "predict.truncat=true"], 2,
                                  "did you mean 'truncate'"),
    "generate/characters the model never saw": C(["generate", "{lm_run}", "--prompt", "\u2603\u2603"], 2,
                                                 "\u2603"),
    "generate/zero new tokens": C(["generate", "{lm_run}", "--prompt", "a", "--max-new-tokens", "0"], 2,
                                  "--max-new-tokens"),
    "data/empty training file": C(TEXTCLS_FILES, 2, "tr.tsv", setup=write("tr.tsv", b"")),
    "data/missing training file": C(TEXTCLS_FILES, 2, "tr.tsv does not exist"),
    "data/translation files misaligned": C(["run", "translation_synthetic", "data.source=files",
                                            "data.train_prefix={d}/tr", "data.val_prefix={d}/va",
                                            "output_dir={d}/new"], 2, "misaligned parallel files",
                                           setup=parallel(5, 4)),
    "data/language model corpus empty": C(["run", "lm_synthetic", "data.source=text", "data.path={d}/empty.txt",
                                           "output_dir={d}/new"], 2, "empty.txt", setup=write("empty.txt", b"")),
    "tokenizer/vocabulary of 0": C(["validate", "textcls_synthetic", "tokenizer.vocab_size=0"], 2,
                                   "tokenizer.vocab_size (0) must be >= 1"),
    "tokenizer/unknown kind": C(["validate", "textcls_synthetic", "tokenizer.kind=sentencepiece"], 2,
                                "tokenizer.kind"),
    "tokenizer/missing file": C(["run", "textcls_synthetic", "tokenizer.path={d}/none.json", "output_dir={d}/new"],
                                2, "none.json"),
})


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A site dir with the toy, faulty and broken plugins, and a finished toy run."""
    root = tmp_path_factory.mktemp("world")
    site = root / "site"
    make_distribution(site, "tk-toy", "tk_toy_plugin", TOY_PLUGIN,
                      {"toy": "tk_toy_plugin:ToyTask", "toy_tokens": "tk_toy_plugin:ToyTokenTask"})
    make_distribution(site, "tk-faulty", "tk_faulty_plugin", FAULTY_PLUGIN, {"faulty": "tk_faulty_plugin:FaultyTask"})
    make_distribution(site, "tk-broken", "tk_broken_plugin", "raise ImportError('boom')\n",
                      {"broken": "tk_broken_plugin:Task"})
    sys.path.insert(0, str(site))
    (root / "toy.yaml").write_text(TOY)
    result = CliRunner().invoke(cli, ["run", str(root / "toy.yaml"), f"output_dir={root / 'run'}"])
    assert result.exit_code == 0, result.output
    tiny_images = ["data.num_train=8", "data.num_val=4", "model.dim=16", "model.depth=1", "model.num_heads=2",
                   "train.max_steps=1", "train.batch_size=4", "train.eval_batch_size=4", "train.progress=false"]
    result = CliRunner().invoke(cli, ["run", "quickstart", f"output_dir={root / 'image_run'}", *tiny_images])
    assert result.exit_code == 0, result.output
    text_runs = {  # tiny finished runs of the text tasks (issue #35 item 2 cases)
        "textcls_run": ["textcls_synthetic", "data.num_train=64", "data.num_val=16", "tokenizer.vocab_size=80"],
        "translation_run": ["translation_synthetic", "data.num_train=64", "data.num_val=8", "model.dim=16",
                            "model.depth=1", "model.num_heads=2", "tokenizer.vocab_size=300"],
        "lm_run": ["lm_synthetic", "tokenizer.kind=char", "model.dim=16", "model.depth=1", "model.num_heads=2"],
    }
    for name, args in text_runs.items():
        result = CliRunner().invoke(cli, ["run", *args, "train.max_steps=1", "train.progress=false",
                                          f"output_dir={root / name}"])
        assert result.exit_code == 0, result.output
    yield {"root": root, "site": site, "run": root / "run", "image_run": root / "image_run",
           **{name: root / name for name in text_runs}}
    sys.path.remove(str(site))


def hashes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def make_case_dir(world: dict[str, Path], d: Path) -> dict[str, str]:
    (d / "toy.yaml").write_text(TOY)
    (d / "faulty.yaml").write_text(FAULTY)
    shutil.copytree(world["run"], d / "run")
    (d / "foreign").mkdir()
    (d / "foreign" / "config.yaml").write_text("db: x\n")
    (d / "foreign" / "thesis.txt").write_text("years of work\n")
    (d / "plain").mkdir()
    (d / "plain" / "thesis.txt").write_text("years of work\n")
    (d / "afile").write_text("not a folder\n")
    (d / "folder.yaml").mkdir()
    (d / "recipes").mkdir()
    for name, text in RECIPES.items():
        path = d / "recipes" / f"{name}.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return {"d": str(d), "toy": str(d / "toy.yaml"), "faulty": str(d / "faulty.yaml"), "run": str(d / "run"),
            "foreign": str(d / "foreign"), "image_run": str(world["image_run"]),
            **{name: str(world[name]) for name in ("textcls_run", "translation_run", "lm_run")}}


def expand(arg: str, places: dict[str, str]) -> str:
    for name in RECIPES:
        arg = arg.replace(f"{{r:{name}}}", f"{places['d']}/recipes/{name}.yaml")
    return arg.format(**places)


def run_case(case: Case, args: list[str], world) -> tuple[int, str]:
    if not case.subprocess:
        result = CliRunner().invoke(cli, args)
        return result.exit_code, result.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(world["site"]), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "tk", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, world, tmp_path, monkeypatch):
    case = CASES[name]
    if "GPU" in name or "fp16" in name or "cuda" in name.lower():
        if torch.cuda.is_available():
            pytest.skip("needs a machine without CUDA")
    if name == "run dir/read-only" and os.geteuid() == 0:
        pytest.skip("root ignores file permissions (see 'run dir/not permitted')")
    if name in ("run dir/not permitted", "run dir/proc") and not sys.platform.startswith("linux"):
        pytest.skip("needs Linux's /sys and /proc")
    places = make_case_dir(world, tmp_path)
    if case.setup:
        case.setup(tmp_path, monkeypatch)
    args = [expand(a, places) for a in case.args]
    before = hashes(tmp_path)
    code, stderr = run_case(case, args, world)
    record = os.environ.get("TK_CATALOGUE_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"case": name, "code": code, "stderr": stderr.replace(str(tmp_path), "{d}")}) + "\n")
    assert code == case.code, stderr
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr  # one line, no traceback
    for fragment in [case.fragment, *case.fragments]:
        assert fragment in stderr, stderr
    if case.unchanged:
        assert hashes(tmp_path) == before
    assert not list(tmp_path.glob(".*tk-overwritten"))


def test_a_vocabulary_other_than_asked_is_reported(tmp_path):
    """tokenizer.vocab_size below the alphabet (wordpiece keeps every character) or above what the texts
    hold (unigram): the size the run really has is one line in train.log (#51 item 11)."""
    for kind, size, said in (("wordpiece", 20, "the texts' alphabet alone needs"), ("unigram", 8000, "has 6")):
        run = tmp_path / kind
        result = CliRunner().invoke(cli, ["run", "textcls_synthetic", f"output_dir={run}", "train.max_steps=1",
                                          "data.num_train=64", f"tokenizer.kind={kind}", f"tokenizer.vocab_size={size}"])
        assert result.exit_code == 0, result.output
        assert f"tokenizer.vocab_size is {size} but" in (run / "train.log").read_text() and said in \
            (run / "train.log").read_text()


def test_a_policy_no_pipeline_runs_is_one_fix_not_two(tmp_path):
    """RandAugment 'inc1' crashes under Pillow >= 13 on the workers path too: data.pipeline=device must not
    send the user there (issue #51 item 13)."""
    result = CliRunner().invoke(cli, ["validate", "quickstart", "data.auto_augment=rand-m9-mstd0.5-inc1",
                                      "data.pipeline=device", f"output_dir={tmp_path / 'r'}"])
    assert result.exit_code == 2 and "drop '-inc1'" in result.stderr, result.output
    assert "data.pipeline=workers" not in result.stderr and result.stderr.count("\n") == 1


# -- renamed recipe keys (issue #23: one vocabulary across the NLP tasks) ------------------
# old key (or old value) -> the new key its one-line error must name
RENAMED = {
    "language_model": {"data.bpe_vocab_size": "tokenizer.vocab_size", "data.tokenizer": "tokenizer.kind",
                       "data.tokenizer_file": "tokenizer.path", "data.dataset": "data.hf_name",
                       "data.config": "data.hf_config", "data.split": "data.hf_split",
                       "data.synthetic_seed": "data.seed", "data.source=hub": "hf"},
    "text_classification": {"data.tokenizer": "tokenizer.kind", "data.vocab_size": "tokenizer.vocab_size",
                            "data.lowercase": "tokenizer.lowercase", "data.hf_splits": "data.hf_split"},
    "translation": {"data.lowercase": "tokenizer.lowercase", "data.hf_val_split": "data.hf_split"},
    # the README's examples hold in every task whose schema has the new key (issue #51 item 12)
    **{t: {"data.synthetic_seed": "data.seed", "data.dataset": "data.hf_name", "data.bpe_vocab_size":
           "tokenizer.vocab_size"} for t in ("text_classification", "mlm", "sft")},
    "image_classification": {"data.synthetic_seed": "data.seed", "data.dataset=cifar10": "data.source"},
}
RENAMED["translation"].update({"data.synthetic_seed": "data.seed", "data.dataset": "data.hf_name"})
RENAMED_CASES = [(task, old, new) for task, keys in RENAMED.items() for old, new in keys.items()]


@pytest.mark.parametrize("how", ["recipe", "override"])
@pytest.mark.parametrize("task,old,new", RENAMED_CASES, ids=[f"{t}:{o}" for t, o, _ in RENAMED_CASES])
def test_renamed_key_is_one_line_naming_the_new_key(task, old, new, how, tmp_path):
    key, _, value = old.partition("=")
    value = value or "4"
    section, field = key.split(".")
    recipe = tmp_path / "old.yaml"
    if how == "recipe":
        recipe.write_text(f"task: {task}\n{section}: {{{field}: {value}}}\noutput_dir: {tmp_path / 'run'}\n")
        args = ["validate", str(recipe)]
    else:
        recipe.write_text(f"task: {task}\noutput_dir: {tmp_path / 'run'}\n")
        args = ["validate", str(recipe), f"{key}={value}"]
    before = hashes(tmp_path)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "renamed to" in result.stderr and new in result.stderr, result.stderr
    assert hashes(tmp_path) == before


# -- tk validate runs what tk run checks (issue #35 item 5) ---------------------------------------
SMALL_TEXT = ["data.num_train=64", "data.num_val=16", "train.max_steps=1"]
SMALL_IMAGES = ["data.num_train=8", "data.num_val=4", "model.dim=16", "model.depth=1", "model.num_heads=2",
                "train.max_steps=1", "train.batch_size=4"]
REFUSALS = {
    "best_metric typo": ["quickstart", *SMALL_IMAGES, "train.best_metric=val/top2"],
    "best_metric of EMA off": ["quickstart", *SMALL_IMAGES, "train.best_metric=val_ema/top1"],
    "text best_metric typo": ["textcls_synthetic", *SMALL_TEXT, "train.best_metric=val/f1"],
    "text teacher missing": ["textcls_synthetic", *SMALL_TEXT, "distill.type=soft", "distill.teacher={d}/none"],
    "image teacher missing": ["quickstart", *SMALL_IMAGES, "distill.type=soft", "distill.teacher={d}/none"],
    "image teacher not a run": ["quickstart", *SMALL_IMAGES, "distill.type=soft", "distill.teacher={d}"],
    "timm teacher file missing": ["quickstart", *SMALL_IMAGES, "distill.type=soft",
                                  "distill.teacher=vit_tiny_patch16_224", "distill.teacher_file={d}/t.safetensors"],
    "pretrained_from missing": ["textcls_synthetic", *SMALL_TEXT, "model.pretrained_from={d}/none"],
    "image pretrained_from not a run": ["quickstart", *SMALL_IMAGES, "model.pretrained_from={d}"],
    "cuda without a GPU": ["quickstart", *SMALL_IMAGES, "train.device=cuda"],
    "fp16 on CPU": ["quickstart", *SMALL_IMAGES, "train.device=cpu", "train.precision=fp16"],
    "lora targets match nothing": ["textcls_synthetic", *SMALL_TEXT, "model.lora.targets=[nomatch]"],
    "config": ["quickstart", "optim.lr=0", "model.dim=30"],
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_validate_refuses_what_run_refuses_with_the_same_line(name, tmp_path):
    """One list of checks (tk.core.engine.checks): validate says the line run says, and run
    says it before it writes anything."""
    if torch.cuda.is_available() and name in ("cuda without a GPU", "fp16 on CPU"):
        pytest.skip("needs a machine without CUDA")
    args = [a.format(d=tmp_path) for a in REFUSALS[name]]
    validate = CliRunner().invoke(cli, ["validate", *args])
    run = CliRunner().invoke(cli, ["run", *args, f"output_dir={tmp_path / 'run'}"])
    assert validate.exit_code == run.exit_code == 2, (validate.stderr, run.stderr)
    assert validate.stderr.startswith("error: ") and validate.stderr.count("\n") == 1, validate.stderr
    assert run.stderr == validate.stderr
    assert not (tmp_path / "run").exists()


def test_translate_truncate_translates_every_line_and_says_how_many_were_cut(world, tmp_path):
    """`tk translate --truncate`: the long line's first tokens are translated, one notice on stderr."""
    (tmp_path / "long.txt").write_bytes(b"a small house\n" + LONG_LINE)
    result = CliRunner().invoke(cli, ["translate", str(world["translation_run"]), str(tmp_path / "long.txt"),
                                      "--truncate"])
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == 2
    assert result.stderr == f"note: 1 line(s) of {tmp_path / 'long.txt'} cut to the first 127 tokens (--truncate)\n"
