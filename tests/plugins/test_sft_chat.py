"""Using a finished sft run: ``tk chat`` (piped and interactive, streamed, multi-turn, /reset),
``tk predict`` on a .jsonl of rows in the data formats, and generated samples in train.log."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.engine.inference import load_run
from tk.core.engine.predict import read_inputs
from tk.core.errors import TkError
from tk.core.text.stream import REPLACEMENT, TextStream
from tk.plugins.sft.cli import Conversation, _interactive

REVERSE, SORT = "reverse: red cat", "sort: dog sun"


def user(text):
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_chat") / "run"
    args = ["run", "sft_synthetic", "data.num_train=300", "data.num_val=20", "model.dim=64", "model.depth=1",
            "model.num_heads=2", "optim.lr=8e-3", "train.max_steps=60", "train.eval_every=60", "train.batch_size=16",
            "train.progress=false", "generate.num_samples=2", f"output_dir={out}"]  # a few seconds: it says words
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def loaded(run):
    return load_run(run, "best")


def chat(run, lines, *args):
    return CliRunner().invoke(cli, ["chat", str(run), *args], input="".join(f"{x}\n" for x in lines))


def test_piped_chat_answers_each_line_and_keeps_the_history(run, loaded):
    task, model = loaded
    result = chat(run, [REVERSE, "", SORT])  # a blank line is no message
    assert result.exit_code == 0, result.output
    first = task.reply(model, [user(REVERSE)])
    second = task.reply(model, [user(REVERSE), {"role": "assistant", "content": first}, user(SORT)])
    assert first  # the model says something: the comparison is not between empty strings
    assert result.stdout.splitlines() == [first, second]


def test_reset_keeps_the_system_message_and_exit_ends_the_chat(run, loaded):
    task, model = loaded
    result = chat(run, [REVERSE, "/reset", REVERSE, "/exit", SORT], "--system", "be brief.")
    alone = task.reply(model, [{"role": "system", "content": "be brief."}, user(REVERSE)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [alone, alone]


def test_streamed_pieces_add_up_to_the_reply(loaded):
    task, model = loaded
    # sampling from the whole vocabulary: byte tokens that end inside a UTF-8 character are held back
    cfg = dataclasses.replace(task.gen_cfg, strategy="sample", seed=0, min_len=12, max_len=24)
    pieces = []
    text = task.reply(model, [user(SORT)], cfg, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == text == task.reply(model, [user(SORT)], cfg)
    ids = task.tokenizer.encode("héllo ☃ wörld", add_special_tokens=False)
    sent = []
    stream = TextStream(lambda new: task.tokenizer.decode(new).strip(), sent.append, [])
    for t in ids:
        stream(len(sent), torch.tensor([t]))
    stream.finish(task.tokenizer.decode(ids).strip())
    assert "".join(sent) == "héllo ☃ wörld" and not any(REPLACEMENT in p for p in sent)


def test_a_conversation_too_long_is_one_line_and_the_terminal_chat_goes_on(run, loaded, monkeypatch, capsys):
    task, model = loaded
    long = "repeat: " + "red cat " * 80
    first = task.reply(model, [user(REVERSE)])
    result = chat(run, [REVERSE, long, SORT])  # piped: the replies so far, then one line and exit 2
    assert result.exit_code == 2 and result.stdout.splitlines() == [first]
    assert len(result.stderr.strip().splitlines()) == 1
    assert "exceeds model.max_len" in result.stderr and "a /reset line starts a new conversation" in result.stderr
    typed = iter([REVERSE, long, SORT, "/exit", REVERSE])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(typed))
    _interactive(Conversation(task, model, None), str(run))
    out = capsys.readouterr()
    assert "exceeds model.max_len" in out.err and "; /reset starts a new conversation" in out.err
    then = task.reply(model, [user(REVERSE), {"role": "assistant", "content": first}, user(SORT)])
    assert f"assistant> {first}\n" in out.out and f"assistant> {then}\n" in out.out  # the failed turn was not kept
    assert out.out.count("assistant> ") == 2  # nothing after /exit


def test_predict_reads_a_jsonl_of_rows_in_any_format(run, loaded, tmp_path):
    task, model = loaded
    rows = [{"prompt": REVERSE},
            {"messages": [user("hi"), {"role": "assistant", "content": "hello"}, user(SORT),
                          {"role": "assistant", "content": "dog sun"}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    result = CliRunner().invoke(cli, ["predict", str(run), str(path), "a plain prompt"])
    assert result.exit_code == 0, result.output
    records = [json.loads(x) for x in result.stdout.splitlines()]
    assert records[0] == {"input": rows[0], "reply": task.reply(model, [user(REVERSE)])}
    assert records[1] == {"input": rows[1], "reference": "dog sun",
                          "reply": task.reply(model, rows[1]["messages"][:-1])}
    assert records[2]["input"] == "a plain prompt" and "reply" in records[2]
    path.write_text('{"prompt": "hi"}\n{"prompt": \n')
    with pytest.raises(TkError, match="prompts.jsonl line 2: not JSON"):
        list(read_inputs([str(path)]))
    path.write_text('{"question": "hi"}\n')
    result = CliRunner().invoke(cli, ["predict", str(run), str(path)])
    assert result.exit_code == 1 and "fit no format" in json.loads(result.stdout)["error"]


def test_another_tasks_run_is_refused_in_one_line(run, tmp_path):
    other = tmp_path / "lm"
    other.mkdir()
    (other / "config.yaml").write_text((run / "config.yaml").read_text().replace("task: sft", "task: language_model"))
    result = chat(other, [REVERSE])
    assert result.exit_code == 2 and result.output.strip().count("\n") == 0
    assert "is a 'language_model' run; tk chat needs an sft run" in result.output


def test_each_evaluation_logs_generated_answers_with_their_reference(run):
    lines = [x for x in (run / "train.log").read_text().splitlines() if " sample " in x]
    assert len(lines) == 2 and all(x.startswith("val sample ") and "at step 60: " in x for x in lines)
    assert all(" -> '" in x and "(reference '" in x for x in lines)
