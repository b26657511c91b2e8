"""tk.core.text.sentencepiece: Marian's tokenizer files (two tiny SentencePiece unigram models and a
joint vocab.json, built here) give the ids and texts of transformers' MarianTokenizer; the files
round-trip byte for byte; a bad folder gives one-line errors."""

from __future__ import annotations

import io
import json
import pickle
import random
import sys
import warnings

import pytest

from tk.core.errors import TkError
from tk.core.text.sentencepiece import MarianVocab, SpmSide

spm = pytest.importorskip("sentencepiece")

EN = ("the a cat dog house river went saw big small quickly today friend teacher asked for advice I am frog "
      "water city 2024 42 3.14 don't it's").split()
DE = ("der die das Katze Hund Haus Fluss ging sah groß klein schnell heute Freund Lehrer fragte um Rat ich bin "
      "Frosch Wasser Stadt Straße Mädchen über schön Bäume Öl Ärger Übung 2024 42 3,5").split()
PUNCT = list(".,!?;:-\"'()")
UNSEEN = list("øñç€漢😀ßΩ")  # ß is seen on the German side only: the English model does not know it
CODES = [">>deu<<", ">>fra<<"]
EDGES = ["", "   ", "Hallo </s> Welt", "the <pad>cat<unk>", "</s>", ">>xx<< the cat", ">> the << cat", ">>deu<<",
         "</s>>>fra<< x", "a\tb\nc", "the cat . dog ? it 's", "ø € 漢 the cat", "der  Fluss   ging ", ">><<x"]


def sentence(words: list[str], rng: random.Random, unseen: bool = False) -> str:
    """A few words with punctuation, capitals, digits, now and then two spaces (and unseen characters)."""
    out = ""
    for i in range(rng.randint(1, 12)):
        word = rng.choice(words)
        word = word.capitalize() if rng.random() < 0.1 else word
        word += rng.choice(PUNCT) if rng.random() < 0.15 else ""
        if unseen and rng.random() < 0.3:
            word = word[:1] + rng.choice(UNSEEN) + word[1:]
        out += ("" if i == 0 else "  " if rng.random() < 0.1 else " ") + word
    return out + rng.choice([".", "!", "?", ""])


def train(lines: list[str], size: int) -> bytes:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=size,
                                   model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                   num_threads=1, minloglevel=2)
    return buf.getvalue()


def marian_vocab(*models: bytes) -> dict[str, int]:
    """As Marian's conversion: </s>=0, <unk>=1, the pieces of both models, language codes, <pad> last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for proto in models:
        sp = spm.SentencePieceProcessor(model_proto=proto)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    for code in CODES:
        vocab[code] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A Marian folder and texts: the training sentences, held-out ones with unseen characters, edge cases."""
    rng = random.Random(0)
    en, de = [sentence(EN, rng) for _ in range(300)], [sentence(DE, rng) for _ in range(300)]
    held_out = [sentence(rng.choice([EN, DE]), rng, unseen=True) for _ in range(150)]
    source, target = train(en, 150), train(de, 200)
    folder = tmp_path_factory.mktemp("opus-mt-en-de")
    (folder / "source.spm").write_bytes(source)
    (folder / "target.spm").write_bytes(target)
    (folder / "vocab.json").write_text(json.dumps(marian_vocab(source, target), ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"source_lang": "en", "target_lang": "de",
                                                              "model_max_length": 512}), encoding="utf-8")
    return folder, en + de + held_out + EDGES


def reference(folder):
    """transformers' MarianTokenizer of ``folder`` (it warns that sacremoses is missing: unused here)."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.MarianTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def ref(corpus):
    return reference(corpus[0])


def with_codes(texts: list[str]) -> list[str]:
    return [code + t for code in ("", ">>deu<< ", ">>fra<<", ">>xx<< ") for t in texts]


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("side", ["source", "target"])
def test_ids_equal_marian_tokenizer_with_and_without_language_codes(corpus, ref, side):
    folder, texts = corpus
    texts = with_codes(texts)
    tok = getattr(MarianVocab.from_folder(folder), side)
    want = ref(texts)["input_ids"] if side == "source" else ref(text_target=texts)["input_ids"]
    got = tok.encode_batch(texts)
    assert len(texts) == 4 * 764 == 3056 and got.ids == want and got.truncated == 0
    assert [tok.encode(t) for t in texts] == want  # single and batch agree
    unk = sum(row.count(tok.unk_id) for row in want)
    assert unk > 300  # unseen characters and >>xx<< became <unk>: that path is compared too
    plain = ref(texts, add_special_tokens=False)["input_ids"] if side == "source" else \
        ref(text_target=texts, add_special_tokens=False)["input_ids"]
    assert tok.encode_batch(texts, add_special_tokens=False).ids == plain
    cut = ref(texts, truncation=True, max_length=6)["input_ids"] if side == "source" else \
        ref(text_target=texts, truncation=True, max_length=6)["input_ids"]
    short = tok.encode_batch(texts, max_length=6)
    assert short.ids == cut and short.truncated == sum(len(row) > 6 for row in want) > 0
    assert short.type_ids == [[0] * len(row) for row in cut]


def test_decode_equals_marian_tokenizer(corpus, ref):
    folder, texts = corpus
    vocab = MarianVocab.from_folder(folder)
    texts = with_codes(texts)
    ids = ref(text_target=texts)["input_ids"] + ref(texts)["input_ids"]  # source ids: pieces target.spm lacks
    want = ref.batch_decode(ids, skip_special_tokens=True)
    assert len(ids) == 2 * 3056 and vocab.target.decode_batch(ids) == want
    assert [vocab.target.decode(row) for row in ids[::7]] == want[::7]
    assert "Straße" in "".join(want) and "ß" in "".join(want)
    # specials kept: equal to MarianTokenizer decoding with target.spm (see the report on use_source_tokenizer)
    kept = [ref.decode(row, skip_special_tokens=False, use_source_tokenizer=False) for row in ids]
    assert vocab.target.decode_batch(ids, skip_special_tokens=False) == kept


def test_clean_up_tokenization_spaces_from_the_config(corpus, tmp_path):
    folder, texts = corpus
    for name in ("source.spm", "target.spm", "vocab.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"clean_up_tokenization_spaces": true}', encoding="utf-8")
    ref, vocab = reference(tmp_path), MarianVocab.from_folder(tmp_path)
    ids = ref(text_target=texts)["input_ids"]
    want = ref.batch_decode(ids, skip_special_tokens=True)
    assert vocab.target.decode_batch(ids) == want and "the cat. dog? it's" in want


def test_vocabulary_calls_match_text_tokenizer(corpus, ref):
    vocab = MarianVocab.from_folder(corpus[0])
    size = len(json.loads((corpus[0] / "vocab.json").read_text(encoding="utf-8")))
    for side in (vocab.source, vocab.target):
        assert isinstance(side, SpmSide) and side.kind == "sentencepiece"
        assert side.vocab_size == size == ref.vocab_size
        assert side.special_ids == {"</s>": 0, "<unk>": 1, "<pad>": size - 1}
        assert side.token_id(">>deu<<") == ref.convert_tokens_to_ids(">>deu<<")
        with pytest.raises(TkError) as e:
            side.token_id("<s>")
        assert "'<s>'" in one_line(e)
    assert (vocab.eos_id, vocab.unk_id, vocab.pad_id) == (0, 1, size - 1) == (ref.eos_token_id, ref.unk_token_id,
                                                                             ref.pad_token_id)
    assert vocab.language_codes == CODES == ref.supported_language_codes
    with pytest.raises(TkError, match="single texts"):
        vocab.source.encode_batch(["a"], ["b"])


def test_files_round_trip_byte_for_byte(corpus, tmp_path):
    folder, texts = corpus
    vocab = MarianVocab.from_folder(folder)
    files = vocab.files()
    assert sorted(files) == ["source.spm", "target.spm", "tokenizer_config.json", "vocab.json"]
    assert all(files[name] == (folder / name).read_bytes() for name in files)
    again = MarianVocab.from_files(files)
    assert again.files() == files
    for a, b in ((vocab.source, again.source), (vocab.target, again.target),
                 (vocab.target, pickle.loads(pickle.dumps(vocab.target)))):  # DataLoader workers
        ids = a.encode_batch(texts).ids
        assert b.encode_batch(texts).ids == ids and b.decode_batch(ids) == a.decode_batch(ids)
    del files["tokenizer_config.json"]  # optional: left out of files() when absent
    assert sorted(MarianVocab.from_files(files).files()) == ["source.spm", "target.spm", "vocab.json"]
    with pytest.raises(TkError) as e:
        MarianVocab.from_files({"source.spm": files["source.spm"], "vocab.json": files["vocab.json"]})
    assert "target.spm" in one_line(e)


@pytest.mark.parametrize("name", ["source.spm", "target.spm", "vocab.json"])
def test_a_missing_file_names_the_folder_and_the_file(corpus, tmp_path, name):
    for other in ("source.spm", "target.spm", "vocab.json"):
        if other != name:
            (tmp_path / other).write_bytes((corpus[0] / other).read_bytes())
    with pytest.raises(TkError) as e:
        MarianVocab.from_folder(tmp_path)
    assert str(tmp_path) in one_line(e) and f"no {name}" in one_line(e)


@pytest.mark.parametrize("case", ["separate_vocabs", "not_a_folder", "a_file", "bad_spm", "bad_vocab", "no_pad"])
def test_bad_folders_give_one_line_errors(corpus, tmp_path, case):
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("source.spm", "target.spm", "vocab.json"):
        (folder / name).write_bytes((corpus[0] / name).read_bytes())
    target, expect = folder, case
    if case == "separate_vocabs":
        (folder / "tokenizer_config.json").write_text('{"separate_vocabs": true}', encoding="utf-8")
        expect = "shared vocabulary of opus-mt"
    elif case == "not_a_folder":
        target, expect = tmp_path / "nowhere", "nowhere"
    elif case == "a_file":
        target, expect = folder / "vocab.json", "is not a folder"
    elif case == "bad_spm":
        (folder / "target.spm").write_bytes(b"not a model")
        expect = "target.spm is not a SentencePiece model"
    elif case == "bad_vocab":
        (folder / "vocab.json").write_text("{oops", encoding="utf-8")
        expect = "vocab.json is not valid UTF-8 JSON"
    else:
        (folder / "tokenizer_config.json").write_text('{"pad_token": "<PAD>"}', encoding="utf-8")
        expect = "'<PAD>'"
    with pytest.raises(TkError) as e:
        MarianVocab.from_folder(target)
    assert expect in one_line(e)


def test_without_sentencepiece_the_error_says_how_to_install_it(corpus, monkeypatch):
    files = MarianVocab.from_folder(corpus[0]).files()
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import sentencepiece raises ImportError
    with pytest.raises(TkError) as e:
        MarianVocab.from_files(files)
    assert "pip install sentencepiece" in one_line(e)
