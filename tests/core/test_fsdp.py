"""``train.strategy: fsdp``: FSDP2 sharding per Transformer block over 2 gloo processes on CPU.

The sharding itself (local shard sizes, the global gradient norm over DTensor shards, the
gathered full weights) is checked in processes started by ``torch.multiprocessing``; whole
runs go through ``tk run --nproc-per-node 2`` and are compared with DDP runs."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

from tk.core.cli import cli
from tk.core.config import TrainConfig, check_core_rules
from tk.core.errors import TkError
from tk.core.nn.config import TransformerConfig, ViTConfig
from tk.core.nn.transformer import DecoderOnlyLM
from tk.core.nn.vit import VisionTransformer
from tk.core.optim import OptimConfig
from tk.core.run.checkpoint import load_checkpoint
from tk.core.run.shards import SHARDS_KEY, read_full_model
from tk.core.training.parallel import block_lists, full_model_state, gathered, shard_blocks, wrap_fsdp
from tk.core.training.update import grad_norms, normalise_and_clip_

ROOT = Path(__file__).resolve().parents[2]


def tiny_lm() -> DecoderOnlyLM:
    torch.manual_seed(0)
    return DecoderOnlyLM(TransformerConfig(dim=16, depth=2, num_heads=2, dropout=0.0, max_len=16), 11)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard_worker(rank: int, port: int, out: str, reshard: bool = True) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ref = tiny_lm()
        model = wrap_fsdp(tiny_lm(), torch.device("cpu"), 2, reshard=reshard)
        block = model.decoder.layers[0]
        local = {n: p.to_local().numel() for n, p in block.named_parameters()}
        full = {n: p.numel() for n, p in block.named_parameters()}
        tokens = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(rank))
        logits = model(tokens)
        kept = [not any(hasattr(p, "to_local") for p in block.parameters())]  # still gathered after forward?
        logits.float().square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        norm = float(torch.stack(grads_norm := grad_norms(grads)).square().sum().sqrt())
        normalise_and_clip_(grads, 1.0, norm, max_norm=0.5)
        clipped = float(torch.stack(grad_norms(grads)).square().sum().sqrt())
        with gathered(model):  # any method sees full weights, here a plain state_dict copy
            gathered_ok = all(not hasattr(p, "to_local") for p in model.parameters())
        logits = model(tokens)  # after gathered(): the wrap-time choice again
        kept.append(not any(hasattr(p, "to_local") for p in block.parameters()))
        logits.sum().backward()
        for p in model.parameters():
            p.grad = None
        state = full_model_state(model)
        same = all(torch.equal(state[k], v) for k, v in ref.state_dict().items()) if rank == 0 else None
        torch.save({"local": local, "full": full, "norms": len(grads_norm), "norm": norm, "clipped": clipped,
                    "kept": kept,
                    "gathered": gathered_ok, "same_weights": same}, f"{out}/rank{rank}{'' if reshard else '_keep'}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_shards_each_block_over_two_processes_and_clips_the_global_norm(tmp_path):
    mp.spawn(_shard_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for name, full in r0["full"].items():  # Shard(0): dim 0 split in two (the first rank gets the odd one)
        assert r0["local"][name] + r1["local"][name] == full, name
        assert r1["local"][name] <= full // 2 <= r0["local"][name], name
    assert sum(r0["local"].values()) == pytest.approx(sum(r0["full"].values()) / 2, rel=0.05)
    # the global norm: one all-reduced number, the same on both ranks; clipping brings it to 0.5
    assert r0["norms"] == 1 and r0["norm"] == pytest.approx(r1["norm"], rel=1e-6) and r0["norm"] > 0.5
    assert r0["clipped"] == pytest.approx(0.5, rel=1e-4) and r1["clipped"] == pytest.approx(0.5, rel=1e-4)
    assert r0["gathered"] and r1["gathered"]
    assert r0["same_weights"]  # rank 0's initial weights, gathered back in full
    # train.fsdp_reshard=false (blocks kept gathered until backward): the same gradients
    mp.spawn(_shard_worker, args=(_free_port(), str(tmp_path), False), nprocs=2, join=True)
    k0 = torch.load(tmp_path / "rank0_keep.pt")
    assert k0["norm"] == pytest.approx(r0["norm"], rel=1e-6) and k0["local"] == r0["local"]
    assert r0["kept"] == [False, False] and k0["kept"] == [True, True]  # also after an evaluation's gathered()


def test_fsdp_refuses_a_model_without_blocks_and_one_process():
    with pytest.raises(TkError, match="Sequential has no `layers` or `blocks`"):
        wrap_fsdp(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.device("cpu"), 2)
    conv_vit = VisionTransformer(ViTConfig(dim=16, depth=1, num_heads=2, patch_size=4, stem="conv"), img_size=8)
    with pytest.raises(TkError, match=r"bf16 on CUDA casts BatchNorm weights.*train.precision=fp32"):
        wrap_fsdp(conv_vit, torch.device("cuda"), 2, "bf16")  # refused before any CUDA call
    with pytest.raises(TkError, match="--nproc-per-node"):
        wrap_fsdp(tiny_lm(), torch.device("cpu"), 1)
    assert len(shard_blocks(tiny_lm())) == 2


def test_block_lists_keep_nested_lists_apart():
    """Neighbours prefetch each other only within one list: a stage list whose stages hold
    block lists (timm Swin's shape) gives three lists, not one interleaved order."""
    def stage() -> nn.Module:
        module = nn.Module()
        module.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        return module

    model = nn.Module()
    model.layers = nn.ModuleList([stage(), stage()])
    lists = block_lists(model)
    assert lists == [list(model.layers), list(model.layers[0].blocks), list(model.layers[1].blocks)]
    assert shard_blocks(model) == [b for blocks in lists for b in blocks]


def test_fsdp_with_ema_or_fp16_is_refused():
    problems = check_core_rules(type("Cfg", (), {"train": TrainConfig(strategy="fsdp", ema_decay=0.99)})())
    assert len(problems) == 1 and problems[0].startswith("train.ema_decay: EMA is not supported")
    problems = check_core_rules(type("Cfg", (), {"train": TrainConfig(strategy="fsdp", precision="fp16")})())
    assert len(problems) == 1 and problems[0].startswith("train.precision: fp16 is not supported")
    assert check_core_rules(type("Cfg", (), {"train": TrainConfig(strategy="ddp", ema_decay=0.99)})()) == []
    problems = check_core_rules(type("Cfg", (), {"train": TrainConfig(strategy="fsdp"),
                                                 "optim": OptimConfig(name="adafactor")})())
    assert len(problems) == 1 and problems[0].startswith("optim.name: adafactor does not run on FSDP")


LM = ["data.num_sentences=2000", "train.max_steps=6", "train.eval_every=3", "train.log_every=1",
      "train.eval_batch_size=25", "data.eval_blocks=50", "train.progress=false", "train.device=cpu",
      "train.batch_size=8"]
TEXTCLS = ["data.num_train=400", "data.num_val=64", "model.dropout=0.0", "model.head_dropout=0.0",
           "train.max_steps=4", "train.eval_every=2", "train.log_every=1", "train.eval_batch_size=32",
           "train.progress=false", "train.device=cpu"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tk_run(recipe: str, out: Path, args: list[str], *extra: str) -> None:
    proc = subprocess.run([str(Path(sys.executable).with_name("tk")), "run", str(ROOT / "recipes" / recipe),
                           f"output_dir={out}", *args, *extra], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_same_run(got: Path, want: Path, atol: float) -> None:
    g, w = records(got), records(want)
    assert [(r["step"], r["split"]) for r in g] == [(r["step"], r["split"]) for r in w]
    for a, b in zip(g, w):
        for key in ("loss", "grad_norm", "val/loss", "val/top1"):
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=atol), (a["step"], key)
    ours, ref = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_fsdp_lm_equals_ddp_resumes_exactly_and_exports_for_one_process(tmp_path):
    fsdp, ddp, one, resumed = tmp_path / "fsdp", tmp_path / "ddp", tmp_path / "one", tmp_path / "resumed"
    tk_run("lm_synthetic.yaml", fsdp, LM, "train.strategy=fsdp", "--nproc-per-node", "2")
    tk_run("lm_synthetic.yaml", ddp, LM, "--nproc-per-node", "2")
    assert_same_run(fsdp, ddp, atol=1e-5)
    # the 2 processes' random blocks are one process's batches of 16, split: the same updates
    tk_run("lm_synthetic.yaml", one, [*LM, "train.batch_size=16"])
    assert_same_run(fsdp, one, atol=1e-5)
    # rank 0 killed right after the step-3 (sharded) checkpoint; torchrun restarts the command,
    # which resumes from it: the same run as the uninterrupted one
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1", "--nproc-per-node", "2",
         "-m", "tk", "run", str(ROOT / "recipes" / "lm_synthetic.yaml"), f"output_dir={resumed}", *LM,
         "train.strategy=fsdp", "--resume", "auto"],
        env={**os.environ, "TK_FAULT_AT_STEP": "3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},  # see
        capture_output=True, text=True, timeout=600)  # test_distributed_train.py for the store
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.count("TK_FAULT_AT_STEP=3: exiting abruptly") == 1, out[-3000:]
    assert "resumed from" in out and "at step 3" in out, out[-3000:]
    assert [r.get("loss") for r in records(resumed)] == [r.get("loss") for r in records(fsdp)]
    assert_same_run(resumed, fsdp, atol=0)
    # the consolidated weights evaluate in one process to the run's last val metrics
    result = CliRunner().invoke(cli, ["eval", str(fsdp), "--weights", str(fsdp / "model.safetensors"), "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    last = [r for r in records(fsdp) if r["split"] == "val"][-1]
    metrics = json.loads(result.output.strip().splitlines()[-1])["metrics"]
    assert metrics == pytest.approx({k: v for k, v in last.items() if k.startswith("val/")}, abs=1e-5)
    # checkpoints are sharded (DCP folders, no weights in the .pt files); one process reads one in full
    checkpoints = fsdp / "checkpoints"
    assert sorted(p.name for p in (checkpoints / "shards").iterdir()) == ["step_00000003", "step_00000006"]
    step3 = load_checkpoint(checkpoints / "step_00000003.pt", full_model=False)
    assert "model" not in step3 and "optimizer" not in step3 and step3[SHARDS_KEY].endswith("step_00000003")
    result = CliRunner().invoke(cli, ["eval", str(fsdp), "--checkpoint", str(checkpoints / "step_00000003.pt"),
                                      "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    at3 = [r for r in records(fsdp) if r["split"] == "val" and r["step"] == 3][0]
    metrics = json.loads(result.output.strip().splitlines()[-1])["metrics"]
    assert metrics == pytest.approx({k: v for k, v in at3.items() if k.startswith("val/")}, abs=1e-5)
    result = CliRunner().invoke(cli, ["average", str(fsdp), "--last", "2", "-o", str(tmp_path / "avg.safetensors")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    averaged = load_file(tmp_path / "avg.safetensors")
    first, second = (read_full_model(checkpoints / "shards" / f"step_{s:08d}") for s in (3, 6))
    key = "tok_embed.weight"
    torch.testing.assert_close(averaged[key], (first[key] + second[key]) / 2)


@pytest.mark.slow
def test_fsdp_text_classifier_with_accumulation_equals_one_process_with_the_global_batch(tmp_path):
    """4 samples x 2 micro-batches x 2 processes (the first micro-batch without gradient sync)
    update exactly as one process with batches of 16 (the same trained tokenizer: its training
    is not bit-reproducible from run to run)."""
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    tk_run("textcls_synthetic.yaml", one, TEXTCLS, "train.batch_size=16")
    tk_run("textcls_synthetic.yaml", fsdp, TEXTCLS, "train.batch_size=4", "train.grad_accum=2",
           "train.strategy=fsdp", f"tokenizer.path={one / 'artifacts' / 'tokenizer.json'}", "--nproc-per-node", "2")
    assert_same_run(fsdp, one, atol=1e-5)


TRANSLATION = ["data.source=reverse", "data.num_train=200", "data.num_val=20", "data.max_len=24",
               "data.max_tokens=128", "tokenizer.vocab_size=320", "model.dim=32", "model.depth=2", "model.num_heads=2",
               "model.max_len=64", "model.dropout=0.0", "model.bias=false", "train.max_steps=4", "train.eval_every=2",
               "train.log_every=1", "train.progress=false", "train.device=cpu"]


@pytest.mark.slow
def test_fsdp_translation_equals_ddp_on_two_processes(tmp_path):
    """The encoder-decoder (shared embeddings tied to the output layer, cross-attention) under
    fully_shard: the same losses, BLEU and consolidated weights as DDP on the same token-budget
    batches (the same tokenizer file: BPE training is not run twice). No biases: a key projection's
    bias has a zero gradient in exact arithmetic, so AdamW turns float noise into +-lr updates
    whose sign differs between any two reduction orders."""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    tk_run("translation_reverse.yaml", ddp, TRANSLATION, "--nproc-per-node", "2")
    tokenizer = ddp / "artifacts" / "tokenizer.json"
    tk_run("translation_reverse.yaml", fsdp, TRANSLATION, f"tokenizer.path={tokenizer}", "train.strategy=fsdp",
           "--nproc-per-node", "2")
    assert_same_run(fsdp, ddp, atol=1e-5)
    bleu = [(r["step"], r["val/bleu"]) for r in records(fsdp) if "val/bleu" in r]
    assert bleu == [(s, pytest.approx(b, abs=1e-6)) for s, b in
                    ((r["step"], r["val/bleu"]) for r in records(ddp) if "val/bleu" in r)]


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_with_another_process_count(tmp_path):
    """A 2-process FSDP run's sharded checkpoint resumes on 3 processes (DCP re-shards the model
    and optimiser state on load); a one-line note says the sample order changes.
    Switching the strategy on resume is refused in one line."""
    fsdp, three = tmp_path / "fsdp", tmp_path / "three"
    tk_run("lm_synthetic.yaml", fsdp, LM, "train.strategy=fsdp", "--nproc-per-node", "2")
    shutil.copytree(fsdp, three)
    step3 = str(three / "checkpoints" / "step_00000003.pt")
    cmd = [str(Path(sys.executable).with_name("tk")), "run", str(ROOT / "recipes" / "lm_synthetic.yaml"),
           f"output_dir={three}", *LM, "--resume-from", step3]
    proc = subprocess.run([*cmd, "train.strategy=fsdp", "--nproc-per-node", "3"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "note: the checkpoint comes from 2 process(es)" in proc.stdout + proc.stderr
    assert [r["step"] for r in records(three) if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    ours, ref = load_file(three / "model.safetensors"), load_file(fsdp / "model.safetensors")
    assert sorted(ours) == sorted(ref) and all(ours[k].shape == ref[k].shape for k in ref)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # one process, strategy ddp
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "train.strategy=fsdp" in lines[0], proc.stderr
    # a shard file lost from the last checkpoint: one line naming it, the intact checkpoints and the
    # command that continues from the newest, with the same number of processes
    (three / "checkpoints" / "shards" / "step_00000006" / "__2_0.distcp").unlink()
    proc = subprocess.run([*cmd[:-2], "train.strategy=fsdp", "train.max_steps=8", "--resume", "--nproc-per-node", "3"],
                          capture_output=True, text=True, timeout=600)
    lines = {line for line in proc.stderr.splitlines() if line.startswith("error:")}
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    line = lines.pop()
    assert "__2_0.distcp is missing" in line and "intact checkpoints: " in line, line
    assert line.endswith(f"train.max_steps=8 --nproc-per-node 3 --resume-from {three / 'checkpoints' / 'step_00000003.pt'}`"), line


@pytest.mark.slow
def test_fsdp_with_lion_equals_ddp(tmp_path):
    """timm's Lion steps FSDP's sharded (DTensor) parameters as DDP's full ones."""
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    lion = ["optim.name=lion", "optim.lr=1e-3", "train.max_steps=4"]
    tk_run("lm_synthetic.yaml", fsdp, LM, *lion, "train.strategy=fsdp", "--nproc-per-node", "2")
    tk_run("lm_synthetic.yaml", ddp, LM, *lion, "--nproc-per-node", "2")
    assert_same_run(fsdp, ddp, atol=1e-5)
