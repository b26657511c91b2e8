"""`tk list` (metadata only: imports no plugin) and `tk info` (every config key with type,
default and doc; a broken plugin shown as broken)."""

import json
import os
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from tests.core.distributions import write_distribution
from tk.core.cli import cli

RECORDING_PLUGIN = textwrap.dedent('''
    import os
    open(os.environ["TK_TEST_IMPORT_LOG"], "a").write(__name__ + "\\n")
    raise ImportError("boom: missing dependency")
''')


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_info_lists_every_key_with_type_default_and_doc():
    result = invoke("info", "image_classification")
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.startswith("image_classification: Image classification")
    sections = [line.split(":")[0] for line in out.splitlines() if line and not line.startswith(" ")][1:]
    assert sections[:5] == ["data", "model", "mixup", "loss", "predict"] and sections[-3:] == ["optim", "schedule", "train"]
    lines = out.splitlines()
    mixup = lines[lines.index(next(line for line in lines if line.startswith("mixup:"))) + 1:]
    assert mixup[0].split("#")[0].strip() == "mixup_alpha: float = 0.0"
    assert mixup[0].split("#", 1)[1].strip() == "Beta(a, a) parameter of Mixup; 0 = Mixup off"
    assert any(line.startswith("  cutmix_alpha: float = 0.0") and "CutMix off" in line for line in mixup)
    assert any(line.startswith("  mode: 'batch' | 'pair' | 'elem' = \"batch\"") for line in mixup)
    assert "  top_k: int = 5" in out and "  max_steps: int | None = null" in out


def test_info_json_for_scripts():
    result = invoke("info", "image_classification", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["task"] == "image_classification" and info["distribution"] == "tk"
    loss = {k["key"]: k for k in info["sections"]["loss"]["keys"]}
    assert loss["label_smoothing"] == {"key": "label_smoothing", "type": "float", "default": 0.0,
                                       "required": False, "doc": "epsilon in [0, 1), training only; Mixup/CutMix "
                                                                 "targets are smoothed alike"}
    assert info["sections"]["train"]["owner"] == "core" and info["sections"]["mixup"]["owner"] == "task"


def test_info_of_a_broken_or_unknown_plugin(tmp_path, monkeypatch):
    site = write_distribution(tmp_path, "tk-broken", "tk_broken_plugin", "raise ImportError('boom: missing dep')\n",
                              {"tk.tasks": {"broken": "tk_broken_plugin:Task"}})
    monkeypatch.syspath_prepend(str(site))
    result = invoke("info", "broken")
    assert result.exit_code == 2
    assert result.stderr == ("error: task 'broken' (entry point 'tk_broken_plugin:Task' of tk-broken) failed to "
                             "import: ImportError: boom: missing dep\n")
    unknown = invoke("info", "image_clasification")
    assert unknown.exit_code == 2 and "did you mean 'image_classification'?" in unknown.stderr


def test_list_reads_metadata_and_imports_no_plugin(tmp_path):
    """In a fresh interpreter: `tk list` shows every task with its distribution, version and
    summary, yet neither the recording plugin nor the built-in image plugin gets imported."""
    site = write_distribution(tmp_path / "site", "tk-recorder", "tk_recorder_plugin", RECORDING_PLUGIN,
                              {"tk.tasks": {"recorder": "tk_recorder_plugin:Task"}},
                              summary="Records its own import (test plugin)")
    log = tmp_path / "imports.log"
    script = textwrap.dedent('''
        import sys
        from click.testing import CliRunner
        from tk.core.cli import cli
        result = CliRunner().invoke(cli, ["list"])
        print(result.output)
        print("EXIT", result.exit_code)
        print("LOADED", sorted(m for m in sys.modules if m.startswith(("tk.plugins.", "tk_recorder"))))
    ''')
    env = {**os.environ, "TK_TEST_IMPORT_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "EXIT 0" in lines and "LOADED []" in lines
    assert not log.exists()
    recorder = next(line for line in lines if line.strip().startswith("recorder"))
    assert "[tk-recorder 0.1]" in recorder and "Records its own import (test plugin)" in recorder
    image = next(line for line in lines if line.strip().startswith("image_classification"))
    assert "[tk " in image and "(run tk info image_classification)" in image
    assert "recipes:" in lines and any(line.strip().startswith("quickstart") for line in lines)


def test_a_one_stack_task_neither_lists_nor_takes_encoder_decoder_keys(tmp_path):
    runner = CliRunner()
    for task in ("language_model", "sft", "mlm", "text_classification"):
        model = json.loads(runner.invoke(cli, ["info", task, "--json"]).output)["sections"]["model"]
        keys = {row["key"] for row in model["keys"]}
        assert "dim" in keys and not keys & {"encoder_depth", "decoder_depth", "share_embeddings"}, task
    translation = json.loads(runner.invoke(cli, ["info", "translation", "--json"]).output)["sections"]["model"]
    assert "encoder_depth" in {row["key"] for row in translation["keys"]}
    result = runner.invoke(cli, ["validate", "lm_synthetic", "model.encoder_depth=2"])
    assert result.exit_code == 2 and "encoder_depth applies to encoder-decoders (translation) only" in result.output
