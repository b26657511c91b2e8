"""Task discovery through entry points: lazy, deduplicated, conflicts and broken plugins."""

import importlib.metadata as md

import pytest

from tests.core.distributions import write_distribution
from tk.core.errors import TkError
from tk.core.registry import COMMANDS_GROUP, available_tasks, discover, discover_commands, load_task
from tk.core.task import Task


def ep(name: str, value: str) -> md.EntryPoint:
    return md.EntryPoint(name=name, value=value, group="tk.tasks")


class Good(Task):
    """A good task."""


def test_available_tasks_reads_metadata_only():
    eps = [ep("zeta", "no_such_module_xyz:Task"), ep("alpha", "tests.core.test_registry:Good")]
    assert available_tasks(eps) == ["alpha", "zeta"]  # sorted; nothing imported


def test_same_entry_point_twice_is_not_a_conflict():
    eps = [ep("good", f"{__name__}:Good"), ep("good", f"{__name__}:Good")]
    assert load_task("good", eps) is Good


def test_two_targets_for_one_name_is_a_clear_error():
    eps = [ep("dup", f"{__name__}:Good"), ep("dup", "other_pkg:Task")]
    assert discover(eps)["dup"].conflicts == [(None, "other_pkg:Task")]
    with pytest.raises(TkError, match="'dup' is claimed by .*Good.* and .*other_pkg:Task"):
        load_task("dup", eps)


def test_broken_plugin_is_wrapped_and_does_not_break_others():
    eps = [ep("broken", "no_such_module_xyz:Task"), ep("good", f"{__name__}:Good")]
    with pytest.raises(TkError, match="task 'broken' .* failed to import: ModuleNotFoundError"):
        load_task("broken", eps)
    assert load_task("good", eps) is Good


def test_non_task_object_is_a_type_error():
    with pytest.raises(TypeError, match="not a subclass of tk.core.task.Task"):
        load_task("bad", [ep("bad", "os:path")])


def test_unknown_name_suggests_and_lists():
    with pytest.raises(TkError, match=r"unknown task 'godo'; did you mean 'good'\? \(available: good"):
        load_task("godo", [ep("good", f"{__name__}:Good")])


def test_import_path_for_local_plugin():
    assert load_task(f"{__name__}:Good") is Good
    with pytest.raises(TkError, match="cannot import module 'no_such_mod_q'"):
        load_task("no_such_mod_q:Task")


def test_real_discovery_through_dist_info(toy_site):
    entry = discover()["toy"]
    assert entry.distribution == "tk-toy"
    assert load_task("toy").__name__ == "ToyTask"


def test_builtin_tasks_registered():
    assert {"image_classification", "language_model", "text_classification", "translation"} <= set(available_tasks())
    assert {"generate", "translate"} <= set(discover_commands())


def test_distribution_version_and_summary_come_from_metadata(tmp_path, monkeypatch):
    write_distribution(tmp_path, "tk-meta-demo", "tk_meta_demo", "raise ImportError('never imported')\n",
                       {"tk.tasks": {"demo": "tk_meta_demo:Task"}, COMMANDS_GROUP: {"demo-cmd": "tk_meta_demo:cli"}},
                       summary="A demo plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = discover()["demo"]
    assert (entry.distribution, entry.version, entry.summary) == ("tk-meta-demo", "0.1", "A demo plugin")
    assert entry.provider == "tk-meta-demo 0.1"
    assert "demo-cmd" not in discover() and "demo-cmd" in discover_commands()  # groups stay apart
    assert "demo" not in discover_commands()
    assert discover([ep("hand", "x:y")])["hand"].provider == "?"
