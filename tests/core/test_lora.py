"""LoRA (tk.core.nn.lora): adapters start at the base model exactly, merge into plain
weights, train only adapters + head, and run through the engine (resume, eval/predict,
merged model.safetensors, EMA, DDP)."""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

from tk.core.cli import cli
from tk.core.config import ConfigError
from tk.core.engine.inference import evaluate_run, load_run
from tk.core.engine.train import Trainer
from tk.core.errors import TkError
from tk.core.nn.config import TransformerConfig
from tk.core.nn.lora import LoRALinear, apply_lora, merge_lora, merged_state_dict
from tk.core.nn.text_encoder import TextEncoder
from tk.core.nn.transformer import DecoderOnlyLM, EncoderDecoder
from tk.core.recipe import load_config
from tk.core.run.checkpoint import load_checkpoint, load_model_state
from tk.core.text import BERT_SPECIALS, TextTokenizer
from tk.core.training.assemble import assemble
from tk.core.training.signals import TrainingInterrupted
from tk.plugins.text_classification.data import TextClsTokenizerConfig
from tk.plugins.text_classification.model import TextClassifier
from tk.plugins.text_classification.synthetic import synthetic_rows

CFG = TransformerConfig(dim=32, depth=2, num_heads=4, mlp_ratio=2.0, dropout=0.0)
TOKENS = torch.randint(1, 50, (3, 7), generator=torch.Generator().manual_seed(0))

# a text classifier run small enough for a test; dropout (model and adapters) and an EMA on; a
# given tokenizer, since training one is not bit-reproducible from run to run
RECIPE = """\
task: text_classification
data: {source: synthetic, num_train: 256, num_val: 64, seed: 0, max_len: 16}
tokenizer: {path: TOKENIZER}
model: {dim: 32, depth: 2, num_heads: 4, mlp_ratio: 2.0, dropout: 0.1, lora: {rank: 4, dropout: 0.1}}
optim: {lr: 0.01, weight_decay: 0.01}
schedule: {name: warmup_cosine, warmup_steps: 2}
train: {max_steps: 12, batch_size: 16, eval_every: 6, log_every: 1, progress: false, num_workers: 0,
        ema_decay: 0.8, seed: 0, deterministic: true}
"""


def _lm():
    return DecoderOnlyLM(CFG, 50)


def _text_encoder():
    return TextEncoder(CFG, 50)


def _timm_vit():
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=3)


def _translation():
    return EncoderDecoder(CFG, 50, 50)


def _outputs(model, kind):
    model.eval()
    with torch.no_grad():
        if kind == "image":
            return model(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
        if kind == "seq2seq":
            return model(TOKENS, TOKENS[:, :5])
        out = model(TOKENS)
        return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("build, kind, adapted", [
    (_lm, "tokens", 2 * 2),  # qkv + proj per layer
    (_text_encoder, "tokens", 2 * 2),
    (_timm_vit, "image", 12 * 2),  # timm's blocks.N.attn.qkv / .proj
    (_translation, "seq2seq", 2 * 2 + 2 * (2 + 4)),  # decoder: self qkv + proj, cross q/k/v + proj
])
def test_adapters_start_at_the_base_model_exactly(build, kind, adapted):
    torch.manual_seed(0)
    base = build()
    model = copy.deepcopy(base)
    names = apply_lora(model, rank=4, alpha=8)
    assert len(names) == adapted and all(isinstance(model.get_submodule(n), LoRALinear) for n in names)
    assert torch.equal(_outputs(model, kind), _outputs(base, kind))


def test_merged_weights_equal_base_plus_adapter_after_updates():
    torch.manual_seed(0)
    model = _lm()
    base = _outputs(copy.deepcopy(model), "tokens")
    apply_lora(model, rank=4, alpha=8, targets=["attention", "mlp"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        model(TOKENS).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    want = _outputs(model, "tokens")
    assert (want - base).abs().max() > 1e-3  # the adapters moved the outputs
    plain = _lm_from(merged_state_dict(model), lora=False)  # the base (non-LoRA) model loads it strictly
    torch.testing.assert_close(_outputs(plain, "tokens"), want, rtol=0, atol=1e-5)
    merged = merge_lora(model)  # in place: plain nn.Linear layers back, same function
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(_lm().state_dict())
    torch.testing.assert_close(_outputs(merged, "tokens"), want, rtol=0, atol=1e-5)


def _lm_from(state_dict, lora):
    model = _lm()
    if lora:
        apply_lora(model)
    load_model_state(model, state_dict)  # strict
    return model


def test_trainable_parameters_are_the_adapters_and_the_head():
    D, F, C, r = 32, 64, 3, 4
    model = TextClassifier(TextEncoder(CFG, 50), C, "cls", 0.0)
    apply_lora(model, rank=r, targets=["attention", "mlp"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    per_layer = r * (D + 3 * D) + r * (D + D) + r * (D + F) + r * (F + D)  # qkv, proj, fc1, fc2
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * per_layer + D * C + C
    assert {n for n in trainable if "lora_" not in n} == {"head.weight", "head.bias"}


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(TkError, match=r"^model.lora.rank \(0\) must be >= 1$"):
        apply_lora(_lm(), rank=0)
    with pytest.raises(TkError) as info:
        apply_lora(_lm(), targets=["*.wq"])
    msg = str(info.value)
    assert "'*.wq'" in msg and "layers.0.self_attn.qkv" in msg and "\n" not in msg
    with pytest.raises(TkError) as info:  # a typo must not silently freeze a fresh head
        apply_lora(TextClassifier(TextEncoder(CFG, 50), 3, "cls", 0.0), trainable=["haed"])
    msg = str(info.value)
    assert "model.lora.trainable ['haed'] match no module or parameter" in msg and "encoder, head" in msg
    apply_lora(TextClassifier(TextEncoder(CFG, 50), 3, "cls", 0.0), trainable=["head", "encoder.encoder.norm*"])
    apply_lora(_lm(), trainable=["head", "head_dist"])  # the defaults may match nothing (an LM has no head)
    with pytest.raises(TkError, match="has no nn.Linear layer to adapt; remove model.lora"):
        apply_lora(nn.Sequential(nn.Conv1d(2, 2, 1), nn.ReLU()))
    model = _lm()
    apply_lora(model)
    with pytest.raises(TkError, match="already has LoRA adapters"):
        apply_lora(model)
    with pytest.raises(ConfigError, match=r"^override 'model.lora.rank=0': model.lora.rank \(0\) must be >= 1$"):
        load_config("textcls_synthetic", ["model.lora.rank=0"])


def _recipe(tmp_path) -> Path:
    texts = [t for t, _ in synthetic_rows(256, 0)]
    TextTokenizer.train(texts, TextClsTokenizerConfig(kind="wordpiece", vocab_size=100), BERT_SPECIALS).save(
        tmp_path / "tok.json")
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(RECIPE.replace("TOKENIZER", str(tmp_path / "tok.json")))
    return recipe


def _train_losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


def test_textcls_run_trains_only_adapters_and_head(tmp_path):
    """`model.lora.rank=4` on textcls_synthetic: loss goes down, frozen weights stay bit for bit,
    eval/predict load the run, and model.safetensors (merged) fits the model without LoRA."""
    run_dir = tmp_path / "run"
    cfg, task_cls = load_config("textcls_synthetic", [
        "model.lora.rank=4", "model.dim=32", "model.depth=1", "model.dropout=0", "tokenizer.vocab_size=100",
        "data.num_train=256", "data.num_val=64", "train.overfit_batches=1", "train.max_steps=30", "train.eval_every=30",
        "train.log_every=1", "train.progress=false", "optim.lr=0.01", "schedule.warmup_steps=2",
        f"output_dir={run_dir}"])
    trainer = Trainer(cfg, task_cls, run_dir)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())  # what `tk run` writes, for eval/predict below
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    results = trainer.fit()
    after = trainer.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k or k.startswith("head.") for k in changed)
    assert any(k.endswith("lora_B") for k in changed) and "head.weight" in changed
    losses = [loss for _, loss in _train_losses(run_dir)]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses  # it fits the one batch
    assert evaluate_run(run_dir, "last")["metrics"]["val/loss"] == pytest.approx(results["val/loss"], abs=1e-6)

    task, model = load_run(run_dir, "last")
    batch = task.collate([task.build_dataset("val")[i] for i in range(8)])
    with torch.no_grad():
        want = model(batch["input_ids"], batch["token_types"])
    base_cfg, _ = load_config(run_dir / "config.yaml", ["model.lora=null"])
    plain = assemble(base_cfg, task_cls, run_dir, "predict").model.eval()
    assert not any(isinstance(m, LoRALinear) for m in plain.modules())
    load_model_state(plain, load_file(run_dir / "model.safetensors"))  # strict: the base model's keys
    with torch.no_grad():
        torch.testing.assert_close(plain(batch["input_ids"], batch["token_types"]), want, rtol=0, atol=1e-5)
    _, weights_model = load_run(run_dir, "last", weights=str(run_dir / "model.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(weights_model(batch["input_ids"], batch["token_types"]), want, rtol=0, atol=1e-5)


def test_interrupted_lora_run_resumes_exactly(tmp_path):
    recipe = _recipe(tmp_path)
    reference, run_dir = tmp_path / "reference", tmp_path / "interrupted"
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={reference}"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    cfg, task_cls = load_config(recipe, [f"output_dir={run_dir}"])
    trainer = Trainer(cfg, task_cls, run_dir)
    calls = []

    def interrupt(*_):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)

    trainer.optimizer.register_step_post_hook(interrupt)
    with pytest.raises(TrainingInterrupted):
        trainer.fit()
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 5
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={run_dir}", "--resume"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert _train_losses(run_dir) == _train_losses(reference)  # every step, bit for bit
    for name in ("model.safetensors", "model_ema.safetensors"):
        ours, ref = load_file(run_dir / name), load_file(reference / name)
        assert ours.keys() == ref.keys() and not any("lora_" in k for k in ours)
        assert all(torch.equal(ours[k], ref[k]) for k in ref), name


@pytest.mark.slow
def test_sigkilled_lora_run_resumes_exactly(tmp_path):
    """SIGKILL (no clean-up, nothing saved on the way out) after a checkpoint, then --resume:
    every step's loss and the merged weights equal an uninterrupted run's."""
    recipe = _recipe(tmp_path)
    reference, run_dir = tmp_path / "reference", tmp_path / "killed"
    every_step = ["train.save_every=1", "train.keep_last=40", "train.max_steps=40"]  # 40: time to kill it mid-run
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={reference}", *every_step],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    proc = subprocess.Popen([str(Path(sys.executable).with_name("tk")), "run", str(recipe), f"output_dir={run_dir}",
                             *every_step], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (run_dir / "checkpoints" / "step_00000004.pt").exists():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"]
    assert 4 <= killed_at < 40  # killed mid-run (the test cannot pick the exact step)
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={run_dir}", "--resume", *every_step],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert _train_losses(run_dir) == _train_losses(reference)  # every step once, bit for bit
    ours, ref = load_file(run_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_lora(tmp_path):
    recipe = _recipe(tmp_path)
    single, multi = tmp_path / "single", tmp_path / "multi"
    common = ["model.dropout=0", "model.head_dropout=0", "model.lora.dropout=0", "train.max_steps=6",
              "train.eval_every=3", "train.device=cpu"]  # no dropout: the ranks draw other masks
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={single}", "train.batch_size=32", *common],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("tk")), "run", str(recipe), f"output_dir={multi}", "--nproc-per-node", "2",
         "train.batch_size=8", "train.grad_accum=2", *common], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours, ref = load_file(multi / "model.safetensors"), load_file(single / "model.safetensors")
    assert ours.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-5)
    got = [(r["step"], r.get("loss"), r.get("val/loss")) for r in map(json.loads, (multi / "metrics.jsonl").open())]
    want = [(r["step"], r.get("loss"), r.get("val/loss")) for r in map(json.loads, (single / "metrics.jsonl").open())]
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want):
        assert g[1:] == pytest.approx(w[1:], abs=1e-5)
