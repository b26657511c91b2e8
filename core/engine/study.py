"""The Optuna side of ``tk sweep``: a study's storage (a journal file or a database), its
sampler and pruner, and a handle on one of its trials from any process."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tk.core.engine.search_space import SearchSpace
from tk.core.errors import TkError

__all__ = ["STUDY_NAME", "build_pruner", "build_sampler", "open_storage", "open_study", "trial_handle"]

STUDY_NAME = "tk-sweep"


def open_storage(url: str) -> Any:
    """An Optuna storage: an RDB URL (``sqlite:///``, ``postgresql://``, ``mysql://``) or a
    journal file path.

    Raises:
        TkError: the database cannot be reached, or the journal's folder does not exist.
    """
    import optuna

    if "://" in url:
        try:
            return optuna.storages.RDBStorage(url)
        except Exception as e:  # sqlalchemy/driver errors of many kinds
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TkError(f"--storage: cannot open {url} ({first}); check the URL, that the server is up and its "
                          f"driver installed") from None
    path = Path(url).expanduser()
    if not path.parent.is_dir():
        raise TkError(f"--storage: the folder of {path} does not exist; give a journal file in an existing folder "
                      f"(shared by the machines) or a database URL")
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))


def build_sampler(space: SearchSpace, seed: int | None = None) -> Any:
    """The space's sampler, seeded by ``seed`` (default: the space's)."""
    import optuna

    seed = space.seed if seed is None else seed
    if space.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if space.sampler == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def build_pruner(name: str) -> Any:
    import optuna

    return {"none": optuna.pruners.NopPruner, "hyperband": optuna.pruners.HyperbandPruner,
            "asha": optuna.pruners.SuccessiveHalvingPruner,
            "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2)}[name]()


def open_study(spec: Mapping[str, Any], sampler: Any = None) -> Any:
    """The study of ``spec`` (``storage``, ``study``, ``pruner``; :meth:`Sweep.trial_spec`)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=spec["study"], storage=open_storage(spec["storage"]),
                             pruner=build_pruner(spec.get("pruner", "none")), sampler=sampler)


def trial_handle(study: Any, number: int) -> Any:
    """The live ``optuna.trial.Trial`` of trial ``number`` (to report to or annotate it from
    another process than the one that asked for it)."""
    import optuna

    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)  # no public API
    return optuna.trial.Trial(study, trial_id)
