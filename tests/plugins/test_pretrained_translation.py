"""Translation from pretrained translators: tiny random Marian (opus-mt-shaped) and NLLB (M2M100)
folders made here with transformers give the same fp32 logits (1e-4), the same greedy and beam-4
token ids as transformers' ``generate`` (each padded row as alone), the same tokenizer ids; the
recipe fine-tunes from the Marian stand-in, and ``tk export --format hf`` gives transformers the
same model back; every bad input is one line, exit 2, no run dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tk.core.cli import cli
from tk.core.engine.inference import load_run
from tk.core.errors import TkError
from tk.core.nn.generation import generate
from tk.core.recipe import load_config
from tests.plugins.hf_translators import marian_tokenizer, parallel, save_marian, save_nllb, write_parallel

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("translators")
    marian = save_marian(root / "marian")
    nllb, nllb_tok = save_nllb(root / "nllb")
    write_parallel(root / "data" / "train", parallel(200, 5))
    write_parallel(root / "data" / "val", parallel(24, 6))
    return {"root": root, "marian": (root / "marian", marian), "nllb": (root / "nllb", nllb, nllb_tok)}


def make_task(folder: Path, *overrides: str, data: Path | None = None):
    args = [f"model.pretrained_from={folder}", "data.source=files", f"data.train_prefix={data}/train",
            f"data.val_prefix={data}/val", *overrides]
    cfg, task_cls = load_config("translation_multi30k_marian", args)
    task = task_cls(cfg)
    task.setup()
    return task


NLLB_CODES = ("data.src_code=eng_Latn", "data.tgt_code=deu_Latn")
SOURCES = ["a red dog sits in the park.", "two people.", "the small child runs with a blue ball on the street!",
           "a cat.", "big man woman dog"]


def _family(folders, name):
    folder, hf = folders[name][:2]
    task = make_task(folder, *(NLLB_CODES if name == "nllb" else ()), data=folders["root"] / "data")
    return task, task.build_model().eval(), hf


@pytest.mark.parametrize("name", ["marian", "nllb"])
def test_logits_equal_transformers_and_padded_rows_equal_alone(folders, name):
    task, model, hf = _family(folders, name)
    ds = task.build_dataset("val")
    batch = task.collate([ds[i] for i in range(6)])
    src, tgt = batch["src"], batch["tgt_in"]
    assert src.eq(task.pad_id).any()
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = hf(input_ids=src, attention_mask=src.ne(task.pad_id).long(), decoder_input_ids=tgt).logits
        real = batch["tgt_out"].ne(task.pad_id)  # what the loss reads (NLLB zeroes padded positions' vectors)
        torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-4)
        assert ours.abs().max() > 1.0  # a wrong mapping would show
        for row in range(3):  # a padded row gives what it gives alone
            n, m = int(src[row].ne(task.pad_id).sum()), int(batch["tgt_out"][row].ne(task.pad_id).sum())
            alone = model(src[row : row + 1, :n], tgt[row : row + 1, :m])
            torch.testing.assert_close(ours[row : row + 1, :m], alone, rtol=1e-5, atol=1e-5)
        if name == "nllb":  # fairseq positions skip padding: a left-padded source equals the right-padded one
            left = torch.full_like(src[:1], task.pad_id)
            n = int(src[1].ne(task.pad_id).sum())
            left[0, -n:] = src[1, :n]
            torch.testing.assert_close(model(left, tgt[1:2]), ours[1:2], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["marian", "nllb"])
@pytest.mark.parametrize("beam", [1, 4])
def test_generated_ids_equal_transformers_generate(folders, name, beam):
    task, model, hf = _family(folders, name)
    texts = task._source_texts(SOURCES)
    ids = task.src_tok.encode_batch(texts, add_special_tokens=False).ids
    rows = [torch.tensor([*task.framing.src_prefix, *s, task.eos_id]) for s in ids]
    src = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=task.pad_id)
    for length in (7, 30):
        task.decode_cfg.max_len_a, task.decode_cfg.max_len_b = 0.0, length
        cfg = task.generation_config(src.shape[1], beam)
        assert cfg.max_len == length and cfg.forced_eos == (name == "marian")
        ours = generate(model, src, cfg).tokens
        kw = {"forced_bos_token_id": task.framing.forced_bos} if name == "nllb" else {}
        with torch.no_grad():
            theirs = hf.generate(input_ids=src, attention_mask=src.ne(task.pad_id).long(), num_beams=beam,
                                 max_length=length + 1, do_sample=False, **kw)[:, 1:]
        width = max(ours.shape[1], theirs.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=task.pad_id)  # noqa: E731
        assert torch.equal(pad(ours), pad(theirs)), (name, beam, length)
        for row in (1, 3):  # each row as alone
            alone = generate(model, rows[row][None], task.generation_config(len(rows[row]), beam)).tokens[0]
            assert torch.equal(alone, ours[row, : len(alone)]) and ours[row, len(alone):].eq(task.pad_id).all()


def test_the_tokenizers_give_transformers_ids(folders):
    pairs = parallel(150, 9) + [("a dog ø 漢.", "ein Hund ß.")]
    task = make_task(folders["marian"][0], data=folders["root"] / "data")
    ref = marian_tokenizer(folders["marian"][0])
    for src, tgt in pairs:
        assert [*task.src_tok.encode(src, add_special_tokens=False), task.eos_id] == ref(src).input_ids
        assert [*task.tgt_tok.encode(tgt, add_special_tokens=False), task.eos_id] == ref(text_target=tgt).input_ids
    task = make_task(folders["nllb"][0], *NLLB_CODES, data=folders["root"] / "data")
    ref = folders["nllb"][2]
    for src, tgt in pairs:
        ids = task.src_tok.encode(src, add_special_tokens=False)
        assert [*task.framing.src_prefix, *ids, task.eos_id] == ref(src).input_ids
        ids = task.tgt_tok.encode(tgt, add_special_tokens=False)
        assert [*task.framing.tgt_prefix, *ids, task.eos_id] == ref(text_target=tgt).input_ids
    multi = folders["root"] / "marian-mul"  # a multilingual opus-mt model: >>deu<< before the source
    save_marian(multi, codes=True)
    task, ref = make_task(multi, "data.tgt_code='>>deu<<'", data=folders["root"] / "data"), marian_tokenizer(multi)
    for src, _ in pairs[:20]:
        ids = task.src_tok.encode(src, add_special_tokens=False)
        assert [*task.framing.src_prefix, *ids, task.eos_id] == ref(">>deu<< " + src).input_ids
    with pytest.raises(TkError, match="'>>ita<<' is not a language code.*>>deu<<"):
        make_task(multi, "data.tgt_code='>>ita<<'", data=folders["root"] / "data")
    task, ref = make_task(folders["nllb"][0], *NLLB_CODES, data=folders["root"] / "data"), folders["nllb"][2]
    decoded = task.tgt_tok.decode_batch([[task.framing.forced_bos, *task.tgt_tok.encode("ein Hund."), 2]])
    assert decoded == ref.batch_decode([[task.framing.forced_bos, *task.tgt_tok.encode("ein Hund."), 2]],
                                       skip_special_tokens=True)


# -- the recipe on the Marian stand-in, end to end -------------------------------------------
@pytest.fixture(scope="module")
def marian_run(folders):
    root = folders["root"]
    args = ["run", "translation_multi30k_marian", f"model.pretrained_from={root / 'marian'}",
            f"data.train_prefix={root / 'data' / 'train'}", f"data.val_prefix={root / 'data' / 'val'}",
            "train.max_steps=30", "train.eval_every=30", "schedule.warmup_steps=5", "optim.lr=1e-3", "train.log_every=5",
            "train.progress=false", f"output_dir={root / 'run'}"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return root / "run"


def test_fine_tuning_learns_keeps_the_files_and_exports_the_family(marian_run, folders):
    records = [json.loads(line) for line in (marian_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("split") == "train"]
    assert losses[-1] < losses[0] - 0.5  # it learns from the pretrained start
    assert any("val/bleu" in r and "val/chrf" in r for r in records)
    for name in ("source.spm", "target.spm", "vocab.json", "hf_config.json", "generation_config.json"):
        assert (marian_run / "artifacts" / name).is_file(), name
    out = folders["root"] / "exported"
    result = CliRunner().invoke(cli, ["export", str(marian_run), "--format", "hf", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "source.spm").read_bytes() == (folders["marian"][0] / "source.spm").read_bytes()
    hf = transformers.MarianMTModel.from_pretrained(out).eval()
    task, model = load_run(marian_run, "best", [])
    tok = marian_tokenizer(out)
    batch = tok(SOURCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        decoder = torch.full((len(SOURCES), 1), task.bos_id)
        torch.testing.assert_close(model.eval()(batch.input_ids, decoder),
                                   hf(**batch, decoder_input_ids=decoder).logits, rtol=1e-5, atol=1e-4)
        theirs = tok.batch_decode(hf.generate(**batch, num_beams=4, max_length=40), skip_special_tokens=True)
    task.decode_cfg.max_len_a, task.decode_cfg.max_len_b = 0.0, 39
    assert task.translate(model, SOURCES) == theirs  # beam 4 from the model's generation_config.json
    assert task.decode_cfg.beam_size == 4


def test_import_then_export_without_training_is_byte_for_byte(folders, tmp_path):
    root = folders["root"]
    for name, extra in (("marian", ()), ("nllb", NLLB_CODES)):
        args = ["run", "translation_multi30k_marian", f"model.pretrained_from={root / name}", *extra,
                f"data.train_prefix={root / 'data' / 'train'}", f"data.val_prefix={root / 'data' / 'val'}",
                "train.max_steps=0", "train.progress=false", f"output_dir={tmp_path / name}"]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        if name == "nllb":  # M2M100's default LayerDrop 0.05: said, not silently dropped
            assert "tk does not drop layers (LayerDrop)" in (tmp_path / name / "train.log").read_text()
        out = tmp_path / f"{name}-hf"
        result = CliRunner().invoke(cli, ["export", str(tmp_path / name), "--format", "hf", "-o", str(out)])
        assert result.exit_code == 0, result.output
        a, b = load_file(root / name / "model.safetensors"), load_file(out / "model.safetensors")
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), name
        before, after = json.loads((root / name / "config.json").read_text()), json.loads((out / "config.json").read_text())
        assert {k: v for k, v in after.items() if k not in ("dtype", "torch_dtype", "transformers_version")} == \
            {k: v for k, v in before.items() if k not in ("dtype", "torch_dtype", "transformers_version")}, name


# -- bad input: one line, exit 2, nothing written --------------------------------------------
def _refused(folders, tmp_path, *overrides, task="translation_multi30k_marian"):
    root = folders["root"]
    data = [f"data.train_prefix={root / 'data' / 'train'}", f"data.val_prefix={root / 'data' / 'val'}"] \
        if task.startswith("translation") else []
    result = CliRunner().invoke(cli, ["run", task, *data, *overrides, f"output_dir={tmp_path / 'r'}"])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "r").exists()
    return result.output.strip()


def test_bad_inputs_are_one_line(folders, tmp_path):
    from tests.plugins.hf_tiny import save_tiny

    root = folders["root"]
    save_tiny("gpt2", tmp_path / "gpt2")
    out = _refused(folders, tmp_path, f"model.pretrained_from={tmp_path / 'gpt2'}")
    assert "decoder-only language model, not a translator" in out and "language_model" in out
    (tmp_path / "nospm").mkdir()
    for f in (root / "marian").iterdir():
        if f.name != "source.spm":
            (tmp_path / "nospm" / f.name).write_bytes(f.read_bytes())
    assert "has no source.spm" in _refused(folders, tmp_path, f"model.pretrained_from={tmp_path / 'nospm'}")
    out = _refused(folders, tmp_path, f"model.pretrained_from={root / 'nllb'}", "data.src_code=eng_Latn",
                   "data.tgt_code=klingon")
    assert "'klingon' is not a language code" in out and "deu_Latn" in out
    assert "set both" in _refused(folders, tmp_path, f"model.pretrained_from={root / 'nllb'}")
    out = _refused(folders, tmp_path, f"model.pretrained_from={root / 'marian'}", "data.max_len=300",
                   "data.max_tokens=4096")
    assert "data.max_len (300) exceeds the model's 256 positions" in out
    out = _refused(folders, tmp_path, f"model.pretrained_from={root / 'marian'}", "tokenizer.vocab_size=500")
    assert "tokenizer.vocab_size=500': the pretrained translator brings its own tokenizer" in out
    out = _refused(folders, tmp_path, f"model.pretrained_from={root / 'marian' / 'config.json'}")
    assert "is a file" in out
    out = _refused(folders, tmp_path, f"model.pretrained_from={root / 'marian'}", "data.block_size=16",
                   task="lm_synthetic")
    assert "a translator" in out and "translation task" in out and "\n" not in out


def test_a_folder_that_is_not_a_seq2seq_model_is_named(folders, tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    out = _refused(folders, tmp_path, f"model.pretrained_from={tmp_path / 'bert'}")
    assert "'bert'" in out and "marian" in out
    with pytest.raises(TkError, match="separate source and target vocabularies"):
        config = json.loads((folders["root"] / "marian" / "config.json").read_text())
        from tk.core.exchange.hf.seq2seq import seq2seq_config
        seq2seq_config({**config, "share_encoder_decoder_embeddings": False})


def test_lora_by_the_family_names_exports_merged_and_as_a_peft_adapter(folders, tmp_path):
    peft = pytest.importorskip("peft")
    root = folders["root"]
    args = ["run", "translation_multi30k_marian", f"model.pretrained_from={root / 'marian'}",
            f"data.train_prefix={root / 'data' / 'train'}", f"data.val_prefix={root / 'data' / 'val'}",
            "model.lora={rank: 4, alpha: 8, targets: [q_proj, v_proj]}", "train.max_steps=8", "optim.lr=1e-2",
            "schedule.warmup_steps=1", "train.progress=false", f"output_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "cross_attn.q_proj" in (tmp_path / "run" / "train.log").read_text()  # q_proj: self and cross attention
    for fmt in ("hf", "peft"):
        result = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "--format", fmt, "-o", str(tmp_path / fmt)])
        assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_2_SEQ_LM" and config["target_modules"] == ["q_proj", "v_proj"]
    _, model = load_run(tmp_path / "run", "best", [])
    src, tgt = torch.tensor([[4, 8, 5, 2, 0], [9, 10, 3, 0, 77]]), torch.tensor([[77, 4, 5], [77, 6, 7]])
    mask = src.ne(77).long()
    with torch.no_grad():
        ours = model.eval()(src, tgt)
        base = transformers.MarianMTModel.from_pretrained(root / "marian").eval()
        before = base(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        assert (ours - before).abs().max() > 0.05  # the adapters trained
        merged = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
        torch.testing.assert_close(merged(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits, ours,
                                   rtol=1e-5, atol=1e-4)
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()  # injects into base in place
        torch.testing.assert_close(adapted(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits, ours,
                                   rtol=1e-5, atol=1e-4)
