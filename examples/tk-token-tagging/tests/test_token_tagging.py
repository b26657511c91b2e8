"""The example's own tests (run after `pip install -e .`): spans by hand, two training steps."""

from click.testing import CliRunner
from tk_token_tagging.spans import bio_spans, prf, span_counts

from tk.core.cli import cli


def test_exact_span_match_by_hand():
    gold = ["B-PER", "I-PER", "O", "B-LOC"]
    pred = ["B-PER", "O", "O", "B-LOC"]  # PER cut short: wrong
    assert bio_spans(gold) == [("PER", 0, 2), ("LOC", 3, 4)]
    assert span_counts(gold, pred) == (1, 2, 2)
    assert prf(1, 2, 2) == (0.5, 0.5, 0.5)


def test_recipe_trains_two_steps(tmp_path):
    result = CliRunner().invoke(cli, ["run", "token_tagging_synthetic", f"output_dir={tmp_path / 'run'}",
                                      "train.max_steps=2", "train.eval_every=2", "data.num_train=64",
                                      "data.num_val=16", "train.progress=false", "train.device=cpu"])
    assert result.exit_code == 0, result.output
    assert "val/entity_f1=" in result.output
