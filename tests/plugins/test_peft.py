"""PEFT LoRA adapters in and out (issue #49 item 5): a tk LoRA model on a Hugging Face decoder,
written in PEFT's format, loads with ``PeftModel.from_pretrained`` on the transformers base with
tk's logits; an adapter PEFT trained loads into tk with PEFT's logits and is written back byte for
byte; LoRA targets by the family's own names; the sft task exports and starts from adapters;
bad adapters are one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from tests.plugins.hf_tiny import save_tiny
from tk.core.cli import cli
from tk.core.errors import TkError
from tk.core.exchange.hf.decoders import family_of, load_decoder
from tk.core.exchange.hf.folder import read_config
from tk.core.exchange.hf.peft import adapter_lora, export_adapter, linear_names, load_adapter, read_adapter
from tk.core.exchange.hf.source import HFSource
from tk.core.nn.config import TransformerConfig
from tk.core.nn.lm import DecoderOnlyLM
from tk.core.nn.lora import LoRAConfig, LoRALinear, apply_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOKENS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def tk_model(folder):
    source = HFSource.open(str(folder))
    cfg = TransformerConfig(**source.fields)
    model = load_decoder(lambda: DecoderOnlyLM(cfg, source.vocab_size), folder, torch.float32)
    return model.eval(), cfg, family_of(source.config)


def randomise(model):
    """Non-zero adapters (B starts at zero, which would hide a wrong split)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.normal_(0, 0.2)
                m.lora_B.normal_(0, 0.2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    return {f: (save_tiny(f, root / f), root / f) for f in ("llama3", "qwen2", "gpt2", "phi3", "gemma")}


@pytest.mark.parametrize("family,targets,trainable", [
    ("llama3", ["attention", "mlp"], []),  # tk's fused qkv / fc1: lora_B split by rows, lora_A copied
    ("llama3", ["q_proj", "v_proj", "gate_proj", "down_proj"], []),  # the family's names: one adapter each
    ("qwen2", ["q_proj", "k_proj", "o_proj", "up_proj"], []),
    ("gpt2", ["c_attn", "c_fc"], []),  # Conv1D: fan_in_fan_out
    ("phi3", ["qkv_proj", "gate_up_proj", "o_proj"], ["lm_head"]),  # fused in transformers too; a trained head
    ("gemma", ["v_proj", "down_proj"], []),
])
def test_a_tk_adapter_loads_in_peft_with_tk_logits(folders, tmp_path, family, targets, trainable):
    hf, folder = folders[family]
    model, cfg, fam = tk_model(folder)
    names = linear_names(fam, model, cfg)
    apply_lora(model, 4, 8.0, 0.0, targets, trainable, names=names)
    randomise(model)
    if trainable:
        with torch.no_grad():
            model.lm_head.weight.add_(0.1)
    config, tensors = export_adapter(model, names, fam, cfg, LoRAConfig(rank=4, alpha=8.0, targets=targets), str(folder))
    from safetensors.torch import save_file

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"), metadata={"format": "pt"})
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    loaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        want = model(TOKENS)
        torch.testing.assert_close(loaded(TOKENS).logits, want, rtol=1e-5, atol=1e-4)
    if family == "llama3" and targets[0] == "q_proj":
        assert config["target_modules"] == ["down_proj", "gate_proj", "q_proj", "v_proj"]
        assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in tensors
        assert not any(".k_proj." in k for k in tensors)  # k's rows of tk's qkv carry no adapter
    if family == "gpt2":
        assert config["fan_in_fan_out"] is True


def test_an_adapter_peft_trained_loads_into_tk_and_is_written_back_byte_for_byte(folders, tmp_path):
    _, folder = folders["qwen2"]
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    trained = peft.get_peft_model(base, lora)
    torch.manual_seed(2)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    trained.save_pretrained(tmp_path / "adapter")
    model, cfg, fam = tk_model(folder)
    names = linear_names(fam, model, cfg)
    config = read_adapter(tmp_path / "adapter")
    section = adapter_lora(config, names, fam, cfg)
    assert (section.rank, section.alpha) == (4, 16.0)
    everything = adapter_lora({**config, "target_modules": "all-linear"}, names, fam, cfg).targets
    assert "model.layers.1.mlp.down_proj" in everything and "lm_head" not in everything
    with pytest.raises(TkError, match="target_modules .* name no layer of this llama model"):
        adapter_lora({**config, "target_modules": "encoder\\..*"}, names, fam, cfg)
    apply_lora(model, section.rank, section.alpha, 0.0, section.targets, section.trainable, names=names)
    assert load_adapter(model, names, fam, cfg, tmp_path / "adapter", str(folder)) == 3 * 2 * 2
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS), trained.eval()(TOKENS).logits, rtol=1e-5, atol=1e-4)
    _, tensors = export_adapter(model, names, fam, cfg, section, str(folder))
    from safetensors.torch import load_file

    original = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(original)
    assert all(torch.equal(tensors[k], original[k]) for k in original)


def test_an_adapter_of_another_model_or_other_targets_is_one_line(folders, tmp_path):
    _, small = folders["qwen2"]
    save_tiny("qwen3", tmp_path / "other")  # head_dim 32: q_proj is (128, 64), not (64, 64)
    other = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "other"),
                                peft.LoraConfig(r=4, target_modules=["q_proj"]))
    other.save_pretrained(tmp_path / "adapter")
    model, cfg, fam = tk_model(small)
    names = linear_names(fam, model, cfg)
    section = adapter_lora(read_adapter(tmp_path / "adapter"), names, fam, cfg)
    apply_lora(model, section.rank, section.alpha, 0.0, section.targets, section.trainable, names=names)
    with pytest.raises(TkError, match=r"q_proj.lora_B.weight is \(128, 4\) but this model needs \(64, 4\)"):
        load_adapter(model, names, fam, cfg, tmp_path / "adapter", "other")
    with pytest.raises(TkError, match="match no nn.Linear.*or as its source family names them: .*q_proj"):
        apply_lora(tk_model(small)[0], 4, 8.0, 0.0, ["query"], [], names=names)
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(TkError, match="use_dora True"):
        read_adapter(tmp_path / "dora")
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_bias": True,
                                                                        "exclude_modules": ["q_proj"]}))
    with pytest.raises(TkError, match="exclude_modules .*lora_bias True"):
        read_adapter(tmp_path / "dora")
    with pytest.raises(TkError, match="no adapter_config.json"):
        read_adapter(tmp_path)


def test_sft_exports_a_peft_adapter_and_starts_from_one(folders, tmp_path):
    """A LoRA sft run on a HF folder, targets by the family's names -> tk export --format peft ->
    PeftModel's logits equal tk's; a new run with model.adapter_from starts where it ended."""
    from tk.core.engine.inference import load_run

    _, folder = folders["qwen2"]
    rows = [{"prompt": f"say {i}", "completion": "the quick brown fox"} for i in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sft.yaml").write_text(  # no shape keys: the folder's shape
        f"task: sft\ndata: {{source: files, train_file: {tmp_path / 'train.jsonl'}, max_len: 48}}\n"
        f"model: {{pretrained_from: {folder}}}\noptim: {{lr: 1.0e-2}}\n"
        "train: {batch_size: 4, progress: false, eval_every: 4}\n")
    common = [str(tmp_path / "sft.yaml")]
    runner = CliRunner()
    result = runner.invoke(cli, ["run", *common, "train.max_steps=4", f"output_dir={tmp_path / 'a'}",
                                 "model.lora={rank: 4, alpha: 8, targets: [q_proj, v_proj, down_proj]}"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["export", str(tmp_path / "a"), "--format", "peft", "-o", str(tmp_path / "ad")])
    assert result.exit_code == 0, result.output
    task, model = load_run(tmp_path / "a", "last", [])
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "ad").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, model.eval()(TOKENS), rtol=1e-5, atol=1e-4)
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(folder)
    # a run from the adapter: its first evaluation is the exported model's (nothing trained before it)
    result = runner.invoke(cli, ["run", *common, "train.max_steps=1", "train.eval_every=1",
                                 f"model.adapter_from={tmp_path / 'ad'}", f"output_dir={tmp_path / 'b'}",
                                 "optim.lr=1e-12"])
    assert result.exit_code == 0, result.output
    log = (tmp_path / "b" / "train.log").read_text()
    assert "model.adapter_from" in log and "rank-4 adapters on" in log
    _, again = load_run(tmp_path / "b", "last", [])
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(TOKENS), model(TOKENS), rtol=1e-4, atol=1e-4)
    # bad inputs: one line, exit 2, no run dir
    for more, says in ((["model.adapter_from=" + str(tmp_path)], "no adapter_config.json"),
                       ([f"model.adapter_from={tmp_path / 'ad'}", "model.lora={rank: 2}"], "remove model.lora"),
                       (["model.lora={targets: [query]}"], "match no nn.Linear")):
        result = runner.invoke(cli, ["run", *common, "train.max_steps=1", f"output_dir={tmp_path / 'bad'}", *more])
        assert result.exit_code == 2 and says in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


def test_the_alpaca_lora_recipe_runs_on_a_stand_in_and_shares_its_adapter(folders, tmp_path):
    """recipes/sft_smollm2_alpaca_lora.yaml on a tiny random Llama folder and an Alpaca-format file."""
    _, folder = folders["llama3"]
    rows = [{"instruction": f"Count to {i}.", "input": "" if i % 2 else "quickly", "output": "the quick brown fox"}
            for i in range(30)]
    (tmp_path / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(cli, [
        "run", "sft_smollm2_alpaca_lora", f"model.pretrained_from={folder}", "data.source=files",
        f"data.train_file={tmp_path / 'alpaca.jsonl'}", "data.val_fraction=0.1", "data.max_len=64",
        "train.max_steps=2", "train.eval_every=2", "train.batch_size=4", "train.progress=false",
        f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 0, result.output
    log = (tmp_path / "run" / "train.log").read_text()
    assert "data: packing: 27 train examples" in log and "rank-16 adapters on 8 Linear layers" in log
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "--format", "peft", "-o", str(tmp_path / "ad")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
