"""Hugging Face decoders into tk and out again, checked against transformers on tiny random models
of every family (tests/plugins/hf_tiny.py): fp32 logits within 1e-4, greedy generation with and
without the KV cache, bf16 kept, sharded = single file, tied heads, the round trip HF -> tk -> HF,
the language_model task end to end, and every bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tk.core.errors import TkError  # noqa: E402
from tk.core.exchange.export_hf import lm_export  # noqa: E402
from tk.core.exchange.hf.decoders import decoder_config, load_decoder  # noqa: E402
from tk.core.exchange.hf.folder import read_config  # noqa: E402
from tk.core.nn.config import TransformerConfig  # noqa: E402
from tk.core.nn.generation import GenerationConfig, generate  # noqa: E402
from tk.core.nn.lm import DecoderOnlyLM  # noqa: E402
from tests.plugins.hf_tiny import FAMILIES, TEXT, save_tiny  # noqa: E402

ALL = sorted(FAMILIES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: (root / f, save_tiny(f, root / f)) for f in ALL}


def tk_model(folder: Path, dtype=None) -> tuple[DecoderOnlyLM, TransformerConfig]:
    config = read_config(folder)
    fields, vocab = decoder_config(config)
    cfg = TransformerConfig(**{**fields, "dropout": 0.0})
    return load_decoder(lambda: DecoderOnlyLM(cfg, vocab), folder, dtype, config).eval(), cfg


@pytest.mark.parametrize("family", ALL)
def test_fp32_logits_equal_transformers(folders, family):
    folder, hf = folders[family]
    model, _ = tk_model(folder)
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert theirs.abs().max() > 1.0  # the tiny model is not near-constant
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama3", "qwen3", "mistral", "gemma2", "phi3"])
def test_greedy_generation_equals_transformers_with_and_without_cache(folders, family):
    folder, hf = folders[family]
    model, _ = tk_model(folder)
    prompt = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(prompt, do_sample=False, num_beams=1, max_new_tokens=32, min_new_tokens=32,
                           eos_token_id=None, pad_token_id=0)[:, 8:]
        for cache in (True, False):
            got = generate(model, prompt, GenerationConfig(max_len=32, use_cache=cache)).tokens
            assert torch.equal(got, want), (family, cache)


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_a_padded_batch_gives_each_row_what_it_gives_alone(folders, family):
    model, _ = tk_model(folders[family][0])
    a, b = torch.randint(0, 300, (1, 20)), torch.randint(0, 300, (1, 12))
    batch = torch.cat([a, torch.cat([b, torch.zeros(1, 8, dtype=torch.long)], 1)])
    cfg = GenerationConfig(max_len=12, pad_id=299)
    together = generate(model, batch, cfg, prompt_lengths=torch.tensor([20, 12])).tokens
    assert torch.equal(together[0], generate(model, a, cfg).tokens[0])
    assert torch.equal(together[1], generate(model, b, cfg).tokens[0])


@pytest.mark.parametrize("family", ["qwen2", "llama3", "gemma2", "gpt2"])
def test_bf16_is_kept_and_agrees_with_transformers(tmp_path, family):
    save_tiny(family, tmp_path / "bf16", dtype=torch.bfloat16)
    model, _ = tk_model(tmp_path / "bf16", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # as users load it (a model cast in memory would also round its rotary frequencies to bf16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, 320, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens).float(), hf(tokens).logits.float()
    # measured: Llama/Qwen/Mistral/Gemma/Phi-3 bit-identical; Gemma 2 99.0% (its soft-capped scores in float32),
    # GPT-2 99.6%
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), theirs.log_softmax(-1), log_target=True, reduction="none")
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.99
    assert kl.sum(-1).mean() < 1e-3
    if family in ("qwen2", "llama3"):
        assert torch.equal(ours, theirs)


def test_sharded_checkpoint_loads_the_same_tensors(tmp_path):
    save_tiny("llama2", tmp_path / "one")
    save_tiny("llama2", tmp_path / "shards", max_shard_size="100KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    one, _ = tk_model(tmp_path / "one")
    shards, _ = tk_model(tmp_path / "shards")
    for (n, a), (_, b) in zip(one.state_dict().items(), shards.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_tied_head_absent_from_the_file_is_tied_not_copied(folders):
    folder, _ = folders["smollm2"]
    from safetensors import safe_open

    assert "lm_head.weight" not in safe_open(str(folder / "model.safetensors"), "pt").keys()
    model, _ = tk_model(folder)
    assert model.lm_head.weight is model.tok_embed.weight


@pytest.mark.parametrize("family", ["gpt2", "llama3", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3"])
def test_import_then_export_is_the_same_family_and_the_same_tensors(folders, tmp_path, family):
    from safetensors.torch import load_file

    folder, hf = folders[family]
    model, cfg = tk_model(folder)
    source = read_config(folder)
    config, state = lm_export(model, cfg, source)
    original = load_file(folder / "model.safetensors")
    assert set(state) == set(original)
    for name, t in original.items():
        assert torch.equal(state[name], t), name
    for key in ("model_type", "rope_parameters", "head_dim", "tie_word_embeddings", "sliding_window",
                "num_key_value_heads", "attention_bias"):
        if key in source:
            assert config[key] == source[key], key


def test_export_refuses_what_the_family_cannot_express(folders):
    model, cfg = tk_model(folders["llama2"][0])
    with pytest.raises(TkError, match="qk_norm"):
        lm_export(model, cfg.__class__(**{**cfg.__dict__, "qk_norm": True}), read_config(folders["llama2"][0]))


# -- bad input: one line, before anything heavy ------------------------------------------
def _write_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change,match", [
    ({"model_type": "mamba"}, "model_type 'mamba' is not a decoder"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"hidden_size": None}, "lacks hidden_size"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
])
def test_unsupported_config_options_are_named(tmp_path, change, match):
    save_tiny("llama2", tmp_path / "m")
    _write_config(tmp_path / "m", **change)
    with pytest.raises(TkError, match=match):
        tk_model(tmp_path / "m")


def test_broken_folders_are_one_line(tmp_path):
    save_tiny("llama2", tmp_path / "m", max_shard_size="100KB")
    folder = tmp_path / "m"
    with pytest.raises(TkError, match="no config.json"):
        tk_model(tmp_path)
    shards = sorted(folder.glob("model-*.safetensors"))
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) // 2])
    with pytest.raises(TkError, match="truncated"):
        tk_model(folder)
    shards[-1].unlink()
    with pytest.raises(TkError, match="does not exist; download the missing shard"):
        tk_model(folder)


def test_weights_that_contradict_the_config_are_named(tmp_path):
    save_tiny("llama2", tmp_path / "m")
    _write_config(tmp_path / "m", intermediate_size=96)
    with pytest.raises(TkError, match="weights and config.json disagree"):
        tk_model(tmp_path / "m")


def test_an_untied_head_missing_from_the_file_is_refused(tmp_path):
    save_tiny("smollm2", tmp_path / "m")
    _write_config(tmp_path / "m", tie_word_embeddings=False)
    with pytest.raises(TkError, match="lm_head.weight.*untied"):
        tk_model(tmp_path / "m")


# -- the language_model task end to end ----------------------------------------------------
@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    from click.testing import CliRunner

    from tk.core.cli import cli as main

    root = tmp_path_factory.mktemp("lm")
    save_tiny("llama3", root / "llama3", eos=[0, 2])
    (root / "corpus.txt").write_text(TEXT)
    args = ["run", "lm_synthetic", "data.source=text", f"data.path={root / 'corpus.txt'}",
            f"model.pretrained_from={root / 'llama3'}", "train.max_steps=4", "train.batch_size=4",
            "data.block_size=32", "data.eval_blocks=2", "data.num_samples=0", f"output_dir={root / 'run'}"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return root


def test_a_run_from_a_hf_folder_keeps_its_files_and_exports_the_same_family(lm_run):
    from click.testing import CliRunner

    from tk.core.cli import cli as main
    from tk.core.engine.inference import load_run

    run = lm_run / "run"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "hf_config.json"):
        assert (run / "artifacts" / name).is_file(), name
    task, model = load_run(run, "last", [])
    assert task.gen_cfg.stop_ids == [0, 2]  # both eos ids of generation_config.json
    result = CliRunner().invoke(main, ["export", str(run), "--format", "hf", "-o", str(lm_run / "exp")])
    assert result.exit_code == 0, result.output
    hf = transformers.AutoModelForCausalLM.from_pretrained(lm_run / "exp").eval()
    assert hf.config.model_type == "llama" and hf.config.rope_parameters["rope_type"] == "llama3"
    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(lm_run / "exp")
    assert tok("the quick brown").input_ids == task.tokenizer.encode("the quick brown")  # BOS included


def test_the_recipe_shape_must_agree_with_the_folder(lm_run, tmp_path):
    from click.testing import CliRunner

    from tk.core.cli import cli as main

    args = ["run", "lm_synthetic", "data.source=text", f"data.path={lm_run / 'corpus.txt'}",
            f"model.pretrained_from={lm_run / 'llama3'}", "model.dim=32", f"output_dir={tmp_path / 'r'}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "model.dim" in result.output and "64" in result.output
    args[-2:] = ["data.block_size=512", f"output_dir={tmp_path / 'r2'}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "data.block_size (512) exceeds the model's 256 positions" in result.output


def test_the_smollm2_recipe_runs_on_a_tiny_stand_in(tmp_path):
    from click.testing import CliRunner

    from tk.core.cli import cli

    save_tiny("smollm2", tmp_path / "smol")
    (tmp_path / "input.txt").write_text(TEXT)
    args = ["run", "lm_smollm2_shakespeare", f"data.path={tmp_path / 'input.txt'}", f"model.pretrained_from={tmp_path / 'smol'}",
            "data.block_size=64", "data.eval_blocks=2", "train.max_steps=2", "train.eval_every=2", "train.batch_size=2",
            "train.progress=false", f"output_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "loaded as float32" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("bos", [False, True])
def test_prompts_encode_to_transformers_ids(tmp_path, bos):
    from tests.plugins.hf_tiny import tokenizer
    from tk.core.text import TextTokenizer

    fast = tokenizer(tmp_path, bos=bos)
    ours = TextTokenizer.load(tmp_path / "tokenizer.json")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["the quick brown fox", "To be, or not to be:\n that is", "  spaces  and\ttabs", "émigré naïve 東京",
                 "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == hf(text).input_ids == fast(text).input_ids, text
    assert (ours.encode("x")[0] == 3) is bos  # the template's BOS, only where the tokenizer adds one


def test_generate_refuses_a_prompt_beyond_the_models_context(lm_run):
    from click.testing import CliRunner

    from tk.core.cli import cli

    result = CliRunner().invoke(cli, ["generate", str(lm_run / "run"), "--prompt", "the quick brown fox " * 60,
                                      "--max-new-tokens", "8"])
    assert result.exit_code == 2 and "exceeds model.max_len (256)" in result.output


def test_a_lora_run_from_a_hf_folder_exports_merged(lm_run, tmp_path):
    from click.testing import CliRunner

    from tk.core.cli import cli
    from tk.core.engine.inference import load_run

    args = ["run", "lm_synthetic", "data.source=text", f"data.path={lm_run / 'corpus.txt'}",
            f"model.pretrained_from={lm_run / 'llama3'}", "model.lora.rank=4", "optim.lr=1e-2", "train.max_steps=3",
            "train.batch_size=4", "data.block_size=32", "data.eval_blocks=2", "data.num_samples=0",
            f"output_dir={tmp_path / 'lora'}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "lora"), "--format", "hf", "-o", str(tmp_path / "exp")])
    assert result.exit_code == 0, result.output
    _, model = load_run(tmp_path / "lora", "last", [])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-4)


def test_a_bare_model_checkpoint_and_a_torch_file_load_too(folders, tmp_path):
    """The hub's gpt2 stores GPT2Model names (no ``transformer.``); older uploads a pytorch_model.bin."""
    from safetensors.torch import load_file, save_file

    folder, hf = folders["gpt2"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    save_file({k.removeprefix("transformer."): v for k, v in load_file(folder / "model.safetensors").items()},
              bare / "model.safetensors")
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((folder / "config.json").read_text())
    torch.save(load_file(folder / "model.safetensors"), binary / "pytorch_model.bin")
    tokens = torch.randint(0, 320, (1, 16))
    with torch.no_grad():
        want = hf(tokens).logits
        for path in (bare, binary):
            torch.testing.assert_close(tk_model(path)[0](tokens), want, rtol=1e-5, atol=1e-4)


def test_a_hub_id_resolves_through_the_hub_client(folders, monkeypatch, tmp_path):
    import huggingface_hub

    from tk.core.exchange.hf.source import HFSource, is_hf_source

    calls = []

    def fake_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(folders["qwen2"][0])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    assert is_hf_source("Qwen/Qwen2.5-0.5B")
    source = HFSource.open("Qwen/Qwen2.5-0.5B")
    assert calls[0][0] == "Qwen/Qwen2.5-0.5B" and "model-*.safetensors" in calls[0][1]
    assert source.config["model_type"] == "qwen2" and source.fields["qkv_bias"] is True


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_training(tmp_path):
    from click.testing import CliRunner

    from tk.core.cli import cli

    save_tiny("llama2", tmp_path / "m")  # a tokenizer of 300 ids
    _write_config(tmp_path / "m", vocab_size=290)
    (tmp_path / "c.txt").write_text(TEXT)
    result = CliRunner().invoke(cli, ["run", "lm_synthetic", "data.source=text", f"data.path={tmp_path / 'c.txt'}",
                                      f"model.pretrained_from={tmp_path / 'm'}", f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2 and "embedding only 290 rows" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fsdp_on_two_processes_from_a_hf_folder_equals_one_process(tmp_path):
    """Each process reads only its shards (the model stays on the meta device until FSDP has
    sharded it); the run equals one process with the global batch."""
    import subprocess
    import sys

    save_tiny("qwen2", tmp_path / "m")
    (tmp_path / "c.txt").write_text(TEXT)
    common = ["data.source=text", f"data.path={tmp_path / 'c.txt'}", f"model.pretrained_from={tmp_path / 'm'}",
              "data.block_size=32", "data.eval_blocks=4", "data.num_samples=0", "train.max_steps=4",
              "train.eval_every=2", "train.log_every=1", "train.progress=false", "train.device=cpu"]

    def run(out, *extra):
        proc = subprocess.run([str(Path(sys.executable).with_name("tk")), "run", "lm_synthetic", f"output_dir={out}",
                               *common, *extra], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    two = run(tmp_path / "fsdp", "train.batch_size=4", "train.strategy=fsdp", "--nproc-per-node", "2")
    assert "each process reads its FSDP shards" in (tmp_path / "fsdp" / "train.log").read_text()
    one = run(tmp_path / "one", "train.batch_size=8")
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(two, one):
        for key in ("loss", "val/loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)


def test_generation_stops_at_any_eos_id_even_when_pad_is_eos(folders):
    model, _ = tk_model(folders["llama3"][0])
    prompt = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(3))
    free = generate(model, prompt, GenerationConfig(max_len=12)).tokens[0]
    stop = int(free[3])
    first = int((free == stop).nonzero()[0])  # where that token first appears
    unused = next(t for t in range(300) if t not in free.tolist())
    for cfg in (GenerationConfig(max_len=12, eos_id=unused, eos_ids=[stop], pad_id=stop),  # pad == an eos id
                GenerationConfig(max_len=12, eos_id=stop, pad_id=stop)):
        out = generate(model, prompt, cfg).tokens[0]
        assert out.tolist() == free[: first + 1].tolist()


def test_lora_on_a_bf16_base_keeps_the_file_dtype_and_trains_float32_adapters(tmp_path):
    from click.testing import CliRunner

    from tk.core.cli import cli
    from tk.core.engine.inference import load_run

    save_tiny("smollm2", tmp_path / "m", dtype=torch.bfloat16)
    (tmp_path / "c.txt").write_text(TEXT)
    args = ["run", "lm_smollm2_shakespeare", f"data.path={tmp_path / 'c.txt'}", f"model.pretrained_from={tmp_path / 'm'}",
            "model.dtype=auto", "model.lora.rank=4", "optim.lr=1e-2", "data.block_size=32", "data.eval_blocks=2",
            "train.max_steps=6", "train.eval_every=6", "train.batch_size=4", "train.progress=false", "train.log_every=1",
            f"output_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "loaded as bfloat16" in (tmp_path / "run" / "train.log").read_text()
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x]
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]
    _, model = load_run(tmp_path / "run", "last", [])
    dtypes = {n.rsplit(".", 1)[-1]: p.dtype for n, p in model.named_parameters()}
    assert dtypes["lora_A"] == torch.float32 and dtypes["weight"] == torch.bfloat16
