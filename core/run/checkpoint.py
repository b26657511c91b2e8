"""Checkpoints: atomic saves, safe (weights-only) loads, RNG capture, rotation, and
model-state matching with readable errors (exporting weights: ``tk.core.exchange.export``)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from tk.core.config import config_diff
from tk.core.errors import TkError
from tk.core.run.atomic import atomic_write
from tk.core.run.rng import capture_rng_state, preserved_rng, restore_rng_state  # re-exported (public API)
from tk.core.run.shards import SHARDS_DIR, SHARDS_KEY, check_shards, read_full_model, shard_steps

__all__ = [
    "save_checkpoint", "load_checkpoint", "CheckpointReadError", "intact_checkpoints", "capture_rng_state", "restore_rng_state",
    "CheckpointManager", "preserved_rng", "load_model_state", "read_resume_checkpoint",
]

_MARK = "_tk_checkpoint"  # format version stored in every checkpoint tk writes
_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)\.pt$")


def save_checkpoint(path: str | Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temp file, fsync, ``os.replace``).

    Args:
        path: destination file; its folder is created if needed.
        state: tensors and plain Python only (dicts, lists, tuples, numbers, strings),
            so that :func:`load_checkpoint` can read it with ``weights_only=True``;
            use :func:`capture_rng_state` for RNG states.
    """
    payload = {**state, _MARK: _VERSION}
    atomic_write(Path(path), lambda f: torch.save(payload, f))


class CheckpointReadError(TkError):
    """A checkpoint file is missing, damaged or not a tk checkpoint. ``problem``: the message
    without the intact alternatives it may name."""

    def __init__(self, problem: str, alternatives: str = "") -> None:
        super().__init__(problem + alternatives)
        self.problem = problem


def load_checkpoint(path: str | Path, map_location: Any = "cpu", mmap: bool = False,
                    full_model: bool = True, alternatives: bool = True) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (``weights_only=True``: no code
    in the file is run). With ``mmap`` the tensors are mapped from the file, not read (cheap
    to open; they are read when used).

    A sharded checkpoint (an fsdp run's: ``tk.core.run.shards``) names its shard folder
    under ``"sharded"``, made absolute here; with ``full_model`` this process reads the full
    model weights from it into ``"model"`` (the optimiser state stays in the shards).

    Raises:
        CheckpointReadError: the file is missing, unreadable, not a tk checkpoint, or its
            shard folder is missing or incomplete; a damaged file in a run's checkpoints/ names
            the intact ones beside it (``alternatives``).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointReadError(f"checkpoint {str(path)!r} does not exist; check the path (or the run "
                                  f"folder's checkpoints)")
    with open(path, "rb") as f:
        if f.read(2) != b"PK":  # torch.save writes a zip archive
            raise CheckpointReadError(f"{str(path)!r} is not a checkpoint (not a torch.save zip file); "
                                      f"pass a .pt file written by `tk run`")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # pickle errors, truncated zip files, unsafe types
        raise CheckpointReadError(f"cannot read checkpoint {str(path)!r}: {_load_problem(e)}",
                                  _alternatives(path) if alternatives else "") from e
    if not isinstance(state, dict) or _MARK not in state:
        raise CheckpointReadError(
            f"{str(path)!r} is not a tk checkpoint (no {_MARK!r} marker); for a plain model state_dict "
            "use torch.load + load_model_state"
        )
    state.pop(_MARK)
    if SHARDS_KEY in state:
        folder = path.parent / state[SHARDS_KEY]
        try:
            check_shards(folder)
        except TkError as e:
            raise CheckpointReadError(f"{str(path)!r}: {e}") from None
        state[SHARDS_KEY] = str(folder)
        if full_model:
            state["model"] = read_full_model(folder)
    return state


def _load_problem(e: Exception) -> str:
    """What torch.load's exception means, in a few words (not miniz's paragraph)."""
    text = str(e)
    if isinstance(e, OSError) or "central directory" in text or "failed reading" in text:
        return "the file is truncated or damaged (an incomplete copy or an interrupted write?)"
    first = (text.splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]} (damaged or not a tk checkpoint; tk loads with weights_only=True)"


def _alternatives(path: Path) -> str:
    """``; intact checkpoints beside it: ...`` for a file in a run's checkpoints/ folder."""
    if path.parent.name != "checkpoints":
        return ""
    intact = [p.name for p in intact_checkpoints(path.parent) if p.name != path.name]
    if not intact:
        return f"; no intact checkpoint in {path.parent}"
    return f"; intact checkpoints beside it: {', '.join(intact)}; use one of them instead"


def intact_checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoints of a run's ``checkpoints/`` folder that load, newest step first
    (``last.pt`` and ``best.pt`` before the step files). Each file is read in full."""
    directory = Path(directory)
    steps = sorted(((int(m.group(1)), p) for p in directory.glob("step_*.pt") if (m := _STEP_RE.match(p.name))),
                   reverse=True)
    candidates = [directory / "last.pt", directory / "best.pt", *(p for _, p in steps)]
    intact = []
    for path in candidates:
        if path.is_file():
            try:
                load_checkpoint(path, full_model=False, alternatives=False)  # shards: complete (metadata last)
            except TkError:
                continue
            intact.append(path)
    return intact


# -- rotation --------------------------------------------------------------------------
def _copy_atomic(src: Path, dst: Path) -> None:
    """Make ``dst`` an independent copy of ``src``, atomically (a copy, not a hard link:
    damage to one file must not break the other)."""
    with open(src, "rb") as source:
        atomic_write(dst, lambda f: shutil.copyfileobj(source, f, 1 << 24))


class CheckpointManager:
    """Keeps ``step_XXXXXXXX.pt`` for the last ``keep_last`` saves, plus ``last.pt`` (the
    newest) and ``best.pt`` (best ``metric`` so far). ``last.pt`` and ``best.pt`` are
    separate copies, each written atomically, so that a damaged file breaks only itself.
    ``checkpoints.json`` remembers the best metric across resumes. The shard folders of
    sharded checkpoints (``shards/step_XXXXXXXX``) are kept while a kept file names them.

    Args:
        directory: folder of the checkpoints (created if needed).
        keep_last: number of step files kept (>= 1).
    """

    def __init__(self, directory: str | Path, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self._index = self.directory / "checkpoints.json"
        self.info: dict[str, Any] = json.loads(self._index.read_text()) if self._index.is_file() else {}
        self._save_hooks: list[Callable[[Path], None]] = []

    def add_save_hook(self, hook: Callable[[Path], None]) -> None:
        """Call ``hook(step_path)`` after every complete save (e.g. ``tk run --overwrite``
        deletes the previous run once the new one has its first checkpoint)."""
        self._save_hooks.append(hook)

    def step_path(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.pt"

    def save(self, state: Mapping[str, Any], step: int, metric: float | None = None, mode: str = "max") -> Path:
        """Save ``state`` as the checkpoint of update ``step``; update ``last.pt``, and
        ``best.pt`` when ``metric`` beats the best so far (higher for ``mode="max"``).

        Returns:
            The path of the step file.
        """
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        path, last = self.step_path(step), self.directory / "last.pt"
        save_checkpoint(last, state)  # last.pt first: once step_N.pt exists, last.pt holds step N too
        _copy_atomic(last, path)
        self.info["last"] = {"step": step}
        best = self.info.get("best")
        if metric is not None and metric == metric:  # NaN never wins
            better = best is None or best.get("mode") != mode or (
                metric > best["metric"] if mode == "max" else metric < best["metric"]
            )
            if better:
                _copy_atomic(last, self.directory / "best.pt")
                self.info["best"] = {"step": step, "metric": float(metric), "mode": mode}
        atomic_write(self._index, lambda f: f.write(json.dumps(self.info, indent=2).encode()))
        self._prune()
        for hook in self._save_hooks:
            hook(path)
        return path

    def _steps(self) -> list[tuple[int, Path]]:
        found = [(int(m.group(1)), p) for p in self.directory.glob("step_*.pt") if (m := _STEP_RE.match(p.name))]
        return sorted(found)

    def _prune(self) -> None:
        for _, p in self._steps()[: -self.keep_last]:
            p.unlink(missing_ok=True)
        folders = shard_steps(self.directory)
        if folders:
            named = self._named_shards()
            for folder in folders.values():
                if folder.name not in named:
                    shutil.rmtree(folder, ignore_errors=True)

    def _named_shards(self) -> set[str]:
        """The names of the shard folders the checkpoints here may name: the step files' own,
        and what ``last.pt`` and ``best.pt`` hold and the index says (a killed save may leave
        the index behind the files)."""
        steps = {s for s, _ in self._steps()} | {self.info[k]["step"] for k in ("last", "best") if k in self.info}
        named = {f"step_{s:08d}" for s in steps}
        for name in ("last.pt", "best.pt"):
            try:  # mmap: only the small entries are read
                ref = torch.load(self.directory / name, map_location="cpu", weights_only=True, mmap=True).get(SHARDS_KEY)
            except Exception:  # noqa: BLE001 - missing or damaged: it names nothing usable
                continue
            if isinstance(ref, str):
                named.add(Path(ref).name)
        return named

    def _aside_folder(self, step: int, names: list[str]) -> Path:
        """``abandoned_after_<step>``, or ``..._2``, ``_3``... when an earlier set-aside at the
        same step already holds one of ``names`` (a second abandoned branch: nothing is overwritten)."""
        base = self.directory / f"abandoned_after_{step:08d}"
        folder, n = base, 1
        while any((folder / name).exists() for name in names):
            n += 1
            folder = base.with_name(f"{base.name}_{n}")
        return folder

    def set_aside_after(self, step: int) -> Path | None:
        """Resuming from an older checkpoint (``--resume-from``): move the step files after
        ``step`` with their shard folders, and ``best.pt`` if it is from after ``step``, into
        ``abandoned_after_<step>/``, so that rotation, ``tk average`` and ``best.pt`` never mix
        the abandoned branch with the resumed one. Shard folders go before their files: a
        set-aside killed midway is finished by the next one, into the same folder. Only shard
        folders no checkpoint file names (a save killed before its file) are deleted. Returns
        the folder, or None.
        """
        later = [p for s, p in self._steps() if s > step]
        best = self.info.get("best")
        stale_best = best is not None and best.get("step", -1) > step
        shards = {s: f for s, f in shard_steps(self.directory).items() if s > step}
        if shards:
            named = self._named_shards()
            for s in [s for s, f in shards.items() if f.name not in named]:
                shutil.rmtree(shards.pop(s), ignore_errors=True)
        if not later and not stale_best and not shards:
            return None
        moving = [p.name for p in later] + [f"{SHARDS_DIR}/{f.name}" for f in shards.values()]
        folder = self._aside_folder(step, moving + (["best.pt"] if stale_best else []))
        folder.mkdir(exist_ok=True)
        for s in sorted(shards):
            (folder / SHARDS_DIR).mkdir(exist_ok=True)
            shards[s].rename(folder / SHARDS_DIR / shards[s].name)  # the files name them relative to themselves
        for path in later:
            path.rename(folder / path.name)
        if stale_best:
            if (self.directory / "best.pt").is_file():
                (self.directory / "best.pt").rename(folder / "best.pt")
            del self.info["best"]
        self.info["last"] = {"step": step}
        atomic_write(self._index, lambda f: f.write(json.dumps(self.info, indent=2).encode()))
        return folder

    def prepare_resume(self, step: int) -> Path | None:
        """Before a run resumes at ``step``: delete the temp files of a save that a killed
        process left behind, then :meth:`set_aside_after` (returns its folder or None)."""
        for stale in [*self.directory.glob(".*.tmp"), *self.directory.glob("*/.*.tmp")]:
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        return self.set_aside_after(step)

    def latest(self) -> Path | None:
        """``last.pt`` if present, else the newest step file, else None."""
        last = self.directory / "last.pt"
        if last.is_file():
            return last
        steps = self._steps()
        return steps[-1][1] if steps else None

    def best(self) -> Path | None:
        """``best.pt`` if a metric was ever given, else None."""
        best = self.directory / "best.pt"
        return best if best.is_file() else None


# -- model states ----------------------------------------------------------------------
def _strip_wrapper_prefix(state_dict: Mapping[str, Any], model_keys: set[str]) -> Mapping[str, Any]:
    """Drop DDP's ``module.`` / torch.compile's ``_orig_mod.`` prefixes if the model lacks them."""
    for prefix in ("module.", "_orig_mod."):
        if state_dict and all(k.startswith(prefix) for k in state_dict) and not any(k.startswith(prefix) for k in model_keys):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def _listing(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def load_model_state(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Load ``state_dict`` into ``model``, explaining any mismatch.

    Args:
        model: the freshly built model.
        state_dict: parameters and buffers, e.g. ``load_checkpoint(p)["model"]``.
        strict: raise on any mismatch; with False, load what matches and skip
            missing, unexpected and wrongly shaped entries.

    Raises:
        TkError: (strict) missing keys, unexpected keys or shape mismatches, the first few
            of each with counts.
    """
    own = model.state_dict()
    state_dict = _strip_wrapper_prefix(state_dict, set(own))
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    shapes = sorted(
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state_dict.items()
        if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape
    )
    if strict and (missing or unexpected or shapes):
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {_listing(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {_listing(unexpected)}")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es): {_listing(shapes)}")
        raise TkError(
            f"checkpoint does not fit {type(model).__name__}: " + "; ".join(parts) + ". The checkpoint "
            "comes from another model or config: rebuild the model with the recipe it was trained with "
            "(saved next to the checkpoint), or load with strict=False to skip these entries"
        )
    bad = {s.split(":")[0] for s in shapes}
    model.load_state_dict({k: v for k, v in state_dict.items() if k not in bad}, strict=strict)


def read_resume_checkpoint(path: str | Path, map_location: Any = "cpu", task: str | None = None) -> dict[str, Any]:
    """The checkpoint ``--resume`` names.

    Raises:
        TkError: there is no file at ``path``, or it is a checkpoint of another task than ``task``.
    """
    if not Path(path).is_file():
        raise TkError(f"--resume: no checkpoint found at {path}; start a new run with --overwrite")
    state = load_checkpoint(path, map_location=map_location, full_model=False)  # shards are read sharded
    saved = state.get("task")
    if task is not None and saved is not None and saved != task:
        recipe = Path(path).resolve().parent.parent / "config.yaml"
        raise TkError(f"--resume: {path} is a checkpoint of task {saved}, not {task}; continue it with its "
                      f"own recipe (`tk run {recipe} --resume-from {path}`), or start this run without --resume-from")
    return state


def load_resumed_model(model: nn.Module, state: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """Load a resumed checkpoint's weights into ``model``; returns the settings that differ
    from the checkpoint's run (``config_diff`` lines).

    Raises:
        TkError: the weights do not fit, naming them and the model settings that changed.
    """
    diff = config_diff(state.get("config", {}), dict(config))
    try:
        load_model_state(model, state["model"])
    except TkError as e:
        changed = "; ".join(d for d in diff if not d.startswith(("train.", "output_dir"))) or "none"
        raise TkError(f"{e}. Settings that differ from the checkpoint's run: {changed}") from None
    return diff
