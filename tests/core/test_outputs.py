"""What commands write outside a fresh run dir (tk.core.run.outputs): never a run, a run's
checkpoints, the current folder or a folder holding the source; an existing output only
with --overwrite and only if the same command wrote it; temporary siblings renamed into
place with normal permissions."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from tk.core.errors import TkError
from tk.core.run.atomic import atomic_write
from tk.core.run.checkpoint import save_checkpoint
from tk.core.run.outputs import OUTPUT_MARKER, WRITTEN_BY, check_merge, check_output, write_output_folder, written_by
from tk.core.run.run_dir import RUN_MARKER


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A run (with checkpoints), a user's folder and file, tmp_path as the current folder."""
    run = tmp_path / "runs" / "a"
    (run / "checkpoints").mkdir(parents=True)
    (run / RUN_MARKER).write_text("id")
    save_checkpoint(run / "checkpoints" / "last.pt", {"model": {"w": torch.ones(2)}, "step": 3})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.txt").write_text("years of work")
    (tmp_path / "notes.pt").write_bytes(b"a user's file")
    monkeypatch.chdir(tmp_path)
    return tmp_path, run


def refusal(path, command="tk export", overwrite=True, sources=()) -> str:
    with pytest.raises(TkError) as e:
        check_output(path, command, overwrite, sources)
    message = str(e.value)
    assert len(message.splitlines()) == 1 and str(path) in message
    return message


def test_places_no_command_writes_over_even_with_overwrite(tree):
    root, run = tree
    assert "is the current folder" in refusal(".")
    assert "is the current folder" in refusal(root)
    assert "holds the current folder" in refusal(root.parent)
    assert "is the run being read" in refusal(run, sources=[run])
    assert "holds the run being read" in refusal(root / "runs", sources=[run])
    assert "is a tk run dir" in refusal(run)  # another run
    assert "inside the checkpoints of the run" in refusal(run / "checkpoints" / "last.pt", "tk average")
    assert "inside the checkpoints of the run" in refusal(run / "checkpoints" / "new.pt", "tk average")
    assert "inside the checkpoints of the run" in refusal(run / "checkpoints" / "sub" / "x.png", "tk plot")


def test_what_the_user_owns_is_refused_without_suggesting_overwrite(tree):
    root, _ = tree
    for overwrite in (False, True):
        message = refusal(root / "mine", overwrite=overwrite)
        assert "a folder tk did not write" in message and "--overwrite" not in message
        message = refusal(root / "notes.pt", "tk average", overwrite=overwrite)
        assert "a file tk did not write" in message and "--overwrite" not in message


def test_another_commands_output_is_not_this_ones(tree):
    root, _ = tree
    save_checkpoint(root / "avg.pt", {"model": {}, WRITTEN_BY: "tk average"})
    assert "a file tk average wrote" in refusal(root / "avg.pt", "tk export")


def test_own_output_needs_overwrite_and_new_or_empty_places_are_free(tree):
    root, _ = tree
    write_output_folder(root / "exported", "tk export", lambda tmp: (tmp / "model.bin").write_bytes(b"1"))
    assert "pass --overwrite to replace it" in refusal(root / "exported", overwrite=False)
    assert check_output(root / "exported", "tk export", True) == root / "exported"
    (root / "empty").mkdir()
    assert check_output(root / "empty", "tk export", False, folder=True) == root / "empty"
    assert check_output(root / "new" / "deeper", "tk export", False) == root / "new" / "deeper"


def test_written_by_reads_each_kind_of_file(tmp_path):
    save_checkpoint(tmp_path / "a.pt", {"model": {}, WRITTEN_BY: "tk average"})
    save_checkpoint(tmp_path / "old.pt", {"model": {}, "averaged_steps": [1, 2]})  # before the mark existed
    save_checkpoint(tmp_path / "run.pt", {"model": {}, "step": 1})
    save_file({"w": torch.ones(1)}, tmp_path / "a.safetensors", metadata={WRITTEN_BY: "tk average"})
    save_file({"w": torch.ones(1)}, tmp_path / "b.safetensors")
    (tmp_path / "broken.safetensors").write_bytes(b"\x00" * 3)
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig = plt.figure()
    fig.savefig(tmp_path / "a.png", metadata={WRITTEN_BY: "tk plot"})
    fig.savefig(tmp_path / "b.png")
    plt.close(fig)
    found = {p.name: written_by(p) for p in sorted(tmp_path.iterdir())}
    assert found == {"a.pt": "tk average", "old.pt": "tk average", "run.pt": None, "a.safetensors": "tk average",
                     "b.safetensors": None, "broken.safetensors": None, "a.png": "tk plot", "b.png": None}


def test_a_folder_is_renamed_into_place_with_normal_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        out = tmp_path / "out"
        write_output_folder(out, "tk export", lambda tmp: (tmp / "w.bin").write_bytes(b"new"), {"format": "x"})
    finally:
        os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "w.bin"]
    assert written_by(out) == "tk export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_write_keeps_the_previous_output_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "out"
    write_output_folder(out, "tk export", lambda tmp: (tmp / "w.bin").write_bytes(b"old"))

    def fail(tmp):
        (tmp / "w.bin").write_bytes(b"half")
        raise RuntimeError("trace failed")

    with pytest.raises(RuntimeError):
        write_output_folder(out, "tk export", fail)
    assert (out / "w.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    write_output_folder(out, "tk export", lambda tmp: (tmp / "w.bin").write_bytes(b"new"))
    assert (out / "w.bin").read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_writes_get_normal_file_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "f.bin", lambda f: f.write(b"x"))
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "f.bin").stat().st_mode) == 0o644


def test_task_files_are_never_merged_over_another_runs(tmp_path):
    ours = tmp_path / "run" / "artifacts"
    ours.mkdir(parents=True)
    (ours / "tokenizer.json").write_text("ours")
    target = tmp_path / "out" / "artifacts"
    check_merge(ours, target, tmp_path / "out" / "avg.safetensors")  # nothing there yet
    target.mkdir(parents=True)
    (target / "tokenizer.json").write_text("ours")
    check_merge(ours, target, tmp_path / "out" / "avg.safetensors")  # the same files: nothing lost
    (target / "tokenizer.json").write_text("another run's")
    with pytest.raises(TkError, match="tokenizer.json already exists and is not this run's"):
        check_merge(ours, target, tmp_path / "out" / "avg.safetensors")


def test_overwrite_keeps_what_the_command_did_not_write(tmp_path):
    out = tmp_path / "exported"
    write_output_folder(out, "tk export", lambda tmp: (tmp / "model.bin").write_bytes(b"1"))
    (out / "notes.txt").write_text("mine")
    (out / "deep").mkdir()
    (out / "deep" / "run.pt").write_bytes(b"a run stored here")
    message = refusal(out, "tk export")
    assert "holds deep/run.pt, notes.txt, which tk export did not write" in message
    assert (out / "notes.txt").read_text() == "mine"


def test_a_checkpoint_being_read_inside_the_output_is_refused(tmp_path):
    out = tmp_path / "exported"
    write_output_folder(out, "tk export", lambda tmp: (tmp / "avg.pt").write_bytes(b"1"))
    assert "holds the run being read" in refusal(out, sources=[tmp_path / "run", out / "avg.pt"])


def test_what_a_file_is_comes_from_its_content_not_its_name(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from tk.core.run.curves import _save

    fig = plt.figure()
    _save(fig, tmp_path / "curves.pt")  # a PNG named .pt
    plt.close(fig)
    assert written_by(tmp_path / "curves.pt") == "tk plot"
    assert "a file tk plot wrote" in refusal(tmp_path / "curves.pt", "tk average")


def test_plot_never_writes_through_a_fixed_temporary_name(tmp_path):
    """A file or link named like a temporary file beside the output is left alone."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from tk.core.run.curves import _save

    precious = tmp_path / "best.pt"
    precious.write_bytes(b"a checkpoint")
    (tmp_path / ".ck.png.tmp").symlink_to(precious)
    fig = plt.figure()
    _save(fig, tmp_path / "ck.png")
    plt.close(fig)
    assert precious.read_bytes() == b"a checkpoint" and not (tmp_path / "ck.png").is_symlink()


def test_paths_under_a_file_folder_names_and_the_checkpoints_folder(tree):
    root, run = tree
    assert "is a file, not a folder" in refusal(root / "notes.pt" / "sub")
    with pytest.raises(TkError, match="names a folder; give a file name"):
        check_output(f"{root}/plots/", "tk plot", False)
    assert "the checkpoints folder of the run" in refusal(run / "checkpoints")


def test_a_failed_write_removes_the_folders_it_created(tmp_path):
    def fail(tmp):
        raise RuntimeError("trace failed")

    with pytest.raises(RuntimeError):
        write_output_folder(tmp_path / "a" / "b" / "out", "tk export", fail)
    assert list(tmp_path.iterdir()) == []


def test_task_files_and_their_copies_get_normal_permissions(tmp_path):
    from tk.core.artifacts import TaskFiles

    mask = os.umask(0o022)
    try:
        files = TaskFiles(tmp_path / "run")
        files.write_text("labels.json", "[]")
        copied = files.copy_to(tmp_path / "export")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "run" / "artifacts" / "labels.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((copied / "labels.json").stat().st_mode) == 0o644
