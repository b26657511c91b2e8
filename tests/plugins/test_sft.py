"""The sft task: formats into messages, targets on the assistant's tokens only (end-of-turn
included), the loss divided by the target count (checked by hand), a run that learns, and a run
from a Hugging Face folder with its own chat template that exports back."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.errors import TkError
from tk.plugins.sft.data import IGNORE, Counts, make_example, to_messages


def test_every_format_becomes_messages():
    want = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
    assert to_messages({"prompt": "hi", "completion": "hello"}, "auto", "be brief.") == want
    assert to_messages({"instruction": "hi", "input": "", "output": "hello"}, "auto", "be brief.") == want
    assert to_messages({"messages": want}, "auto", "other")[0]["content"] == "be brief."  # a system message is kept
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert to_messages(sharegpt, "auto", "be brief.") == want
    alpaca = to_messages({"instruction": "translate", "input": "chat", "output": "cat"}, "alpaca", None)
    assert alpaca[0]["content"] == "translate\n\nchat"
    with pytest.raises(TkError, match="fit no format"):
        to_messages({"question": "hi", "answer": "x"}, "auto", None)


def test_targets_are_the_next_tokens_where_the_mask_is_set_and_counts_are_kept():
    counts = Counts()
    assert make_example([5, 6, 7, 8], [0, 0, 1, 1], 10, counts) == ([5, 6, 7], [IGNORE, 7, 8])
    assert make_example([5, 6, 7, 8], [0, 0, 0, 0], 10, counts) is None
    assert make_example([5, 6, 7, 8, 9, 10], [0, 0, 0, 0, 1, 1], 3, counts) is None  # truncated, then nothing left
    assert (counts.examples, counts.truncated, counts.dropped, counts.targets) == (3, 1, 2, 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "run"
    args = ["run", "sft_synthetic", "data.num_train=600", "data.num_val=100", "model.dim=64", "model.depth=2",
            "train.max_steps=80", "train.eval_every=80", "train.batch_size=16", "train.progress=false",
            "train.log_every=10", f"output_dir={out}"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_a_synthetic_run_learns_and_logs_its_counts(run):
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "val"][-1]
    assert val["val/loss"] < 2.5 and val["val/token_accuracy"] > 0.3  # a uniform guess: ln(vocab) ~ 5.8, 0.003
    log = (run / "train.log").read_text()
    assert "train: 600 examples" in log and "0 dropped with no target token" in log


def test_the_loss_is_the_target_tokens_mean_and_the_end_of_turn_is_a_target(run):
    from tk.core.engine.inference import load_run

    task, model = load_run(run, "last", [])
    batch = task.collate([task.build_dataset("val")[i] for i in range(4)])
    out = task.loss(model.eval(), batch)
    logits = model(batch["tokens"])
    keep = batch["targets"].ne(IGNORE)
    by_hand = F.cross_entropy(logits[keep], batch["targets"][keep], reduction="sum")
    assert int(out.num_items) == int(keep.sum())
    torch.testing.assert_close(out.loss, by_hand)
    end = task.tokenizer.token_id("<|im_end|>")
    inputs, targets = task.build_dataset("val")[0]
    assert end in [t for t in targets if t != IGNORE]  # the assistant's end of turn is learned (the model stops)
    prompt_ends = [t for x, t in zip(inputs[1:], targets) if x == task.tokenizer.token_id("<|im_start|>")]
    assert prompt_ends and all(t == IGNORE for t in prompt_ends)  # nothing of the user's turn is learned
    assert "reply" in task.predict(model, ["reverse: sun moon"])[0]


def test_a_run_from_a_hf_folder_with_its_chat_template_exports_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.core.test_chat import CHATML_TAGGED
    from tests.plugins.hf_tiny import save_tiny
    from tk.core.engine.inference import load_run

    save_tiny("qwen2", tmp_path / "m")
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    fast.chat_template = CHATML_TAGGED
    fast.save_pretrained(tmp_path / "m")
    rows = [{"messages": [{"role": "user", "content": f"the quick {i}"}, {"role": "assistant", "content": "brown fox"}]}
            for i in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sft.yaml").write_text(  # a recipe without shape keys: the folder's shape is used
        "# SFT from a tiny stand-in; tk run sft.yaml\ntask: sft\n"
        f"data: {{source: files, train_file: {tmp_path / 'train.jsonl'}, max_len: 64}}\n"
        f"model: {{pretrained_from: {tmp_path / 'm'}}}\n"
        "train: {max_steps: 3, eval_every: 3, batch_size: 4, progress: false}\n")
    args = ["run", str(tmp_path / "sft.yaml"), f"output_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "artifacts" / "chat_template.jinja").read_text() == CHATML_TAGGED
    task, model = load_run(tmp_path / "run", "last", [])
    # the run's examples are transformers' apply_chat_template ids, its targets transformers' assistant mask
    want = fast.apply_chat_template(rows[-1]["messages"], tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
    inputs, targets = task.build_dataset("val")[-1]
    assert inputs == want["input_ids"][:-1]
    assert [t != IGNORE for t in targets] == [bool(m) for m in want["assistant_masks"][1:]]
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "--format", "hf", "-o", str(tmp_path / "exp")])
    assert result.exit_code == 0, result.output
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-4)


def test_a_packed_batch_has_the_loss_of_its_examples_alone(run):
    """Packing (best-fit decreasing, block-causal mask, positions restarting) changes no example's
    loss: the packed batch's summed loss and target count equal the sum over the examples alone."""
    from tk.core.engine.inference import load_run
    from tk.plugins.sft.data import collate_examples, pack_examples

    task, model = load_run(run, "last", [])
    examples = task.splits["val"][:24]
    rows = pack_examples(examples, 64)
    assert sorted(map(id, (e for r in rows for e in r))) == sorted(map(id, examples))  # each example once
    assert all(sum(len(x) for x, _ in r) <= 64 for r in rows) and len(rows) < len(examples) / 2
    with torch.no_grad():
        packed = task.loss(model.eval(), collate_examples(rows, task.meta["pad_id"]))
        alone = [task.loss(model, collate_examples([e], task.meta["pad_id"])) for e in examples]
    assert int(packed.num_items) == sum(int(a.num_items) for a in alone)
    torch.testing.assert_close(packed.loss, sum(a.loss for a in alone), rtol=1e-5, atol=1e-5)


def test_a_packed_run_logs_its_padding_and_resumes_exactly(tmp_path):
    small = ["data.num_train=300", "data.num_val=40", "data.packing=true", "data.max_len=96", "model.dim=32",
             "model.depth=1", "train.batch_size=4", "train.eval_every=6", "train.progress=false"]

    def losses(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["val/loss"] for r in rows if "val/loss" in r]

    runner = CliRunner()
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    for out, steps, more in ((straight, 12, []), (halves, 6, []), (halves, 12, ["--resume"])):
        result = runner.invoke(cli, ["run", "sft_synthetic", f"output_dir={out}", f"train.max_steps={steps}", *small,
                                     *more], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    assert losses(halves)[-1] == pytest.approx(losses(straight)[-1], rel=1e-6)
    log = (straight / "train.log").read_text()
    assert "data: packing: 300 train examples in" in log and "padded batches of 4 examples would be" in log


@pytest.mark.slow
def test_two_processes_ddp_and_fsdp_equal_one_with_packing_from_a_hf_folder(tmp_path):
    """sft on 2 gloo processes (DDP, and FSDP reading its shards) gives the losses of one process with
    the global batch: packed rows of different target counts are normalised by the global count."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    from tests.plugins.hf_tiny import save_tiny

    save_tiny("qwen2", tmp_path / "m")
    rows = [{"prompt": f"say {'a b ' * (i % 7)}{i}", "completion": "the quick brown fox" + " dog" * (i % 5)}
            for i in range(80)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sft.yaml").write_text(
        f"task: sft\ndata: {{source: files, train_file: {tmp_path / 'train.jsonl'}, max_len: 128, packing: true, "
        f"val_fraction: 0.2}}\nmodel: {{pretrained_from: {tmp_path / 'm'}}}\noptim: {{lr: 1.0e-3}}\n"
        "generate: {num_samples: 0}\n"
        "train: {max_steps: 4, eval_every: 2, log_every: 1, progress: false, device: cpu}\n")

    def run(out, *extra):
        proc = subprocess.run([str(Path(sys.executable).with_name("tk")), "run", str(tmp_path / "sft.yaml"),
                               f"output_dir={out}", *extra], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    one = run(tmp_path / "one", "train.batch_size=4")
    for strategy in ("ddp", "fsdp"):
        two = run(tmp_path / strategy, "train.batch_size=2", f"train.strategy={strategy}", "--nproc-per-node", "2")
        assert [r["step"] for r in two] == [r["step"] for r in one]
        for a, b in zip(two, one):
            for key in ("loss", "val/loss", "val/token_accuracy"):
                if key in b:
                    assert a[key] == pytest.approx(b[key], abs=1e-5), (strategy, a["step"], key)


def test_an_example_over_max_len_with_truncation_off_is_one_line(tmp_path):
    args = ["run", "sft_synthetic", "data.num_train=20", "data.num_val=4", "data.max_len=8", "data.truncate=false",
            "model.dim=32", "model.depth=1", "train.max_steps=1", f"output_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "data: example 1 has" in result.output and "more than data.max_len (8)" in result.output
    assert not (tmp_path / "run").exists()  # the new run dir is taken away again
